"""Interaction inference from ``I_k`` against FedFast's server (notes section 1, A17).

Adversary: the honest-but-curious FedFast server. Input: its view only (every ``"update"`` record it
received, :func:`attacks.fedmf.server_view`) plus :meth:`protocols.fedfast.FedFastGMF.public_info`
(the number of training negatives per positive, local epochs, the mean positives per client);
ground truth is used only when scoring (:func:`attacks.scoring.score_sets`).

Attack ``"fedfast-ik"``: a delegate's plaintext upload names the item rows it changed, ``I_k`` =
its positives plus the negatives it sampled (A3), with their changes. BCE's gradient on an item row
is ``(sigmoid(logit) - label) * p_u * h``: all of a client's positive rows move towards ``p_u * h``,
all its negative rows away from it. Negatives outnumber positives (``train_negatives`` per
positive), so minus the client's mean row change points along ``p_u * h``: ``method="direction"``
(default) scores each changed row by the cosine of its change with that direction (no ``p_u`` or
``h`` needed, so it works on plaintext FedAvg uploads too), adds the scores over the rounds the
client was sampled in, and guesses the ``n`` best, ``n = n_k / ((1 + negatives) x epochs)`` (``n_k`` is in the upload: FedAvg's
weight). ``method="magnitude"`` ranks by ``|delta|`` as notes A17 suggest; under the lazy Adam
optimiser every touched row moves by about ``lr`` per step whatever its gradient, so this separates
little (measured in docs/fedfast.md). Beside the random guesser the CLI reports the F1 of guessing
all of ``I_k`` (what the set alone gives).

Under the secure variant the ``"update"`` records hold uniformly masked ring elements: the same
ranking on the decoded masked item block (and ``n`` = the public mean positives per client) is
measured at random level, which is the promise of :mod:`protocols.fedfast` failing if it were not.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from attacks.fedmf import server_view
from attacks.registry import AttackSpec, register_attack
from attacks.scoring import SetScore, score_sets
from protocols.fedavg import ClientUpdate
from protocols.transport import SERVER, Record

__all__ = ["STATUS_MASKED", "STATUS_OK", "IkInference", "changed_set_score", "ik_attack", "infer", "score", "server_view"]

STATUS_OK = "ok"
STATUS_MASKED = "ok on masked values: per-client uploads are masked by secure aggregation (or DPF key shares)"
STATUS_EMPTY = "no client upload in the view"
#: Items guessed per client from a masked upload when the protocol publishes no mean (FedAvg).
_MASKED_GUESS = 10


class IkInference(dict):
    """user -> inferred positives (int64); ``.status`` and ``.changed`` (user -> union of ``I_k``)."""

    status: str = STATUS_OK
    changed: dict[int, np.ndarray]
    rounds: tuple[int, ...] = ()


def _sender_user(record: Record) -> int:
    return int(record.sender.split(":", 1)[1])


def _row_scores(rows_delta: np.ndarray, method: str) -> np.ndarray:
    """Per-row evidence of being a positive, in [-1, 1] (direction) or [0, 1] (magnitude)."""
    mag = np.abs(rows_delta).sum(1)
    if method == "magnitude":
        top = mag.max(initial=0.0)
        return mag / top if top > 0 else mag
    direction = -rows_delta.sum(0)  # negatives outnumber positives: their mean change points away
    norm = np.linalg.norm(rows_delta, axis=1) * np.linalg.norm(direction)
    return np.divide(rows_delta @ direction, norm, out=np.zeros(len(rows_delta)), where=norm > 0)


def ik_attack(view: Iterable[Record], public: Mapping[str, Any], *, rounds: Iterable[int] | None = None,
              method: str = "direction") -> IkInference:
    """Infer every sampled client's training positives from the ``"update"`` records it sent.

    Args:
        view: the server's records (others are ignored).
        public: ``public_info()`` of the FedFast run.
        rounds: restrict to these rounds (default: every round in the view).
        method: ``"direction"`` (the row change against ``p_u * h``) or ``"magnitude"`` (``|delta|``).
    """
    if method not in ("direction", "magnitude"):
        raise ValueError(f"method must be 'direction' or 'magnitude'; found {method!r}")
    cfg = public["config"]
    n_items, d = int(public["n_items"]), int(cfg["dim"])
    per_positive = (1 + int(cfg["train_negatives"])) * int(cfg["local_epochs"])
    keep = None if rounds is None else set(rounds)
    scores: dict[int, np.ndarray] = {}
    n_pos: dict[int, int] = {}
    changed: dict[int, set[int]] = {}
    masked = plain = False
    seen: set[int] = set()
    unread: set[int] = set()
    for r in view:
        if r.receiver != SERVER or r.kind != "update" or r.payload is None or (keep is not None and r.round not in keep):
            continue
        u = _sender_user(r)
        seen.add(r.round)
        if not isinstance(r.payload, (ClientUpdate, np.ndarray)):  # DPF key sets, ciphertexts: unreadable
            masked = True
            unread.add(u)
            continue
        s = scores.setdefault(u, np.full(n_items, -np.inf))
        if isinstance(r.payload, ClientUpdate):
            plain = True
            rows, delta = r.payload.rows, r.payload.item_delta.astype(np.float64)
            n_pos[u] = max(1, int(round(r.payload.weight / per_positive)))
            changed.setdefault(u, set()).update(rows[np.abs(delta).sum(1) > 0].tolist())
        elif isinstance(r.payload, np.ndarray) and r.payload.dtype == np.uint64:  # masked ring elements
            masked = True
            delta = r.payload[: n_items * d].view(np.int64).astype(np.float64).reshape(n_items, d)
            rows = np.arange(n_items)
            n_pos[u] = max(1, int(round(public.get("mean_positives", _MASKED_GUESS))))
        else:
            if u not in n_pos:  # an array of another kind: nothing read from this client
                scores.pop(u, None)
            continue
        ev = _row_scores(delta, method)
        s[rows] = np.where(np.isinf(s[rows]), 0.0, s[rows]) + ev  # evidence adds up over rounds
    out = IkInference()
    for u, s in scores.items():
        order = np.argsort(-s, kind="stable")
        out[u] = np.sort(order[: min(n_pos[u], int(np.isfinite(s).sum()))]).astype(np.int64)
    for u in unread - set(scores):  # its upload was seen but could not be read
        out[u] = np.zeros(0, np.int64)
    out.status = STATUS_EMPTY if not out else (STATUS_MASKED if masked and not plain else STATUS_OK)
    out.rounds = tuple(sorted(seen))
    out.changed = {u: np.array(sorted(c), np.int64) for u, c in changed.items()}
    return out


def score(inferred: IkInference, truth: Mapping[int, np.ndarray], n_items: int) -> SetScore:
    """Macro precision/recall/F1 over the attacked users (beside the random guesser)."""
    return score_sets(dict(inferred), {u: truth[u] for u in inferred}, n_items)


def changed_set_score(inferred: IkInference, truth: Mapping[int, np.ndarray], n_items: int) -> SetScore | None:
    """The score of guessing the whole ``I_k`` (plaintext views only; ``None`` otherwise)."""
    if not inferred.changed:
        return None
    return score_sets(inferred.changed, {u: truth[u] for u in inferred.changed}, n_items)


def infer(view: Iterable[Record], public: Mapping[str, Any]) -> IkInference:
    """:func:`ik_attack` over every recorded round of the server's view."""
    from attacks.findings import NotApplicable

    out = ik_attack(view, public)
    if out.status == STATUS_EMPTY:
        raise NotApplicable("the view holds no client upload payloads")
    return out


