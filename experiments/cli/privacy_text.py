"""What a run spent, in words, from its privacy ledger: the end-of-run statement and the text report.

``secagg run`` prints it after the metrics (``summary.json``: ``privacy.statement`` and
``privacy.parts``) and ``secagg privacy report RUN_DIR`` prints it under "in words". It reads the
ledger only (and the protocol's own ``privacy_report`` keys, as ``--json`` does), so it covers every
protocol, including a plugin's, in the same sentences:

* releases without differential privacy, every kind named (``leaf 0: ...`` and ``leaf 3: ...``
  become one phrase with the leaves listed), so an infinite epsilon always says why;
* central DP on disjoint cohorts (parallel composition): each cohort's epsilon; FEL's report adds
  each leaf's epsilon alone, its clients, and the over-arch (opt-in, or trained by FL with its
  composition and epsilon);
* local DP on each user's uploads (``user:<u>`` cohorts): epsilon per upload, uploads per user and
  the per-user epsilon, median and max (basic composition here; the protocol's report, e.g.
  FedCL's ``per_user``, adds the tightest accountant's figure);
* the premise the protocol's report states, if any (``noise_assumption``: FEL's collusion bound on
  distributed noise);
* the overall guarantee: ``(epsilon, delta)``-DP for the worst-off user by the accountant named, or
  infinite with the reason.
"""

from __future__ import annotations

import math
import re
import statistics
from typing import Any

__all__ = ["describe_spent"]

#: ``leaf 3: the clipped sum`` -> (``leaf``, 3, ``the clipped sum``): one phrase per kind, units listed.
_UNIT_PREFIX = re.compile(r"^([A-Za-z][\w-]*) (\d+): (.+)$")
#: Kinds of release listed by name before "and N more".
_MAX_KINDS = 6


def _num(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.4g}"


def _units(numbers: list[int]) -> str:
    numbers = sorted(set(numbers))
    if len(numbers) > 2 and numbers == list(range(numbers[0], numbers[-1] + 1)):
        return f"{numbers[0]}-{numbers[-1]}"
    return ", ".join(map(str, numbers))


def _plural(unit: str) -> str:
    return unit[:-1] + "ves" if unit.endswith("f") else unit + "s"


def _mechanism(event: Any) -> str | None:
    """``epsilon 2 each`` (Laplace) or ``noise multiplier 1.2`` (Gaussian, possibly sampled), else ``None``."""
    from dp.events import Gaussian, Laplace

    inner = getattr(event, "event", event)  # PoissonSampled / SampledWithoutReplacement wrap the mechanism
    if isinstance(event, Laplace):
        return f"epsilon {_num(event.epsilon0)} each"
    if isinstance(inner, Gaussian):
        q = getattr(event, "q", None)
        return f"Gaussian noise multiplier {inner.noise_multiplier:.3g}" + (f", sampling rate {q:.3g}" if q else "")
    return None


def _kinds(entries: list[Any], *, details: bool = False) -> list[str]:
    """The distinct release descriptions of ``entries``, with ``<unit> <n>: <rest>`` merged over ``n``;
    with ``details``, the number of releases and the mechanism's parameters beside each."""
    groups: dict[tuple[str, str | None], list[Any]] = {}
    units: dict[tuple[str, str | None], list[int]] = {}
    for e in entries:
        m = _UNIT_PREFIX.match(e.what)
        key = (m.group(3), m.group(1)) if m else (e.what, None)
        groups.setdefault(key, []).append(e)
        if m:
            units.setdefault(key, []).append(int(m.group(2)))
    out = []
    for (rest, unit), members in groups.items():
        text = rest
        if unit is not None:
            ns = units[(rest, unit)]
            text += f" ({_plural(unit) if len(set(ns)) > 1 else unit} {_units(ns)})"
        if details:
            mech = sorted({m for m in (_mechanism(e.event) for e in members) if m})
            text += f" [{len(members)} release{'s' * (len(members) != 1)}" + (f"; {', '.join(mech)}" if mech else "") + "]"
        out.append(text)
    return out


def _listed(kinds: list[str]) -> str:
    if len(kinds) <= _MAX_KINDS:
        return "; ".join(kinds)
    return "; ".join(kinds[:_MAX_KINDS - 1]) + f"; and {len(kinds) - _MAX_KINDS + 1} more kinds (the ledger lists them)"


def _ldp_part(entries: list[Any], per_user: dict[str, Any] | None) -> str | None:
    """Local DP per user (``user:<u>`` cohorts of Laplace releases), in words."""
    from dp.events import Laplace

    eps: dict[str, float] = {}
    uploads: dict[str, int] = {}
    per_upload: set[float] = set()
    whats: dict[str, None] = {}
    for e in entries:
        if e.cohort and e.cohort.startswith("user:") and isinstance(e.event, Laplace):
            eps[e.cohort] = eps.get(e.cohort, 0.0) + e.event.epsilon0
            uploads[e.cohort] = uploads.get(e.cohort, 0) + 1
            per_upload.add(round(e.event.epsilon0, 12))
            whats.setdefault(e.what, None)
    if not eps:
        return None
    values, counts = sorted(eps.values()), sorted(uploads.values())
    e0 = ", ".join(_num(x) for x in sorted(per_upload))
    text = (f"local DP on each user's own uploads ({'; '.join(whats)}): epsilon {e0} per upload, "
            f"{counts[0]}-{counts[-1]} uploads per user (median {statistics.median(counts):g}); each user spent "
            f"epsilon median {_num(statistics.median(values))}, max {_num(values[-1])} by basic composition "
            f"({len(values)} users)")
    best = (per_user or {}).get("epsilon")
    if isinstance(best, dict) and "median" in best and "max" in best:
        acc = per_user.get("accountant", "the tightest accountant")
        text += (f"; by {acc} (delta {per_user.get('delta', 0):g}): median {_num(best['median'])}, "
                 f"max {_num(best['max'])}")
    return text


