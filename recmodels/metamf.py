"""The MetaMF model (Lin, Ren, Chen, Ren, Ma and de Rijke 2020, "Meta Matrix Factorization for Federated
Rating Predictions"): a meta network that, from a user's embedding, generates that user's private item
embeddings and the weights of its private rating-prediction MLP.

Pure functions over a dict of float64 tensors (names in :data:`SPARSE` and :func:`param_shapes`); the
protocol (:mod:`protocols.metamf`) decides who holds which part. For a batch of ``b`` users with
embeddings ``e`` (``[b, user_dim]``) and ``k`` items each:

1. collaborative memory (CM): ``a = softmax(e K^T)`` over ``memory_slots`` keys ``K``, and the
   collaborative vector ``c = a M`` (``M``: ``[memory_slots, memory_dim]``);
2. meta recommender (MR), for each generated layer ``l`` of the rating network with ``n_in -> n_out``
   units: ``h_l = ReLU(A_l c + a_l)``, ``W_l = reshape(B_l h_l + b_l, [n_in, n_out])``,
   ``bias_l = D_l h_l + d_l`` (a hypernetwork per layer, ``gen_hidden`` units wide);
3. item embeddings by a low-rank decomposition: ``g = ReLU(A_I c + a_I)``,
   ``P = reshape(L g + l, [n_items, item_rank])``, ``Q = reshape(R g + r, [item_rank, item_dim])`` and
   the user's item embedding matrix ``E = P Q``. Row ``i`` of ``P`` needs only the slice ``L[i]``
   (``[item_rank, gen_hidden]``) and ``l[i]``, so :func:`predict` takes the rows of the items it scores
   (:func:`item_rows`), one per (user, item) pair; generating every row and selecting gives the same numbers (tested);
4. rating prediction (RP): ``x_0 = E[i]``, ``x_l = ReLU(x_(l-1) W_l + bias_l)`` and a linear last
   layer: ``r_ui = x_(L-1) W_L + bias_L``.

The constant of the last layer's bias generator starts at ``init_bias`` (3.5 on a 0.5-5 scale, as
FedRec's ``init_mean``): a public constant, so the first predictions are near the usual mean rating.
"""

from __future__ import annotations

import math

import torch

__all__ = ["SPARSE", "collaborative_vector", "item_rows", "init_params", "param_shapes", "predict", "rp_sizes"]

#: The item generator's per-item slices: a client's gradient is nonzero only in its rated items' rows.
SPARSE = ("item.left_w", "item.left_b")


def rp_sizes(item_dim: int, rp_hidden: int, rp_layers: int) -> list[tuple[int, int]]:
    """``(n_in, n_out)`` of each generated layer: ``item_dim -> rp_hidden -> ... -> 1``."""
    widths = [item_dim] + [rp_hidden] * (rp_layers - 1) + [1]
    return list(zip(widths[:-1], widths[1:]))


def param_shapes(n_items: int, *, user_dim: int, memory_slots: int, memory_dim: int, gen_hidden: int,
                 item_dim: int, item_rank: int, rp_hidden: int, rp_layers: int) -> dict[str, tuple[int, ...]]:
    """The meta network's parameters by name (the server's model; the user embeddings are not in it)."""
    shapes: dict[str, tuple[int, ...]] = {"cm.keys": (memory_slots, user_dim), "cm.memory": (memory_slots, memory_dim)}
    for l, (n_in, n_out) in enumerate(rp_sizes(item_dim, rp_hidden, rp_layers)):
        shapes.update({f"rp{l}.hidden_w": (gen_hidden, memory_dim), f"rp{l}.hidden_b": (gen_hidden,),
                       f"rp{l}.weight_w": (n_in * n_out, gen_hidden), f"rp{l}.weight_b": (n_in * n_out,),
                       f"rp{l}.bias_w": (n_out, gen_hidden), f"rp{l}.bias_b": (n_out,)})
    shapes.update({"item.hidden_w": (gen_hidden, memory_dim), "item.hidden_b": (gen_hidden,),
                   "item.left_w": (n_items, item_rank, gen_hidden), "item.left_b": (n_items, item_rank),
                   "item.right_w": (item_rank * item_dim, gen_hidden), "item.right_b": (item_rank * item_dim,)})
    return shapes


