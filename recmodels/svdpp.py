"""SVD++ (Koren, KDD 2008): biased MF plus the implicit feedback of *which* items a user rated.

The prediction (Koren's Eq. 15) is

    r_ui ~ mu + b_u + b_i + q_i . (p_u + |N(u)|^(-1/2) sum_(j in N(u)) y_j),

``N(u)`` the items ``u`` rated in training (the implicit-feedback term: a user is also described by
the set of items it chose to rate). SGD over the ratings, each update at the error ``e`` of the
rating before it (Koren's update rules, as scikit-surprise's ``SVDpp`` runs them, our test oracle):

    b_u += lr (e - reg b_u);  b_i += lr (e - reg b_i)
    p_u += lr (e q_i - reg p_u);  q_i += lr (e (p_u_old + |N(u)|^-1/2 sum y_j) - reg q_i)
    y_j += lr (e |N(u)|^-1/2 q_i_old - reg y_j)   for every j in N(u).

One learning rate and one regulariser for every parameter (surprise's ``lr_all``/``reg_all``);
factors start as ``N(0, init_std^2)``, biases at 0. Centralised numpy, no parties.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from recmodels.pmf import ORDERS, RatingModel, check_positive

__all__ = ["SVDppConfig", "SVDppModel", "svdpp_epoch", "svdpp_order"]


@dataclass(frozen=True)
class SVDppConfig:
    """Hyper-parameters of SVD++ (surprise's ``SVDpp`` defaults).

    Attributes:
        dim: latent factors.
        lr: SGD learning rate of every parameter.
        reg: weight decay of every parameter.
        init_std: factors start as ``N(0, init_std^2)``.
        order: ``"shuffle"`` or ``"user"`` (:func:`svdpp_order`; both grouped by user).
    """

    dim: int = 20
    lr: float = 0.007
    reg: float = 0.02
    init_std: float = 0.1
    order: str = "shuffle"

    def __post_init__(self) -> None:
        if type(self.dim) is not int or self.dim < 1:
            raise ValueError(f"svdpp.dim must be an int >= 1; found {self.dim!r}")
        check_positive("svdpp", lr=self.lr, reg=self.reg, init_std=self.init_std)
        if not self.lr > 0:
            raise ValueError(f"svdpp.lr must be positive; found {self.lr!r}")
        if self.order not in ORDERS:
            raise ValueError(f"svdpp.order must be one of {ORDERS}; found {self.order!r}")


@dataclass
class SVDppModel(RatingModel):
    """:class:`recmodels.pmf.RatingModel` plus the implicit factors ``y`` and each user's ``N(u)``.

    ``n_start``/``n_items``: user ``u``'s rated items are ``n_items[n_start[u]:n_start[u + 1]]``.
    """

    y: np.ndarray = None  # type: ignore[assignment]
    n_start: np.ndarray = None  # type: ignore[assignment]
    n_items: np.ndarray = None  # type: ignore[assignment]

    @classmethod
    def init_svdpp(cls, n_users: int, n_items: int, dim: int, init_std: float, mu: float, users: np.ndarray,
                   items: np.ndarray, rng: np.random.Generator) -> SVDppModel:
        base = RatingModel.init(n_users, n_items, dim, init_std, mu, rng)
        y = rng.normal(0.0, init_std, (n_items, dim))
        order = np.argsort(users, kind="stable")
        start = np.concatenate([[0], np.cumsum(np.bincount(users, minlength=n_users))]).astype(np.int64)
        return cls(base.p, base.q, base.bu, base.bi, base.mu, y, start, np.asarray(items, np.int64)[order])

    def implicit(self, users: np.ndarray) -> np.ndarray:
        """``|N(u)|^-1/2 sum_(j in N(u)) y_j`` per user (zeros for a user without ratings)."""
        users = np.asarray(users, np.int64)
        counts = self.n_start[users + 1] - self.n_start[users]
        out = np.zeros((len(users), self.y.shape[1]))
        uniq, inv = np.unique(users, return_inverse=True)
        for k, u in enumerate(uniq.tolist()):
            lo, hi = self.n_start[u], self.n_start[u + 1]
            if hi > lo:
                out[inv == k] = self.y[self.n_items[lo:hi]].sum(0) / np.sqrt(hi - lo)
        out[counts == 0] = 0.0
        return out

    def user_vectors(self, users: np.ndarray) -> np.ndarray:
        """``p_u + implicit(u)``: the vector ``q_i`` is scored against."""
        return self.p[np.asarray(users)] + self.implicit(users)

    def predict(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        users, items = np.asarray(users), np.asarray(items)
        return (self.mu + self.bu[users] + self.bi[items]
                + np.einsum("nd,nd->n", self.user_vectors(users), self.q[items]))


def svdpp_order(users: np.ndarray, order: str, rng: np.random.Generator) -> np.ndarray:
    """One epoch's row order, always grouped by user: ``"user"``: users ascending, each user's rows in
    the training data's order (surprise's); ``"shuffle"``: users in a seeded random order, each
    user's rows shuffled (grouping keeps an epoch O(ratings x dim), see :func:`svdpp_epoch`)."""
    if order == "user":
        return np.argsort(users, kind="stable")
    rows = rng.permutation(len(users))
    rank = rng.permutation(int(users.max()) + 1 if len(users) else 0)
    return rows[np.argsort(rank[users[rows]], kind="stable")]


