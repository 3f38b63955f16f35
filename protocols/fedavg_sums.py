"""FedAvg-GMF's round sums: from plaintext uploads, through secure aggregation (each client's update as one
dense vector), or through the two-server DPF sum (each client's touched rows), and the server's update
from them; as a mixin of :class:`protocols.fedavg.FedAvgGMF`.

Every path returns the same ``(item_num, touched, h_num, b_num, w_sum)`` (:meth:`FedAvgSums._plain_sums`),
which :meth:`FedAvgSums._apply` turns into the new global model; the protocols built on FedAvg-GMF
(FedFast, FEL's leaves) and the Flower adapter reuse these. Split out of :mod:`protocols.fedavg` to keep
that module readable; every name here stays importable from :mod:`protocols.fedavg`.
"""

from __future__ import annotations

import numpy as np
import torch

from protocols.secure_sum import RowStack, secure_row_sum, secure_sum
from protocols.transport import SERVER, client

__all__ = ["SERVER2", "FedAvgSums"]

#: The second aggregation server's party name under ``"dpf"``.
SERVER2 = "server2"


class FedAvgSums:
    """The sums of a FedAvg-GMF round and the server's update from them (a mixin: it uses the trainer's
    state and configuration)."""

    def _plain_sums(self, pair_slot, pair_item, dQ, dH, dB, weight):
        """The sums the server needs, from plaintext uploads.

        Returns ``(item_num, touched, h_num, b_num, w_sum)``: ``item_num`` is the sum of the
        clients' item changes (``"sum"``) or of their ``n_k``-weighted changes (otherwise);
        ``touched`` the per-item sum of ``n_k`` over the clients that touched it (``"touched"``
        only); ``h_num``, ``b_num`` the ``n_k``-weighted output-layer changes; ``w_sum`` the sum of
        ``n_k``.
        """
        agg = self.config.item_aggregation
        rows = dQ if agg == "sum" else dQ * weight[pair_slot].unsqueeze(1)
        item_num = torch.zeros_like(self.item).index_add_(0, pair_item, rows)
        touched = None
        if agg == "touched":
            touched = torch.zeros(self.train.n_items).index_add_(0, pair_item, weight[pair_slot])
        h_num = (dH * weight.unsqueeze(1)).sum(0)
        return item_num, touched, h_num, (dB * weight).sum(), weight.sum()

    def _client_vectors(self, sampled, pair_slot, pair_item, dQ, dH, dB, weight) -> np.ndarray:
        """Each client's update as one dense float vector whose column sums are the round's sums
        (:meth:`_client_rows`, stacked)."""
        return self._client_rows(sampled, pair_slot, pair_item, dQ, dH, dB, weight).stacked()

    def _extra_columns(self, weight: np.ndarray) -> np.ndarray | None:
        """Columns a subclass appends to every client's row (``[m, k]``), or ``None``."""
        return None

    def _client_rows(self, sampled, pair_slot, pair_item, dQ, dH, dB, weight) -> RowStack:
        """Each client's update as one dense float vector whose column sums are the round's sums, built
        when it is asked for (a client masks its own; the cohort's dense matrix never exists).

        Layout: ``item change (n_items x dim) | [n_k per touched item (n_items), "touched" only]
        | n_k * dh (dim) | n_k * db | n_k | extra columns``, so that summing the vectors gives exactly
        what :meth:`_plain_sums` computes. ``pair_slot`` is grouped by client, as the round builds it.
        """
        n_items, d, m = self.train.n_items, self.config.dim, len(sampled)
        touched = self.config.item_aggregation == "touched"
        w = weight.numpy().astype(np.float64)
        slot = np.asarray(pair_slot, dtype=np.int64)
        item = np.asarray(pair_item, dtype=np.int64)
        vals = dQ.numpy()  # the pairs' changes as trained (float32): each row widens only its own
        scale = self.config.item_aggregation != "sum"
        if slot.size and np.any(slot[1:] < slot[:-1]):  # a round groups them already; stable keeps the last write
            order = np.argsort(slot, kind="stable")
            slot, item, vals = slot[order], item[order], vals[order]
        bounds = np.searchsorted(slot, np.arange(m + 1))
        tail = np.concatenate([dH.numpy() * w[:, None], (dB.numpy() * w)[:, None], w[:, None]], axis=1)
        extra = self._extra_columns(w)
        if extra is not None:
            tail = np.concatenate([tail, np.asarray(extra, dtype=np.float64).reshape(m, -1)], axis=1)
        width = n_items * d + (n_items if touched else 0) + tail.shape[1]

        def row(c: int) -> np.ndarray:
            out = np.zeros(width)
            lo, hi = bounds[c], bounds[c + 1]
            mine = vals[lo:hi].astype(np.float64)
            out[: n_items * d].reshape(n_items, d)[item[lo:hi]] = mine * w[c] if scale else mine
            if touched:
                out[n_items * d + item[lo:hi]] = w[c]
            out[width - tail.shape[1]:] = tail[c]
            return out

        return RowStack.lazy(m, width, row)

    def _secure_sums(self, t, sampled, pair_slot, pair_item, dQ, dH, dB, weight):
        """The same sums through secure aggregation; the transcript records the masked uploads."""
        cfg = self.config
        vectors = self._client_rows(sampled, pair_slot, pair_item, dQ, dH, dB, weight)
        res = secure_sum(
            vectors, protocol=cfg.secure_aggregation, frac_bits=cfg.frac_bits, value_clip=cfg.value_clip,
            round=t, transport=self.transport, senders=[client(u) for u in sampled], where="fedavg.value_clip",
            dropout=cfg.secagg_dropout, corrupt=cfg.secagg_corrupt,
            min_survivors=getattr(getattr(self, "device_policy", None), "min_survivors", 2),
        )
        self._secagg_seconds = float(np.mean(res.client_seconds))
        return self._sums_from_total(res.total), res.bytes_per_client

    def dpf_layout(self) -> tuple[int, int, int]:
        """``"dpf"``: ``(row width, tail rows, table rows)`` of the two-server sum's table: item row
        ``i`` holds the client's change of it (times ``n_k`` unless ``"sum"``), with ``n_k`` in one
        more column for ``"touched"``; the ``tail rows`` after the items hold ``n_k dh | n_k db | n_k``."""
        n_items, d = self.train.n_items, self.config.dim
        width = d + (1 if self.config.item_aggregation == "touched" else 0)
        tail = -(-(d + 2) // width)
        return width, tail, n_items + tail

    def _dpf_rows(self, sampled, pair_slot, pair_item, dQ, dH, dB, weight) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Each client's touched rows and their values in the :meth:`dpf_layout` table (float64)."""
        n_items, d, m = self.train.n_items, self.config.dim, len(sampled)
        width, tail, _ = self.dpf_layout()
        w = weight.numpy().astype(np.float64)
        vals = dQ.numpy().astype(np.float64)
        if self.config.item_aggregation != "sum":
            vals = vals * w[pair_slot][:, None]
        if width > d:  # "touched": n_k beside each touched row
            vals = np.concatenate([vals, w[pair_slot][:, None]], axis=1)
        tails = np.zeros((m, tail * width))
        tails[:, :d] = dH.numpy() * w[:, None]
        tails[:, d] = dB.numpy() * w
        tails[:, d + 1] = w
        tail_rows = np.arange(n_items, n_items + tail, dtype=np.int64)
        bounds = np.searchsorted(pair_slot, np.arange(m + 1))
        rows = [np.concatenate([pair_item[bounds[c]:bounds[c + 1]].astype(np.int64), tail_rows]) for c in range(m)]
        values = [np.concatenate([vals[bounds[c]:bounds[c + 1]], tails[c].reshape(tail, width)]) for c in range(m)]
        return rows, values

    def _dpf_sums(self, t, sampled, pair_slot, pair_item, dQ, dH, dB, weight):
        """The round's sums through the two-server DPF sum (clients send only their touched rows)."""
        cfg = self.config
        rows, values = self._dpf_rows(sampled, pair_slot, pair_item, dQ, dH, dB, weight)
        width, tail, n_rows = self.dpf_layout()
        res = secure_row_sum(
            rows, values, n_rows=n_rows, frac_bits=cfg.frac_bits, value_clip=cfg.value_clip, round=t,
            transport=self.transport, senders=[client(u) for u in sampled], points=cfg.dpf_points,
            max_parts=cfg.dpf_max_parts, pad_parts=cfg.dpf_pad_parts, dense_above=cfg.dpf_dense_above,
            receiver=SERVER, receiver2=SERVER2,
            where="fedavg.value_clip", min_survivors=getattr(getattr(self, "device_policy", None), "min_survivors", 2),
        )
        self._secagg_seconds = float(np.mean(res.client_seconds))
        self.dpf_server_seconds = res.server_seconds
        return self._sums_from_table(res.total), res.bytes_per_client

    def _sums_from_table(self, total: np.ndarray):
        """The round's sums (as :meth:`_plain_sums` returns them) from the decoded :meth:`dpf_layout` table."""
        n_items, d = self.train.n_items, self.config.dim
        width, tail, n_rows = self.dpf_layout()
        table = np.asarray(total).reshape(n_rows, width)
        item_num = torch.as_tensor(table[:n_items, :d], dtype=torch.float32)
        touched = torch.as_tensor(table[:n_items, d], dtype=torch.float32) if width > d else None
        rest = table[n_items:].reshape(-1)
        h_num = torch.as_tensor(rest[:d], dtype=torch.float32)
        return item_num, touched, h_num, torch.tensor(float(rest[d])), torch.tensor(float(rest[d + 1]))

    def _sums_from_total(self, total: np.ndarray):
        """The round's sums (as :meth:`_plain_sums` returns them) from the decoded sum of the
        :meth:`_client_vectors` (the Flower adapter's secure rounds use it too)."""
        n_items, d = self.train.n_items, self.config.dim
        cfg = self.config
        item_num = torch.as_tensor(total[: n_items * d].reshape(n_items, d), dtype=torch.float32)
        off, touched = n_items * d, None
        if cfg.item_aggregation == "touched":
            touched = torch.as_tensor(total[off : off + n_items], dtype=torch.float32)
            off += n_items
        h_num = torch.as_tensor(total[off : off + d], dtype=torch.float32)
        return item_num, touched, h_num, torch.tensor(float(total[off + d])), torch.tensor(float(total[off + d + 1]))

    def _apply(self, item_num, touched, h_num, b_num, w_sum) -> None:
        """The server's update from the round's sums (the same for plaintext and secure sums)."""
        cfg = self.config
        if cfg.item_aggregation == "sum":
            item_change = item_num
        elif cfg.item_aggregation == "mean":
            item_change = item_num / w_sum
        else:  # "touched": average over the clients that touched each row
            item_change = item_num / touched.clamp_min(1e-12).unsqueeze(1)
        self.item += cfg.server_lr * item_change
        self.h += cfg.server_lr * h_num / w_sum
        self.b += cfg.server_lr * b_num / w_sum
