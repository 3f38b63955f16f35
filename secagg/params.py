"""Choosing SecAgg+'s degree ``k`` and threshold ``t`` from the guarantees a deployment needs.

Bell et al. (2020) pick the neighbourhood size ``k`` and the Shamir threshold ``t`` of SecAgg+
from the number of clients ``n``, the largest fraction ``delta`` of clients that may drop out, the
largest fraction ``gamma`` of clients that may collude with the server, a correctness target
``2^-eta`` and a security target ``2^-sigma``: the graph must let every round finish when at most
``delta n`` clients drop (probability of failure at most ``2^-eta``), and must keep every honest
client safe when at most ``gamma n`` clients collude (probability of failure at most
``2^-sigma``). This module does the same for our graph (:func:`secagg.graph.random_regular_graph`:
a circulant ring on a CSPRNG permutation) and our protocol, with exact per-client probabilities
and a union bound over clients:

* **abort**: at most ``D = ceil(delta n)`` clients drop (after sharing keys, or at any later
  stage), the rest respond. A client that responds needs ``t - 1`` responding neighbours (its
  own share is the ``t``-th); a client that does not needs ``t``. A client's ``k`` neighbours are a
  uniformly random ``k``-subset of the other ``n - 1`` clients, so the number of dropped
  neighbours is hypergeometric. If every client has enough, nobody aborts (a client that aborts
  only reduces its neighbours' counts once some client already failed the condition), so
  ``P(abort) <= (n - D) P[HG(n-1, D, k) > k - t + 1] + D P[HG(n-1, D-1, k) > k - t]``.
  :func:`secagg.graph.abort_probability` gives the bound for *independent* dropouts at rate
  ``delta`` instead (the count then fluctuates); it is reported beside, not used for the choice.
* **security**, with ``C = floor(gamma n)`` colluding clients fixed before the graph is drawn
  (the server draws it honestly, as in Bell et al.'s semi-honest setting), the union of

  - *collusion*: some honest client has ``>= t`` colluding neighbours, who with the server
    rebuild both its secrets: ``(n - C) P[HG(n-1, C, k) >= t]``;
  - *equivocation*: a server that shows two groups of a client's holders different survivor
    sets (the attack of issue 8, item 5) needs two disjoint sets of ``t - c`` honest holders
    when ``c`` holders collude, possible iff ``2t <= k + 1 + c``:
    ``(n - C) P[HG(n-1, C, k) >= 2t - k - 1]`` (this is why ``t`` must exceed half the ``k + 1``
    holders, see :func:`min_safe_threshold`);
  - *partition*: the honest survivors' graph is disconnected, so the server learns the sum of
    each part. In a circulant graph with ``k/2`` neighbours on each side this needs two separate
    runs of ``k/2`` consecutive colluding-or-dropped clients on the ring:
    ``<= n^2/2 * C(B, k) / C(n, k)`` with ``B = C + D`` (zero for the complete graph).

  These bounds take the dropouts to be chosen independently of the graph. A server that sees the
  graph first can pick whom to treat as dropped; ignoring more clients than planned it cuts the
  ring at will (``tests/secagg/test_adaptive_dropout.py``), which is why every client refuses to
  sign a survivor set missing more than ``D`` clients (:class:`secagg.bonawitz.ClientPolicy`
  ``max_dropout``). Within those ``D`` the cut is bounded by :func:`adaptive_partition`
  (reported as :attr:`Guarantees.adaptive_partition`, not part of :attr:`Guarantees.security`
  nor of the choice below).

:func:`choose` returns the smallest ``k`` (even, or ``n - 1`` for the complete graph) for which
some ``t > (k + 1) / 2`` meets both targets, and among those ``t`` the one with the largest
margin on the tighter target (in bits); ties, e.g. when both bounds are exactly zero, go to the
middle of the tied range. It refuses, naming the fix, when no ``k`` works. Bounds are evaluated
in log space (``scipy.special.gammaln``) and checked against exact integer arithmetic in the
tests.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from secagg.defaults import DEFAULT_CORRUPT, DEFAULT_DROPOUT

# scipy (gammaln, binom) is imported where used: secure-aggregation setups that never plan k and t
# (and every module that imports this one for a constant) need not load it.

__all__ = [
    "ABORT_EXPONENT",
    "ADAPTIVE_CAVEAT",
    "DEFAULT_CORRUPT",
    "DEFAULT_DROPOUT",
    "SECURITY_EXPONENT",
    "Guarantees",
    "adaptive_partition",
    "check_fraction",
    "choose",
    "dropout_quantile",
    "choose_t",
    "evaluate",
    "min_safe_threshold",
]

ABORT_EXPONENT = 20  #: default correctness target: P(abort) <= 2^-20 at the configured dropout
SECURITY_EXPONENT = 40  #: default security target: P(some honest client exposed) <= 2^-40
_LN2 = math.log(2.0)


def dropout_quantile(n: int, rate: float, *, exponent: int = ABORT_EXPONENT + 1) -> float:
    """The dropout fraction to plan for when each of ``n`` clients drops independently at ``rate``.

    Returns ``D / n`` for the smallest ``D`` with ``P[Binomial(n, rate) > D] <= 2^-exponent``, so
    that ``choose(n, dropout=dropout_quantile(n, rate))`` keeps the abort probability under
    independent dropouts below ``2^-exponent + 2^-ABORT_EXPONENT`` (at most ``2^-20 + 2^-21``
    by default: given the number of dropouts, who drops is uniform, and more dropouts only hurt).
    """
    from scipy.stats import binom

    rate = check_fraction("rate", rate)
    dropped = int(binom.isf(2.0**-exponent, n, rate)) if rate > 0 else 0
    while dropped < n and binom.sf(dropped, n, rate) > 2.0**-exponent:
        dropped += 1
    return min(dropped, n - 1) / n


def min_safe_threshold(holders: int) -> int:
    """Smallest ``t`` above half of ``holders``: two disjoint groups of ``t`` holders cannot exist.

    With ``t <= holders / 2`` a server that shows two disjoint groups of a client's holders
    different survivor sets collects the shares of both its self-mask seed and its mask key.
    """
    return holders // 2 + 1


def check_fraction(name: str, value: float, *, upper: float = 1.0) -> float:
    """``value`` as a float in ``[0, upper)``, or a ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < upper:
        raise ValueError(f"{name} must be a fraction in [0, {upper}); found {value!r}.")
    return float(value)