def _leaves_part(extra: dict[str, Any]) -> list[str]:
    """FEL's per-leaf and over-arch figures (``privacy_report``'s ``per_leaf`` and ``over_arch``)."""
    parts = []
    leaves = extra.get("per_leaf")
    if isinstance(leaves, list) and leaves:
        shown = [f"leaf {d.get('cluster')} ({d.get('clients', '?')} clients) epsilon {_num(float(d.get('epsilon', math.inf)))}"
                 for d in leaves if isinstance(d, dict)]
        parts.append("per leaf, each alone by RDP (disjoint clusters, parallel composition): " + "; ".join(shown))
    over = extra.get("over_arch")
    if isinstance(over, dict):
        mode = over.get("mode")
        if mode == "opt-in":
            parts.append("the over-arch: no release of the leaves' users (trained on the server from opt-in users, "
                         "or a fixed combiner): it spends nothing of their budget")
        elif mode is not None:
            parts.append(f"the over-arch (trained by FL, {mode} composition with the leaves, "
                         f"{over.get('releases', '?')} releases): epsilon {_num(float(over.get('epsilon', math.inf)))}"
                         + (" on top of each leaf's" if mode == "sequential" else " for its own cohort"))
    return parts


def describe_spent(ledger: Any, delta: float, protocol_extra: dict[str, Any] | None = None,
                   *, use_pld: bool = True) -> dict[str, Any]:
    """What the run recorded in ``ledger`` spent, in words.

    Args:
        ledger: the run's :class:`dp.ledger.PrivacyLedger`.
        delta: the delta epsilon is reported at.
        protocol_extra: the protocol's ``privacy_report(ledger, delta)`` keys, if it has any (FEL's
            ``per_leaf``/``over_arch``, FedCL's ``per_user``).
        use_pld: also consult the PLD accountant for the overall epsilon.

    Returns:
        ``{"statement": one paragraph, "parts": its sentences, "epsilon": overall epsilon or None
        (infinite), "accountant": ..., "unprotected": [kinds released without DP]}``.
    """
    from dp.events import NoOp, NonPrivate

    extra = protocol_extra or {}
    entries = ledger.entries()
    if not entries:
        text = "nothing derived from private data was released (no rounds ran): epsilon 0"
        return {"statement": text, "parts": [text], "epsilon": 0.0, "accountant": None, "unprotected": []}
    unprotected = _kinds([e for e in entries if isinstance(e.event, NonPrivate)])
    protected = [e for e in entries if not isinstance(e.event, (NonPrivate, NoOp))]
    parts: list[str] = []
    if unprotected:
        parts.append(f"released WITHOUT differential privacy (epsilon infinite for them): {_listed(unprotected)}")
    central = _kinds([e for e in protected if not (e.cohort or "").startswith("user:")], details=True)
    if central:
        parts.append(f"released with DP noise: {_listed(central)}")
    parts += _leaves_part(extra)
    if not extra.get("per_leaf"):
        cohorts = sorted({e.cohort for e in protected if e.cohort and not e.cohort.startswith("user:")})
        if cohorts:
            by = ledger.spent_by_cohort(delta)
            shown = [f"{c} epsilon {_num(by[c].epsilon)}" for c in cohorts if c in by]
            parts.append("per cohort (disjoint users, parallel composition): " + _listed(shown))
    ldp = _ldp_part(entries, extra.get("per_user") if isinstance(extra.get("per_user"), dict) else None)
    if ldp:
        parts.append(ldp)
    assumption = extra.get("noise_assumption")  # a protocol's stated premise (FEL: the collusion bound)
    if isinstance(assumption, str) and assumption:
        parts.append(f"this accounting assumes: {assumption}")
    if unprotected:
        epsilon, accountant = None, None
        overall = ("overall: epsilon is infinite (no DP bound covers the "
                   + ("release" if len(unprotected) == 1 else f"{len(unprotected)} kinds of release")
                   + " without DP noise above)")
        if ldp:
            overall += "; the local-DP figure above bounds what each user's own uploads reveal"
    else:
        rep = ledger.spent(delta, use_pld=use_pld)
        epsilon, accountant = rep.epsilon, rep.accountant
        overall = (f"overall: ({_num(rep.epsilon)}, {delta:g})-DP for the worst-off user by the {rep.accountant} "
                   "accountant")
    parts.append(overall)
    statement = " ".join(p[0].upper() + p[1:] + "." for p in parts)
    return {"statement": statement, "parts": parts, "epsilon": epsilon, "accountant": accountant,
            "unprotected": unprotected}
