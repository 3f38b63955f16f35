"""STTFedRec's client half (:class:`protocols.sttfedrec.STTFedRec`'s device steps), as a mixin.

What a client does in each exchange of a round (its request, its user-tower gradient through the chain,
its item-gradient rows), what it keeps on its device between them, and the model it scores with. Split
out of :mod:`protocols.sttfedrec` to keep that module readable; nothing here is meant to be used without it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from protocols.sttfedrec_parties import ITEM_ID, ProtocolError
from protocols.transport import client
from recmodels.twotower import numpy_flat
from secagg.dpf_pir import query

__all__ = ["STTFedRecDevice"]


class STTFedRecDevice:
    """The client's half of :class:`protocols.sttfedrec.STTFedRec` (a mixin: it uses the trainer's state)."""

    # -- the client half --------------------------------------------------------------------------
    def device_step(self, kind: str, round_: int, users: np.ndarray, broadcast: Mapping[str, np.ndarray],
                    per_user: Mapping[int, Mapping[str, np.ndarray]]) -> dict[int, dict[str, np.ndarray]]:
        """Client step ``kind`` of round ``round_`` for ``users`` (see :meth:`device_round`)."""
        users = np.asarray(users, dtype=np.int64)
        if kind == "request":
            return self._step_request(int(round_), users)
        if kind == "train":
            step = self._step_train if self.mode == "split" else self._step_fl_train
            return step(int(round_), users, broadcast, per_user)
        if kind == "item-gradient":
            return self._step_rows(int(round_), users, broadcast)
        raise ProtocolError(f"sttfedrec has no client step {kind!r}")

    def device_requires_secure(self, kind: str) -> bool:
        """The user-tower gradient always goes through the chain; the rows unless ``item_aggregation = "none"``."""
        if self.mode == "fl":  # FL-DSSM/CLSM's updates are plaintext by design (the baseline)
            return False
        return kind == "train" or (kind == "item-gradient" and self.config.item_aggregation != "none")

    def _step_request(self, t: int, users: np.ndarray) -> dict[int, dict[str, np.ndarray]]:
        ids, labels = self.client_requests(users, t)
        self.last_batches = (users.copy(), ids, labels)  # simulation ground truth for attack scoring; never sent
        out = {}
        for r, u in enumerate(users.tolist()):
            self._pending[u] = {"round": np.array(t, np.int64), "ids": ids[r].copy(), "labels": labels[r].copy()}
            if self.config.decoys == "pir":  # one key set for RS, one for SAS (CSPRNG roots, secagg.dpf)
                rows = np.unique(ids[r])
                k_rs, k_sas, q = query(self.pir_layout, rows)
                self._pending[u].update(pir_rows=rows, pir_buckets=q.buckets.astype(np.int64))
                out[u] = {"pir_rs": np.frombuffer(k_rs, np.uint8).copy(), "pir_sas": np.frombuffer(k_sas, np.uint8).copy()}
                continue
            out[u] = ({"all": np.array(1, np.int64)} if self.config.decoys == "download-all"
                      else {"ids": ids[r].copy()})
        return out

    def _pending_of(self, u: int, t: int, key: str) -> dict[str, np.ndarray] | None:
        p = self._pending.get(u)
        return p if p is not None and int(p["round"]) == t and key in p else None

    def _tower_of(self, arrays: Mapping[str, np.ndarray], like: dict[str, torch.Tensor] | None = None,
                  prefix: str = "user.") -> dict[str, torch.Tensor]:
        """The tower a client received (the user tower, or ``like``'s tower under ``prefix``; checked)."""
        out = {}
        for n, p in (self.user_params if like is None else like).items():
            if n == ITEM_ID:
                continue
            got = arrays.get(f"{prefix}{n}")
            if not isinstance(got, np.ndarray) or tuple(got.shape) != tuple(p.shape) or got.dtype != np.float32:
                raise ProtocolError(f"the tower's {prefix}{n!r} is missing or malformed (expected float32 "
                                    f"{tuple(p.shape)})")
            out[n] = torch.from_numpy(np.array(got))
        return out

    def _step_train(self, t: int, users: np.ndarray, broadcast: Mapping[str, np.ndarray],
                    per_user: Mapping[int, Mapping[str, np.ndarray]]) -> dict[int, dict[str, np.ndarray]]:
        cfg = self.config
        mine = [u for u in users.tolist() if self._pending_of(u, t, "ids") is not None]  # no request, no step
        if not mine:
            return {}
        params = self._tower_of(broadcast)
        ids = np.stack([self._pending[u]["ids"] for u in mine])
        labels = np.stack([self._pending[u]["labels"] for u in mine])
        want = (cfg.request_size, cfg.dim)
        if cfg.decoys == "download-all":
            table = broadcast.get("embeddings")
            if not isinstance(table, np.ndarray) or table.shape != (self.n_items, cfg.dim):
                raise ProtocolError(f"round {t}: expected all {self.n_items} item embeddings of {cfg.dim}")
            returned = torch.as_tensor(np.asarray(table, np.float32)[ids])
        elif cfg.decoys == "pir":
            returned = torch.as_tensor(np.stack([self._pir_rows(t, u, per_user.get(u, {})) for u in mine]))
        else:
            got = [per_user.get(u, {}).get("embeddings") for u in mine]
            if any(not isinstance(e, np.ndarray) or e.shape != want for e in got):
                raise ProtocolError(f"round {t}: expected {want} embeddings for each request")
            returned = torch.as_tensor(np.stack(got).astype(np.float32))
        users_m = np.asarray(mine, dtype=np.int64)
        user_x = self.client_user_x(users_m, ids, labels)
        masks = self.client_masks(users_m, t)
        gu, gi, loss = self._per_client(params, user_x, masks, returned, torch.as_tensor(labels))
        vec = np.concatenate([numpy_flat(gu), loss.double().numpy()[:, None]], axis=1)
        if self.record_chain_inputs:
            self.last_chain_inputs = ([client(u) for u in mine], vec)
        rows = gi.double().numpy()
        for r, u in enumerate(mine):
            self._pending[u]["emb_grad"] = rows[r]
        self._device_seconds.append(self._time_split_device(params, user_x, masks, returned, labels))
        return {u: {"vector": vec[r]} for r, u in enumerate(mine)}

    def _pir_rows(self, t: int, u: int, answers: Mapping[str, np.ndarray]) -> np.ndarray:
        """The client's ``T`` embeddings from RS's and SAS's PIR answers (XOR per bucket, bit for bit)."""
        cfg, lay, p = self.config, self.pir_layout, self._pending[u]
        row_bytes = 4 * cfg.dim
        dtype, words = (np.uint64, row_bytes // 8) if row_bytes % 8 == 0 else (np.uint8, row_bytes)
        a, b = answers.get("pir_rs"), answers.get("pir_sas")
        want = (lay.buckets, words)
        if any(not isinstance(x, np.ndarray) or x.shape != want or x.dtype != dtype for x in (a, b)):
            raise ProtocolError(f"round {t}: expected two PIR answers of {np.dtype(dtype)} {want}")
        rows = np.ascontiguousarray(np.bitwise_xor(a, b)[p["pir_buckets"]]).view(np.float32).reshape(-1, cfg.dim)
        return rows[np.searchsorted(p["pir_rows"], p["ids"])]

    def _step_rows(self, t: int, users: np.ndarray, broadcast: Mapping[str, np.ndarray]) -> dict[int, dict[str, np.ndarray]]:
        cfg = self.config
        if cfg.decoys in ("download-all", "pir"):
            union = np.arange(self.n_items)
        else:
            union = broadcast.get("union")
            if (not isinstance(union, np.ndarray) or union.ndim != 1 or union.dtype.kind not in "iu" or not len(union)
                    or np.any(np.diff(union) <= 0) or union[0] < 0 or union[-1] >= self.n_items):
                raise ProtocolError(f"round {t}: the union of ids must be sorted distinct item ids")
        out = {}
        for u in users.tolist():
            p = self._pending_of(u, t, "emb_grad")
            if p is None:
                continue  # nothing trained this round: nothing to send
            pos = np.minimum(np.searchsorted(union, p["ids"]), len(union) - 1)
            if np.any(union[pos] != p["ids"]):
                continue  # the union misses one of this client's ids: it sends nothing (RS drops it)
            del self._pending[u]
            if cfg.item_aggregation == "dpf":  # only the rows of its ids (the DPF sum sends no others): no dense table
                ids, at = np.unique(pos, return_inverse=True)
                rows = np.zeros((len(ids), cfg.dim))
                np.add.at(rows, at.reshape(-1), p["emb_grad"])
                out[u] = {"rows": ids.astype(np.int64), "row_values": rows}
                continue
            rows = np.zeros((len(union), cfg.dim))
            np.add.at(rows, pos, p["emb_grad"])
            out[u] = {"rows": rows.astype(np.float32)} if cfg.item_aggregation == "none" else {"vector": rows.ravel()}
        return out

    def device_state(self, user: int) -> dict[str, np.ndarray]:
        """What stays on the device between a round's exchanges (its request and gradients); nothing across rounds."""
        return {k: v.copy() for k, v in self._pending.get(int(user), {}).items()}

    def load_device_state(self, user: int, state: Mapping[str, np.ndarray]) -> None:
        if set(state) - {"round", "ids", "labels", "emb_grad", "pir_rows", "pir_buckets"}:
            raise ProtocolError(f"unknown device state keys {sorted(set(state))}")
        if state:
            self._pending[int(user)] = {k: np.array(v) for k, v in state.items()}
        else:
            self._pending.pop(int(user), None)

    def device_model(self) -> dict[str, np.ndarray]:
        """What a client needs to score: the user tower (SAS) and all ``M`` normalised item embeddings (RS)."""
        out = {f"user.{n}": p.detach().numpy().copy() for n, p in self.user_params.items()}
        out["item_embeddings"] = self.item_embeddings().numpy().copy()
        return out

    def load_device_model(self, model: Mapping[str, np.ndarray]) -> None:
        params = self._tower_of(model)
        emb = model.get("item_embeddings")
        if not isinstance(emb, np.ndarray) or emb.shape != (self.n_items, self.config.dim):
            raise ProtocolError(f"expected {self.n_items} item embeddings of {self.config.dim}")
        self.user_params = params
        self._device_emb = torch.as_tensor(np.asarray(emb, np.float32))