@dataclass(frozen=True)
class Guarantees:
    """What a SecAgg+ configuration guarantees (all probabilities are upper bounds).

    Attributes:
        n, k, t: clients, neighbours per client (``n - 1``: complete graph), threshold of ``k + 1``.
        dropout: planned dropout fraction (at most ``ceil(dropout n)`` clients drop).
        corrupt: tolerated colluding fraction (at most ``floor(corrupt n)`` clients).
        abort: P(the round aborts) with at most ``ceil(dropout n)`` dropouts.
        abort_independent: P(abort) if each client drops independently with probability ``dropout``.
        collusion, equivocation, partition: the three security events (module docstring).
    """

    n: int
    k: int
    t: int
    dropout: float
    corrupt: float
    abort: float
    abort_independent: float
    collusion: float
    equivocation: float
    partition: float

    @property
    def security(self) -> float:
        """P(some honest client's input is exposed, or a proper subset's sum is learned)."""
        return min(1.0, self.collusion + self.equivocation + self.partition)

    @property
    def dropped(self) -> int:
        """The number of dropouts the abort bound allows for."""
        return math.ceil(self.dropout * self.n - 1e-9)

    @property
    def colluders(self) -> int:
        """The number of colluding clients the security bound allows for."""
        return math.floor(self.corrupt * self.n + 1e-9)

    @property
    def adaptive_partition(self) -> float:
        """P(a server that picks up to :attr:`dropped` dropouts *after seeing the graph* can learn a
        part's sum): :func:`adaptive_partition`. Not in :attr:`security`, which assumes dropouts
        independent of the graph."""
        return adaptive_partition(self.n, self.k, self.t, dropped=self.dropped, colluders=self.colluders)

    def summary(self) -> str:
        """One line for users: the parameters, what they guarantee, and the adaptive caveat."""
        return (
            f"k = {self.k}, t = {self.t} of {self.k + 1} holders: abort <= {_fmt(self.abort)} with up to "
            f"{self.dropped} of {self.n} clients dropping ({_fmt(self.abort_independent)} if each drops "
            f"independently at {self.dropout:g}); security failure <= {_fmt(self.security)} with up to "
            f"{self.colluders} clients colluding with the server. {ADAPTIVE_CAVEAT.format(d=self.dropped, n=self.n)} "
            f"(a server choosing those {self.dropped} after seeing the graph cuts it with probability <= "
            f"{_fmt(self.adaptive_partition)})"
        )


#: The caveat printed wherever SecAgg+'s guarantees are (``{d}`` dropouts of ``{n}`` clients).
ADAPTIVE_CAVEAT = ("The security bound assumes dropouts chosen independently of the graph; clients refuse to sign "
                   "a survivor set with more than {d} of {n} missing")


def _fmt(p: float) -> str:
    if p <= 0.0:
        return "0"
    return f"{p:.2g} (2^{math.log2(p):.1f})"


def _lcomb(n: float, k: np.ndarray | float) -> np.ndarray:
    from scipy.special import gammaln

    return gammaln(n + 1) - gammaln(np.asarray(k) + 1) - gammaln(n - np.asarray(k) + 1)


