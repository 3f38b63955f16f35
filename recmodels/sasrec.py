"""A SASRec-style self-attention sequence encoder (Kang & McAuley 2018), the option the FedCL issue
names beside the GRU (FedCL notes section 3).

:class:`SelfAttnEncoder` has the interface of :class:`recmodels.seqrec.SeqEncoder` (``item``,
``states``, ``encode``, ``shared_weights``, ``per_row_weights``), so that FedCL and its baselines
train it unchanged: item embeddings (tied between the input and the output side, as in SASRec)
plus learned absolute positional embeddings feed ``blocks`` pre-LayerNorm transformer blocks with
causal (left-to-right) self-attention of ``heads`` heads and a two-layer ReLU feed-forward, then a
final LayerNorm. The state at position ``t`` depends on items ``0..t`` only (tested as a property);
positions at or beyond a row's length repeat the last valid state, as the GRU does.

Every layer is written out as matrix products whose weights may be shared (``[out, in]``) or one
copy per row (``[b, out, in]``), so that one backward pass gives each client its own gradient.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from recmodels.seqrec import gather_rows

__all__ = ["SelfAttnEncoder"]


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``x @ w.T + b`` for shared (``w [o, i]``, ``b [o]``) or per-row (``[r, o, i]``, ``[r, o]``) weights."""
    return x @ w.transpose(-1, -2) + b.unsqueeze(-2)


def _layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return nn.functional.layer_norm(x, x.shape[-1:]) * w.unsqueeze(-2) + b.unsqueeze(-2)


def _dropout(x: torch.Tensor, p: float, generator: torch.Generator | None) -> torch.Tensor:
    if p <= 0 or generator is None:
        return x
    keep = torch.rand(x.shape, generator=generator, dtype=x.dtype) >= p
    return x * keep / (1.0 - p)


class SelfAttnEncoder(nn.Module):
    """SASRec-style causal self-attention encoder with tied item embeddings.

    Args:
        n_items: item vocabulary size.
        dim: embedding size (the model width).
        max_len: longest sequence (the number of positional embeddings).
        blocks: transformer blocks.
        heads: attention heads (``dim`` must be divisible by it).
        generator: torch generator of the initialisation.
        init_std: standard deviation of the item and positional embeddings.
    """

    def __init__(self, n_items: int, dim: int = 64, max_len: int = 50, *, blocks: int = 2, heads: int = 1,
                 generator: torch.Generator | None = None, init_std: float = 0.05):
        super().__init__()
        if n_items < 1 or dim < 1 or max_len < 1 or blocks < 1 or heads < 1 or dim % heads:
            raise ValueError(f"SelfAttnEncoder needs positive sizes and dim divisible by heads; found n_items={n_items}, "
                             f"dim={dim}, max_len={max_len}, blocks={blocks}, heads={heads}")
        self.heads, self.blocks = heads, blocks
        self.item = nn.Parameter(torch.randn(n_items, dim, generator=generator) * init_std)
        self.pos = nn.Parameter(torch.randn(max_len, dim, generator=generator) * init_std)
        bound = 1.0 / math.sqrt(dim)
        for i in range(blocks):
            for name, shape in (("ln1_w", (dim,)), ("ln1_b", (dim,)), ("qkv_w", (3 * dim, dim)), ("qkv_b", (3 * dim,)),
                                ("out_w", (dim, dim)), ("out_b", (dim,)), ("ln2_w", (dim,)), ("ln2_b", (dim,)),
                                ("ff1_w", (dim, dim)), ("ff1_b", (dim,)), ("ff2_w", (dim, dim)), ("ff2_b", (dim,))):
                if name.startswith("ln"):
                    value = torch.ones(shape) if name.endswith("_w") else torch.zeros(shape)
                else:
                    value = (torch.rand(shape, generator=generator) * 2 - 1) * bound
                self.register_parameter(f"b{i}_{name}", nn.Parameter(value))
        self.lnf_w = nn.Parameter(torch.ones(dim))
        self.lnf_b = nn.Parameter(torch.zeros(dim))

    @property
    def dim(self) -> int:
        return int(self.item.shape[1])

    @property
    def max_len(self) -> int:
        return int(self.pos.shape[0])

    def shared_weights(self) -> dict[str, torch.Tensor]:
        """The parameters by name, in :meth:`parameters` order, shared by every row."""
        return dict(self.named_parameters())

    def per_row_weights(self, rows: int, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """``rows`` leaf copies of the parameters in ``names`` (``[rows, ...]``, requiring grad);
        the others are shared (as :meth:`recmodels.seqrec.SeqEncoder.per_row_weights`)."""
        out = {}
        for k, v in self.shared_weights().items():
            if k in names:
                out[k] = v.detach().unsqueeze(0).expand(rows, *v.shape).clone().requires_grad_(True)
            else:
                out[k] = v.unsqueeze(0) if k not in ("item", "pos") else v
        return out

    def states(self, seqs: torch.Tensor, lengths: torch.Tensor, weights: dict[str, torch.Tensor] | None = None,
               *, dropout: float = 0.0, generator: torch.Generator | None = None) -> torch.Tensor:
        """The state after every prefix: ``[b, L, dim]`` for right-padded ``seqs[b, L]`` (``L <= max_len``).

        Position ``t`` attends to positions ``0..t`` only; positions at or beyond a row's length
        repeat its last valid state. ``dropout`` (with ``generator``) drops embedding, attention
        and feed-forward outputs, SASRec's regularisation; without a generator there is none.
        """
        w = weights if weights is not None else self.shared_weights()
        b, length = seqs.shape
        if length > self.max_len:
            raise ValueError(f"sequence length {length} exceeds the encoder's max_len {self.max_len}")
        x = gather_rows(w["item"], seqs.clamp_min(0)) * math.sqrt(self.dim)
        pos = w["pos"][..., :length, :]
        x = _dropout(x + pos, dropout, generator)
        h, dh = self.heads, self.dim // self.heads
        causal = torch.ones(length, length, dtype=torch.bool).triu(1)
        for i in range(self.blocks):
            p = lambda n: w[f"b{i}_{n}"]  # noqa: E731
            y = _layer_norm(x, p("ln1_w"), p("ln1_b"))
            q, k, v = _linear(y, p("qkv_w"), p("qkv_b")).split(self.dim, dim=-1)
            q, k, v = (z.reshape(b, length, h, dh).transpose(1, 2) for z in (q, k, v))  # [b, h, L, dh]
            att = (q @ k.transpose(-1, -2)) / math.sqrt(dh)
            att = torch.softmax(att.masked_fill(causal, float("-inf")), dim=-1)
            a = (att @ v).transpose(1, 2).reshape(b, length, self.dim)
            x = x + _dropout(_linear(a, p("out_w"), p("out_b")), dropout, generator)
            y = _layer_norm(x, p("ln2_w"), p("ln2_b"))
            f = _linear(torch.relu(_linear(y, p("ff1_w"), p("ff1_b"))), p("ff2_w"), p("ff2_b"))
            x = x + _dropout(f, dropout, generator)
        x = _layer_norm(x, w["lnf_w"], w["lnf_b"])
        last = (lengths - 1).clamp_min(0).unsqueeze(1)
        idx = torch.minimum(torch.arange(length).unsqueeze(0), last)  # beyond the length: the last valid state
        return x.gather(1, idx.unsqueeze(-1).expand(-1, -1, self.dim))

    def encode(self, seqs: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The user embedding of each whole sequence: ``[b, dim]`` (the last valid state)."""
        st = self.states(seqs, lengths)
        return st[torch.arange(len(lengths)), (lengths - 1).clamp_min(0)]
