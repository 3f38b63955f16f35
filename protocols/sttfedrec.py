"""STTFedRec (Qin et al.): a split two-tower model trained by clients, RS and SAS; and FL-DSSM/CLSM.

Parties:
    * clients: one per user, holding the user's features, clicks and a copy of the user tower;
    * RS, the recommendation server: all item data and the item tower (never the user tower);
    * SAS, the secure aggregation server: the user tower and its FedAdam state.

Round ``t`` (notes section 2.4, with the decisions of issue 10):
    1. SAS samples ``K`` clients (seeded simulation choice) and sends each the user tower
       (kind ``"user-tower"``).
    2. each client sends RS an obfuscated request of ``T`` item ids (kind ``"request"``):
       ``T - round(rho T)`` of its clicks among non-clicked ids (``decoys``), shuffled. RS
       validates it (:class:`RequestError`: wrong length, unknown id, replay) and returns only
       the ``T`` item embeddings (kind ``"embeddings"``). RS computes the union of the round's
       ids once, with one dropout mask per item id, so every client sees the same embedding of
       an item (notes G19).
    3. each client computes the sampled-softmax loss over cosines (Eq. 8, ``temperature``) and
       the gradients of its user tower and of the ``T`` returned embeddings.
    4. the user-tower gradient and the loss go to SAS through the circular chain
       (:func:`protocols.secure_sum.secure_sum` with ``protocol="chain"``, ``s =
       chain_successors``; Z_2^64 fixed point, a fresh random ring per round, dropouts re-run
       or abort); SAS divides the sum by the survivors and applies FedAdam with the descending
       sign (notes G2).
    5. each client scatters its embedding gradients into the round's union of requested ids
       (zero rows elsewhere, notes G1) and the rows go to RS through ``item_aggregation``
       (SecAgg+ by default): RS learns the per-id sum only, divides by the survivors and
       backpropagates it through the item tower, then applies FedAdam.
    6. inference: the device downloads all item embeddings (``M x k`` float32) once and ranks by
       cosine with its user embedding (``score`` / ``score_all`` compute exactly that).

Options (``[sttfedrec]``, docs/sttfedrec.md): ``item_id_embedding`` adds RS-held per-item-id
vectors to the item tower's output (trained by RS from the same per-id sums of step 5; nothing
changes for the client); ``user_features = "history"`` makes the user input the mean trigram
vector of the user's other training clicks (computed on the device); ``click_id_dim = B`` appends
to the user input the bag of the hashed item ids of the user's other training clicks (computed
on the device; the user tower's first layer, and so its chain upload, grows by ``256 B`` values);
``decoys = "download-all"``
replaces step 2's request by a constant-size request for every embedding: the client picks its
``T`` training items on the device, RS returns all ``M`` embeddings, and step 5 scatters the
gradients into all ``M`` ids, so RS receives no item id of any client.

On separate devices (docs/sttfedrec.md, "On separate devices"): the round is named exchanges
(:mod:`protocols.exchange`): ``"request"`` (plaintext to RS, refused requests drop the client),
``"train"`` (down: the user tower and the embeddings; up: step 4's vector through the chain to SAS)
and ``"item-gradient"`` (down: RS's public union of the round's ids; up: step 5's rows through
``item_aggregation`` to RS). ``run_round`` drives the same generator in process. Both servers'
halves live in :meth:`STTFedRec.device_round`, their messages keep their parties (``rs``/``sas``)
in the transcript; a runtime hosting both in one process (one operator) loses the RS/SAS
non-collusion separation, while each secure step still releases only its sum. Each client's
request and user-tower dropout masks come from its own keyed stream (:mod:`recmodels.streams`).

``fl-twotower`` (FL-DSSM / FL-CLSM, Huang et al. 2020a) is the same model and the same round,
except that each client downloads both towers and the raw item data of its request, computes both
towers' gradients itself and uploads them in plaintext to one server, which runs FedAdam on both;
for inference it downloads the raw data of all items and runs the item tower. With the same seed
it computes the same updates as the split protocol (notes C6), up to the fixed point of step 4-5.

``decoys = "pir"`` with ``item_aggregation = "dpf"`` (the defense ``dpf``, docs/dpf.md) uses RS and
SAS as the two servers of :mod:`secagg.dpf_pir` and :mod:`secagg.dpf_sum`: RS computes all ``M``
embeddings (as under download-all) and sends the table to SAS; each client sends each server one
PIR key set for its ``T`` ids (kind ``"request-pir"``), gets one answer from each (``m`` rows) and
XORs them into its ``T`` embeddings; its embedding gradients go as DPF key sets of its ``T`` rows to
RS (which learns the per-id sum over all ``M`` ids) and to SAS. Neither server alone learns which
ids a client requested or trained on (each key set is independent of them); together they do.

Adversary and promise (honest-but-curious RS and SAS that do not collude with each other):
    * RS never receives the user tower, a user's features, a loss, or one client's gradient: it
      sees the requests, and (with ``item_aggregation`` != ``"none"``) only the per-id *sum* of
      the embedding gradients over the round's clients.
    * SAS sees only chain uploads (uniform given their sum) and learns the sum of user-tower
      gradients and losses over the round's survivors; with ``s`` successors it needs ``2s``
      colluding clients around a victim to isolate it (docs/chain.md; attack
      ``chain-collusion``).
Stated limits (each shown by an attack, docs/sttfedrec.md): the requests are linked to their
client and the clicks recur across rounds while fresh decoys do not, so RS recovers the clicked
set by intersection (attack ``request-intersection``; ``decoys = "fixed-pool"`` only blunts it,
``decoys = "download-all"`` removes the ids from RS's view at ``M x k x 4`` bytes per client per
round); an id requested by one client only in a round leaks that client's gradient row even in
the sum (notes G1; gone under ``download-all``, where every client contributes to all ``M`` rows);
the RS learns which ids were requested together and which clients take part in a round.
With ``click_id_dim`` the first-layer columns of the summed user-tower gradient are non-zero
exactly at the hash buckets some survivor of the round clicked, so SAS learns that union of
buckets (public hash: a bucket names ~``M / B`` candidate items), as it already learns the union
of the trigram columns of the cohort's features.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from torch.func import functional_call, grad_and_value, vmap

from dp.events import NonPrivate
from protocols.base import Release, RoundStats
from protocols.exchange import DeviceRound, Exchange, Replies, SecureSum, run_exchanges
from protocols.registry import Exchanges, ProtocolSpec, register
from protocols.secure_sum import SecureSumAborted
from protocols.sttfedrec_device import STTFedRecDevice
from protocols.sttfedrec_fl import FLTwoTowerRounds
from protocols.sttfedrec_parties import (  # noqa: F401  (re-exported: they were defined here)
    _MASK_STREAM,
    _REQUEST_STREAM,
    ITEM_ID,
    RS,
    SAS,
    ProtocolError,
    RequestError,
)
from protocols.transport import InProcessTransport, client
from protocols.twotower_data import (
    TwoTowerConfig,
    TwoTowerData,
    build_features,
    decoy_pools,
    positive_lists,
    sample_requests_keyed,
)
from recmodels.data import Interactions, pair_keys
from recmodels.streams import stream_keys
from recmodels.twotower import FedAdam, keyed_dropout_masks, make_tower, sampled_softmax_loss, tower_inputs
from secagg.cuckoo import CuckooLayout
from secagg.dpf import DpfError, KeySet
from secagg.dpf_pir import PirServer
from secagg.encoding import check_budget

__all__ = ["RS", "SAS", "ProtocolError", "RequestError", "STTFedRec", "TwoTowerConfig"]

class STTFedRec(STTFedRecDevice, FLTwoTowerRounds):
    """The split protocol (``mode="split"``) or its FL baseline (``mode="fl"``); see the module docstring."""

    def __init__(self, train: Interactions, config: TwoTowerConfig, *, seed: int, source: str = "synthetic",
                 transport: InProcessTransport | None = None, exclude: Interactions | None = None,
                 mode: str = "split", data: TwoTowerData | None = None):
        if mode not in ("split", "fl"):
            raise ValueError(f"mode must be 'split' or 'fl'; found {mode!r}")
        self.config, self.mode, self.seed = config, mode, seed
        self.transport = transport or InProcessTransport()
        self.data = data or build_features(train, source, config, exclude)
        self.n_users, self.n_items = train.n_users, train.n_items
        self.rng = np.random.default_rng(seed)
        g = torch.Generator().manual_seed(int(seed))
        kw = dict(dropout=config.dropout, init_std=config.init_std, generator=g, dim=config.dim)
        self.user_tower = make_tower(config.tower, config.user_in_dim, **kw)  # SAS (and each client's copy)
        self.item_tower = make_tower(config.tower, config.hash_dim, **kw)  # RS
        self.dropout_gen = torch.Generator().manual_seed(int(seed) + 1)
        self.user_params = {k: v.detach().clone() for k, v in self.user_tower.named_parameters()}
        self.item_params = {k: v.detach().clone() for k, v in self.item_tower.named_parameters()}
        self.n_item_params = sum(p.numel() for p in self.item_params.values())  # the tower alone
        if config.item_id_embedding:  # starts at zero: the initial model is the paper's
            self.item_params[ITEM_ID] = torch.zeros(train.n_items, config.dim)
        opt = dict(lr=config.lr, beta1=config.beta1, beta2=config.beta2, tau=config.tau)
        self.user_opt, self.item_opt = FedAdam(self.user_params, **opt), FedAdam(self.item_params, **opt)
        self.pos_items, self.pos_start = positive_lists(self.data.train)
        self._clients = np.flatnonzero(np.diff(self.pos_start) > 0)
        self.pool = None
        if config.decoys == "fixed-pool":
            self.pool = decoy_pools(self.data.train, self.data.never_negative, config.n_pos, config.n_neg,
                                    config.pool_factor, np.random.default_rng([seed, 7]))
        self.round = 0
        self._served: set[tuple[int, str]] = set()
        self._cache: tuple[int, torch.Tensor] | None = None
        self._device_emb: torch.Tensor | None = None  # a client's copy of RS's embeddings (load_device_model)
        self._pending: dict[int, dict[str, np.ndarray]] = {}  # a client's request and gradients within a round
        never = self.data.never_negative  # a client's own clicks and excluded ratings: never a decoy
        self._forbidden = np.unique(pair_keys(never.users, never.items, self.n_items))
        self._dropouts: dict[str, dict[str, frozenset[int]]] = {}  # test hook: "user"/"item" -> stage -> rows
        self._device_seconds: list[float] = []
        self._train_bytes: list[float] = []
        #: a client's secure-aggregation work per round (its chain steps and, with a secure item
        #: aggregation, that protocol's): mean over the round's clients, measured by the runner
        self._secure_seconds: list[float] = []
        #: simulation ground truth for the chain-collusion attack's scoring (never sent): when set,
        #: each split round keeps its chain inputs as ``last_chain_inputs = (senders, [K, dim] float64)``
        self.record_chain_inputs = False
        self.last_chain_inputs: tuple[list[str], np.ndarray] | None = None
        #: the clients each exchange of the last split round left out, with the reason (kind -> user -> why)
        self.last_dropped: dict[str, dict[int, str]] = {}
        self.n_user_params = sum(p.numel() for p in self.user_params.values())
        self.n_item_id_params = train.n_items * config.dim if config.item_id_embedding else 0
        k = min(config.clients_per_round, len(self._clients))
        check_budget(n_summands=max(k, 1), clip=config.value_clip, frac_bits=config.frac_bits)
        #: the public cuckoo layout of PIR requests (``decoys = "pir"``): ``T`` rows of ``M``
        self.pir_layout: CuckooLayout | None = None
        if config.decoys == "pir":
            if mode != "split":
                raise ValueError("decoys = 'pir' is sttfedrec's (two servers, RS and SAS); fl-twotower has one server")
            self.pir_layout = CuckooLayout.for_points(self.n_items, min(config.request_size, self.n_items),
                                                      seed=bytes(32))

    # -- sizes --------------------------------------------------------------------------------
    @property
    def clients_per_round(self) -> int:
        return min(self.config.clients_per_round, len(self._clients))

    def _item_forward(self, params: dict[str, torch.Tensor], rows: np.ndarray, inputs: tuple[torch.Tensor, ...],
                      masks: list[torch.Tensor] | None) -> torch.Tensor:
        """RS's item side for items ``rows``: the tower's output plus (``item_id_embedding``) the id vectors."""
        tower = {n: p for n, p in params.items() if n != ITEM_ID}
        out = functional_call(self.item_tower, tower, (*inputs, masks))
        if ITEM_ID in params:
            out = out + params[ITEM_ID][torch.as_tensor(np.asarray(rows, dtype=np.int64))]
        return out

    def _inputs(self, which: str, rows: np.ndarray) -> tuple[torch.Tensor, ...]:
        d, cfg = self.data, self.config
        x, lens = (d.user_x, d.user_len) if which == "user" else (d.item_x, d.item_len)
        return tower_inputs(cfg.tower, (x, lens), rows, cfg.max_words)

    # -- RS -----------------------------------------------------------------------------------
    def check_request(self, t: int, who: str, ids: Any) -> np.ndarray | None:
        """RS's validation of one request; raises :class:`RequestError` before any state changes.

        ``ids=None`` is the download-all request (``decoys = "download-all"``): only the round and
        replay checks apply.
        """
        if ids is None:
            if self.config.decoys != "download-all":
                raise RequestError(f"round {t}: {who} asked for every embedding but RS serves requests of "
                                   f"{self.config.request_size} ids (decoys = {self.config.decoys!r})")
            self._check_fresh(t, who)
            return None
        if self.config.decoys == "download-all":
            raise RequestError(f"round {t}: {who} sent item ids but RS serves every embedding (decoys = 'download-all')")
        arr = np.asarray(ids)
        if arr.shape != (self.config.request_size,) or arr.dtype.kind not in "iu":
            raise RequestError(f"round {t}: {who} sent a request of shape {arr.shape} and dtype {arr.dtype}; "
                               f"expected {self.config.request_size} integer item ids")
        if arr.min() < 0 or arr.max() >= self.n_items:
            bad = int(arr[(arr < 0) | (arr >= self.n_items)][0])
            raise RequestError(f"round {t}: {who} requested unknown item id {bad} (catalogue has {self.n_items})")
        self._check_fresh(t, who)
        return arr.astype(np.int64)

    def _check_fresh(self, t: int, who: str) -> None:
        if t != self.round:
            raise RequestError(f"round {t}: {who}'s request is for round {t}, RS is in round {self.round} (replay?)")
        if (t, who) in self._served:
            raise RequestError(f"round {t}: {who} already requested this round (replayed request refused)")

    def check_user(self, users: np.ndarray) -> np.ndarray:
        users = np.asarray(users)
        if users.dtype.kind not in "iu" or (users.size and (users.min() < 0 or users.max() >= self.n_users)):
            raise ProtocolError(f"features requested for unknown user(s) {users!r}; known users are 0..{self.n_users - 1}")
        return users.astype(np.int64)

    # -- the clients' own draws and inputs (per-user keyed streams: the same alone or in a cohort) ----
    def client_requests(self, users: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
        """The requests of round ``t`` (ids ``[K, T]``, click labels) each client draws on its device."""
        cfg, users = self.config, np.asarray(users, dtype=np.int64)
        keys = stream_keys(self.seed, _REQUEST_STREAM, t, users)
        return sample_requests_keyed(users, self.pos_items, self.pos_start, cfg.n_pos, cfg.n_neg, self._forbidden,
                                     self.n_items, keys, self.pool)

    def client_masks(self, users: np.ndarray, t: int) -> list[torch.Tensor]:
        """Each client's user-tower dropout masks of round ``t``, from its own stream."""
        return keyed_dropout_masks(self.user_tower, stream_keys(self.seed, _MASK_STREAM, t,
                                                                np.asarray(users, dtype=np.int64)))

    def client_user_x(self, users: np.ndarray, ids: np.ndarray, labels: np.ndarray) -> tuple[torch.Tensor, ...]:
        """The user inputs of each client's request (``history`` / click ids leave its clicks out)."""
        user_x = self._inputs("user", users)
        if self.data.user_rule == "history" or self.data.click_bag is not None:
            hist_x = None
            if self.data.user_rule == "history":  # the public item inputs of the request's ids
                hist_x = self._inputs("item", ids.ravel())[0].reshape(*ids.shape, -1)
            user_x = (self.data.request_user_x(users, labels, hist_x, ids),)
        return user_x

    # -- one round ------------------------------------------------------------------------------
    def run_round(self) -> RoundStats:
        return run_exchanges(self, self.device_step)  # the same exchanges a runtime with separate devices drives

    def device_round(self) -> DeviceRound:
        """The server half of a split round (RS and SAS in one generator; module docstring, steps 1-5).

        Exchanges: ``"request"`` (plaintext, each client's ids to RS, checked by
        :meth:`check_request`: a refused request drops the client), ``"train"`` (down: SAS's user
        tower to all and RS's embeddings, per client or, under download-all, the whole table; up:
        the user-tower gradient and the loss through the chain to SAS), ``"item-gradient"`` (down:
        the round's union of ids, RS's public list; up: the per-id rows through
        ``item_aggregation`` to RS, or in plaintext under ``"none"``). Nothing here reads client data.
        """
        if self.mode == "fl":
            return (yield from self._fl_exchanges())
        cfg, t = self.config, self.round
        t0 = time.perf_counter()
        keep = self.transport.transcript.keep_payloads
        everything = cfg.decoys == "download-all"
        pir = cfg.decoys == "pir"
        all_ids = everything or pir  # RS computes (and the gradients cover) every item id
        timed = len(self._device_seconds)
        item_secure_s = 0.0
        sampled = np.sort(self.rng.choice(self._clients, size=self.clients_per_round, replace=False))  # SAS's choice
        try:
            # Step 2: the requests, to RS.
            keys = {"pir_rs", "pir_sas"} if pir else {"all" if everything else "ids"}
            got: Replies = yield Exchange("request", sampled, reply_keys=frozenset(keys),
                                          validate=lambda u, reply: self._receive_request(t, u, reply))
            self.last_dropped = {"request": dict(got.dropped)}
            users = np.array(sorted(got.values), dtype=np.int64)
            if len(users) < 2:  # neither secure sum could release anything but one client's vector
                raise SecureSumAborted(f"round {t}: RS accepted {len(users)} request(s); the secure sums need at least 2")
            names = [client(u) for u in users]
            reqs = None if all_ids else np.stack([got.values[u] for u in users]).reshape(len(users), -1)
            union = np.arange(self.n_items) if all_ids else np.unique(reqs)
            # RS: one dropout mask per item id of the round, so every client sees the same embedding of an item.
            item_masks = self.item_tower.masks(len(union), self.dropout_gen)
            params_v = {n: p.clone().requires_grad_(True) for n, p in self.item_params.items()}
            ts = time.perf_counter()
            emb = self._item_forward(params_v, union, self._inputs("item", union), item_masks)  # kept for backprop
            rs_s = time.perf_counter() - ts
            table = emb.detach().numpy()
            n_sent = len(union) if everything else cfg.request_size  # rows each client receives
            down: dict[str, np.ndarray] = {f"user.{n}": p.detach().numpy().copy() for n, p in self.user_params.items()}
            per_user: dict[int, dict[str, np.ndarray]] = {}
            answer_bytes = 0
            if everything:
                down["embeddings"] = table.copy()
            elif pir:  # RS shares the table with SAS; each answers every client's key set
                self.transport.send(RS, SAS, t, "item-table", None, int(table.nbytes))
                ts = time.perf_counter()
                servers = (PirServer(self.pir_layout, table, 0), PirServer(self.pir_layout, table, 1))
                per_user = {int(u): {"pir_rs": servers[0].answer(got.values[u][0]),
                                     "pir_sas": servers[1].answer(got.values[u][1])} for u in users}
                rs_s += time.perf_counter() - ts
                answer_bytes = int(per_user[int(users[0])]["pir_rs"].nbytes)
            else:
                per_user = {int(u): {"embeddings": table[np.searchsorted(union, reqs[c])]} for c, u in enumerate(users)}
            for name in names:
                self.transport.send(SAS, name, t, "user-tower", None, 4 * self.n_user_params)
            for c, name in enumerate(names):
                if pir:
                    for server, key in ((RS, "pir_rs"), (SAS, "pir_sas")):
                        ans = per_user[int(users[c])][key]
                        self.transport.send(server, name, t, "embeddings", ans.copy() if keep else None, int(ans.nbytes))
                    continue
                payload = (down["embeddings"] if everything else per_user[int(users[c])]["embeddings"].copy()) if keep else None
                self.transport.send(RS, name, t, "embeddings", payload, 4 * n_sent * cfg.dim)
            # Steps 3-4: each client's user-tower gradient and loss, summed through the chain to SAS.
            chain = SecureSum("chain", width=self.n_user_params + 1, frac_bits=cfg.frac_bits,
                              value_clip=cfg.value_clip, where="sttfedrec.value_clip", kind="user-gradient",
                              receiver=SAS, k=cfg.chain_successors, dropouts=self._dropouts.get("user"))
            res_u: Replies = yield Exchange("train", users, broadcast=down, per_user=per_user, secure=chain)
            self.last_dropped["train"] = dict(res_u.dropped)
            if res_u.aborted is not None:
                raise SecureSumAborted(res_u.aborted)
            # Step 5: the per-id embedding-gradient rows over RS's public union of the round's ids, to RS.
            union_down = {} if all_ids else {"union": union.copy()}
            if not all_ids:
                for name in names:
                    self.transport.send(RS, name, t, "union", union.copy() if keep else None, 4 * len(union))
            if cfg.item_aggregation == "none":
                res_i: Replies = yield Exchange("item-gradient", users, broadcast=union_down,
                                                reply_keys=frozenset({"rows"}),
                                                validate=lambda u, reply: self._receive_rows(t, u, reply, union))
                self.last_dropped["item-gradient"] = dict(res_i.dropped)
                if not res_i.values:
                    raise SecureSumAborted(f"round {t}: no client sent its item-gradient rows")
                g_sum = np.sum([res_i.values[u].astype(np.float64).ravel() for u in sorted(res_i.values)], axis=0)
                n_i, bytes_i = len(res_i.values), 4.0 * len(union) * cfg.dim
            else:
                two = {} if cfg.item_aggregation != "dpf" else {
                    "row_width": cfg.dim, "points": min(cfg.request_size, len(union)), "receiver2": SAS}
                spec = SecureSum(cfg.item_aggregation, width=len(union) * cfg.dim, frac_bits=cfg.frac_bits,
                                 value_clip=cfg.value_clip, where="sttfedrec.value_clip", kind="item-gradient",
                                 receiver=RS, dropouts=self._dropouts.get("item"), **two)
                res_i = yield Exchange("item-gradient", users, broadcast=union_down, secure=spec)
                self.last_dropped["item-gradient"] = dict(res_i.dropped)
                if res_i.aborted is not None:
                    raise SecureSumAborted(res_i.aborted)
                g_sum, n_i, bytes_i = res_i.total, len(res_i.survivors), res_i.bytes_per_client
                item_secure_s = float(res_i.client_seconds)
                rs_s += res_i.server_seconds
                # RS's own output (0 bytes on the wire), in its view so attacks see what RS learns.
                names_in = [client(u) for u in res_i.survivors]
                self.transport.send(RS, RS, t, "item-gradient-sum",
                                    (union.copy(), g_sum.reshape(len(union), cfg.dim).copy(), names_in) if keep else None,
                                    0)
        finally:
            self._served = {s for s in self._served if s[0] != t}  # the round is over (or may be run again)
        # Both sums are in: only now does any state change (an abort above leaves the model as it was).
        n_u = len(res_u.survivors)
        mean_u = self._unflatten(res_u.total[:-1] / n_u, self.user_params)
        mean_loss = float(res_u.total[-1] / n_u)
        ts = time.perf_counter()
        self.user_opt.step(self.user_params, mean_u, lr=cfg.lr_at(t))
        sas_s = time.perf_counter() - ts + res_u.server_seconds
        ts = time.perf_counter()
        G = torch.as_tensor(g_sum.reshape(len(union), cfg.dim) / n_i, dtype=torch.float32)
        grads_v = torch.autograd.grad(emb, list(params_v.values()), grad_outputs=G)
        self.item_opt.step(self.item_params, dict(zip(params_v, grads_v)), lr=cfg.lr_at(t))
        rs_s += time.perf_counter() - ts
        req_bytes = 4 if everything else 4 * cfg.request_size
        down_bytes = 4 * n_sent * cfg.dim
        if pir:  # two key sets up, two answers down
            req_bytes = 2 * KeySet.size(depth=self.pir_layout.depth, points=self.pir_layout.buckets, width=0,
                                        check=False)
            down_bytes = 2 * answer_bytes
        union_bytes = 0 if all_ids else 4 * len(union)
        train_bytes = (4 * self.n_user_params + req_bytes + down_bytes + union_bytes
                       + res_u.bytes_per_client + bytes_i)
        what = (f"user-tower gradient sum via the chain (s={cfg.chain_successors}) to SAS; item-id gradient "
                + ("rows of each client in plaintext to RS" if cfg.item_aggregation == "none"
                   else f"sums via {cfg.item_aggregation} to RS") + ("; requests by two-server PIR (RS, SAS)" if pir else
                                                                     "; requests in plaintext to RS") + " (no DP noise)")
        k = len(users)
        self._train_bytes.append(float(train_bytes))
        self.round += 1
        self._cache = None
        seconds = {"rs": rs_s, "sas": sas_s, "server": rs_s + sas_s, "round": time.perf_counter() - t0}
        secure_s = float(res_u.client_seconds) + item_secure_s
        self._secure_seconds.append(secure_s)
        seconds["client_secure"] = secure_s
        if len(self._device_seconds) > timed:  # in process the client steps ran here and timed one device
            seconds["client_compute"] = self._device_seconds[-1]
            seconds["client"] = self._device_seconds[-1] + secure_s  # the device's whole work
        return RoundStats(
            round=t, loss=mean_loss, clients=k, bytes_per_client=float(train_bytes), seconds=seconds,
            extra={"union_ids": int(len(union)), "survivors_user": n_u, "survivors_item": n_i,
                   "train_bytes_per_client": float(train_bytes), "requests_refused": len(got.dropped)},
            releases=(Release(NonPrivate(), who="clients", what=what, params={"clients": k}),),
        )

    def _receive_request(self, t: int, u: int, reply: dict[str, np.ndarray]) -> np.ndarray | None:
        """RS's check of one request reply (:meth:`check_request`); a refusal drops the client."""
        name, cfg = client(u), self.config
        if cfg.decoys == "pir":
            return self._receive_pir(t, name, reply)
        if cfg.decoys == "download-all":
            flag = reply["all"]
            if flag.shape != () or flag.dtype.kind not in "iu" or int(flag) != 1:
                raise RequestError(f"round {t}: {name} sent {flag!r} as its download-all request; expected the "
                                   "integer 1")
            self.check_request(t, name, None)
            self.transport.send(name, RS, t, "request-all", None, 4)
            arr = None
        else:
            arr = self.check_request(t, name, reply["ids"])
            self.transport.send(name, RS, t, "request", arr.copy() if self.transport.transcript.keep_payloads else None,
                                4 * cfg.request_size)
        self._served.add((t, name))
        return arr

    def _receive_pir(self, t: int, name: str, reply: dict[str, np.ndarray]) -> tuple[bytes, bytes]:
        """RS's and SAS's checks of one PIR request (a key set each, parsed strictly; a malformed or
        foreign key drops the client with the reason); recorded at each server."""
        lay = self.pir_layout
        assert lay is not None
        blobs = []
        for key, party, server in (("pir_rs", 0, RS), ("pir_sas", 1, SAS)):
            arr = reply[key]
            if arr.dtype != np.uint8 or arr.ndim != 1:
                raise RequestError(f"round {t}: {name}'s {key} is {arr.dtype} {arr.shape}; expected a uint8 key set")
            blob = arr.tobytes()
            try:
                KeySet.from_bytes(blob, party=party, depth=lay.depth, points=lay.buckets, width=0, check=False)
            except DpfError as exc:
                raise RequestError(f"round {t}: {name}'s PIR key for {server}: {exc}") from None
            blobs.append(blob)
        self._check_fresh(t, name)
        keep = self.transport.transcript.keep_payloads
        for blob, server in zip(blobs, (RS, SAS)):
            self.transport.send(name, server, t, "request-pir", blob if keep else None, len(blob))
        self._served.add((t, name))
        return blobs[0], blobs[1]

    def _receive_rows(self, t: int, u: int, reply: dict[str, np.ndarray], union: np.ndarray) -> np.ndarray:
        """RS's check of one client's plaintext item-gradient rows (``item_aggregation = "none"``)."""
        rows, name = reply["rows"], client(u)
        want = (len(union), self.config.dim)
        if rows.shape != want or rows.dtype != np.float32 or not np.isfinite(rows).all():
            raise ProtocolError(f"round {t}: {name} sent item-gradient rows of {rows.dtype} {rows.shape}; expected "
                                f"finite float32 {want}")
        payload = (union.copy(), rows.copy()) if self.transport.transcript.keep_payloads else None
        self.transport.send(name, RS, t, "item-gradient", payload, 4 * rows.size)
        return rows

    # -- the user tower's gradients (the client half: protocols.sttfedrec_device; the FL baseline's
    # round: protocols.sttfedrec_fl) ------------------------------------------------------------------------
    def _user_fn(self, params, inputs, masks, items, labels):
        u = functional_call(self.user_tower, params, (*inputs, masks))
        return sampled_softmax_loss(u, items, labels, self.config.temperature)

    def _per_client(self, params, user_x, user_masks, items, labels):
        """Per-client user-tower gradients, embedding gradients and losses (one vmap call)."""
        f = grad_and_value(self._user_fn, argnums=(0, 3))
        n_in = len(user_x)
        (gu, gi), loss = vmap(f, in_dims=(None, (0,) * n_in, 0, 0, 0))(params, user_x, user_masks, items, labels)
        return gu, gi, loss

    def _time_split_device(self, params, user_x, masks, returned, labels) -> float:
        """Wall seconds of one client's training work alone (the first of the step's clients), unbatched."""
        ts = time.perf_counter()
        pu = {n: p.clone().requires_grad_(True) for n, p in params.items()}
        u = functional_call(self.user_tower, pu, (*(x[0:1] for x in user_x), [m[0:1] for m in masks]))
        v = returned[0].clone().requires_grad_(True)
        loss = sampled_softmax_loss(u[0], v, torch.as_tensor(labels[0]), self.config.temperature)
        torch.autograd.grad(loss, list(pu.values()) + [v])
        return time.perf_counter() - ts

    @staticmethod
    def _unflatten(vec: np.ndarray, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        expected = sum(p.numel() for p in like.values())
        if vec.shape != (expected,):
            raise ProtocolError(f"gradient of length {vec.shape} does not fit the tower's {expected} parameters")
        out, off = {}, 0
        for n, p in like.items():
            out[n] = torch.as_tensor(vec[off:off + p.numel()], dtype=torch.float32).reshape(p.shape)
            off += p.numel()
        return out

    def apply_user_gradient(self, vec: np.ndarray, survivors: int) -> None:
        """SAS's step from a decoded sum (tests use it to show a wrong length changes nothing)."""
        mean = self._unflatten(np.asarray(vec, dtype=np.float64) / survivors, self.user_params)
        self.user_opt.step(self.user_params, mean, lr=self.config.lr_at(self.round))

    # -- evaluation, costs and checkpoints ----------------------------------------------------------
    @torch.no_grad()
    def item_embeddings(self) -> torch.Tensor:
        """All ``M`` item embeddings, L2-normalised (what RS ships for inference; on a client, the loaded ones)."""
        if self._device_emb is not None:
            return self._device_emb
        if self._cache is None or self._cache[0] != self.round:
            out = []
            for lo in range(0, self.n_items, 1024):
                rows = np.arange(lo, min(lo + 1024, self.n_items))
                out.append(self._item_forward(self.item_params, rows, self._inputs("item", rows), None))
            e = torch.cat(out)
            self._cache = (self.round, e / e.norm(dim=1, keepdim=True).clamp_min(1e-12))
        return self._cache[1]

    @torch.no_grad()
    def user_embeddings(self, users: np.ndarray) -> torch.Tensor:
        users = self.check_user(users)
        u = functional_call(self.user_tower, self.user_params, (*self._inputs("user", users), None))
        return u / u.norm(dim=1, keepdim=True).clamp_min(1e-12)

    def score(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        u = self.user_embeddings(users)
        return (self.item_embeddings()[torch.as_tensor(np.asarray(items))] * u.unsqueeze(1)).sum(-1).numpy()

    def score_all(self, users: np.ndarray) -> np.ndarray:
        return (self.user_embeddings(users) @ self.item_embeddings().T).numpy()

    def cost_report(self) -> dict[str, Any]:
        """Per-client training/inference bytes and device seconds (summary.json ``costs``)."""
        cfg, m = self.config, self.n_items
        ts = time.perf_counter()
        if self.mode == "fl":  # the device runs the item tower over the raw data of all items
            self._cache = None
        emb = self.item_embeddings() if self.mode == "fl" else self.item_embeddings().clone()
        u = self.user_embeddings(np.array([0]))
        torch.topk(u @ emb.T, k=min(10, m))
        infer_s = time.perf_counter() - ts
        if self.mode == "split":  # only the ranking runs on the device
            ts = time.perf_counter()
            torch.topk(self.user_embeddings(np.array([0])) @ emb.T, k=min(10, m))
            infer_s = time.perf_counter() - ts
        infer_bytes = m * cfg.dim * 4 if self.mode == "split" else self.data.item_text_bytes + 4 * self.n_item_id_params
        rounds = [r for r in self._device_seconds]
        return {**self._paper_costs(), **self._secure_costs(rounds),
            "inference_bytes_per_client": int(infer_bytes),
            "device_inference_seconds": float(infer_s),
            "train_bytes_per_client_per_round": float(np.mean(self._train_bytes)) if self._train_bytes else 0.0,
            "user_tower_params": int(self.n_user_params),
            "item_tower_params": int(self.n_item_params),
            "item_id_params": int(self.n_item_id_params),
            "features": self.data.describe(),
        }

    def _secure_costs(self, rounds: list[float]) -> dict[str, Any]:
        """Device seconds per round: compute (one client timed alone), secure aggregation (mean over
        the round's clients of their chain/masking steps: key agreement, PRG expansion, sealing) and
        their sum, the device's whole training work (``device_train_seconds_per_round``)."""
        compute = float(np.mean(rounds)) if rounds else 0.0
        secure = float(np.mean(self._secure_seconds)) if self._secure_seconds else 0.0
        return {"device_compute_seconds_per_round": compute, "device_secure_seconds_per_round": secure,
                "device_train_seconds_per_round": compute + secure}

    def _paper_costs(self) -> dict[str, Any]:
        """Training bytes counted the paper's way (notes section 5, Table 3): float32 tower parameters
        only, each tower once down (the model) and once up (its gradient). FL-DSSM: both towers;
        STTFedRec: the user tower (down from SAS, up through the chain). Left out: the item request,
        the returned embeddings, the item-gradient upload, the id vectors, the raw item features
        and the chain's 8-byte ring values, seeds and headers (all in ``train_bytes_per_client_per_round``)."""
        split = 2 * 4 * int(self.n_user_params)
        fl = 2 * 4 * (int(self.n_user_params) + int(self.n_item_params))
        return {
            "paper_train_bytes_per_client_per_round": float(split if self.mode == "split" else fl),
            "paper_train_bytes_sttfedrec": float(split), "paper_train_bytes_fl_dssm": float(fl),
            "paper_train_bytes_ratio_fl_over_sttfedrec": fl / split,
            "paper_count": "4 B x (user tower down + user-tower gradient up)" if self.mode == "split"
            else "4 B x (both towers down + both towers' gradients up)",
        }

    def public_info(self) -> dict[str, Any]:
        cfg = self.config
        return {"protocol": "sttfedrec" if self.mode == "split" else "fl-twotower", "n_users": self.n_users,
                "n_items": self.n_items, "clients": int(len(self._clients)), "request_size": cfg.request_size,
                "n_pos": cfg.n_pos, "n_neg": cfg.n_neg, "config": asdict(cfg),
                "item_popularity_public": False}

    def state_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "user": {k: v.clone() for k, v in self.user_params.items()},
            "item": {k: v.clone() for k, v in self.item_params.items()},
            "user_opt": self.user_opt.state_dict(), "item_opt": self.item_opt.state_dict(),
            "rng": self.rng.bit_generator.state, "dropout_gen": self.dropout_gen.get_state(),
            "device_seconds": list(self._device_seconds),
            "secure_seconds": list(self._secure_seconds), "train_bytes": list(self._train_bytes), "config": asdict(self.config), "mode": self.mode,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A key added to the configuration after the checkpoint was written (e.g. click_id_dim) is
        # absent from it; the checkpoint was made under that key's default, so it counts as the default.
        stored = {**asdict(type(self.config)()), **state["config"]}
        if stored != asdict(self.config) or state["mode"] != self.mode:
            raise ValueError("checkpoint was written with a different sttfedrec configuration or mode")
        for mine, theirs in ((self.user_params, state["user"]), (self.item_params, state["item"])):
            if set(mine) != set(theirs) or any(mine[k].shape != theirs[k].shape for k in mine):
                raise ValueError("checkpoint towers do not match the configured towers")
        self.round = int(state["round"])
        self.user_params = {k: v.clone() for k, v in state["user"].items()}
        self.item_params = {k: v.clone() for k, v in state["item"].items()}
        self.user_opt.load_state_dict(state["user_opt"])
        self.item_opt.load_state_dict(state["item_opt"])
        self.rng.bit_generator.state = state["rng"]
        self.dropout_gen.set_state(state["dropout_gen"])
        self._device_seconds = [float(x) for x in state["device_seconds"]]
        self._secure_seconds = [float(x) for x in state.get("secure_seconds", [])]  # absent before issue 25
        self._train_bytes = [float(x) for x in state["train_bytes"]]
        self._cache = None


def _build(ctx, mode: str) -> STTFedRec:
    return STTFedRec(ctx.train, ctx.config, seed=ctx.seed, source=ctx.source, transport=ctx.transport,
                     exclude=ctx.exclude, mode=mode)


def check_devices(config: TwoTowerConfig) -> None:
    """Refuse (in words) a configuration whose clients cannot run on separate devices."""
    if config.decoys == "fixed-pool":
        raise ValueError("sttfedrec.decoys = 'fixed-pool' cannot run on separate devices: each client's decoy pool "
                         "is popularity-matched over every user's training clicks (decoy_pools), which no device "
                         "holds and RS does not publish; use decoys = 'fresh' or 'download-all'")


register(ProtocolSpec(
    name="sttfedrec",
    summary="STTFedRec: split two-tower (DSSM/CLSM); item tower on RS, user tower on SAS via the circular chain",
    build=lambda ctx: _build(ctx, "split"), section="sttfedrec", config_cls=TwoTowerConfig,
    exchanges=Exchanges(check=check_devices), adversaries=(RS, SAS),
))
register(ProtocolSpec(
    name="fl-twotower",
    summary="FL-DSSM/FL-CLSM: clients train both towers and upload plaintext gradients (STTFedRec's baseline)",
    build=lambda ctx: _build(ctx, "fl"), section="sttfedrec", config_cls=TwoTowerConfig,
    exchanges=Exchanges(check=check_devices), adversaries=(RS,),
))

from protocols import twotower_central  # noqa: E402,F401  (registers centralized-twotower beside them)