def _hg_logsf(pop: int, succ: int, draws: int) -> np.ndarray:
    """``out[x] = log P[X >= x]`` for ``x = 0..draws+1``, ``X ~ Hypergeometric(pop, succ, draws)``."""
    i = np.arange(draws + 1)
    valid = (i <= succ) & (draws - i <= pop - succ)
    lp = np.full(draws + 1, -np.inf)
    iv = i[valid]
    lp[valid] = _lcomb(succ, iv) + _lcomb(pop - succ, draws - iv) - _lcomb(pop, draws)
    tail = np.logaddexp.accumulate(lp[::-1])[::-1]
    return np.append(np.minimum(tail, 0.0), -np.inf)


def _at(logsf: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``log P[X >= x]`` for integer arrays ``x`` (``x <= 0``: certain; beyond the support: 0)."""
    x = np.asarray(x)
    return np.where(x <= 0, 0.0, logsf[np.clip(x, 0, len(logsf) - 1)])


def _log_bounds(n: int, k: int, dropped: int, colluders: int, dropout: float) -> dict[str, np.ndarray]:
    """Natural-log bounds of every event, vectorised over ``t = 0..k+1``."""
    from scipy.stats import binom

    t = np.arange(k + 2)
    sf_d = _hg_logsf(n - 1, dropped, k)
    responder = np.log(n - dropped) + _at(sf_d, k - t + 2) if n > dropped else np.full(k + 2, -np.inf)
    if dropped:
        silent = np.log(dropped) + _at(_hg_logsf(n - 1, dropped - 1, k), k - t + 1)
        abort = np.logaddexp(responder, silent)
    else:
        abort = responder
    q = 1.0 - dropout
    with np.errstate(divide="ignore"):
        indep = np.log(n) + np.logaddexp(
            np.log(q) + binom.logcdf(t - 2, k, q), np.log(dropout) + binom.logcdf(t - 1, k, q)
        )
    sf_c = _hg_logsf(n - 1, colluders, k)
    honest = np.log(n - colluders)
    collusion = honest + _at(sf_c, t)
    equivocation = honest + _at(sf_c, 2 * t - k - 1)
    bad = colluders + dropped
    if k >= n - 1 or bad < k:
        partition = np.full(k + 2, -np.inf)
    else:
        partition = np.full(k + 2, 2 * np.log(n) - _LN2 + float(_lcomb(bad, k) - _lcomb(n, k)))
    return {"abort": abort, "indep": indep, "collusion": collusion, "equivocation": equivocation,
            "partition": partition}


def _prob(logp: float) -> float:
    return float(min(1.0, math.exp(logp))) if logp > -745 else 0.0


def adaptive_partition(n: int, k: int, t: int, *, dropped: int, colluders: int) -> float:
    """Bound on a partition a server can force by choosing up to ``dropped`` dropouts after seeing the graph.

    The ``colluders`` are placed before the graph is drawn (uniformly random ring positions); the
    server then picks the dropped clients, and every client refuses to sign a survivor set missing
    more than ``dropped`` (:class:`secagg.bonawitz.ClientPolicy` ``max_dropout``). To learn the sum
    of an honest part ``A`` of the circulant graph (``h = k/2`` neighbours on each side), both ends
    of the arc ``A`` must face a run of at least ``h`` colluding-or-dropped clients; call ``W1``,
    ``W2`` the ``h`` positions of each run next to ``A``. Then (i) at most ``dropped`` of these
    ``k`` positions are dropped, so at least ``k - dropped`` of them collude; and (ii) the end
    client of ``A`` next to ``W1`` signs only with at most ``k + 1 - t`` dropped neighbours, so at
    least ``t - 1 - h`` of ``W1`` collude (a client that cannot sign has fewer than ``t`` live
    holders, and its self-mask is never rebuilt), likewise ``W2``. Hence ``W1 + W2`` hold at least
    ``need = max(k - dropped, 2 (t - 1 - h))`` colluders; over the ``n^2/2`` pairs of windows,
    ``P <= n^2/2 * P[HG(n, colluders, k) >= need]`` (1 if ``need <= 0``; 0 for the complete graph).
    """
    if type(n) is not int or n < 2:
        raise ValueError(f"SecAgg+ needs n >= 2 clients; found {n!r}.")
    k = min(int(k), n - 1)
    if k >= n - 1:
        return 0.0
    need = max(k - int(dropped), 2 * (int(t) - 1 - k // 2))
    if need <= 0:
        return 1.0
    return _prob(2 * math.log(n) - _LN2 + float(_at(_hg_logsf(n, int(colluders), k), np.array(need))))


def _validate(n: int, dropout: float, corrupt: float) -> tuple[float, float]:
    if type(n) is not int or n < 2:
        raise ValueError(f"SecAgg+ needs n >= 2 clients; found {n!r}.")
    return check_fraction("dropout", dropout), check_fraction("corrupt", corrupt, upper=0.5)


def evaluate(n: int, k: int, t: int, *, dropout: float, corrupt: float) -> Guarantees:
    """The guarantees of an explicit ``(k, t)`` (``k >= n - 1`` means the complete graph)."""
    dropout, corrupt = _validate(n, dropout, corrupt)
    k = min(int(k), n - 1)
    if not 1 <= t <= k + 1:
        raise ValueError(f"t must be in [1, {k + 1}] for k = {k}; found {t}.")
    g = Guarantees(n, k, t, dropout, corrupt, 0, 0, 0, 0, 0)
    b = _log_bounds(n, k, g.dropped, g.colluders, dropout)
    return Guarantees(n, k, t, dropout, corrupt, _prob(b["abort"][t]), _prob(b["indep"][t]),
                      _prob(b["collusion"][t]), _prob(b["equivocation"][t]), _prob(b["partition"][t]))


def _best_t(n: int, k: int, dropped: int, colluders: int, dropout: float, eta: int, sigma: int) -> int | None:
    b = _log_bounds(n, k, dropped, colluders, dropout)
    t = np.arange(k + 2)
    security = np.logaddexp(np.logaddexp(b["collusion"], b["equivocation"]), b["partition"])
    margin_a = np.minimum(-b["abort"] / _LN2 - eta, 4096.0)
    margin_s = np.minimum(-security / _LN2 - sigma, 4096.0)
    ok = (t >= min_safe_threshold(k + 1)) & (t <= k + 1) & (margin_a >= 0) & (margin_s >= 0)
    if not ok.any():
        return None
    score = np.where(ok, np.minimum(margin_a, margin_s), -np.inf)
    best = t[score == score.max()]
    return int(best[len(best) // 2])


@functools.lru_cache(maxsize=256)
def choose(
    n: int,
    *,
    dropout: float = DEFAULT_DROPOUT,
    corrupt: float = DEFAULT_CORRUPT,
    abort_exponent: int = ABORT_EXPONENT,
    security_exponent: int = SECURITY_EXPONENT,
) -> Guarantees:
    """The cheapest SecAgg+ ``(k, t)`` meeting both targets (see the module docstring).

    Raises:
        ValueError: no ``k`` up to the complete graph meets both targets; the message says which
            knob to turn.
    """
    dropout, corrupt = _validate(n, dropout, corrupt)
    for name, e in (("abort_exponent", abort_exponent), ("security_exponent", security_exponent)):
        if type(e) is not int or not 1 <= e <= 256:
            raise ValueError(f"{name} must be an int in [1, 256]; found {e!r}.")
    dropped = math.ceil(dropout * n - 1e-9)
    colluders = math.floor(corrupt * n + 1e-9)
    for k in [*range(2, n - 1, 2), n - 1]:
        t = _best_t(n, k, dropped, colluders, dropout, abort_exponent, security_exponent)
        if t is not None:
            return evaluate(n, k, t, dropout=dropout, corrupt=corrupt)
    full = evaluate(n, n - 1, min_safe_threshold(n), dropout=dropout, corrupt=corrupt)
    raise ValueError(
        f"no SecAgg+ parameters for n = {n} clients meet both targets (abort <= 2^-{abort_exponent} with up "
        f"to {dropped} dropouts, security failure <= 2^-{security_exponent} with up to {colluders} "
        f"colluders): even the complete graph with t = {full.t} gives abort <= {_fmt(full.abort)} and "
        f"security failure <= {_fmt(full.security)}. Lower the planned dropout (--dropout / "
        "secagg_dropout) or the corrupt fraction (secagg_corrupt), add clients, or relax "
        "abort_exponent / security_exponent."
    )


def choose_t(
    n: int,
    k: int,
    *,
    dropout: float = DEFAULT_DROPOUT,
    corrupt: float = DEFAULT_CORRUPT,
    abort_exponent: int = ABORT_EXPONENT,
    security_exponent: int = SECURITY_EXPONENT,
) -> Guarantees:
    """The best ``t`` for a given ``k`` (same rule as :func:`choose`), or a ``ValueError``."""
    dropout, corrupt = _validate(n, dropout, corrupt)
    k = min(int(k), n - 1)
    dropped = math.ceil(dropout * n - 1e-9)
    colluders = math.floor(corrupt * n + 1e-9)
    t = _best_t(n, k, dropped, colluders, dropout, abort_exponent, security_exponent)
    if t is None:
        raise ValueError(
            f"no threshold t for k = {k} meets both targets at n = {n}, dropout {dropout:g}, corrupt "
            f"{corrupt:g}; omit k to let it be chosen (secagg.params.choose), or pass t explicitly."
        )
    return evaluate(n, k, t, dropout=dropout, corrupt=corrupt)