def init_params(shapes: dict[str, tuple[int, ...]], *, init_bias: float, generator: torch.Generator
                ) -> dict[str, torch.Tensor]:
    """Normal draws scaled so that every generated layer starts as a usual layer plus a user-dependent part.

    Keys ``N(0, 1)``; memory and the generators' hidden layers ``N(0, 1 / fan_in)``, their biases 0; a
    generated layer's weight generator ``N(0, 1 / (gen_hidden n_in))`` and constant ``N(0, 1 / n_in)``
    (the constant is a usual ``1 / fan_in`` layer; the user-dependent part ``B_l h`` adds less, as ``h``
    is small at the start); its bias generator
    ``N(0, 0.01 / gen_hidden)`` and constant 0, except the output's constant ``init_bias``; the item
    generators ``L``, ``R`` ``N(0, 1 / (gen_hidden item_rank))`` and ``l``, ``r`` ``N(0, 1 / item_rank)``.
    """
    rank, gen_hidden = shapes["item.left_b"][1], shapes["item.hidden_w"][0]
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        kind = name.split(".")[1]
        if name == "cm.keys":
            var = 1.0
        elif kind in ("memory", "hidden_w"):
            var = 1.0 / shape[0] if kind == "memory" else 1.0 / shape[1]
        elif kind in ("weight_w", "weight_b"):
            n_in = shape[0] // shapes[name.replace(kind, "bias_b")][0]
            var = 1.0 / (gen_hidden * n_in) if kind == "weight_w" else 1.0 / n_in
        elif kind == "bias_w":
            var = 0.01 / gen_hidden
        elif kind in ("left_w", "right_w"):
            var = 1.0 / (gen_hidden * rank)
        elif kind in ("left_b", "right_b"):
            var = 1.0 / rank
        else:  # hidden_b, bias_b
            var = 0.0
        out[name] = math.sqrt(var) * torch.randn(shape, generator=generator, dtype=torch.float64)
    last = max(int(n.split(".")[0][2:]) for n in shapes if n.startswith("rp"))
    out[f"rp{last}.bias_b"] = torch.full(shapes[f"rp{last}.bias_b"], float(init_bias), dtype=torch.float64)
    return out


def collaborative_vector(params: dict[str, torch.Tensor], e: torch.Tensor) -> torch.Tensor:
    """CM module: ``softmax(e K^T) M`` (``[b, memory_dim]``)."""
    return torch.softmax(e @ params["cm.keys"].T, dim=-1) @ params["cm.memory"]


def item_rows(params: dict[str, torch.Tensor], items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The item generator's slices ``L[i]``, ``l[i]`` of ``items`` (any index shape)."""
    return params["item.left_w"][items], params["item.left_b"][items]


def predict(params: dict[str, torch.Tensor], e: torch.Tensor, left_w: torch.Tensor, left_b: torch.Tensor,
            owner: torch.Tensor) -> torch.Tensor:
    """Predicted ratings ``[n]`` of ``n`` (user, item) pairs: pair ``j``'s user has embedding ``e[owner[j]]``
    (``e``: ``[b, user_dim]``) and its item the generator slices ``left_w[j]`` (``[item_rank, gen_hidden]``)
    and ``left_b[j]`` (``[item_rank]``).

    ``params`` needs every dense parameter (those outside :data:`SPARSE`); steps 1-4 of the module docstring,
    each user's generators run once and their outputs gathered per pair.
    """
    c = collaborative_vector(params, e)
    g = torch.relu(c @ params["item.hidden_w"].T + params["item.hidden_b"])
    p = torch.einsum("nrg,ng->nr", left_w, g[owner]) + left_b
    q = (g @ params["item.right_w"].T + params["item.right_b"]).view(len(e), left_b.shape[-1], -1)
    x = torch.einsum("nr,nrs->ns", p, q[owner])  # the users' generated item embeddings, one row per pair
    n_layers = sum(1 for n in params if n.endswith(".hidden_w") and n.startswith("rp"))
    for l in range(n_layers):
        h = torch.relu(c @ params[f"rp{l}.hidden_w"].T + params[f"rp{l}.hidden_b"])
        w = (h @ params[f"rp{l}.weight_w"].T + params[f"rp{l}.weight_b"]).view(len(e), x.shape[-1], -1)
        bias = h @ params[f"rp{l}.bias_w"].T + params[f"rp{l}.bias_b"]
        x = torch.einsum("ni,nio->no", x, w[owner]) + bias[owner]
        if l < n_layers - 1:
            x = torch.relu(x)
    return x[:, 0]