def svdpp_epoch(model: SVDppModel, users: np.ndarray, items: np.ndarray, ratings: np.ndarray, order: np.ndarray,
                config: SVDppConfig) -> float:
    """One SGD pass over the rows in ``order`` (in place); returns the mean squared error seen.

    Exactly Koren's per-rating updates (module docstring), computed lazily: while consecutive rows
    belong to the same user ``u``, every ``y_j`` (``j in N(u)``) moves as ``y_j <- a y_j + b_t``
    with the same ``a = 1 - lr reg`` and vector ``b_t``, so the implicit sum follows
    ``S <- a S + |N(u)| b_t`` in O(dim) and the ``y_j`` are written once when the user changes
    (``y_j <- A y_j + C``). Any order is exact; one grouped by user (:func:`svdpp_order`) costs
    O(ratings x dim) per epoch instead of O(sum_u |N(u)|^2 x dim).
    """
    p, q, y, bu, bi, mu = model.p, model.q, model.y, model.bu, model.bi, model.mu
    lr, reg = config.lr, config.reg
    a = 1.0 - lr * reg
    start, rated = model.n_start, model.n_items
    total = 0.0
    cur = -1
    nu = rated[:0]
    s = big_a = c = None
    n = sq = 1.0

    def flush() -> None:
        if cur >= 0 and len(nu):
            y[nu] = big_a * y[nu] + c

    for k in order.tolist():
        u, i = int(users[k]), int(items[k])
        if u != cur:
            flush()
            cur = u
            nu = rated[start[u]:start[u + 1]]
            n = float(len(nu))
            sq = np.sqrt(n)
            s = y[nu].sum(0)
            big_a, c = 1.0, np.zeros(y.shape[1])
        impl = s / sq
        pu, qi = p[u], q[i]
        err = float(ratings[k]) - (mu + bu[u] + bi[i] + float(qi @ (pu + impl)))
        total += err * err
        bu[u] += lr * (err - reg * bu[u])
        bi[i] += lr * (err - reg * bi[i])
        pu_old, qi_old = pu.copy(), qi.copy()
        pu += lr * (err * qi_old - reg * pu)
        qi += lr * (err * (pu_old + impl) - reg * qi)
        b = (lr * err / sq) * qi_old
        s = a * s + n * b
        big_a, c = a * big_a, a * c + b
    flush()
    return total / max(len(order), 1)
