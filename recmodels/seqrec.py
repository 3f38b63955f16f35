"""FedCL's base recommenders (FedCL notes section 3): a GRU4Rec-style sequence encoder and the
NCF/GMF variant with a private user embedding, both scored by the dot product of Eq. (1).

* :class:`SeqEncoder` (``"gru"``): item embeddings (``[n_items, dim]``, tied between the input
  and the output side) feed a one-layer GRU with hidden size ``dim`` (64 in the paper); the
  user embedding after a prefix is the GRU's last hidden state. The embedding a client uploads is
  that of its whole training prefix (notes 8.4), truncated to the last ``max_len`` items.
* ``"id"`` (NCF/GMF variant, notes 8.8): the user embedding is a row of a user table that never
  leaves its client; the shared model is the item table only, and the score is ``p_u . q_i``
  (GMF with its output layer fixed to ones, i.e. Eq. (1)'s dot product).

:func:`contrastive_loss` is Eq. (1): per positive, a sampled softmax over the positive and a
mix of in-batch, local and semi-hard negatives, computed for many clients at once (one row of
every tensor per client), returning each client's own mean loss so that per-client gradients
can be taken. Each client's copy of the item table may be a :class:`PerRowTable`: its reads
become small recorded leaves instead of an ``[n_items, d]`` copy per client.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

__all__ = ["PerRowTable", "SeqEncoder", "client_sequences", "contrastive_loss", "gather_rows"]


class PerRowTable:
    """Every one of ``rows`` rows' own copy of a shared table ``[n, d]``, without the copies.

    Per-client gradients (FedCL's secure rounds) give each client its own copy of the item table,
    so that one backward pass yields each client's gradient separately; but a client's loss reads
    only a few item rows, and ``rows`` dense copies (and their ``[rows, n, d]`` gradient) cost
    ``rows x n x d`` for those few reads. This stands for the ``[rows, n, d]`` leaf copy where
    :func:`gather_rows` reads it: every read gathers from the shared table (detached) into a
    fresh leaf ``[b, ..., d]`` that requires grad, and records which row owns each entry and which
    ids it holds (:attr:`reads`). The gradient of a sum of per-row losses w.r.t. those leaves,
    scattered by (row, id) (:meth:`scatter_into`; repeated reads accumulate), is each row's
    gradient w.r.t. its own copy: the ids a row never read get zero, as they would from the copy.

    Rows are sliced as a tensor's first dimension (``table[c : c + 1]``): the slice shares the
    record and keeps the row numbers of the whole. Any read of the whole table (the full softmax)
    needs the dense copies instead.
    """

    def __init__(self, table: torch.Tensor, rows: int, *, first: int = 0,
                 reads: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None):
        if table.dim() != 2:
            raise ValueError(f"PerRowTable needs a [n, d] table; found shape {tuple(table.shape)}")
        self.table, self.rows, self.first = table.detach(), int(rows), int(first)
        self.reads = [] if reads is None else reads  # (owner row [k], ids [k], leaf [..., d]) per read

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, *self.table.shape))

    def dim(self) -> int:
        return 3

    def __getitem__(self, key: slice) -> "PerRowTable":
        """Rows ``key`` (a slice, step 1), sharing this table's record of reads."""
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"PerRowTable is sliced by rows only (step 1); found {key!r}")
        start, stop, _ = key.indices(self.rows)
        return PerRowTable(self.table, max(stop - start, 0), first=self.first + start, reads=self.reads)

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        """Row ``r``'s ``copy[r][idx[r]]`` for ``idx [rows, ...]``: a fresh recorded leaf ``[rows, ..., d]``."""
        if idx.dim() < 1 or idx.shape[0] != self.rows:
            raise ValueError(f"PerRowTable of {self.rows} rows read with indices of shape {tuple(idx.shape)}")
        leaf = self.table[idx].requires_grad_(True)
        owner = (self.first + torch.arange(self.rows)).view(-1, *([1] * (idx.dim() - 1))).expand(idx.shape)
        self.reads.append((owner.reshape(-1), idx.reshape(-1), leaf))
        return leaf

    def leaves(self) -> list[torch.Tensor]:
        """The recorded leaves, in the order of :attr:`reads` (what to take the gradient w.r.t.)."""
        return [leaf for _, _, leaf in self.reads]

    def scatter_into(self, out: torch.Tensor, grads: list[torch.Tensor | None]) -> None:
        """Add each read's leaf gradient (``grads``, as :meth:`leaves`; None: unused, zero) into
        ``out [rows, n, d]`` at (owner row, id), widened to ``out``'s dtype; repeats accumulate."""
        d = self.table.shape[1]
        parts = [(o, i, g.reshape(-1, d)) for (o, i, _), g in zip(self.reads, grads) if g is not None]
        if not parts:
            return
        owner, ids, vals = (torch.cat(x) for x in zip(*parts))
        out.index_put_((owner, ids), vals.to(out.dtype), accumulate=True)


