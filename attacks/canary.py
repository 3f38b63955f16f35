"""Membership scores of audit canaries from a recorded view (``secagg audit RUN_DIR``, docs/audit.md).

A canary (:mod:`experiments.run.canaries`) holds one of its two fresh item sets, A ("included")
or B, by a secret coin. A scorer reads what an adversary role saw (the recorded view, the run's
``public_info()``) and the public canary list (users, both item sets), never the coins, and returns
one score per canary: higher means "holds A". ``NaN`` abstains (nothing about that canary is in
the view). The auditor then guesses and bounds epsilon (:mod:`dp.audit`).

Each scorer states what it reads and against which accounted epsilon it is compared:

* ``accounted = "ledger"``: the run's whole ledger at its delta (``inf`` if anything was released
  without DP);
* ``accounted = "per_user"``: the protocol's per-user report (FedCL: each user's LDP embedding
  uploads composed), for a scorer that reads only those releases.

``swap_steps`` is how many neighbouring steps one canary's swap (A for B) is under the accounted
relation: 1 where every release is local DP (any two inputs are neighbours), 2 under add/remove
DP (remove the canary holding A, add it holding B); the audit then compares with the group bound
``(2 eps, (1 + e^eps) delta)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocols.transport import SERVER, Record

__all__ = ["CanaryScorer", "register_canary_scorer", "scorers_for"]


@dataclass(frozen=True)
class CanaryScorer:
    """A registered canary scorer: ``score(view, public, canaries) -> float [K]`` (NaN: abstain)."""

    protocol: str
    name: str
    view: str
    score: Callable[[Sequence[Record], dict[str, Any], Any], np.ndarray]
    reads: str
    swap_steps: int = 2
    accounted: str = "ledger"


_SCORERS: dict[tuple[str, str], CanaryScorer] = {}


def register_canary_scorer(spec: CanaryScorer) -> CanaryScorer:
    if spec.swap_steps not in (1, 2) or spec.accounted not in ("ledger", "per_user"):
        raise ValueError(f"canary scorer {spec.name!r}: swap_steps must be 1 or 2 and accounted 'ledger' or 'per_user'")
    _SCORERS[(spec.protocol, spec.name)] = spec
    return spec


def scorers_for(protocol: str) -> list[CanaryScorer]:
    """The scorers registered for ``protocol`` (the first is the default of ``secagg audit``)."""
    return [s for (p, _), s in _SCORERS.items() if p == protocol]


def _user(sender: str) -> int | None:
    head, _, tail = sender.partition(":")
    return int(tail) if head == "client" and tail.lstrip("-").isdigit() else None


def _by_canary(view: Iterable[Record], canaries: Any, kind: str) -> dict[int, list[Record]]:
    """The records of ``kind`` each canary sent, with a payload."""
    index = {int(u): c for c, u in enumerate(canaries.users)}
    out: dict[int, list[Record]] = {}
    for r in view:
        u = _user(r.sender)
        if r.kind == kind and r.payload is not None and u in index:
            out.setdefault(index[u], []).append(r)
    return out


def _set_evidence(rows_abs: dict[int, float], a: np.ndarray, b: np.ndarray) -> float:
    return float(sum(rows_abs.get(int(i), 0.0) for i in a) - sum(rows_abs.get(int(i), 0.0) for i in b))


# -- FedAvg / FedFast: plaintext ClientUpdate rows --------------------------------------------------
def score_update_rows(view: Sequence[Record], public: dict[str, Any], canaries: Any) -> np.ndarray:
    """Per canary, over its own uploads: the L1 mass of its update on set A's rows minus set B's. An
    upload the server cannot read (masked ring elements, ciphertexts) adds nothing; a canary with no
    readable upload is abstained on."""
    out = np.full(len(canaries.users), np.nan)
    for c, recs in _by_canary(view, canaries, "update").items():
        total, readable = 0.0, False
        for r in recs:
            p = r.payload
            rows, delta = getattr(p, "rows", None), getattr(p, "item_delta", None)
            if not isinstance(delta, np.ndarray) or delta.dtype.kind != "f":
                continue
            readable = True
            mass = np.abs(delta.reshape(len(delta), -1)).sum(1)
            ids = np.arange(len(delta)) if rows is None else np.asarray(rows, np.int64)
            total += _set_evidence(dict(zip(ids.tolist(), mass.tolist())), canaries.items_a[c], canaries.items_b[c])
        if readable:
            out[c] = total
    return out


# -- FedMF: Upload bodies (plaintext, or LDP-noised) -------------------------------------------------
def score_fedmf_uploads(view: Sequence[Record], public: dict[str, Any], canaries: Any) -> np.ndarray:
    """Per canary, over its own uploads: the L1 mass of its (noisy) item update on set A's rows minus
    set B's (the dense ``full`` body, or the ``part`` rows at their ids). Masked or encrypted bodies
    add nothing."""
    out = np.full(len(canaries.users), np.nan)
    for c, recs in _by_canary(view, canaries, "update").items():
        total, readable = 0.0, False
        for r in recs:
            body, items = getattr(r.payload, "body", None), getattr(r.payload, "items", None)
            if not isinstance(body, np.ndarray) or body.dtype.kind != "f" or body.ndim != 2:
                continue
            readable = True
            mass = np.abs(body).sum(1)
            ids = np.arange(len(body)) if items is None else np.asarray(items, np.int64)
            total += _set_evidence(dict(zip(ids.tolist(), mass.tolist())), canaries.items_a[c], canaries.items_b[c])
        if readable:
            out[c] = total
    return out


# -- FEL: the leaf models the server releases ----------------------------------------------------------
def score_fel_leaves(view: Sequence[Record], public: dict[str, Any], canaries: Any) -> np.ndarray:
    """Per canary, over every recorded release of its (public) leaf: the L2 change of the leaf's item
    rows of set A minus set B (``after - before``; the flat model is ``item | h | b``). A canary in no
    leaf (opt-in, held out) is abstained on: no leaf carries its data."""
    n_items, dim = int(public["n_items"]), int(public["config"]["dim"])
    assignment = np.asarray(public["assignment"], np.int64)
    no_leaf = {int(u) for u in public.get("opt_in", [])} | {int(u) for u in public.get("held_out", [])}
    changes: dict[int, list[np.ndarray]] = {}
    for r in view:
        p = r.payload
        if r.kind == "leaf-model" and hasattr(p, "before") and hasattr(p, "after"):
            d = (np.asarray(p.after, np.float64) - np.asarray(p.before, np.float64))[: n_items * dim]
            changes.setdefault(int(p.leaf), []).append(np.linalg.norm(d.reshape(n_items, dim), axis=1))
    out = np.full(len(canaries.users), np.nan)
    for c, u in enumerate(canaries.users):
        leaf = int(assignment[u]) if u < len(assignment) and int(u) not in no_leaf else -1
        if leaf < 0 or leaf not in changes:
            continue
        rows = np.sum(changes[leaf], axis=0)
        out[c] = float(rows[canaries.items_a[c]].sum() - rows[canaries.items_b[c]].sum())
    return out


# -- FedCL: the LDP user embeddings ------------------------------------------------------------------
def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def gru_embedding(model: dict[str, np.ndarray], seq: np.ndarray) -> np.ndarray:
    """The last GRU state over ``seq`` (torch's GRU: gates r, z, n), as FedCL's GRU encoder computes a
    user embedding from its items; from the weights of the model the server sent."""
    item = np.asarray(model["item"], np.float64)
    w_ih, w_hh = np.asarray(model["weight_ih"], np.float64), np.asarray(model["weight_hh"], np.float64)
    b_ih, b_hh = np.asarray(model["bias_ih"], np.float64), np.asarray(model["bias_hh"], np.float64)
    h = np.zeros(item.shape[1])
    for i in seq:
        gi, gh = w_ih @ item[int(i)] + b_ih, w_hh @ h + b_hh
        i_r, i_z, i_n = np.split(gi, 3)
        h_r, h_z, h_n = np.split(gh, 3)
        r, z = _sigmoid(i_r + h_r), _sigmoid(i_z + h_z)
        h = (1 - z) * np.tanh(i_n + r * h_n) + z * h
    return h


def score_fedcl_embeddings(view: Sequence[Record], public: dict[str, Any], canaries: Any) -> np.ndarray:
    """Per canary, over its noisy embedding uploads ``y``: ``y . (e_A / |e_A|_1 - e_B / |e_B|_1)``, where
    ``e_A``, ``e_B`` are the embeddings the GRU encoder of the round-0 model (the initial model, which no
    user's data has touched) gives the canary's two item sets. So the score reads the LDP uploads and
    nothing the (non-DP) gradient sums released. Needs round 0 recorded and the GRU encoder."""
    from attacks.findings import NotApplicable

    if public.get("config", {}).get("encoder") != "gru":
        raise NotApplicable("the canary embedding scorer replays FedCL's GRU encoder; this run's encoder is "
                            f"{public.get('config', {}).get('encoder')!r}")
    models = [r for r in view if r.sender == SERVER and r.kind == "model" and isinstance(r.payload, dict)
              and isinstance(r.payload.get("weight_ih"), np.ndarray)]
    if min((r.round for r in models), default=None) != 0:
        raise NotApplicable("needs the round-0 model the server sent (record round 0)")
    model = next(r for r in models if r.round == 0).payload
    max_len = int(public["config"].get("max_len", 0)) or None
    out = np.full(len(canaries.users), np.nan)
    for c, recs in _by_canary(view, canaries, "embedding").items():
        e = [gru_embedding(model, s[-max_len:] if max_len else s) for s in (canaries.items_a[c], canaries.items_b[c])]
        direction = e[0] / max(np.abs(e[0]).sum(), 1e-300) - e[1] / max(np.abs(e[1]).sum(), 1e-300)
        out[c] = float(sum(np.asarray(r.payload, np.float64) @ direction for r in recs))
    return out


for _proto in ("fedavg", "fedfast"):
    register_canary_scorer(CanaryScorer(
        protocol=_proto, name=f"{_proto}-canary-rows", view=SERVER, score=score_update_rows,
        reads="each canary's own uploads: the L1 mass of its item update on its set A rows minus set B rows"))
register_canary_scorer(CanaryScorer(
    protocol="fedmf", name="fedmf-canary-rows", view=SERVER, score=score_fedmf_uploads, swap_steps=1,
    reads="each canary's own uploads (LDP-noised under defense ldp): the L1 mass on its set A rows minus set B rows"))
register_canary_scorer(CanaryScorer(
    protocol="fel", name="fel-canary-leaf", view=SERVER, score=score_fel_leaves,
    reads="the released leaf models of each canary's leaf: the change of its set A item rows minus set B rows"))
register_canary_scorer(CanaryScorer(
    protocol="fedcl", name="fedcl-canary-embedding", view=SERVER, score=score_fedcl_embeddings, swap_steps=1,
    accounted="per_user",
    reads="each canary's LDP embedding uploads against its two candidate embeddings under the round-0 GRU encoder"))
