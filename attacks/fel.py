"""Label inference on FEL's per-leaf releases, scored as an advantage beside its DP bound.

Adversary: the honest-but-curious FEL server, or anyone who sees the released leaf models. Input:
the server's view only (:func:`attacks.fedmf.server_view`): the ``"leaf-model"`` records of the
target's leaf (:class:`protocols.fel_leaf.LeafModel`, the model before and after every round's
aggregate, noisy under DP) plus :meth:`protocols.fel.FelTrainer.public_info` (the public cluster
assignment, sizes, dim). The attack never reads a client's upload, so it applies unchanged to
plaintext, SecAgg and DP leaves: the aggregate is the least the server sees.

The test (``"fel-label"``, the issue's "does a target user's label change the leaf's aggregate
update detectably?"): the adversary holds two hypotheses about a target user's positives, item
sets ``S0`` and ``S1`` of equal size; in the world ``b`` the user trained on ``S_b``. A positive's
gradient moves its item row along the target's ``p_u * h`` (the same direction for every one of its
positives in a round), so the rows of ``S_b`` change *coherently*. The score is
``coh(S1) - coh(S0)`` with ``coh(S) = sum_t sum_{i != j in S} <dq_{t,i}, dq_{t,j}>`` over the rounds
``t`` of the view (``dq_t = after - before``, item block); Gaussian noise adds zero-mean cross terms
only. The decision ``score > threshold`` is scored by :func:`advantage`: the threshold is chosen on a
calibration half of the trials and the advantage ``TPR - FPR`` measured on the other half, with
Clopper-Pearson intervals.

The bound it must respect (:func:`dp_advantage_bound`): for any test between the outputs on two
neighbouring inputs of an ``(epsilon, delta)``-DP mechanism, ``TPR <= e^eps FPR + delta`` and
``1 - FPR <= e^eps (1 - TPR) + delta``, so ``TPR - FPR <= (e^eps - 1 + 2 delta) / (e^eps + 1)``
(Kairouz, Oh, Viswanath 2015, the hypothesis-testing reading of DP). The leaf's accounted epsilon
is for one user's update added or zeroed (L2 sensitivity ``clip``); the two worlds here *replace*
the target's data, a change of up to ``2 clip``, so the epsilon the test must respect is the same
composition with half the noise multiplier (:func:`label_change_epsilon`; group privacy would give
a looser bound). :func:`gdp_advantage_bound` gives the tight bound of the Gaussian mechanism itself
(``mu = 2 sqrt(T) / z`` for ``T`` unamplified rounds; ``2 Phi(mu / 2) - 1``) beside it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy import stats

from attacks.fedmf import server_view
from attacks.registry import AttackSpec, register_attack
from dp.accountant import RdpAccountant
from dp.events import DpEvent, Gaussian, NonPrivate
from protocols.fel_leaf import LEAF_MODEL_KIND, LeafModel
from protocols.transport import SERVER, Record

__all__ = [
    "AdvantageScore",
    "advantage",
    "dp_advantage_bound",
    "gdp_advantage_bound",
    "label_change_epsilon",
    "label_inference",
    "leaf_updates",
    "server_view",
]


def leaf_updates(view: Iterable[Record], leaf: int) -> np.ndarray:
    """``[rounds, width]`` the released changes of ``leaf``'s model, in round order.

    Raises:
        ValueError: the view holds no ``"leaf-model"`` payload for that leaf (keep them).
    """
    rel = sorted((r.payload for r in view if r.kind == LEAF_MODEL_KIND and r.sender == SERVER
                  and isinstance(r.payload, LeafModel) and r.payload.leaf == leaf), key=lambda p: p.round)
    if not rel:
        raise ValueError(f"the view holds no {LEAF_MODEL_KIND!r} payloads of leaf {leaf}; run with a transcript "
                         "that keeps them (Transcript(keep_payloads=...))")
    return np.stack([p.after.astype(np.float64) - p.before.astype(np.float64) for p in rel])


def _coherence(rows: np.ndarray) -> float:
    """``sum_{i != j} <r_i, r_j>`` over ``rows [k, d]``."""
    total = rows.sum(0)
    return float(total @ total - np.einsum("kd,kd->", rows, rows))


def label_inference(view: Sequence[Record], public: Mapping[str, Any], *, target: int,
                    hypotheses: tuple[Sequence[int], Sequence[int]]) -> float:
    """Score for "the target trained on ``hypotheses[1]``" against ``hypotheses[0]`` (higher: S1).

    Args:
        view: the server's records (others are ignored).
        public: ``FelTrainer.public_info()`` (the assignment gives the target's leaf; ``n_items``, dim).
        target: the target user's index.
        hypotheses: ``(S0, S1)``, two item sets of the same size.
    """
    s0, s1 = (np.asarray(h, dtype=np.int64) for h in hypotheses)
    if len(s0) != len(s1) or len(s1) < 2:
        raise ValueError(f"hypotheses must be two item sets of the same size >= 2; found {len(s0)} and {len(s1)}")
    leaf = int(public["assignment"][target])
    n_items, d = int(public["n_items"]), int(public["config"]["dim"])
    deltas = leaf_updates(view, leaf)[:, : n_items * d].reshape(-1, n_items, d)
    return float(sum(_coherence(dq[s1]) - _coherence(dq[s0]) for dq in deltas))


@dataclass(frozen=True)
class AdvantageScore:
    """The test ``score > threshold`` on the evaluation half, with 95% Clopper-Pearson intervals.

    ``advantage = tpr - fpr``; ``advantage_low``/``advantage_high`` combine the two rates' intervals
    (each at 97.5%, so the pair holds with at least 95%). ``precision``/``recall``/``f1`` read
    "world 1" as the positive class; ``random_f1`` is a coin flip's expected F1 at that prevalence.
    """

    advantage: float
    advantage_low: float
    advantage_high: float
    tpr: float
    fpr: float
    threshold: float
    precision: float
    recall: float
    f1: float
    random_f1: float
    trials: int
    calibration_trials: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cp(k: int, n: int, level: float) -> tuple[float, float]:
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=level, method="exact")
    return float(ci.low), float(ci.high)


def _best_threshold(scores: np.ndarray, worlds: np.ndarray) -> float:
    cand = np.unique(scores)
    cuts = np.concatenate([[cand[0] - 1.0], (cand[:-1] + cand[1:]) / 2, [cand[-1] + 1.0]])
    pos, neg = scores[worlds == 1], scores[worlds == 0]
    tpr = (pos[None, :] > cuts[:, None]).mean(1)
    fpr = (neg[None, :] > cuts[:, None]).mean(1)
    return float(cuts[int(np.argmax(tpr - fpr))])


def advantage(scores: Sequence[float], worlds: Sequence[int], *, calibration: Sequence[bool]) -> AdvantageScore:
    """Threshold chosen on the ``calibration`` trials, advantage measured on the others.

    Args:
        scores: one attack score per trial.
        worlds: the true world (0 or 1) of every trial.
        calibration: ``True`` for the trials that choose the threshold.
    """
    s, w, cal = np.asarray(scores, np.float64), np.asarray(worlds, np.int64), np.asarray(calibration, bool)
    if not (s.shape == w.shape == cal.shape) or not np.isin(w, (0, 1)).all():
        raise ValueError("scores, worlds and calibration must have one entry per trial, worlds in {0, 1}")
    for part, name in ((cal, "calibration"), (~cal, "evaluation")):
        if not (np.any(w[part] == 0) and np.any(w[part] == 1)):
            raise ValueError(f"the {name} trials need both worlds; found worlds {sorted(set(w[part].tolist()))}")
    thr = _best_threshold(s[cal], w[cal])
    es, ew = s[~cal], w[~cal]
    guess = es > thr
    tp, fp = int(np.sum(guess & (ew == 1))), int(np.sum(guess & (ew == 0)))
    n1, n0 = int(np.sum(ew == 1)), int(np.sum(ew == 0))
    tpr, fpr = tp / n1, fp / n0
    (tl, th), (fl, fh) = _cp(tp, n1, 0.975), _cp(fp, n0, 0.975)
    prec = tp / max(tp + fp, 1)
    f1 = 0.0 if tp == 0 else 2 * prec * tpr / (prec + tpr)
    prev = n1 / (n0 + n1)
    return AdvantageScore(advantage=tpr - fpr, advantage_low=tl - fh, advantage_high=th - fl, tpr=tpr, fpr=fpr,
                          threshold=thr, precision=prec, recall=tpr, f1=f1, random_f1=prev / (prev + 0.5),
                          trials=int(len(es)), calibration_trials=int(cal.sum()))


def dp_advantage_bound(epsilon: float, delta: float) -> float:
    """``(e^eps - 1 + 2 delta) / (e^eps + 1)``: no test between neighbours does better (1 if eps is inf)."""
    if not (epsilon >= 0) or not (0 <= delta < 1):
        raise ValueError(f"need epsilon >= 0 and delta in [0, 1); found {epsilon}, {delta}")
    if math.isinf(epsilon):
        return 1.0
    return min(1.0, (math.expm1(epsilon) + 2 * delta) / (math.exp(epsilon) + 1))


def gdp_advantage_bound(mu: float) -> float:
    """``2 Phi(mu / 2) - 1``: the largest advantage against a ``mu``-GDP mechanism (1 if mu is inf)."""
    return 1.0 if math.isinf(mu) else float(2 * stats.norm.cdf(mu / 2) - 1)


def _halved(event: DpEvent) -> DpEvent:
    if isinstance(event, Gaussian):
        return NonPrivate() if event.noise_multiplier <= 0 else Gaussian(event.noise_multiplier / 2)
    if isinstance(event, NonPrivate):
        return event
    raise ValueError(f"the label-change bound is implemented for unamplified Gaussian rounds; found {event!r} "
                     "(use fel.sampling = \"fixed\")")


def label_change_epsilon(events: Sequence[DpEvent], delta: float) -> tuple[float, float]:
    """``(epsilon, mu)`` of the leaf's rounds for neighbours that *replace* one user's data.

    Each round ``Gaussian(z)`` (sensitivity ``clip``) becomes ``Gaussian(z / 2)`` (sensitivity
    ``2 clip``), composed by the RDP accountant; ``mu = sqrt(sum_t (2 / z_t)^2)`` (GDP).
    """
    halved = [_halved(e) for e in events]
    if any(isinstance(e, NonPrivate) for e in halved) or not halved:
        return math.inf, math.inf
    acc = RdpAccountant()
    for e in halved:
        acc.compose(e)
    mu = math.sqrt(sum(1 / e.noise_multiplier**2 for e in halved))
    return float(acc.get_epsilon(delta)), mu


register_attack(AttackSpec(
    protocol="fel", name="fel-label", view=SERVER, run=label_inference,
    summary="label inference on a leaf's released aggregates: did the target train on S1 or S0?",
))
