"""Attacks on what STTFedRec's recommendation server (RS) sees.

Adversary: the honest-but-curious RS. Input: RS's view only (the records it received, from
``transport.transcript.view("rs")``) plus :meth:`protocols.sttfedrec.STTFedRec.public_info`
(``T``, ``n_pos``, ``n_neg``, catalogue size). Ground truth is used only by the scoring in
:mod:`experiments.studies.attack_sttfedrec`.

* ``request-intersection``: a client's clicks recur across its requests while fresh decoys are
  redrawn from the whole catalogue each time, so an id the client requested in at least
  ``min_count`` of its requests (default 2) is inferred to be a click, and so are the ``n_pos``
  ids of each request that all clients together request most (clicks follow popularity, fresh
  decoys are uniform). The paper never measures
  this (notes section 1, "What leaks"). The defense ``decoys = "fixed-pool"`` makes decoys recur
  as often as clicks, which this counting cannot separate.
* ``item-gradient``: the gradient of the loss with respect to a returned embedding ``i_j`` is
  ``(p_j - r_j / n) / (T tau) * (u_hat - cos_j i_hat_j) / |i_j|`` (up to the positive factor), so
  its sign along the user's direction separates clicks (pulled towards ``u``) from non-clicks
  (pushed away). RS does not know ``u``, but the non-clicks are the majority: their normalised
  rows sum to a direction ``w`` close to ``+u``, and a row with ``<g_j, w> < 0`` is inferred to be
  a click. Against per-client plaintext rows (``item_aggregation = "none"``, the naive fix for
  notes G1) this reads every request; against the SecAgg sum RS can only apply it to the ids
  that exactly one client requested in that round (the stated limit of G1), and attributes the
  sign to that client.
* ``chain-collusion``: the adversary is SAS together with some clients (notes section 1, "What
  leaks"). Its view: the chain uploads and the pads it opened at ``UNLOCK`` (its own view of
  step 4), the completed ring, and the ring seeds its colluders sent or received
  (:meth:`secagg.chain.ChainClient.known_seeds`). It strips from the victim's upload the opened
  pad and every seed a colluder shares with the victim (:func:`secagg.chain.remove_masks`): with
  all ``2s`` ring neighbours of the victim in the coalition that is the victim's user-tower
  gradient and loss exactly (the chain's stated limit, docs/chain.md); with any one missing the
  result is masked by a uniform ``PRG`` stream and carries nothing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from attacks.registry import AttackSpec, register_attack
from protocols.transport import Record
from secagg.chain import remove_masks

__all__ = ["ChainView", "chain_collusion_attack", "item_gradient_attack", "request_intersection_attack",
           "requests_by_client", "ring_neighbours"]


def _user(party: str) -> int:
    return int(party.split(":", 1)[1])


def requests_by_client(view: list[Record]) -> dict[int, list[np.ndarray]]:
    """Every request RS received, by client (user index), in round order."""
    out: dict[int, list[np.ndarray]] = defaultdict(list)
    for r in sorted((r for r in view if r.kind == "request"), key=lambda r: r.round):
        if r.payload is None:
            raise ValueError("the view holds request sizes only; record payloads (keep_payloads) to attack them")
        out[_user(r.sender)].append(np.asarray(r.payload, dtype=np.int64))
    return dict(out)


def request_intersection_attack(view: list[Record], public: dict[str, Any], *, min_count: int = 2,
                                popularity: bool = True) -> dict[int, np.ndarray]:
    """Inferred clicks per client: ids in at least ``min_count`` of its requests, plus (``popularity``)
    the ``n_pos`` ids of each request that all clients requested most often overall.

    RS counts every client's requests, so it knows which ids are requested often; clicks follow
    the (skewed) popularity while fresh decoys are uniform over the catalogue, so a request's most
    requested ids are likely its clicks even in a client's first request.
    """
    by_client = requests_by_client(view)
    n_items = int(public["n_items"])
    everything = np.concatenate([r for reqs in by_client.values() for r in reqs]) if by_client else np.zeros(0, np.int64)
    global_count = np.bincount(everything, minlength=n_items)
    n_pos = int(public["n_pos"])
    out = {}
    for u, reqs in by_client.items():
        ids, counts = np.unique(np.concatenate([np.unique(r) for r in reqs]), return_counts=True)
        guess = set(ids[counts >= min_count].tolist())
        if popularity:  # clicks follow popularity, fresh decoys are uniform: the most requested ids per request
            for r in reqs:
                guess.update(r[np.argsort(-global_count[r], kind="stable")[:n_pos]].tolist())
        out[u] = np.array(sorted(guess), dtype=np.int64)
    return out


def _signs(rows: np.ndarray) -> np.ndarray:
    """``<g_j, w>`` for each row, ``w`` the sum of the normalised non-zero rows."""
    norm = np.linalg.norm(rows, axis=1, keepdims=True)
    live = norm[:, 0] > 0
    w = (rows[live] / norm[live]).sum(0)
    return rows @ w


def item_gradient_attack(view: list[Record], public: dict[str, Any]) -> dict[int, np.ndarray]:
    """Inferred clicks per client from per-client rows, or from the per-id sums (module docstring)."""
    out: dict[int, set[int]] = defaultdict(set)
    per_client = [r for r in view if r.kind == "item-gradient" and isinstance(r.payload, tuple)]
    for r in per_client:
        union, rows = r.payload
        rows = np.asarray(rows, dtype=np.float64)
        score = _signs(rows)
        live = np.linalg.norm(rows, axis=1) > 0
        out[_user(r.sender)].update(union[live & (score < 0)].tolist())
    if not per_client:
        reqs = defaultdict(list)  # round -> [(user, ids)]
        for r in view:
            if r.kind == "request" and r.payload is not None:
                reqs[r.round].append((_user(r.sender), np.unique(r.payload)))
        for r in view:
            if r.kind != "item-gradient-sum" or r.payload is None:
                continue
            union, total, names = r.payload
            survivors = {_user(n) for n in names}
            owners: dict[int, list[int]] = defaultdict(list)
            for u, ids in reqs[r.round]:
                if u in survivors:
                    for i in ids.tolist():
                        owners[i].append(u)
            score = _signs(np.asarray(total, dtype=np.float64))
            for j, item in enumerate(union.tolist()):
                if len(owners[item]) == 1 and score[j] < 0:
                    out[owners[item][0]].add(item)
        for u, _ in (x for rs in reqs.values() for x in rs):
            out.setdefault(u, set())
    return {u: np.array(sorted(s), dtype=np.int64) for u, s in out.items()}


@dataclass(frozen=True)
class ChainView:
    """SAS's view of one completed chain aggregation plus what its colluders hand over.

    Attributes:
        uploads: each ring member's upload (``uint64 [dim]``) of the completed attempt.
        pads: the pad seed SAS opened at ``UNLOCK`` for each ring member.
        ring: the ring order SAS drew (it sends each client its neighbours, so it knows it).
        successors: ``s`` of the ring.
        attempt: the completed attempt (seeds of other attempts are ignored).
        seeds: ``(attempt, sender, receiver) -> seed`` from every colluding client.
    """

    uploads: Mapping[int, np.ndarray]
    pads: Mapping[int, bytes]
    ring: tuple[int, ...]
    successors: int
    attempt: int
    seeds: Mapping[tuple[int, int, int], bytes]


def ring_neighbours(ring: tuple[int, ...], target: int, s: int) -> list[int]:
    """The ``2s`` ring neighbours of ``target``, nearest first (successor 1, predecessor 1, ...)."""
    n, pos = len(ring), ring.index(target)
    out: list[int] = []
    for j in range(1, s + 1):
        for c in (ring[(pos + j) % n], ring[(pos - j) % n]):
            if c != target and c not in out:
                out.append(c)
    return out


def chain_collusion_attack(view: ChainView, public: dict[str, Any], *, target: int,
                           colluders: Iterable[int]) -> np.ndarray:
    """SAS's best reconstruction of ``target``'s chain input (``uint64``) from ``view`` (module docstring).

    ``colluders`` are the clients whose seeds SAS uses (their entries of ``view.seeds``); the
    target's own seeds are never used. Exact when ``colluders`` holds all ``2s`` neighbours.
    """
    if target not in view.uploads:
        raise ValueError(f"client {target} has no upload in the completed attempt; ring members: {sorted(view.uploads)}")
    coalition = set(colluders) - {target}
    sent, received = [], []
    for (att, snd, rcv), seed in view.seeds.items():
        if att != view.attempt:
            continue
        if snd == target and rcv in coalition:
            sent.append(seed)
        elif rcv == target and snd in coalition:
            received.append(seed)
    return remove_masks(view.uploads[target], sent=sent, received=received, pad=view.pads[target])


def _on_run_dir(name: str, attack: Any) -> tuple[Any, Any]:
    """``infer`` and ``assess`` of an RS attack on a recorded view: the inferred clicks are scored by
    precision against the client's training items (a click is one), beside a random set and a fixed
    public guess of ``n_pos`` items."""

    def infer(view: list[Record], public: dict[str, Any]) -> dict[int, np.ndarray]:
        from attacks.findings import NotApplicable

        if not any(r.kind == "request" and r.payload is not None for r in view):
            # two-server PIR queries, or download-all (no request at all): no item id to read, so the
            # attack infers nothing about the clients RS saw take part, and scores the stronger baseline
            seen = {_user(r.sender) for r in view if r.sender.startswith("client:")}
            if seen:
                return {u: np.zeros(0, np.int64) for u in sorted(seen)}
            raise NotApplicable("the view holds no client message")
        return attack(view, public)

    def assess(inferred: dict[int, np.ndarray], truth: Any, public: dict[str, Any]) -> list[Any]:
        from attacks.findings import public_items, set_finding

        n_items = int(public["n_items"])
        users = sorted(inferred)
        guess = public_items(public, n_items, int(public["n_pos"]))
        mean_guessed = float(np.mean([len(v) for v in inferred.values()])) if inferred else 0.0
        return [set_finding(attack=name, role="rs", target="clicked items", metric="precision", inferred=inferred,
                            truth={u: truth.items_of(u) for u in users}, n_candidates=n_items,
                            public_guess={u: guess for u in users}, rounds=(), status="ok",
                            extra={"items_guessed_per_user": mean_guessed})]

    return infer, assess


for _name, _fn, _summary in (
    ("request-intersection", request_intersection_attack,
     "clicks recur across a client's obfuscated requests while fresh decoys do not"),
    ("item-gradient", item_gradient_attack,
     "the sign of an item-embedding gradient along the user direction marks the clicks"),
):
    _infer, _assess = _on_run_dir(_name, _fn)
    register_attack(AttackSpec(protocol="sttfedrec", name=_name, view="rs", run=_fn, summary=_summary,
                               infer=_infer, assess=_assess))
register_attack(AttackSpec(
    protocol="sttfedrec", name="chain-collusion", view="sas", run=chain_collusion_attack,
    summary="SAS plus a client's 2s ring neighbours strip the chain masks off its user-tower gradient",
))
