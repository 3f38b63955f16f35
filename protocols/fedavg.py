"""FedAvg for GMF: user embeddings stay on their clients, the server aggregates the rest.

Parties:
    * one client per user, holding its interactions and its user embedding ``p_u``;
    * the server, holding the item table ``Q``, the output layer ``h`` and the bias ``b``.

Round ``t``:
    1. the server samples clients (a seeded simulation choice) and sends each the global
       ``(Q, h, b)`` (kind ``"model"``);
    2. each sampled client trains locally for ``local_epochs`` epochs on its positives and
       freshly sampled negatives (binary cross-entropy), updating ``p_u`` and its local copies of
       ``Q``, ``h`` and ``b``;
    3. each client uploads the dense change of ``(Q, h, b)`` and its example count ``n_k``
       (kind ``"update"``); ``p_u`` never leaves the client;
    4. the server applies ``server_lr`` times the aggregate (see ``item_aggregation``).

Adversary and promise: with ``secure_aggregation = "none"`` (the default), nothing beyond data
locality: the honest-but-curious server sees every client's plaintext update, including which
item rows it changed. With ``"secagg"`` or ``"secagg+"`` each client encodes its update as one
fixed-point vector in Z_(2^64) and the round's sums go through :mod:`secagg`'s state machines
(Bonawitz et al. 2017 / Bell et al. 2020): the server receives uniformly masked vectors and
learns only the sum over the sampled clients (for SecAgg+, against collusions of fewer than
``t`` of a client's neighbours; see docs/secagg.md), from which it computes exactly the same
aggregate as in plaintext, up to the fixed-point quantisation (``frac_bits``; deterministic
nearest rounding, so runs stay reproducible from their seed). Step 4 only needs linear sums,
which is what makes this possible.

``"dpf"`` (docs/dpf.md) adds a second aggregation server, ``server2``. Parties: the clients, the
server (server A: it holds the model and learns the sums) and ``server2`` (server B, run by
another operator). Adversary: each server honest-but-curious, the two **not colluding**; clients
may send malformed or forged keys (rejected or left out of both sums). Each client sends only
the item rows it touched (its positives' and negatives' rows, plus two rows carrying ``n_k dh``,
``n_k db`` and ``n_k``), as distributed-point-function key sets of ``dpf_points`` rows each, one
set to each server (:func:`protocols.secure_sum.secure_row_sum`); the two servers' evaluations add
up to the same sums as above (the same model up to fixed point). Promise: server A learns only
the sums over the clients both servers received, and neither server learns which rows a client
touched or their values (each key alone is independent of them). Stated limits: the two servers
together read every update; a client with more than ``dpf_points`` rows sends
``ceil(rows / dpf_points)`` key sets and **each server sees that count** (the size class of its
update, i.e. of its history) unless ``dpf_pad_parts`` makes every client send
``dpf_max_parts`` of them; above ``dpf_dense_above`` key sets a client sends a dense two-server
share instead (a CSPRNG seed to one server, its update minus the seed's expansion to the other),
and both servers see that it is dense; a malicious client can touch up to the buckets of its key sets, not
only ``dpf_points`` rows; values are not range-checked (as with SecAgg).

Simulation: all sampled clients train at once as one batched computation. Every client owns
separate parameter rows (its user row, its own copy of each item row it touches, its own
``h`` and ``b``), and the gradient and optimiser updates are computed row-wise with
``index_add_``, so the batch is exactly equivalent to each client training alone; there is no
Python loop per client or per item. Each client's random choices (its negatives and its
shuffles) come from its own counter-based stream keyed by ``(seed, round, epoch, user)``
(:mod:`recmodels.streams`), not from a shared generator, so a client draws the same whether it
trains in this batch or alone on its own device: the Flower apps (``fedflower``) rely on this to
give the same model as the in-process run. Client sampling is the server's choice and comes from
the seeded generator ``rng``. The local optimiser is *lazy* (sparse) Adam or SGD: a row
moves only at steps where it has a gradient, so an item a client never trained on is
unchanged in its upload (FedFast notes A2/A3). Local optimiser state is fresh every round
(clients are stateless apart from ``p_u``).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from dp.events import NonPrivate
from protocols.base import Release, RoundStats
from protocols.fedavg_sums import SERVER2, FedAvgSums  # noqa: F401  (SERVER2 re-exported: it was defined here)
from protocols.registry import ProtocolSpec, register
from protocols.transport import SERVER, InProcessTransport, client
from recmodels.data import Interactions
from recmodels.models import gmf_logits
from recmodels.data import pair_keys
from recmodels.sampling import sample_negatives_keyed
from recmodels.streams import shuffle_keys, stream_keys
from secagg.encoding import check_budget
from secagg.params import check_fraction
from secagg.params import choose as choose_secagg_plus

__all__ = ["FedAvgConfig", "FedAvgGMF", "ClientUpdate", "LocalRound", "RoundStats"]

_AGGREGATIONS = ("mean", "touched", "sum")
_OPTIMIZERS = ("adam", "sgd")
#: Secure-aggregation protocols FedAvg can route its sums through (:func:`protocols.secure_sum.secure_sum`).
_SECURE = ("none", "secagg", "secagg+")
#: FedAvg-GMF (not the protocols built on its config) also sums through two servers.
_TWO_SERVER = ("dpf",)


@dataclass(frozen=True)
class FedAvgConfig:
    """Hyper-parameters of FedAvg-GMF.

    Attributes:
        dim: embedding size.
        client_fraction: fraction of all clients sampled each round, in (0, 1].
        clients_per_round: a fixed count of clients per round; 0 (default) uses
            ``client_fraction`` instead.
        local_epochs: passes over the client's data per round.
        local_batch_size: client mini-batch size (examples: positives plus negatives).
        lr: local learning rate.
        optimizer: ``"adam"`` (lazy Adam) or ``"sgd"``.
        train_negatives: negatives sampled per positive, fresh every local epoch.
        item_aggregation: ``"mean"``: FedAvg, every item row averages the sampled clients'
            changes weighted by ``n_k`` (a client that did not touch a row contributes 0);
            ``"touched"``: each item row averages over the clients that touched it, weighted by
            ``n_k`` (the denominator is one more linear sum, so this runs under secure
            aggregation too); ``"sum"``: each item row adds the clients' changes unweighted
            (federated collaborative filtering's rule: like centralised training, an item
            moves once per user who trained on it). ``h`` and ``b`` are always averaged over all
            sampled clients.
        server_lr: scale of the aggregated change applied by the server.
        init_std: standard deviation of the embedding initialisation.
        secure_aggregation: ``"none"`` (plaintext uploads), ``"secagg"``, ``"secagg+"`` or ``"dpf"``
            (two non-colluding servers, sparse rows: see the module docstring; FedAvg-GMF only).
        dpf_points: ``"dpf"``: item rows per key set (public; a key set's size grows with it).
        dpf_max_parts: ``"dpf"``: the most key sets one client may send (``dpf_points x
            dpf_max_parts`` rows at most; a client with more stops the round in words).
        dpf_pad_parts: ``"dpf"``: every client sends exactly ``dpf_max_parts`` key sets, so neither
            server learns the size of its update (at ``dpf_max_parts`` times the cost).
        dpf_dense_above: ``"dpf"``: a client whose rows need more key sets than this sends a dense
            two-server share of its whole update instead (a seed to one server, the update minus
            the seed's expansion to the other: cheaper for both servers than many full-domain
            evaluations); both servers see that it is dense. 0: never (0 with ``dpf_pad_parts``).
        frac_bits: fixed-point fractional bits of the secure-aggregation encoding.
        value_clip: largest absolute value a client may put in its encoded update (item
            changes, and the output-layer changes times ``n_k``); a larger value refuses the
            round with an error naming this key. The bit budget ``clients x value_clip x
            2^frac_bits < 2^63`` is checked before the first round.
        secagg_dropout: the fraction of a round's clients that may drop out, which SecAgg+'s
            neighbourhood size ``k`` and threshold ``t`` are chosen for
            (:func:`secagg.params.choose`: abort probability <= 2^-20 with that many dropouts).
            Ignored unless ``secure_aggregation = "secagg+"``; the simulation itself drops nobody.
        secagg_corrupt: the fraction of a round's clients that may collude with the server, which
            SecAgg+'s ``k`` and ``t`` must tolerate (security failure <= 2^-40). Ignored unless
            ``secure_aggregation = "secagg+"``. Both are checked before the first round: a
            combination no ``k`` and ``t`` can meet is refused with an error naming the fix.
    """

    dim: int = 32
    client_fraction: float = 1.0
    clients_per_round: int = 0
    local_epochs: int = 1
    local_batch_size: int = 64
    lr: float = 0.01
    optimizer: str = "adam"
    train_negatives: int = 4
    item_aggregation: str = "sum"
    server_lr: float = 1.0
    init_std: float = 0.01
    secure_aggregation: str = "none"
    frac_bits: int = 24
    value_clip: float = 65536.0
    secagg_dropout: float = 0.1
    secagg_corrupt: float = 0.05
    dpf_points: int = 512
    dpf_max_parts: int = 64
    dpf_pad_parts: bool = False
    dpf_dense_above: int = 0

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise ValueError(f"fedavg.dim must be >= 1; found {self.dim}")
        if not (0 < self.client_fraction <= 1):
            raise ValueError(f"fedavg.client_fraction must be in (0, 1]; found {self.client_fraction}")
        if self.clients_per_round < 0:
            raise ValueError(f"fedavg.clients_per_round must be >= 0 (0: use client_fraction); found {self.clients_per_round}")
        for name in ("local_epochs", "local_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"fedavg.{name} must be >= 1; found {getattr(self, name)}")
        if self.train_negatives < 0:
            raise ValueError(f"fedavg.train_negatives must be >= 0; found {self.train_negatives}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"fedavg.lr must be a positive number; found {self.lr}")
        if self.optimizer not in _OPTIMIZERS:
            raise ValueError(f"fedavg.optimizer must be one of {_OPTIMIZERS}; found {self.optimizer!r}")
        if self.item_aggregation not in _AGGREGATIONS:
            raise ValueError(
                f"fedavg.item_aggregation must be one of {_AGGREGATIONS}; found {self.item_aggregation!r}"
            )
        if not (self.server_lr > 0):
            raise ValueError(f"fedavg.server_lr must be positive; found {self.server_lr}")
        allowed = _SECURE + (_TWO_SERVER if type(self) is FedAvgConfig else ())
        if self.secure_aggregation not in allowed:
            raise ValueError(
                f"fedavg.secure_aggregation must be one of {allowed}; found {self.secure_aggregation!r}"
            )
        for name in ("dpf_points", "dpf_max_parts"):
            if type(getattr(self, name)) is not int or not 1 <= getattr(self, name) <= 4096:
                raise ValueError(f"fedavg.{name} must be an int in 1..4096; found {getattr(self, name)!r}")
        if not isinstance(self.dpf_pad_parts, bool):
            raise ValueError(f"fedavg.dpf_pad_parts must be true or false; found {self.dpf_pad_parts!r}")
        if type(self.dpf_dense_above) is not int or self.dpf_dense_above < 0 or (self.dpf_dense_above and self.dpf_pad_parts):
            raise ValueError(f"fedavg.dpf_dense_above must be an int >= 0, and 0 with dpf_pad_parts; found "
                             f"{self.dpf_dense_above!r}")
        if not (0 < self.frac_bits < 62) or not (self.value_clip > 0 and math.isfinite(self.value_clip)):
            raise ValueError(
                f"fedavg.frac_bits must be in 1..61 and fedavg.value_clip positive; found {self.frac_bits}, {self.value_clip}"
            )
        check_fraction("fedavg.secagg_dropout", self.secagg_dropout)
        check_fraction("fedavg.secagg_corrupt", self.secagg_corrupt, upper=0.5)

    def clients_in_round(self, n_clients: int) -> int:
        """Clients sampled per round out of ``n_clients``."""
        if self.clients_per_round:
            return min(self.clients_per_round, n_clients)
        return max(1, min(n_clients, math.ceil(self.client_fraction * n_clients - 1e-9)))


@dataclass(frozen=True)
class ClientUpdate:
    """What the server receives from one client: a dense change of ``(Q, h, b)``.

    The dense ``[n_items, dim]`` item change is stored as its non-zero rows (``rows``,
    ``item_delta``); every other row is an explicit zero on the wire. ``weight`` is ``n_k``.
    """

    user: int
    rows: np.ndarray
    item_delta: np.ndarray
    h_delta: np.ndarray
    b_delta: float
    weight: float

    def dense_item_delta(self, n_items: int) -> np.ndarray:
        out = np.zeros((n_items, self.item_delta.shape[1]), dtype=self.item_delta.dtype)
        out[self.rows] = self.item_delta
        return out


@dataclass
class LocalRound:
    """The sampled clients' local training in one round (slot ``c`` is ``sampled[c]``).

    Attributes:
        P: ``[m, dim]`` the clients' new user embeddings.
        pair_slot, pair_item: one row per (client slot, touched item), sorted by slot.
        dQ: ``[pairs, dim]`` each client's change of each item row it touched.
        dH, dB: ``[m, dim]``, ``[m]`` the output-layer changes.
        weight: ``[m]`` ``n_k``, the client's example count.
        loss, examples: summed training loss and example count.
    """

    P: torch.Tensor
    pair_slot: np.ndarray
    pair_item: np.ndarray
    dQ: torch.Tensor
    dH: torch.Tensor
    dB: torch.Tensor
    weight: torch.Tensor
    loss: float
    examples: int


class _LazyAdam:
    """Row-wise lazy Adam (or SGD) over a 2-D tensor: rows move only when they get a gradient.

    Bias correction uses the step count of the *client* that owns the row (how many local
    steps it has taken). With ``sparse=True`` the update is ``torch.optim.SparseAdam``'s
    (``eps`` added to the uncorrected ``sqrt(v)``), used for the embedding tables; with
    ``sparse=False`` it is ``torch.optim.Adam``'s, used for ``h`` and ``b``, which get a gradient
    at every step of their client. Each client therefore runs exactly what those torch
    optimisers would run on its own parameters; the tests use them as the oracle.
    """

    def __init__(self, param: torch.Tensor, lr: float, kind: str, *, sparse: bool, betas=(0.9, 0.999), eps: float = 1e-8):
        self.p, self.lr, self.kind, self.eps, self.sparse = param, lr, kind, eps, sparse
        self.b1, self.b2 = betas
        if kind == "adam":
            self.m = torch.zeros_like(param)
            self.v = torch.zeros_like(param)

    def step(self, rows: torch.Tensor, grad: torch.Tensor, t: torch.Tensor) -> None:
        """Apply ``grad`` to the unique ``rows``; ``t`` is each row's owner's step count (>= 1)."""
        if self.kind == "sgd":
            self.p.index_add_(0, rows, grad, alpha=-self.lr)
            return
        m = self.m.index_select(0, rows).mul_(self.b1).add_(grad, alpha=1 - self.b1)
        v = self.v.index_select(0, rows).mul_(self.b2).addcmul_(grad, grad, value=1 - self.b2)
        self.m.index_copy_(0, rows, m)
        self.v.index_copy_(0, rows, v)
        c1 = (1 - self.b1**t).unsqueeze(1)
        c2 = (1 - self.b2**t).unsqueeze(1)
        if self.sparse:
            step = m.mul_(self.lr * c2.sqrt() / c1).div_(v.sqrt_().add_(self.eps))
        else:
            step = m.mul_(self.lr / c1).div_(v.sqrt_().div_(c2.sqrt()).add_(self.eps))
        self.p.index_add_(0, rows, step, alpha=-1.0)


class FedAvgGMF(FedAvgSums):
    """FedAvg over GMF with batched client simulation (see the module docstring).

    ``upload_cls`` is the payload type of a plaintext upload in the transcript.

    Args:
        train: training interactions (implicit; every row a positive).
        config: hyper-parameters.
        seed: seeds the initialisation and every simulation choice (client sampling with ``rng``;
            each client's shuffles and negatives with its own stream keyed by the seed, the
            round and the user), so that a run is reproducible from it.
        transport: where messages go; a fresh in-process transport by default.
        exclude: pairs never drawn as training negatives besides the client's own positives
            (ratings below the positive threshold; :attr:`experiments.run.prepare.Prepared.exclude`).
        clients: restrict the client pool to these user indices (e.g. one FEL cluster); default:
            every user with training data.
    """

    #: its ``seconds["client"]`` already holds the secure-aggregation work (experiments/run/training.py)
    client_seconds_include_secure = True

    upload_cls: type[ClientUpdate] = ClientUpdate

    def __init__(
        self, train: Interactions, config: FedAvgConfig, *, seed: int, transport: InProcessTransport | None = None,
        exclude: Interactions | None = None, clients: np.ndarray | None = None,
    ):
        self.train, self.config, self.exclude = train, config, exclude
        self.transport = transport or InProcessTransport()
        self.seed = int(seed)
        self.rng = np.random.default_rng(seed)
        g = torch.Generator().manual_seed(int(seed))
        d = config.dim
        self.user = torch.randn(train.n_users, d, generator=g) * config.init_std  # held by the clients
        self.item = torch.randn(train.n_items, d, generator=g) * config.init_std  # held by the server
        self.h = torch.ones(d)
        self.b = torch.zeros(())
        order = np.argsort(train.users, kind="stable")
        self._pos_items = train.items[order]
        self._pos_start = np.concatenate([[0], np.cumsum(np.bincount(train.users, minlength=train.n_users))])
        self._clients = np.flatnonzero(np.diff(self._pos_start) > 0)
        # Pairs never drawn as negatives besides each client's positives (sorted pair keys).
        self._exclude_keys = (np.unique(pair_keys(exclude.users, exclude.items, train.n_items))
                              if exclude is not None and len(exclude) else np.zeros(0, np.int64))
        if clients is not None:
            self._clients = np.intersect1d(self._clients, np.asarray(clients, dtype=np.int64))
        self.round = 0
        if config.secure_aggregation != "none":
            check_budget(
                n_summands=config.clients_in_round(len(self._clients)),
                clip=config.value_clip,
                frac_bits=config.frac_bits,
            )
        #: SecAgg+'s k, t and their guarantees (``Guarantees.summary()`` for users); None otherwise
        self.secagg_guarantees = None
        if config.secure_aggregation == "secagg+":  # refuse impossible guarantees before training
            self.secagg_guarantees = choose_secagg_plus(
                config.clients_in_round(len(self._clients)), dropout=config.secagg_dropout,
                corrupt=config.secagg_corrupt)

    # -- sizes on the wire -------------------------------------------------------------------
    @property
    def model_bytes(self) -> int:
        """Bytes of ``(Q, h, b)`` in float32: the download and the dense upload each round."""
        return 4 * (self.train.n_items * self.config.dim + self.config.dim + 1)

    # -- one round ---------------------------------------------------------------------------
    def run_round(self) -> RoundStats:
        """Sample clients, train them locally (batched), collect their updates and aggregate."""
        t = self.round
        t_start = time.perf_counter()
        sampled = self._sample_clients()
        m = len(sampled)
        lr_ = self._local_round(sampled)
        t_local = time.perf_counter()
        self._secagg_seconds = 0.0  # mean seconds of a client's secure-aggregation work (set by _secure_sums)
        upload_bytes, releases, extra = self._aggregate(
            t, sampled, lr_.pair_slot, lr_.pair_item, lr_.dQ, lr_.dH, lr_.dB, lr_.weight
        )
        self.user[torch.as_tensor(sampled)] = lr_.P  # stays on the clients
        t_end = time.perf_counter()
        # Local training is simulated batched across the clients: its wall time is shared evenly.
        # The aggregation window also ran every client's secure-aggregation work, sequentially.
        seconds = {
            "round": t_end - t_start,
            "client": (t_local - t_start) / m + self._secagg_seconds,
            "server": max(0.0, (t_end - t_local) - self._secagg_seconds * m),
        }

        self.round += 1
        return RoundStats(
            round=t,
            loss=lr_.loss / max(lr_.examples, 1),
            clients=m,
            bytes_per_client=self.model_bytes + upload_bytes,
            seconds=seconds,
            extra={"examples": lr_.examples, **extra},
            releases=releases,
        )

    def _sample_clients(self) -> np.ndarray:
        """The round's cohort: a fixed-size uniform sample without replacement (seeded)."""
        m = self.config.clients_in_round(len(self._clients))
        return np.sort(self.rng.choice(self._clients, size=m, replace=False))

    def _aggregate(self, t, sampled, pair_slot, pair_item, dQ, dH, dB, weight):
        """Collect the uploads, update the server model; returns ``(upload bytes, releases, extra)``.

        Subclasses (FEL's DP leaves) replace this step and keep the local training.
        """
        cfg, m = self.config, len(sampled)
        if cfg.secure_aggregation == "none":
            self._send_updates(t, sampled, pair_slot, pair_item, dQ, dH, dB, weight)
            sums = self._plain_sums(torch.as_tensor(pair_slot), torch.as_tensor(pair_item), dQ, dH, dB, weight)
            upload_bytes = self.model_bytes + 4.0
        elif cfg.secure_aggregation in _TWO_SERVER:
            sums, upload_bytes = self._dpf_sums(t, sampled, pair_slot, pair_item, dQ, dH, dB, weight)
        else:
            sums, upload_bytes = self._secure_sums(t, sampled, pair_slot, pair_item, dQ, dH, dB, weight)
        self._apply(*sums)
        return upload_bytes, (self._update_release(m),), {}

    def _update_release(self, m: int) -> Release:
        """The ledger entry of one round's uploads from ``m`` clients (plaintext or their secure sum)."""
        cfg = self.config
        what = "item/output-layer updates, each in plaintext" if cfg.secure_aggregation == "none" else (
            f"the sum of item/output-layer updates through {cfg.secure_aggregation} (no DP noise)")
        return Release(NonPrivate(), who="clients", what=what, params={"clients": m})

    def _local_round(self, sampled: np.ndarray) -> LocalRound:
        """Send the model to the ``sampled`` clients and train them all locally (batched)."""
        for u in sampled:
            self.transport.send(SERVER, client(u), self.round, "model", None, self.model_bytes)
        return self._train_sampled(sampled)

    def _train_sampled(self, sampled: np.ndarray) -> LocalRound:
        """The ``sampled`` clients' local training (batched), without the model download."""
        cfg = self.config
        counts, epochs = self._local_data(sampled)
        # Each client's private copy of every item row it touches this round: one row per
        # (client slot, item) pair, so that clients never share a parameter.
        keys = np.concatenate([e[0] for e in epochs]) * self.train.n_items + np.concatenate([e[1] for e in epochs])
        uniq, inverse = np.unique(keys, return_inverse=True)
        pair_slot, pair_item = uniq // self.train.n_items, uniq % self.train.n_items
        P, Q, H, B, loss, examples = self._train_locally(sampled, epochs, pair_slot, pair_item, torch.as_tensor(inverse))
        # Uploads: the dense change of (Q, h, b) per client, weighted by its example count.
        weight = torch.as_tensor(counts * (1 + cfg.train_negatives) * cfg.local_epochs, dtype=torch.float32)
        return LocalRound(
            P=P, pair_slot=pair_slot, pair_item=pair_item, dQ=Q - self.item[torch.as_tensor(pair_item)],
            dH=H - self.h, dB=B.squeeze(1) - self.b, weight=weight, loss=loss, examples=examples,
        )

    def _local_data(self, sampled: np.ndarray) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray, np.ndarray]]]:
        """Positive counts and, per local epoch, ``(slot, item, label)`` of every example.

        Slot ``c`` is client ``sampled[c]``; its examples are its positives (in its data's
        order) followed by ``train_negatives`` negatives per positive, fresh every epoch and
        drawn from the client's own stream (see the module docstring).
        """
        cfg, n_items = self.config, self.train.n_items
        counts = self._pos_start[sampled + 1] - self._pos_start[sampled]
        slots_pos = np.repeat(np.arange(len(sampled)), counts)
        items_pos = np.concatenate([self._pos_items[self._pos_start[u] : self._pos_start[u + 1]] for u in sampled])
        items_pos = items_pos.astype(np.int64)
        n_neg = cfg.train_negatives
        if n_neg:
            users_pos = sampled[slots_pos].astype(np.int64)
            forbidden = np.union1d(pair_keys(users_pos, items_pos, n_items), self._exclude_keys)
            within = np.arange(len(slots_pos)) - np.concatenate([[0], np.cumsum(counts)])[slots_pos]
            neg_index = (np.repeat(within * n_neg, n_neg) + np.tile(np.arange(n_neg), len(slots_pos))).astype(np.int64)
            neg_slots = np.repeat(slots_pos, n_neg)
        epochs = []
        for e in range(cfg.local_epochs):
            if n_neg:
                keys = stream_keys(self.seed, self.round, e, 0, sampled)[neg_slots]
                neg_items = sample_negatives_keyed(sampled[neg_slots], keys, neg_index, n_items=n_items, forbidden=forbidden)
                slots = np.concatenate([slots_pos, neg_slots])
                items = np.concatenate([items_pos, neg_items])
                labels = np.concatenate([np.ones(len(items_pos)), np.zeros(len(neg_items))])
            else:
                slots, items, labels = slots_pos, items_pos, np.ones(len(items_pos))
            epochs.append((slots, items, labels))
        return counts, epochs

    def _train_locally(self, sampled, epochs, pair_slot, pair_item, pair_of_example, observe=None):
        """Every sampled client's local epochs at once; returns its final parameters.

        ``observe(P, Q, H, B, slots, pairs, labels)`` (optional) sees each mini-batch before its
        step (FedFast sums each client's own loss with it)."""
        cfg, m = self.config, len(sampled)
        P = self.user[torch.as_tensor(sampled)].clone()
        Q = self.item[torch.as_tensor(pair_item)].clone()
        H = self.h.expand(m, -1).clone()
        B = self.b.expand(m).clone().unsqueeze(1)
        opts = [_LazyAdam(x, cfg.lr, cfg.optimizer, sparse=x is P or x is Q) for x in (P, Q, H, B)]
        client_steps = torch.zeros(m, dtype=torch.float32)  # local steps taken by each client
        pair_slot_t = torch.as_tensor(pair_slot)
        def step(slot, pair, label):  # noqa: ANN001, ANN202
            if observe is not None:
                observe(P, Q, H, B, slot, pair, label)
            return self._step(P, Q, H, B, opts, slot, pair, label, client_steps, pair_slot_t)

        total_loss, total_examples = self._minibatches(sampled, epochs, pair_of_example, step)
        return P, Q, H, B, total_loss, total_examples

    def _minibatches(self, sampled, epochs, pair_of_example, step) -> tuple[float, int]:
        """Call ``step(slots, pairs, labels)`` on every local mini-batch step of every epoch, all
        active clients at once (step ``s`` holds each client's ``s``-th batch); returns the summed
        loss and the example count. Leaf models (FEL's NCF) pass their own ``step``."""
        total_loss, total_examples, offset = 0.0, 0, 0
        for epoch, (slots, _, labels) in enumerate(epochs):
            ex_pair = pair_of_example[offset : offset + len(slots)]
            offset += len(slots)
            steps = self._local_steps(slots, sampled, epoch)
            order = np.argsort(steps, kind="stable")
            bounds = np.searchsorted(steps[order], np.arange(steps.max() + 2))
            slots_t = torch.as_tensor(slots)
            labels_t = torch.as_tensor(labels, dtype=torch.float32)
            for s in range(len(bounds) - 1):
                idx = torch.as_tensor(order[bounds[s] : bounds[s + 1]])
                if len(idx):
                    total_loss += step(slots_t[idx], ex_pair[idx], labels_t[idx])
                    total_examples += len(idx)
        return total_loss, total_examples

    # (the round's sums and the server's update from them: protocols.fedavg_sums)

    def _local_steps(self, slots: np.ndarray, sampled: np.ndarray, epoch: int) -> np.ndarray:
        """Step index of every example: a per-client shuffle cut into mini-batches.

        Each client orders its examples by sort keys from its own stream (keyed by the seed,
        the round, ``epoch`` and the user; entry ``i`` is its ``i``-th example), so its shuffle
        is the same alone or batched.
        """
        m = len(sampled)
        start = np.concatenate([[0], np.cumsum(np.bincount(slots, minlength=m))])
        by_slot = np.argsort(slots, kind="stable")
        within = np.empty(len(slots), np.int64)
        within[by_slot] = np.arange(len(slots)) - start[slots[by_slot]]
        keys = stream_keys(self.seed, self.round, epoch, 1, sampled)[slots]
        order = np.lexsort((shuffle_keys(keys, within), slots))
        pos = np.empty(len(slots), np.int64)
        pos[order] = np.arange(len(slots)) - start[slots[order]]
        return pos // self.config.local_batch_size

    @staticmethod
    def _step(P, Q, H, B, opts, slot, pair, label, client_steps, pair_slot) -> float:
        """One local mini-batch step of every active client (manual GMF gradients).

        Each client minimises the mean binary cross-entropy over its own batch; the gradients
        below are those of that loss, accumulated per parameter row with ``index_add_``.
        """
        m = P.shape[0]
        p, q, h, b = P[slot], Q[pair], H[slot], B[slot, 0]
        logits = gmf_logits(p, q, h, b)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, label, reduction="none")
        n_in_batch = torch.zeros(m).index_add_(0, slot, torch.ones_like(label))
        active = torch.nonzero(n_in_batch).squeeze(1)
        client_steps[active] += 1
        g = ((torch.sigmoid(logits) - label) / n_in_batch[slot]).unsqueeze(1)
        # Per-client parameters (user row, h, b): every active client owns exactly one row.
        for opt, grad in ((opts[0], g * q * h), (opts[2], g * p * q), (opts[3], g)):
            acc = torch.zeros(m, grad.shape[1]).index_add_(0, slot, grad)
            opt.step(active, acc[active], client_steps[active])
        # Item rows: each (client, item) pair is its own row.
        uniq, inv = torch.unique(pair, return_inverse=True)
        acc = torch.zeros(len(uniq), q.shape[1]).index_add_(0, inv, g * p * h)
        opts[1].step(uniq, acc, client_steps[pair_slot[uniq]])
        return float(loss.sum())

    def _send_updates(self, t, sampled, pair_slot, pair_item, dQ, dH, dB, weight, user=None) -> None:
        """Record every client's plaintext upload (an :attr:`upload_cls`).

        ``user`` (``[m, dim]``): the clients' new ``p_u``, for subclasses whose server receives it
        (their ``upload_cls`` has a ``user_embedding`` field); FedAvg never sends it.
        """
        keep = self.transport.transcript.keep_payloads
        extra = 0 if user is None else 4 * self.config.dim
        bounds = np.searchsorted(pair_slot, np.arange(len(sampled) + 1))
        for c, u in enumerate(sampled):
            payload = None
            if keep:
                lo, hi = bounds[c], bounds[c + 1]
                payload = self.upload_cls(
                    user=int(u),
                    rows=pair_item[lo:hi].copy(),
                    item_delta=dQ[lo:hi].numpy().copy(),
                    h_delta=dH[c].numpy().copy(),
                    b_delta=float(dB[c]),
                    weight=float(weight[c]),
                    **({} if user is None else {"user_embedding": user[c].numpy().copy()}),
                )
            self.transport.send(client(u), SERVER, t, "update", payload, self.model_bytes + 4 + extra)

    # -- the parties' arrays, for a runtime that puts each client on its own device -----------
    def global_arrays(self) -> dict[str, torch.Tensor]:
        """The global model each sampled client downloads, by name (GMF: ``item``, ``h``, ``b``).

        A runtime with the clients on separate devices (``fedflower``) sends these and installs
        them on the client with :meth:`load_global_arrays`; a subclass with more server-held
        parameters (FEL's NCF leaves: the MLP) adds its own.
        """
        return {"item": self.item, "h": self.h, "b": self.b}

    def load_global_arrays(self, arrays: dict[str, torch.Tensor]) -> None:
        """Install the global model (copies of ``arrays[name]`` for every name of
        :meth:`global_arrays`; the caller has checked each array's shape and dtype)."""
        self.item, self.h, self.b = (arrays[n].clone() for n in ("item", "h", "b"))

    def upload_fields(self) -> dict[str, tuple[int, ...]]:
        """The per-client float32 arrays an upload carries besides FedAvg's sparse item rows,
        ``dh``, ``db`` and ``n_k``: ``{name: shape}`` (GMF: none; FEL's NCF leaves: the MLP's
        change). :meth:`local_fields` gives them after a local round, :meth:`load_local_fields`
        installs a cohort's before :meth:`_aggregate`."""
        return {}

    def local_fields(self) -> dict[str, torch.Tensor]:
        """The last :meth:`_local_round`'s :meth:`upload_fields`, each ``[m, *shape]`` in cohort order."""
        return {}

    def load_local_fields(self, fields: dict[str, torch.Tensor]) -> None:
        """Install a cohort's :meth:`upload_fields` (``[m, *shape]``, slot ``c`` = ``sampled[c]``)
        as if its :meth:`_local_round` had produced them (a server whose clients trained elsewhere)."""
        if fields:
            raise ValueError(f"{type(self).__name__} uploads no fields besides FedAvg's; found {sorted(fields)}")

    def client_vector_width(self) -> int:
        """Length of one client's :meth:`_client_vectors` row (its secure-aggregation input)."""
        n_items, d = self.train.n_items, self.config.dim
        return n_items * d + (n_items if self.config.item_aggregation == "touched" else 0) + d + 2

    # -- evaluation and checkpoints ------------------------------------------------------------
    @torch.no_grad()
    def score(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Candidate scores, as each client would compute them locally with the global model."""
        pu = self.user[torch.as_tensor(np.asarray(users))].unsqueeze(1)
        return gmf_logits(pu, self.item[torch.as_tensor(np.asarray(items))], self.h, self.b).numpy()

    @torch.no_grad()
    def score_all(self, users: np.ndarray) -> np.ndarray:
        return ((self.user[torch.as_tensor(np.asarray(users))] * self.h) @ self.item.T + self.b).numpy()

    def public_info(self) -> dict[str, Any]:
        """What every party knows: sizes, hyper-parameters and the update layout."""
        return {
            "protocol": "fedavg",
            "n_users": self.train.n_users,
            "n_items": self.train.n_items,
            "clients": int(len(self._clients)),
            "config": asdict(self.config),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "user": self.user.clone(),
            "item": self.item.clone(),
            "h": self.h.clone(),
            "b": self.b.clone(),
            "rng": self.rng.bit_generator.state,
            "seed": self.seed,  # keys the clients' streams (negatives, shuffles)
            "config": asdict(self.config),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # (a key missing from an older checkpoint, e.g. the dpf_* keys, takes its default)
        if {**asdict(type(self.config)()), **state["config"]} != asdict(self.config):
            raise ValueError("checkpoint was written with a different fedavg configuration")
        self.round = int(state["round"])
        # Copies: the caller's state must not change as training continues.
        self.user, self.item = state["user"].clone(), state["item"].clone()
        self.h, self.b = state["h"].clone(), state["b"].clone()
        self.rng.bit_generator.state = state["rng"]
        self.seed = int(state.get("seed", self.seed))  # checkpoints from before per-client streams lack it


register(ProtocolSpec(
    name="fedavg",
    summary="FedAvg over GMF; user embeddings stay on the clients, sums optionally through SecAgg/SecAgg+ or two "
            "servers' DPF sum",
    build=lambda ctx: FedAvgGMF(ctx.train, ctx.config, seed=ctx.seed, transport=ctx.transport, exclude=ctx.exclude),
    section="fedavg",
    config_cls=FedAvgConfig,
))