def gather_rows(item: torch.Tensor | PerRowTable, idx: torch.Tensor) -> torch.Tensor:
    """``item[idx]`` for a shared table ``[n, d]``, or per row ``item[r][idx[r]]`` for ``[b, n, d]``
    (a dense per-row copy, or a :class:`PerRowTable` that records the read)."""
    if isinstance(item, PerRowTable):
        return item.gather(idx)
    if item.dim() == 2:
        return item[idx]
    batch = torch.arange(idx.shape[0]).view(-1, *([1] * (idx.dim() - 1)))
    return item[batch, idx]


class SeqEncoder(nn.Module):
    """GRU4Rec-style encoder with tied item embeddings.

    Args:
        n_items: item vocabulary size.
        dim: embedding and hidden size.
        generator: torch generator of the initialisation (``N(0, init_std^2)`` item rows; the
            GRU keeps torch's uniform initialisation, drawn from ``generator`` too).
        init_std: standard deviation of the item embeddings.
    """

    def __init__(self, n_items: int, dim: int = 64, *, generator: torch.Generator | None = None, init_std: float = 0.05):
        super().__init__()
        if n_items < 1 or dim < 1:
            raise ValueError(f"SeqEncoder needs positive sizes; found n_items={n_items}, dim={dim}")
        self.item = nn.Parameter(torch.randn(n_items, dim, generator=generator) * init_std)
        self.gru = nn.GRU(dim, dim, batch_first=True)
        bound = 1.0 / dim**0.5
        with torch.no_grad():
            for p in self.gru.parameters():
                p.copy_(torch.rand(p.shape, generator=generator) * 2 * bound - bound)

    def states(self, seqs: torch.Tensor, lengths: torch.Tensor, weights: dict[str, torch.Tensor] | None = None,
               *, dropout: float = 0.0, generator: torch.Generator | None = None) -> torch.Tensor:
        """Hidden state after every prefix: ``[b, L, dim]`` for right-padded ``seqs[b, L]``.

        Position ``j`` holds the user embedding after items ``0..j``; positions at or beyond a
        row's length keep the last valid state. Padding entries of ``seqs`` may hold any value.

        ``weights`` (from :meth:`per_row_weights`) gives every row its own copy of the parameters,
        so that one backward pass yields each row's gradient separately; the recurrence is
        torch's GRU (gates r, z, n in that order), written out so that it runs batched over rows.
        ``dropout`` (with ``generator``) drops input embedding entries (training only).
        """
        w = weights if weights is not None else self.shared_weights()
        b, length = seqs.shape
        x = gather_rows(w["item"], seqs.clamp_min(0))  # [b, L, d]
        if dropout > 0 and generator is not None:
            x = x * (torch.rand(x.shape, generator=generator, dtype=x.dtype) >= dropout) / (1.0 - dropout)
        gi = x @ w["weight_ih"].transpose(-1, -2) + w["bias_ih"].unsqueeze(-2)  # [b, L, 3d]
        h = x.new_zeros(b, self.dim)
        out = []
        for t in range(length):
            gh = (h.unsqueeze(1) @ w["weight_hh"].transpose(-1, -2)).squeeze(1) + w["bias_hh"]
            i_r, i_z, i_n = gi[:, t].chunk(3, -1)
            h_r, h_z, h_n = gh.chunk(3, -1)
            r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
            new = (1 - z) * torch.tanh(i_n + r * h_n) + z * h
            h = torch.where((t < lengths).unsqueeze(1), new, h)
            out.append(h)
        return torch.stack(out, 1)

    @property
    def dim(self) -> int:
        return int(self.item.shape[1])

    def shared_weights(self) -> dict[str, torch.Tensor]:
        """The parameters by name, shared by every row (weights broadcast over the batch)."""
        g = self.gru
        return {"item": self.item, "weight_ih": g.weight_ih_l0, "weight_hh": g.weight_hh_l0,
                "bias_ih": g.bias_ih_l0, "bias_hh": g.bias_hh_l0}

    def per_row_weights(self, rows: int, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """``rows`` leaf copies of the parameters in ``names`` (``[rows, ...]``, requiring grad);
        the others are shared. The gradient of a sum of per-row losses w.r.t. a copy is that
        row's own gradient."""
        out = {}
        for k, v in self.shared_weights().items():
            if k in names:
                out[k] = v.detach().unsqueeze(0).expand(rows, *v.shape).clone().requires_grad_(True)
            else:
                out[k] = v.unsqueeze(0) if k != "item" else v
        return out

    def encode(self, seqs: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The user embedding of each whole sequence: ``[b, dim]`` (the last valid state)."""
        st = self.states(seqs, lengths)
        return st[torch.arange(len(lengths)), (lengths - 1).clamp_min(0)]


def client_sequences(users: np.ndarray, items: np.ndarray, timestamps: np.ndarray, n_users: int,
                     max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Each user's training items in time order, last ``max_len`` kept, right-padded with -1.

    Returns ``(seqs int64 [n_users, max_len], lengths int64 [n_users])``; ties in time keep the
    given row order (the split's seeded shuffle already ordered them).
    """
    order = np.lexsort((np.arange(len(users)), timestamps, users))
    u, it = users[order], items[order]
    counts = np.bincount(u, minlength=n_users)
    start = np.concatenate([[0], np.cumsum(counts)[:-1]])
    pos_from_end = (start + counts)[u] - 1 - np.arange(len(u))  # 0 = the latest item
    keep = pos_from_end < max_len
    lengths = np.minimum(counts, max_len)
    col = lengths[u[keep]] - 1 - pos_from_end[keep]
    seqs = np.full((n_users, max_len), -1, dtype=np.int64)
    seqs[u[keep], col] = it[keep]
    return seqs, lengths.astype(np.int64)


def contrastive_loss(
    user_emb: torch.Tensor,
    pos: torch.Tensor,
    pos_mask: torch.Tensor,
    item: torch.Tensor,
    *,
    local_neg: torch.Tensor | None = None,
    hard_neg: torch.Tensor | None = None,
    hard_mask: torch.Tensor | None = None,
    in_batch: bool = True,
    local_log_q: float | None = None,
    hard_log_q: float | None = None,
    full_softmax: bool = False,
) -> torch.Tensor:
    """Eq. (1) for ``m`` clients at once; returns each client's mean loss over its positives ``[m]``.

    Args:
        user_emb: ``[m, P, d]``, the user embedding matched with each positive.
        pos: ``[m, P]`` positive item ids (any valid id where ``pos_mask`` is False).
        pos_mask: ``[m, P]`` bool, which positives exist.
        item: ``[n_items, d]`` item embeddings, or ``[m, n_items, d]`` (one copy per client), or a
            :class:`PerRowTable` of ``m`` rows (the copies recorded sparsely; not with ``full_softmax``).
        local_neg: ``[m, P, K]`` local negatives per positive, or None.
        hard_neg: ``[m, T]`` semi-hard negatives shared by all positives of a client, or None.
        hard_mask: ``[m, T]`` bool, which semi-hard negatives the client kept.
        in_batch: use the client's other positives as negatives (an identical item id is never
            its own negative: repeats are masked, notes 8.9).
        local_log_q: the logQ correction of the local negatives: ``log`` of the expected number
            of times an item is among a positive's local negatives (``log(K / n_items)`` for K
            uniform draws). Their logits become ``s - local_log_q``, so that the sampled sum
            estimates the full softmax's sum over all items (sampled softmax with importance
            weights; the positive is counted exactly). None: uncorrected (the paper's Eq. 1).
        hard_log_q: the same for the semi-hard negatives (``log(T / (R% of n_items))``).
        full_softmax: ignore every negative and take the softmax over all items (the ceiling of
            the sampled losses; ``item`` must then be the whole table).
    """
    if full_softmax:
        if isinstance(item, PerRowTable):
            raise ValueError("the full softmax reads the whole item table: it needs a dense table, not a PerRowTable")
        logits_all = user_emb @ item.transpose(-1, -2)  # [m, P, n_items]
        per_pos = torch.logsumexp(logits_all, dim=-1) - logits_all.gather(-1, pos.unsqueeze(-1)).squeeze(-1)
        per_pos = per_pos * pos_mask
        return per_pos.sum(1) / pos_mask.sum(1).clamp_min(1)
    neg_inf = torch.finfo(user_emb.dtype).min
    q_pos = gather_rows(item, pos)  # [m, P, d]
    pos_logit = (user_emb * q_pos).sum(-1, keepdim=True)  # [m, P, 1]
    parts = [pos_logit]
    if in_batch:
        ib = user_emb @ q_pos.transpose(1, 2)  # [m, P, P]: positive j against positive k
        ok = pos_mask.unsqueeze(1) & (pos.unsqueeze(1) != pos.unsqueeze(2))
        parts.append(ib.masked_fill(~ok, neg_inf))
    if local_neg is not None and local_neg.shape[-1]:
        ll = (user_emb.unsqueeze(2) * gather_rows(item, local_neg)).sum(-1)
        parts.append(ll if local_log_q is None else ll - local_log_q)
    if hard_neg is not None and hard_neg.shape[-1]:
        hl = user_emb @ gather_rows(item, hard_neg).transpose(1, 2)  # [m, P, T]
        if hard_log_q is not None:
            hl = hl - hard_log_q
        if hard_mask is not None:
            hl = hl.masked_fill(~hard_mask.unsqueeze(1), neg_inf)
        parts.append(hl)
    logits = torch.cat(parts, dim=-1)
    per_pos = torch.logsumexp(logits, dim=-1) - pos_logit.squeeze(-1)  # [m, P]
    per_pos = per_pos * pos_mask
    return per_pos.sum(1) / pos_mask.sum(1).clamp_min(1)
