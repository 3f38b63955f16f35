"""FEL's ensemble payload: combiners over leaf predictions, the over-arch MLP, and fold-in.

FEL (Hejazinia et al. 2022; notes §2.4) combines ``C`` leaf models on the server, either by a
fixed rule over the leaves' predicted probabilities (mean, median, max; notes §8.8: over
probabilities) or by a learned over-arch: a small MLP whose input is every leaf's prediction and
last hidden layer, ``z(x) = [p_1(x), h_1(x), ..., p_C(x), h_C(x)]``, trained after the leaves with
the leaves frozen.

For id-based GMF leaves the "last hidden layer" is the element-wise product ``p_u * q_i * h``
before the output sum (dimension ``d``). A GMF leaf only trained the user rows of its own
cluster, so a user outside the cluster needs a representation in that leaf: :func:`fold_in`
fits it from the user's own positives against the leaf's frozen item table (a ridge/implicit-ALS
solve, deterministic, no randomness). Under FEL's label-only privacy the user's positives are
private, so fold-in runs where the positives are: on the device (or for opt-in users, on the
server); see docs/fel.md.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["COMBINERS", "OverArch", "ServerAdam", "combine", "fold_in", "over_arch_gradient", "train_over_arch"]

COMBINERS = ("mean", "median", "max")


def combine(probs: np.ndarray, how: str) -> np.ndarray:
    """Combine leaf probabilities ``[C, ...]`` over the leaf axis with ``how`` in :data:`COMBINERS`."""
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim < 1 or p.shape[0] < 1:
        raise ValueError(f"combine needs [n_leaves >= 1, ...] probabilities; found shape {p.shape}")
    if how == "mean":
        return p.mean(axis=0)
    if how == "median":
        return np.median(p, axis=0)
    if how == "max":
        return p.max(axis=0)
    raise ValueError(f"combiner must be one of {COMBINERS}; found {how!r}")


@torch.no_grad()
def fold_in(item_out: torch.Tensor, pos_start: np.ndarray, pos_items: np.ndarray, users: np.ndarray,
            *, reg: float = 0.1, neg_weight: float = 0.01, chunk: int = 8192) -> torch.Tensor:
    """User vectors fitted to a frozen leaf: ``argmin_p sum_pos (1 - p.v_i)^2 + w0 sum_all (p.v_i)^2 + reg |p|^2``.

    Args:
        item_out: ``[n_items, d]`` item vectors as the leaf's output sees them (``q_i * h``).
        pos_start, pos_items: the users' positives in CSR form (``pos_items[pos_start[u]:pos_start[u+1]]``).
        users: the users to fit.
        reg: ridge weight.
        neg_weight: weight ``w0`` of every item as a weak negative (implicit ALS).
        chunk: positives per batched outer-product step (bounds memory).

    Returns:
        ``[len(users), d]`` float32 vectors (zeros for a user without positives).
    """
    v = item_out.double()
    d = v.shape[1]
    users = np.asarray(users, dtype=np.int64)
    counts = pos_start[users + 1] - pos_start[users]
    owner = np.repeat(np.arange(len(users)), counts)
    items = np.concatenate([pos_items[pos_start[u]:pos_start[u + 1]] for u in users]) if len(users) else np.zeros(0, np.int64)
    gram = (neg_weight * (v.T @ v) + reg * torch.eye(d, dtype=torch.float64)).expand(len(users), d, d).clone()
    rhs = torch.zeros(len(users), d, dtype=torch.float64)
    for lo in range(0, len(items), chunk):
        vi = v[torch.as_tensor(items[lo:lo + chunk])]
        own = torch.as_tensor(owner[lo:lo + chunk])
        gram.index_add_(0, own, (1 - neg_weight) * vi.unsqueeze(2) * vi.unsqueeze(1))
        rhs.index_add_(0, own, vi)
    return torch.linalg.solve(gram, rhs.unsqueeze(2)).squeeze(2).float()


class OverArch(torch.nn.Module):
    """The over-arch NN: ``[p_c, h_c]_{c=1..C}`` -> one logit (notes §8.4: one hidden ReLU layer)."""

    def __init__(self, n_in: int, hidden: int, *, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(int(seed))
        self.l1 = torch.nn.Linear(n_in, hidden)
        self.l2 = torch.nn.Linear(hidden, 1)
        with torch.no_grad():
            for lin in (self.l1, self.l2):
                bound = 1.0 / np.sqrt(lin.in_features)
                lin.weight.copy_((torch.rand(lin.weight.shape, generator=g) * 2 - 1) * bound)
                lin.bias.zero_()

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(z))).squeeze(-1)


def train_over_arch(model: OverArch, z: torch.Tensor, y: torch.Tensor, *, epochs: int, lr: float,
                    batch_size: int, seed: int) -> float:
    """Train ``model`` centrally (opt-in users' examples, leaves frozen) with Adam and BCE; returns the last loss."""
    g = torch.Generator().manual_seed(int(seed))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loss = torch.zeros(())
    for _ in range(epochs):
        perm = torch.randperm(len(y), generator=g)
        for lo in range(0, len(y), batch_size):
            idx = perm[lo:lo + batch_size]
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(z[idx]), y[idx])
            loss.backward()
            opt.step()
    return float(loss.detach())


def over_arch_gradient(model: OverArch, z: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Gradient of the *summed* BCE loss over ``(z, y)`` w.r.t. ``model``'s parameters (one FedSGD upload).

    Summed, so that the gradients of disjoint clients add up to the cohort's: a FedSGD server that
    divides the sum by the cohort's example count takes the full-batch step on their union.
    """
    model.zero_grad()
    with torch.enable_grad():
        torch.nn.functional.binary_cross_entropy_with_logits(model(z), y, reduction="sum").backward()
    return [p.grad.detach().clone() for p in model.parameters()]


class ServerAdam:
    """Adam applied by the server to an averaged federated gradient (FedSGD with a server optimiser).

    Its state (``t``, ``m``, ``v``) is plain tensors so that a checkpoint restores it exactly.
    """

    def __init__(self, params: list[torch.Tensor], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        self.lr, self.betas, self.eps, self.t = lr, betas, eps, 0
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        b1, b2 = self.betas
        self.t += 1
        for p, g, m, v in zip(params, grads, self.m, self.v):
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            p -= self.lr * (m / (1 - b1**self.t)) / ((v / (1 - b2**self.t)).sqrt() + self.eps)

    def state_dict(self) -> dict:
        return {"t": self.t, "m": [x.clone() for x in self.m], "v": [x.clone() for x in self.v]}

    def load_state_dict(self, state: dict) -> None:
        self.t = int(state["t"])
        self.m = [x.clone() for x in state["m"]]
        self.v = [x.clone() for x in state["v"]]
