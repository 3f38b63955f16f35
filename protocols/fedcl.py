"""FedCL (Wu et al. 2022): federated contrastive learning with LDP user embeddings, server-side
clustering and semi-hard negatives, model updates through SecAgg+ (notes: papers/fedcl.md).

Parties:
    * one client per user, holding its interaction history (and, for the ``"id"`` encoder, its
      private user embedding, which never leaves it);
    * the server, holding the global model (item table, and the GRU for ``"gru"``), a cache of
      the latest noisy user embedding of every client, and the server-side Adam state.

Round ``t`` (notes section 2 with the decisions of section 8):
    1. the server samples ``clients_per_round`` clients (a seeded simulation choice) and sends
       them the global model (kind ``"model"``);
    2. every client due to upload (``upload_every``/``user_budget`` policy; in round 0 with
       ``initial_upload`` every client, notes 8.1 option b) encodes its training prefix into one
       user embedding (notes 8.4), clips it in L1 to ``clip`` and adds i.i.d.
       ``Laplace(2 clip / epsilon)`` noise from the OS CSPRNG (:func:`dp.ldp.ldp_laplace`), and
       uploads it (kind ``"embedding"``); the server replaces the client's cache entry;
    3. the server clusters the cache (Ward; k-means or none as options) and replaces each
       embedding by its cluster centroid; for each sampled client it ranks all items by
       ``centroid . item`` (global item table), keeps the top ``hard_percent``% and sends
       ``semi_hard`` of them drawn uniformly (kind ``"negatives"``);
    4. the client drops received negatives that are in its own history (notes 8.6) and computes
       the gradient of Eq. (1) (sampled softmax over in-batch, local and semi-hard negatives) on
       its data with the current global model (one step, notes 8.10);
    5. the gradients are summed through ``secure_aggregation`` (SecAgg+ by default, dense
       vectors: which items a client touched is not revealed, notes 8.12), the server divides by
       the number of clients in the sum and applies Adam (``lr``) to the global model.

Adversary and promise: an honest-but-curious server (and anyone who reads the uploads). Each
embedding upload is ``epsilon``-LDP for its user (replace-one: any two embeddings; sensitivity
``2 clip`` in L1 after the L1 clip, never per coordinate). ``k`` uploads by one user compose:
every upload is recorded as a Laplace release with cohort ``"user:<u>"``, and
``secagg privacy report RUN_DIR --json`` gives each user's composed epsilon (``per_user``: basic
``k epsilon`` and the tightest of pure/RDP/PLD). With secure aggregation, the server sees only
uniformly masked gradient vectors and learns their sum (SecAgg+'s collusion limits,
docs/secagg.md).

A server that deviates within the exchange interface (issue 23, item 7) could ask a client for
its embedding again and again: ``k`` noisy copies average to the embedding with ``1/sqrt(k)`` of
one upload's error, and the ledger holds only what the server records. So the budget is the
client's, counted on the device (:mod:`protocols.guard`): every upload is charged to the client's
own record when the step is admitted, before it is computed (``device_ldp_epsilon``; the device
step refuses to compute an upload that was not), and the client refuses (:meth:`FedCL.device_check`)
a second upload in one round, one before ``upload_every`` rounds have passed since its last, one
past ``user_budget``, and (the guard) one past its operator's ``ldp_epsilon_budget``
(``[clients]`` in process, node config ``ldp-epsilon-budget`` on Flower). Default: a client its
operator gives no budget still keeps to its configuration's own policy (the smaller of the two
budgets holds; with ``user_budget = 0`` and no operator budget only the rate, one upload per
``upload_every`` rounds, bounds it). The record persists with the client: in the trainer's
checkpoint in process (``--resume`` continues the counts), in the node's context and state
directory on Flower. The server half meets a refusal as a dropped client (the reason in
``last_dropped``, no ledger entry, the cached embedding kept).

Limits: the summed model updates and the final model carry no DP (the ledger records them as
``NonPrivate``); the LDP uploads compose and the budget is basic composition (``k epsilon``),
which a schedule within the budget still spends: a server that follows ``upload_every = 1`` for
``k`` rounds averages ``k`` uploads; rounds are the server's count, so only a budget (not the
rate) bounds the total; on Flower the FedCL configuration reaches the node in the server's
messages, so ``user_budget`` and ``upload_every`` bind a server that deviates in what it asks,
not one that also rewrites the configuration it sends (the node config's ``ldp-epsilon-budget``
and one upload per round do not depend on it); the cluster a client falls in and the negatives
it is sent are post-processing of its LDP upload and cost nothing more; the LDP noise is float
noise (see :mod:`dp.mechanisms`' floating-point caveat).

Simulation: the sampled clients' losses are computed as one batched computation; each client's
gradient is then taken separately (its own loss only), so the uploads are what each client
computes alone (to float32 rounding).

On separate devices (protocols.exchange, docs/fedcl.md "On separate devices"): the round is the
generator :meth:`FedCL.device_round` with the exchanges ``"embedding"`` (the due clients' LDP
uploads, plaintext) and ``"train"`` (the sampled clients, each with its own semi-hard negatives;
gradient, loss and dropped-negative count through secure aggregation as one vector, or in
plaintext); :meth:`FedCL.device_step` is the client half. Client randomness (local pools, local
negatives, dropout masks) comes from per-user keyed streams (:mod:`recmodels.streams`), so a
client alone draws what it draws in the cohort; ``run_round`` drives the same generator.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from dp.events import Laplace, NonPrivate
from protocols.base import Release, RoundStats
from protocols.exchange import DeviceRound, Exchange, Replies, SecureSum, admit, answer_in_process, drive, run_exchanges
from protocols.fedcl_device import FedCLDevice
from protocols.fedcl_negatives import (  # noqa: F401  (re-exported: they were defined here)
    _STREAM_DROPOUT,
    _STREAM_PICKS,
    _STREAM_POOL,
    FedCLNegatives,
    _in_sorted,
)
from protocols.fedcl_server import CLUSTERINGS, WARD_MAX_POINTS, per_user_report
from protocols.guard import device_guard
from protocols.registry import Exchanges, ProtocolSpec, register
from protocols.transport import SERVER, InProcessTransport, client
from recmodels.data import Interactions, pair_keys
from recmodels.sasrec import SelfAttnEncoder
from recmodels.seqrec import PerRowTable, SeqEncoder, client_sequences, contrastive_loss
from recmodels.streams import stream_keys
from secagg.params import check_fraction

__all__ = ["CentralSeqRec", "FedCL", "FedCLConfig"]

_ENCODERS = ("gru", "id", "sasrec")
_SECURE = ("none", "secagg", "secagg+")
_HARD_MODES = ("sample", "hardest")


@dataclass(frozen=True)
class FedCLConfig:
    """Hyper-parameters of FedCL (the ``[fedcl]`` section); paper values as defaults.

    Attributes:
        encoder: ``"gru"`` (GRU4Rec-style sequence encoder), ``"sasrec"`` (SASRec-style causal
            self-attention, :class:`recmodels.sasrec.SelfAttnEncoder`) or ``"id"`` (NCF/GMF
            variant with a private local user embedding; in-batch negatives are never used with it).
        blocks: self-attention blocks of ``"sasrec"`` (2).
        heads: attention heads of ``"sasrec"`` (1; must divide ``dim``).
        dropout: training-time dropout of the sequence encoders (``"gru"``: its input embeddings;
            ``"sasrec"``: embeddings, attention and feed-forward outputs); the masks are drawn
            from one torch generator per client per round seeded from its keyed stream
            (seed, round, user), so resume is exact and a client alone draws the same masks.
        dim: embedding and hidden size (64).
        max_len: most recent training items a client encodes and trains on.
        clients_per_round: clients per round (|U'| = 16).
        lr: server Adam learning rate (1e-3).
        user_lr: the ``"id"`` encoder's local Adam learning rate for the private user row.
        init_std: standard deviation of the embedding initialisation.
        epsilon: LDP epsilon per embedding upload (4).
        clip: L1 clip ``delta`` of the embedding before noise (1).
        clusters: number of clusters ``C`` (25).
        clustering: ``"ward"``, ``"kmeans"`` or ``"none"`` (each client's own noisy embedding).
        hard_percent: ``R``, the top share of items (in %) the semi-hard negatives come from (25).
        semi_hard: ``T``, semi-hard negatives per client per round (20); 0 disables the LDP
            uploads and the semi-hard negatives (the "Fed" baseline and the ablation).
        semi_hard_mode: ``"sample"`` (uniform from the top R%) or ``"hardest"`` (the top T).
        local_pool: items stored on each client as local negatives (100, never its own items).
        local_negatives: local negatives per positive, drawn from the pool every round (10).
        in_batch: use the client's other positives as negatives (ignored for ``"id"``).
        logq: correct the sampled softmax for its sampling (logQ): the local negatives' logits
            minus ``log(local_negatives / n_items)`` and the semi-hard ones' minus
            ``log(semi_hard / (hard_percent% of n_items))``, so that the sampled sum estimates the
            full softmax's (docs/fedcl.md, "The base model"). In-batch negatives stay uncorrected.
        logq_semihard: with ``logq``, correct the semi-hard negatives too (true, the default); false
            corrects the local negatives only and leaves the semi-hard logits as in Eq. (1) (the
            ablation of docs/fedcl.md: a corrected semi-hard negative stands for ~120 top items).
        full_softmax: the softmax over all items instead of the sampled one (every client holds
            the whole item table); ignores the negatives of every kind.
        upload_every: a client uploads a fresh embedding at most once per this many rounds and
            otherwise reuses its cached one (1: whenever it is sampled). The client refuses an
            earlier request itself (:meth:`FedCL.device_check`).
        initial_upload: in round 0 every client uploads, so the cache starts full (notes 8.1 b).
        user_budget: per-user epsilon budget over the run (basic composition); a client whose
            next upload would exceed it stops uploading and keeps its cached embedding. 0: none.
            The client counts its own uploads and refuses past it; with its operator's
            ``ldp_epsilon_budget`` (:class:`protocols.guard.DevicePolicy`) the smaller holds.
        secure_aggregation: ``"secagg+"``, ``"secagg"`` or ``"none"`` (plaintext uploads).
        frac_bits, value_clip: fixed-point encoding of the gradient vectors.
        secagg_dropout, secagg_corrupt: the fractions SecAgg+'s k and t are chosen for.
    """

    encoder: str = "gru"
    dim: int = 64
    max_len: int = 50
    clients_per_round: int = 16
    lr: float = 1e-3
    user_lr: float = 1e-2
    init_std: float = 0.05
    blocks: int = 2
    heads: int = 1
    dropout: float = 0.0
    epsilon: float = 4.0
    clip: float = 1.0
    clusters: int = 25
    clustering: str = "ward"
    hard_percent: float = 25.0
    semi_hard: int = 20
    semi_hard_mode: str = "sample"
    local_pool: int = 100
    local_negatives: int = 10
    in_batch: bool = True
    logq: bool = False
    logq_semihard: bool = True
    full_softmax: bool = False
    upload_every: int = 1
    initial_upload: bool = True
    user_budget: float = 0.0
    secure_aggregation: str = "secagg+"
    frac_bits: int = 24
    value_clip: float = 1024.0
    secagg_dropout: float = 0.1
    secagg_corrupt: float = 0.05

    def __post_init__(self) -> None:
        if self.encoder not in _ENCODERS:
            raise ValueError(f"fedcl.encoder must be one of {_ENCODERS}; found {self.encoder!r}")
        for name in ("dim", "max_len", "clients_per_round", "clusters", "upload_every", "blocks", "heads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"fedcl.{name} must be an int >= 1; found {v!r}")
        for name in ("semi_hard", "local_pool", "local_negatives"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"fedcl.{name} must be an int >= 0; found {v!r}")
        for name in ("in_batch", "logq", "logq_semihard", "full_softmax", "initial_upload"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"fedcl.{name} must be true or false; found {getattr(self, name)!r}")
        if self.dim % self.heads:
            raise ValueError(f"fedcl.heads must divide fedcl.dim; found heads={self.heads}, dim={self.dim}")
        if not (isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1):
            raise ValueError(f"fedcl.dropout must be in [0, 1); found {self.dropout!r}")
        if self.local_negatives and not self.local_pool:
            raise ValueError("fedcl.local_negatives > 0 needs fedcl.local_pool > 0 (the items they are drawn from)")
        for name in ("lr", "user_lr", "init_std", "epsilon", "clip"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"fedcl.{name} must be a positive number; found {v!r}")
        if not (0 < self.hard_percent <= 100):
            raise ValueError(f"fedcl.hard_percent must be in (0, 100]; found {self.hard_percent}")
        if self.clustering not in CLUSTERINGS:
            raise ValueError(f"fedcl.clustering must be one of {CLUSTERINGS}; found {self.clustering!r}")
        if self.semi_hard_mode not in _HARD_MODES:
            raise ValueError(f"fedcl.semi_hard_mode must be one of {_HARD_MODES}; found {self.semi_hard_mode!r}")
        if not (self.user_budget >= 0 and math.isfinite(self.user_budget)):
            raise ValueError(f"fedcl.user_budget must be >= 0 (0: no budget); found {self.user_budget}")
        if 0 < self.user_budget < self.epsilon:
            raise ValueError(f"fedcl.user_budget {self.user_budget} is below one upload's fedcl.epsilon {self.epsilon}; "
                             "no client could ever upload")
        if self.secure_aggregation not in _SECURE:
            raise ValueError(f"fedcl.secure_aggregation must be one of {_SECURE}; found {self.secure_aggregation!r}")
        if not (0 < self.frac_bits < 62) or not (self.value_clip > 0 and math.isfinite(self.value_clip)):
            raise ValueError(f"fedcl.frac_bits must be in 1..61 and fedcl.value_clip positive; "
                             f"found {self.frac_bits}, {self.value_clip}")
        check_fraction("fedcl.secagg_dropout", self.secagg_dropout)
        check_fraction("fedcl.secagg_corrupt", self.secagg_corrupt, upper=0.5)

    @property
    def laplace_scale(self) -> float:
        """``b = 2 clip / epsilon``, the Laplace scale of every upload."""
        return 2.0 * self.clip / self.epsilon

    @property
    def uses_in_batch(self) -> bool:
        return self.in_batch and self.encoder != "id"


class FedCL(FedCLNegatives, FedCLDevice):
    """The FedCL protocol (module docstring) behind :class:`protocols.base.Trainer`."""

    def __init__(self, train: Interactions, config: FedCLConfig | None = None, *, seed: int = 0,
                 transport: InProcessTransport | None = None, exclude: Interactions | None = None,
                 _test_source: Any = None):
        self.train, self.config = train, config or FedCLConfig()
        # TEST-ONLY deterministic LDP noise (dp.rng.DeterministicTestSource); None: the OS CSPRNG.
        self._test_source = _test_source
        self.last_aggregate: np.ndarray | None = None  # the averaged gradient the server applied last
        self.last_dropped: dict[int, str] = {}  # the clients the server dropped last round, with the reasons
        self.transport = transport if transport is not None else InProcessTransport()
        self.exclude, self.round = exclude, 0
        cfg, n_users, n_items = self.config, train.n_users, train.n_items
        self.rng = np.random.default_rng([seed, 14])
        self._clients = np.flatnonzero(np.bincount(train.users, minlength=n_users) > 0)
        if cfg.semi_hard and cfg.clustering == "ward" and len(self._clients) > WARD_MAX_POINTS:
            n = len(self._clients)
            raise ValueError(
                f"fedcl.clustering = \"ward\" on {n} clients: the cache reaches {n} embeddings and Ward's distance "
                f"matrix about {1.13 * n * (n - 1) * 4 / 1e9:.1f} GB at its peak (limit {WARD_MAX_POINTS} clients, about 2.8 GB); "
                "set fedcl.clustering = \"kmeans\"")
        self._enc = client_sequences(train.users, train.items, train.timestamps, n_users, cfg.max_len)
        self._seq = client_sequences(train.users, train.items, train.timestamps, n_users, cfg.max_len + 1)
        keys = [pair_keys(train.users, train.items, n_items)]
        if exclude is not None:
            keys.append(pair_keys(exclude.users, exclude.items, n_items))
        self._own = np.unique(np.concatenate(keys))  # what each client knows it has interacted with
        self.seed = int(seed)
        self._pool = self._keyed_pools()
        gen = torch.Generator().manual_seed(int(seed))
        if cfg.encoder == "sasrec":
            self.model = SelfAttnEncoder(n_items, cfg.dim, cfg.max_len, blocks=cfg.blocks, heads=cfg.heads,
                                         generator=gen, init_std=cfg.init_std)
        else:
            self.model = SeqEncoder(n_items, cfg.dim, generator=gen, init_std=cfg.init_std)
        if cfg.encoder == "id":
            self.model.gru.requires_grad_(False)
            self.user = torch.randn(n_users, cfg.dim, generator=gen) * cfg.init_std
            self.user_m, self.user_v = torch.zeros_like(self.user), torch.zeros_like(self.user)
            self.user_steps = torch.zeros(n_users)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        n = sum(p.numel() for p in self.params)
        self.adam_m, self.adam_v, self.adam_step = torch.zeros(n), torch.zeros(n), 0
        self.cache = np.zeros((n_users, cfg.dim))
        self.has_cache = np.zeros(n_users, dtype=bool)
        self.last_upload = np.full(n_users, -1, dtype=np.int64)
        self.uploads = np.zeros(n_users, dtype=np.int64)

    # -- set-up (the negatives' pools: protocols.fedcl_negatives) ------------------------------------
    @property
    def model_bytes(self) -> int:
        return 4 * sum(p.numel() for p in self.params)

    # -- client side ----------------------------------------------------------------------------
    def user_embeddings(self, users: np.ndarray) -> torch.Tensor:
        """The user embedding each client computes from its training prefix (``[b, dim]``)."""
        if self.config.encoder == "id":
            return self.user[torch.as_tensor(users)]
        seqs, lengths = self._enc
        return self.model.encode(torch.as_tensor(seqs[users]), torch.as_tensor(lengths[users]))

    def _due(self, users: np.ndarray, t: int) -> np.ndarray:
        cfg = self.config
        due = (self.last_upload[users] < 0) | (t - self.last_upload[users] >= cfg.upload_every)
        if cfg.user_budget:
            due &= (self.uploads[users] + 1) * cfg.epsilon <= cfg.user_budget * (1 + 1e-12)
        return users[due]

    def _upload_release(self, u: int) -> Release:
        """The ledger entry of one accepted upload (its event follows from the public config)."""
        cfg = self.config
        return Release(Laplace.from_epsilon(cfg.epsilon), who=client(u), what="LDP user embedding",
                       cohort=f"user:{int(u)}",
                       params={"epsilon": cfg.epsilon, "clip": cfg.clip, "laplace_scale": cfg.laplace_scale})

    def _source_for(self, user: int) -> Any:
        """TEST-ONLY noise source of ``user``: one shared source, or one per user (a mapping)."""
        src = self._test_source
        return src.get(int(user)) if isinstance(src, Mapping) else src

    def _names(self) -> tuple[str, ...]:
        """The shared parameters (the order of :attr:`params` and of the upload vector)."""
        return ("item",) if self.config.encoder == "id" else tuple(self.model.shared_weights())

    def _dropout_generators(self, users: np.ndarray, t: int) -> list[torch.Generator] | torch.Generator:
        """The dropout masks' torch generators of round ``t``: one per client, seeded from its keyed stream."""
        keys = stream_keys(self.seed, _STREAM_DROPOUT, t, np.asarray(users, np.int64))
        return [torch.Generator().manual_seed(int(k)) for k in keys]

    def client_losses(self, sampled: np.ndarray, neg: np.ndarray | None, kept: np.ndarray | None, *,
                      per_client: bool = True, t: int | None = None, _dense_items: bool = False):
        """Eq. (1) of every sampled client with the current global model, in round ``t`` (default:
        the trainer's round; it keys the clients' random streams).

        Returns ``(losses [m], user rows or None, weights)``; with ``per_client`` every client
        computes with its own copy of the shared parameters (``weights``), so that one backward
        pass gives each client's own gradient (:meth:`client_gradients`). The item table's copies
        are a :class:`recmodels.seqrec.PerRowTable` (each client's reads recorded as small leaves:
        a client's loss touches a few of the ``n_items`` rows), except with ``full_softmax``, which
        reads every row, and with ``_dense_items`` (the dense ``[m, n_items, d]`` copies: the
        reference the sparse path is tested against).
        """
        cfg, m = self.config, len(sampled)
        t = self.round if t is None else int(t)
        if not per_client:
            w = self.model.shared_weights()
        elif cfg.full_softmax or _dense_items:
            w = self.model.per_row_weights(m, self._names())
        else:
            w = self.model.per_row_weights(m, tuple(k for k in self._names() if k != "item"))
            w["item"] = PerRowTable(self.model.item, m)
        local = None
        if cfg.encoder != "id":
            seqs, lengths = self._seq
            s = torch.as_tensor(seqs[sampled])
            n_pos = torch.as_tensor(lengths[sampled] - 1)
            gens = self._dropout_generators(sampled, t) if cfg.dropout else None
            if gens is None or isinstance(gens, torch.Generator):  # no dropout, or one generator for the batch
                user_emb = self.model.states(s[:, :-1], n_pos, w, dropout=cfg.dropout, generator=gens)
            else:  # one client at a time, each with its own masks
                names = self._names() if per_client else ()
                user_emb = torch.cat([
                    self.model.states(s[c : c + 1, :-1], n_pos[c : c + 1],
                                      {k: v[c : c + 1] if k in names else v for k, v in w.items()},
                                      dropout=cfg.dropout, generator=gens[c])
                    for c in range(m)])
            pos = s[:, 1:].clamp_min(0)
            pos_mask = torch.arange(cfg.max_len).unsqueeze(0) < n_pos.unsqueeze(1)
            rows = None
        else:
            seqs, lengths = self._enc
            pos = torch.as_tensor(seqs[sampled]).clamp_min(0)
            pos_mask = torch.arange(cfg.max_len).unsqueeze(0) < torch.as_tensor(lengths[sampled]).unsqueeze(1)
            rows = self.user[torch.as_tensor(sampled)].clone().requires_grad_(True)
            user_emb = rows.unsqueeze(1).expand(-1, cfg.max_len, -1)
        if cfg.local_negatives:
            pick = self._local_picks(sampled, t, pos.shape[1])
            local = torch.as_tensor(self._pool[sampled][np.arange(m)[:, None, None], pick])
        losses = contrastive_loss(
            user_emb, pos, pos_mask, w["item"], local_neg=local,
            hard_neg=None if neg is None else torch.as_tensor(neg),
            hard_mask=None if kept is None else torch.as_tensor(kept), in_batch=cfg.uses_in_batch,
            full_softmax=cfg.full_softmax, **self._log_q(),
        )
        return losses, rows, w

    def _log_q(self) -> dict[str, float]:
        """The logQ corrections of :func:`recmodels.seqrec.contrastive_loss` (``logq``); public numbers only."""
        cfg, n = self.config, self.train.n_items
        if not cfg.logq:
            return {}
        out = {"local_log_q": math.log(cfg.local_negatives / n)} if cfg.local_negatives else {}
        if cfg.semi_hard and cfg.logq_semihard:
            pool = max(1, math.ceil(cfg.hard_percent / 100.0 * n - 1e-9))  # as hard_candidates
            out["hard_log_q"] = math.log(min(cfg.semi_hard, pool) / pool)
        return out

    def client_gradients(self, losses: torch.Tensor, rows: torch.Tensor | None,
                         w: dict[str, torch.Tensor], *, extra: int = 0) -> tuple[np.ndarray, torch.Tensor | None]:
        """Each client's gradient of its own loss: ``(float64 [m, n_params + extra], user-row gradients)``;
        the ``extra`` trailing columns are zeros for the caller (the secure vector's loss and count).

        Each parameter's float32 gradient is widened straight into its columns of the one float64
        array (the exact float32 -> float64 conversion of ``torch.cat(...).double()``, without the
        concatenated float32 copy, its float64 copy and the caller's concatenation: the secure
        path's two extra m x n copies; test_client_gradients_widen_in_place_as_cat_then_double).

        With the item table as a :class:`recmodels.seqrec.PerRowTable` (:meth:`client_losses`), the
        backward pass reaches only the item rows each client read (its inputs, positives and
        negatives): their float32 gradients are widened and added into that client's item columns,
        the others stay zero. The values are the dense copies' up to float32 summation order (a
        row read twice is summed in float64 here, in float32 by the dense copy's backward;
        test_sparse_item_gradients_equal_the_dense_copies)."""
        names = self._names()
        table = w["item"] if isinstance(w.get("item"), PerRowTable) else None
        dense = [k for k in names if not (table is not None and k == "item")]
        sparse = table.leaves() if table is not None else []
        leaves = [w[k] for k in dense] + sparse + ([rows] if rows is not None else [])
        grads = torch.autograd.grad(losses.sum(), leaves, allow_unused=table is not None)
        by_name = dict(zip(dense, grads[: len(dense)]))
        m = len(losses)
        shared = self.model.shared_weights()
        n = sum(shared[k].numel() for k in names)
        # zeros where nothing is written: the item rows a client never read and the extra columns
        flat = np.zeros((m, n + extra), np.float64)
        off = 0
        for k in names:
            size = shared[k].numel()
            g = by_name.get(k)
            if g is not None:
                flat[:, off : off + size] = g.reshape(m, -1).numpy()
            elif table is not None and k == "item":  # the rows each client read, added at its item ids
                cols = torch.from_numpy(flat)[:, off : off + size].view(m, *shared[k].shape)
                table.scatter_into(cols, list(grads[len(dense) : len(dense) + len(sparse)]))
            off += size
        return flat, (grads[-1] if rows is not None else None)

    # -- one round: the server's exchanges (protocols.exchange) ---------------------------------
    def run_round(self) -> RoundStats:
        """Steps 1-5 of the module docstring, as the exchanges of :meth:`device_round`."""
        if self._sum_only():
            return drive(self.device_round(), self._answer_summed)
        return run_exchanges(self, self.device_step)

    def _sum_only(self) -> bool:
        """Plaintext sum and no payload kept: in process the gradient of the summed losses IS the
        sum of the clients' gradients, so the cohort's train step skips the per-client copies
        (same values up to float32 summation order;
        test_plaintext_fast_path_equals_the_sum_of_per_client_gradients)."""
        return self.config.secure_aggregation == "none" and not self.transport.transcript.keep_payloads

    def _answer_summed(self, ex: Exchange) -> Replies:
        """In process, the fast path of :meth:`_sum_only`: the train exchange is answered with the
        cohort's summed gradient (``Replies.total``) and each client's loss and dropped count."""
        t = int(self.round)
        if ex.kind != "train":
            return answer_in_process(self, ex, self.device_step, t)
        ok, refused = admit(self, ex, t, ex.users.tolist())  # the clients' guards, as on devices
        users = np.asarray(ok, np.int64)
        per_user = {u: ex.per_user[u] for u in ok if u in ex.per_user}
        total, losses, dropped = self._train(ex.kind, t, users, ex.broadcast, per_user, summed=True)
        values = {u: {"loss": float(losses[c]), "semi_hard_dropped": int(dropped[c]), "gradient": None}
                  for c, u in enumerate(ok)}
        return Replies(values=values, total=total, survivors=users.copy(), dropped=refused)

    def device_round(self) -> DeviceRound:
        """The server's half of a round (protocols.exchange): it never reads client data.

        Exchanges: ``"embedding"`` (the clients due upload their LDP embedding; plaintext: it is
        already LDP) and ``"train"`` (the sampled clients, each with its own semi-hard negatives,
        return their gradient, loss and count of dropped negatives: through secure aggregation
        as one vector, or in plaintext with ``secure_aggregation = "none"``)."""
        cfg, t, rng = self.config, self.round, self.rng
        m = min(cfg.clients_per_round, len(self._clients))
        sampled = np.sort(rng.choice(self._clients, size=m, replace=False))
        releases: list[Release] = []
        uploaders = np.zeros(0, np.int64)
        if cfg.semi_hard:
            candidates = self._clients if (t == 0 and cfg.initial_upload) else sampled
            uploaders = self._due(candidates, t)
        model = self.device_model()
        keep = self.transport.transcript.keep_payloads
        for u in np.union1d(sampled, uploaders):  # one model object for every client (a view stores it once)
            self.transport.send(SERVER, client(u), t, "model", model if keep else None, self.model_bytes)
        accepted = np.zeros(0, np.int64)
        per_user: dict[int, dict[str, np.ndarray]] = {}
        self.last_dropped = {}
        if cfg.semi_hard:
            if len(uploaders):
                got: Replies = yield Exchange("embedding", uploaders, broadcast=model,
                                              reply_keys=frozenset({"embedding"}), validate=self._check_embedding)
                self.last_dropped.update(got.dropped)
                accepted = np.asarray(sorted(got.values), np.int64)
                for u in accepted.tolist():
                    e = got.values[u]
                    self.transport.send(client(u), SERVER, t, "embedding", e.copy() if keep else None, 4 * cfg.dim)
                    self.cache[u], self.has_cache[u] = e, True
                    releases.append(self._upload_release(u))
                self.last_upload[accepted] = t
                self.uploads[accepted] += 1
            per_user = self._negatives(t, sampled)
        n = self._n_params()
        if cfg.secure_aggregation == "none":
            res: Replies = yield Exchange("train", sampled, broadcast=model, per_user=per_user,
                                          reply_keys=frozenset({"gradient", "loss", "semi_hard_dropped"}),
                                          validate=self._train_validator(per_user))
            members = list(res.values)
            for u in members:
                g = res.values[u]["gradient"]
                self.transport.send(client(u), SERVER, t, "update", None if keep is False else g.copy(), self.model_bytes)
            if res.total is not None:  # in process: the summed gradient (_sum_only)
                total = res.total
            else:
                total = np.stack([res.values[u]["gradient"] for u in members]).sum(0) if members else np.zeros(n)
            losses = [res.values[u]["loss"] for u in members]
            loss = float(np.mean(losses)) if losses else float("nan")
            dropped = sum(res.values[u]["semi_hard_dropped"] for u in members)
            n_sum, up_bytes = len(members), float(self.model_bytes)
        else:
            res = yield Exchange("train", sampled, broadcast=model, per_user=per_user, secure=SecureSum(
                cfg.secure_aggregation, width=n + 2, frac_bits=cfg.frac_bits, value_clip=cfg.value_clip,
                where="fedcl.value_clip", dropout=cfg.secagg_dropout, corrupt=cfg.secagg_corrupt))
            n_sum = len(res.survivors)
            if res.total is None or not n_sum:
                raise RuntimeError(f"fedcl round {t}: secure aggregation produced no sum ({res.aborted})")
            total, loss = res.total[:n], float(res.total[n] / n_sum)
            dropped, up_bytes = int(round(res.total[n + 1])), res.bytes_per_client
            members = res.survivors.tolist()
        self.last_dropped.update(res.dropped)
        # a sampled client the server sent no negatives (no cached embedding) lost all T of them
        dropped += sum(cfg.semi_hard for u in members if cfg.semi_hard and not len(per_user[u]["negatives"]))
        self.last_aggregate = total / max(n_sum, 1)
        if n_sum:  # no client in the sum (every one dropped): no update, Adam's state untouched
            self._server_step(torch.as_tensor(self.last_aggregate, dtype=torch.float32))
        self.round += 1
        what = ("gradient sum, plaintext uploads" if cfg.secure_aggregation == "none"
                else f"gradient sum through {cfg.secure_aggregation} (no DP noise)")
        releases.append(Release(NonPrivate(), who="clients", what=what, params={"clients": m}))
        return RoundStats(
            round=t, loss=loss, clients=n_sum,
            bytes_per_client=self.model_bytes + up_bytes + (4 * cfg.semi_hard if cfg.semi_hard else 0),
            extra={"uploads": int(len(accepted)), "semi_hard_dropped": int(dropped) if cfg.semi_hard else 0,
                   "dropped_clients": len(self.last_dropped)},
            releases=tuple(releases),
        )

    def _n_params(self) -> int:
        return sum(p.numel() for p in self.params)

    def _check_embedding(self, user: int, reply: dict[str, np.ndarray]) -> np.ndarray:
        e = reply["embedding"]
        if e.shape != (self.config.dim,) or e.dtype != np.float64 or not np.isfinite(e).all():
            raise ValueError(f"user {user}: an embedding must be {self.config.dim} finite float64 values; "
                             f"found {e.dtype} {e.shape}")
        return e.copy()

    def _train_validator(self, per_user: Mapping[int, Mapping[str, np.ndarray]]):
        n = self._n_params()

        def check(user: int, reply: dict[str, np.ndarray]) -> dict[str, Any]:
            g, loss, dropped = reply["gradient"], reply["loss"], reply["semi_hard_dropped"]
            if g.shape != (n,) or g.dtype != np.float64 or not np.isfinite(g).all():
                raise ValueError(f"user {user}: a gradient must be {n} finite float64 values; found {g.dtype} {g.shape}")
            if loss.shape != () or loss.dtype.kind != "f" or not (np.isfinite(loss) and loss >= 0):
                raise ValueError(f"user {user}: the loss must be one finite number >= 0; found {loss!r}")
            sent = len(per_user[user]["negatives"]) if user in per_user else 0
            if dropped.shape != () or dropped.dtype.kind not in "iu" or not (0 <= int(dropped) <= sent):
                raise ValueError(f"user {user}: semi_hard_dropped must be an integer in [0, {sent}]; found {dropped!r}")
            return {"gradient": g.copy(), "loss": float(loss), "semi_hard_dropped": int(dropped)}

        return check

    # -- the optimisers (the client's steps of a round: protocols.fedcl_device) -------------------------
    def _server_step(self, grad: torch.Tensor) -> None:
        """Adam (torch.optim.Adam's update, betas 0.9/0.999, eps 1e-8) on the averaged gradient."""
        b1, b2, eps = 0.9, 0.999, 1e-8
        self.adam_step += 1
        self.adam_m.mul_(b1).add_(grad, alpha=1 - b1)
        self.adam_v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        m_hat = self.adam_m / (1 - b1**self.adam_step)
        denom = (self.adam_v / (1 - b2**self.adam_step)).sqrt().add_(eps)
        step = (-self.config.lr * m_hat / denom)
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(torch.nn.utils.parameters_to_vector(self.params) + step, self.params)

    def _local_user_step(self, users: np.ndarray, grad: torch.Tensor) -> None:
        """Each client's Adam step on its own private user row (``user_lr``)."""
        b1, b2, eps = 0.9, 0.999, 1e-8
        u = torch.as_tensor(users)
        self.user_steps[u] += 1
        st = self.user_steps[u].unsqueeze(1)
        self.user_m[u] = b1 * self.user_m[u] + (1 - b1) * grad
        self.user_v[u] = b2 * self.user_v[u] + (1 - b2) * grad * grad
        m_hat = self.user_m[u] / (1 - b1**st)
        v_hat = self.user_v[u] / (1 - b2**st)
        self.user[u] = self.user[u] - self.config.user_lr * m_hat / (v_hat.sqrt() + eps)

    # -- evaluation and checkpoints ---------------------------------------------------------------
    @torch.no_grad()
    def score(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Candidate scores ``u . q_i``, as each client computes them on-device."""
        emb = self.user_embeddings(np.asarray(users)).unsqueeze(1)
        return (emb * self.model.item[torch.as_tensor(np.asarray(items))]).sum(-1).numpy()

    @torch.no_grad()
    def score_all(self, users: np.ndarray) -> np.ndarray:
        return (self.user_embeddings(np.asarray(users)) @ self.model.item.T).numpy()

    def public_info(self) -> dict[str, Any]:
        cfg = self.config
        return {"protocol": "fedcl", "n_users": self.train.n_users, "n_items": self.train.n_items,
                "clients": int(len(self._clients)), "laplace_scale": cfg.laplace_scale, "config": asdict(cfg)}

    def state_dict(self) -> dict[str, Any]:
        out = {
            "round": self.round, "config": asdict(self.config), "rng": self.rng.bit_generator.state,
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "adam_m": self.adam_m.clone(), "adam_v": self.adam_v.clone(), "adam_step": self.adam_step,
            "cache": self.cache.copy(), "has_cache": self.has_cache.astype(np.int8),
            "last_upload": self.last_upload.copy(), "uploads": self.uploads.copy(),
            # in process the trainer plays every client: their own records (what each counted) go with it
            "device_guard": device_guard(self).state_dict(),
        }
        if self.config.encoder == "id":
            out["user"] = {"emb": self.user.clone(), "m": self.user_m.clone(), "v": self.user_v.clone(),
                           "steps": self.user_steps.clone()}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["config"] != asdict(self.config):
            raise ValueError("checkpoint was written with a different fedcl configuration")
        self.round = int(state["round"])
        self.rng.bit_generator.state = state["rng"]
        self.model.load_state_dict({k: v.clone() for k, v in state["model"].items()})
        self.adam_m, self.adam_v = state["adam_m"].clone(), state["adam_v"].clone()
        self.adam_step = int(state["adam_step"])
        self.cache = np.array(state["cache"], dtype=np.float64)
        self.has_cache = np.asarray(state["has_cache"]).astype(bool)
        self.last_upload = np.array(state["last_upload"], dtype=np.int64)
        self.uploads = np.array(state["uploads"], dtype=np.int64)
        if "device_guard" in state:  # (absent from a checkpoint written before the clients' records were kept)
            device_guard(self).load_state_dict({k: np.asarray(v) for k, v in state["device_guard"].items()})
        if self.config.encoder == "id":
            u = state["user"]
            self.user, self.user_m, self.user_v = u["emb"].clone(), u["m"].clone(), u["v"].clone()
            self.user_steps = u["steps"].clone()


def _build(ctx: Any) -> FedCL:
    return FedCL(ctx.train, ctx.config, seed=ctx.seed, transport=ctx.transport, exclude=ctx.exclude)


def _check_devices(config: FedCLConfig) -> None:
    """Every FedCL configuration separates onto devices (docs/fedcl.md, "On separate devices"):
    in-batch negatives are the client's own other positives, logQ offsets are public numbers,
    the full softmax needs the item table every client receives anyway, and dropout, local
    pools and local negatives come from per-client keyed streams. What is refused is refused
    for every run (FedCLConfig, and Ward above WARD_MAX_POINTS clients when built)."""
    if not isinstance(config, FedCLConfig):
        raise ValueError(f"fedcl on devices needs a FedCLConfig; found {type(config).__name__}")


register(ProtocolSpec(
    name="fedcl",
    summary="FedCL: LDP user embeddings, clustered semi-hard negatives, contrastive loss, updates through SecAgg+",
    build=_build,
    section="fedcl",
    config_cls=FedCLConfig,
    privacy_report=per_user_report,
    exchanges=Exchanges(check=_check_devices),
))


class CentralSeqRec(FedCL):
    """The centralised baseline of FedCL's base models: the same encoder and Eq. (1), trained on all
    users at once (no parties, no LDP, no secure aggregation); one round is one epoch over the users
    in batches of ``clients_per_round``, with in-batch negatives (``"gru"``) and ``local_negatives``
    uniform non-interacted items per positive drawn fresh every epoch (``local_pool`` of them per
    user), and one Adam step per batch."""

    def __init__(self, train: Interactions, config: FedCLConfig | None = None, *, seed: int = 0,
                 exclude: Interactions | None = None):
        super().__init__(train, config, seed=seed, exclude=exclude)
        self.transport = None

    def _local_picks(self, users: np.ndarray, t: int, positions: int) -> np.ndarray:
        """Central: from the run's generator (no parties)."""
        return self.rng.integers(0, self.config.local_pool, size=(len(users), positions, self.config.local_negatives))

    def _dropout_generators(self, users: np.ndarray, t: int) -> torch.Generator:
        """Central: one generator for the whole batch, seeded from the run's generator."""
        return torch.Generator().manual_seed(int(self.rng.integers(2**62)))

    def run_round(self) -> RoundStats:
        cfg, t = self.config, self.round
        self._pool = self._local_pools(self.rng)  # fresh negatives every epoch
        order = self.rng.permutation(self._clients)
        total, n = 0.0, 0
        for start in range(0, len(order), cfg.clients_per_round):
            batch = np.sort(order[start : start + cfg.clients_per_round])
            losses, rows, _ = self.client_losses(batch, None, None, per_client=False)
            grads = torch.autograd.grad(losses.mean(), self.params + ([rows] if rows is not None else []))
            if rows is not None:
                self._local_user_step(batch, grads[-1] * len(batch))  # each user's own loss
            self._server_step(torch.cat([g.reshape(-1) for g in grads[: len(self.params)]]))
            total, n = total + float(losses.detach().sum()), n + len(batch)
        self.round += 1
        return RoundStats(round=t, loss=total / max(n, 1), extra={"users": n})

    def public_info(self) -> dict[str, Any]:
        return {**super().public_info(), "protocol": "fedcl-central"}


register(ProtocolSpec(
    name="fedcl-central",
    summary="FedCL's base model (GRU or ID encoder, Eq. 1 loss) trained centrally: the upper reference",
    build=lambda ctx: CentralSeqRec(ctx.train, ctx.config, seed=ctx.seed, exclude=ctx.exclude),
    section="fedcl",
    config_cls=FedCLConfig,
    federated=False,
))
