"""STTFedRec's FL baseline (``mode="fl"``, the ``fl-twotower`` protocol): the server's round and the
client's step of plain federated learning of both towers, as a mixin of :class:`protocols.sttfedrec.STTFedRec`.

Each client downloads both towers (and the dropout masks and id rows of its request's items) and uploads
both towers' gradients in plaintext: the baseline the split protocol is measured against. Split out of
:mod:`protocols.sttfedrec` to keep that module readable; nothing here is meant to be used without it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np
import torch
from torch.func import functional_call, grad_and_value, vmap

from dp.events import NonPrivate
from protocols.base import Release, RoundStats
from protocols.exchange import DeviceRound, Exchange, Replies
from protocols.sttfedrec_parties import ITEM_ID, RS, ProtocolError
from protocols.transport import client
from recmodels.twotower import numpy_flat, sampled_softmax_loss

__all__ = ["FLTwoTowerRounds"]


class FLTwoTowerRounds:
    """The FL baseline's round (:meth:`_fl_exchanges`), its server check and its client step (a mixin: it
    uses :class:`protocols.sttfedrec.STTFedRec`'s state)."""

    def _fl_exchanges(self) -> DeviceRound:
        """The server half of an ``fl-twotower`` round: ``"request"`` as under sttfedrec, then ``"train"``
        (down: both towers, the dropout masks and id rows of the request's items; up: both towers'
        gradients, the id rows' gradients and the loss, each client's in plaintext)."""
        cfg, t = self.config, self.round
        t0 = time.perf_counter()
        everything = cfg.decoys == "download-all"
        timed = len(self._device_seconds)
        has_id = ITEM_ID in self.item_params
        sampled = np.sort(self.rng.choice(self._clients, size=self.clients_per_round, replace=False))
        try:
            got: Replies = yield Exchange("request", sampled, reply_keys=frozenset({"all" if everything else "ids"}),
                                          validate=lambda u, reply: self._receive_request(t, u, reply))
            self.last_dropped = {"request": dict(got.dropped)}
            users = np.array(sorted(got.values), dtype=np.int64)
            if not len(users):
                raise ProtocolError(f"round {t}: RS accepted no request")
            names = [client(u) for u in users]
            reqs = None if everything else np.stack([got.values[u] for u in users]).reshape(len(users), -1)
            union = np.arange(self.n_items) if everything else np.unique(reqs)
            # The server's dropout mask per item id of the round (every client drops the same units of an item).
            masks = [m.numpy() for m in self.item_tower.masks(len(union), self.dropout_gen)]
            id_table = self.item_params[ITEM_ID][torch.as_tensor(union)].numpy() if has_id else None
            down = {f"user.{n}": p.detach().numpy().copy() for n, p in self.user_params.items()}
            down.update({f"item.{n}": p.detach().numpy().copy() for n, p in self.item_params.items() if n != ITEM_ID})
            per_user: dict[int, dict[str, np.ndarray]] = {}
            if everything:
                down.update({f"mask.{i}": m for i, m in enumerate(masks)})
                if has_id:
                    down["id_rows"] = id_table
            else:
                for c, u in enumerate(users):
                    pos = np.searchsorted(union, reqs[c])
                    per_user[int(u)] = {f"mask.{i}": m[pos] for i, m in enumerate(masks)}
                    if has_id:
                        per_user[int(u)]["id_rows"] = id_table[pos]
            id_bytes = 4 * cfg.request_size * cfg.dim if has_id else 0
            rows_down = len(union) if everything else cfg.request_size
            item_bytes = (int(self.data.item_x[union].nnz * 8 // max(len(union), 1)) * rows_down
                          + id_bytes * rows_down // cfg.request_size)
            for name in names:
                self.transport.send(RS, name, t, "user-tower", None, 4 * self.n_user_params)
                self.transport.send(RS, name, t, "item-tower", None, 4 * self.n_item_params)
                self.transport.send(RS, name, t, "item-features", None, item_bytes)
            keys = {"user", "item", "loss"} | ({"ids"} if has_id else set()) | ({"id_index"} if has_id and everything
                                                                               else set())
            upd: Replies = yield Exchange("train", users, broadcast=down, per_user=per_user, reply_keys=frozenset(keys),
                                          validate=lambda u, reply: self._receive_update(t, u, reply))
            self.last_dropped["train"] = dict(upd.dropped)
        finally:
            self._served = {s for s in self._served if s[0] != t}  # the round is over (or may be run again)
        order = sorted(upd.values)
        k = len(order)
        if k == 0:
            raise ProtocolError(f"round {t}: no client sent an update")
        ts = time.perf_counter()
        tower_v = {n: p for n, p in self.item_params.items() if n != ITEM_ID}
        mean_u = self._unflatten(np.sum([upd.values[u]["user"].astype(np.float64) for u in order], 0) / k,
                                 self.user_params)
        gv = self._unflatten(np.sum([upd.values[u]["item"].astype(np.float64) for u in order], 0) / k, tower_v)
        if has_id:  # the mean over clients of each client's gradient of the whole id table (its rows only)
            g_id = torch.zeros_like(self.item_params[ITEM_ID])
            row_of = {int(u): c for c, u in enumerate(users)}
            for u in order:
                idx = upd.values[u]["id_index"] if everything else reqs[row_of[u]]
                g_id.index_add_(0, torch.as_tensor(idx), torch.as_tensor(upd.values[u]["ids"]) / k)
            gv[ITEM_ID] = g_id
        self.user_opt.step(self.user_params, mean_u, lr=cfg.lr_at(t))
        self.item_opt.step(self.item_params, gv, lr=cfg.lr_at(t))
        server_s = time.perf_counter() - ts
        upload = 4 * (self.n_user_params + self.n_item_params) + 4 + id_bytes
        train_bytes = 4 * (self.n_user_params + self.n_item_params) + upload + 4 * cfg.request_size + item_bytes
        self._train_bytes.append(float(train_bytes))
        self.round += 1
        self._cache = None
        seconds = {"server": server_s, "round": time.perf_counter() - t0}
        if len(self._device_seconds) > timed:
            seconds["client"] = self._device_seconds[-1]
        loss = float(np.mean([float(upd.values[u]["loss"]) for u in order]))
        return RoundStats(
            round=t, loss=loss, clients=k, bytes_per_client=float(train_bytes), seconds=seconds,
            extra={"train_bytes_per_client": float(train_bytes), "requests_refused": len(got.dropped)},
            releases=(Release(NonPrivate(), who="clients", what="both towers' gradients, each in plaintext",
                              params={"clients": k}),),
        )

    def _receive_update(self, t: int, u: int, reply: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The FL server's check of one client's plaintext update."""
        cfg, name = self.config, client(u)
        want = {"user": (self.n_user_params,), "item": (self.n_item_params,), "loss": (),
                "ids": (cfg.request_size, cfg.dim), "id_index": (cfg.request_size,)}
        for key, value in reply.items():
            if value.shape != want[key]:
                raise ProtocolError(f"round {t}: {name}'s {key!r} has shape {value.shape}; expected {want[key]}")
            if key == "id_index":
                if value.dtype.kind not in "iu" or value.min() < 0 or value.max() >= self.n_items:
                    raise ProtocolError(f"round {t}: {name}'s id_index must be item ids in 0..{self.n_items - 1}")
            elif value.dtype != (np.float64 if key == "loss" else np.float32) or not np.isfinite(value).all():
                raise ProtocolError(f"round {t}: {name}'s {key!r} must be finite "
                                    f"{'float64' if key == 'loss' else 'float32'}; found {value.dtype}")
        nbytes = 4 * (self.n_user_params + self.n_item_params) + 4 + (4 * cfg.request_size * cfg.dim if "ids" in reply else 0)
        # the plaintext gradients as RS received them (a recorded view keeps them; docs/attacks.md)
        self.transport.send(name, RS, t, "update", dict(reply) if self.transport.transcript.keep_payloads else None, nbytes)
        return reply

    def _step_fl_train(self, t: int, users: np.ndarray, broadcast: Mapping[str, np.ndarray],
                       per_user: Mapping[int, Mapping[str, np.ndarray]]) -> dict[int, dict[str, np.ndarray]]:
        """An FL client: both towers' gradients on its request, from the downloaded towers, masks and id rows."""
        cfg = self.config
        mine = [u for u in users.tolist() if self._pending_of(u, t, "ids") is not None]
        if not mine:
            return {}
        everything, has_id = cfg.decoys == "download-all", ITEM_ID in self.item_params
        pu = self._tower_of(broadcast)
        pv = self._tower_of(broadcast, self.item_params, "item.")
        ids = np.stack([self._pending[u]["ids"] for u in mine])
        labels = np.stack([self._pending[u]["labels"] for u in mine])
        k, T = ids.shape
        n_masks = len(self.item_tower.widths) - 1

        def rows(key: str, width: int | None = None) -> np.ndarray:
            if everything:
                table = broadcast.get(key)
                if not isinstance(table, np.ndarray) or table.shape[0] != self.n_items:
                    raise ProtocolError(f"round {t}: expected {key!r} for all {self.n_items} items")
                return np.asarray(table)[ids]
            got = [per_user.get(u, {}).get(key) for u in mine]
            if any(not isinstance(g, np.ndarray) or g.shape[0] != T for g in got):
                raise ProtocolError(f"round {t}: expected {key!r} for the {T} items of each request")
            return np.stack(got)

        im = [torch.as_tensor(rows(f"mask.{i}"), dtype=torch.float32) for i in range(n_masks)]
        erows = (torch.as_tensor(rows("id_rows"), dtype=torch.float32) if has_id
                 else torch.zeros(k, T, cfg.dim))
        ix = tuple(x.reshape(k, T, *x.shape[1:]) for x in self._inputs("item", ids.ravel()))
        users_m = np.asarray(mine, dtype=np.int64)
        user_x, um = self.client_user_x(users_m, ids, labels), self.client_masks(users_m, t)

        def loss_fn(pu_, pv_, er, ux, umask, vx, vm, lab):
            u = functional_call(self.user_tower, pu_, (*ux, umask))
            v = functional_call(self.item_tower, pv_, (*vx, vm)) + er
            return sampled_softmax_loss(u, v, lab, cfg.temperature)

        f = grad_and_value(loss_fn, argnums=(0, 1, 2))
        lab = torch.as_tensor(labels)
        (gu, gv, ge), loss = vmap(f, in_dims=(None, None, 0, (0,) * len(user_x), 0, (0,) * len(ix), 0, 0))(
            pu, pv, erows, user_x, um, ix, im, lab)
        ts = time.perf_counter()  # one device's work alone, unbatched (the first client of the step)
        f(pu, pv, erows[0], tuple(x[0] for x in user_x), [m[0] for m in um], tuple(x[0] for x in ix),
          [m[0] for m in im], lab[0])
        self._device_seconds.append(time.perf_counter() - ts)
        fu, fv = numpy_flat(gu).astype(np.float32), numpy_flat(gv).astype(np.float32)
        out = {}
        for r, u in enumerate(mine):
            reply = {"user": fu[r], "item": fv[r], "loss": np.array(float(loss[r]), np.float64)}
            if has_id:
                reply["ids"] = ge[r].numpy().astype(np.float32)
                if everything:
                    reply["id_index"] = ids[r].copy()
            out[u] = reply
            del self._pending[u]
        return out