def _assess(name: str) -> Any:
    def assess(inferred: IkInference, truth: Any, public: Mapping[str, Any]) -> list[Any]:
        """Training positives (F1) of every client whose upload the server saw; masked uploads yield
        the public guess (a fixed set of the public mean number of positives)."""
        from attacks.findings import STATUS_PUBLIC, public_items, set_finding

        n_items = int(public["n_items"])
        users = sorted(inferred)
        guess = public_items(public, n_items, int(round(public.get("mean_positives", _MASKED_GUESS))))
        usable = inferred.status == STATUS_OK
        extra = {}
        if usable and inferred.changed:
            cs = changed_set_score(inferred, {u: truth.items_of(u) for u in inferred.changed}, n_items)
            extra = {"changed_set_f1": None if cs is None else cs.f1}
        return [set_finding(
            attack=name, role=SERVER, target="training positives",
            inferred={u: (inferred[u] if usable else guess) for u in users},
            truth={u: truth.items_of(u) for u in users}, n_candidates=n_items,
            public_guess={u: guess for u in users}, rounds=getattr(inferred, "rounds", ()),
            status=inferred.status if usable else STATUS_PUBLIC, extra=extra)]
    return assess


register_attack(AttackSpec(
    protocol="fedfast", name="fedfast-ik", view="server", run=ik_attack,
    summary="training positives from the changed item rows I_k of the delegates' uploads, ranked by |delta|",
    infer=infer, assess=_assess("fedfast-ik"),
))
register_attack(AttackSpec(
    protocol="fedavg", name="fedavg-ik", view="server", run=ik_attack,
    summary="training positives from the item rows a FedAvg upload changes (the I_k attack on plain FedAvg)",
    infer=infer, assess=_assess("fedavg-ik"),
))
