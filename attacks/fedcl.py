"""What the server infers about a user's items from FedCL's LDP embedding uploads.

Adversary: the honest-but-curious server of :mod:`protocols.fedcl`. Its view holds every noisy
user embedding (kind ``"embedding"``, ``clip_L1(u, delta) + Lap(2 delta / epsilon)^d``) linked to
its client, and it knows the global model (it computes it). The attack averages the last ``uploads``
noisy embeddings of each user (the noise is zero-mean and independent across uploads, so the
average's noise shrinks like ``1/sqrt(uploads)``: exactly why the uploads must be composed), ranks
all items by ``average . item`` and guesses the top ``k`` as the user's items.

It is scored with :func:`attacks.scoring.score_sets` (precision@k against the user's training
history, beside a uniformly random guess of ``k`` items) and compared with the same ranking from the
noise-free embedding (what the server would learn with no LDP at all).

Promise attacked: each upload is ``epsilon``-LDP, so for every item the probability that one
upload puts it in the guess changes by at most a factor ``e^epsilon`` between any two users'
embeddings: the attack's expected precision@k is at most ``e^epsilon`` times what the same attack
gets from an upload of any fixed, data-independent embedding. ``k`` uploads compose (``k epsilon``
basic; the ledger's per-user report), and the measured precision climbs with ``k``
(docs/fedcl.md has the curve).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from attacks.registry import AttackSpec, register_attack
from attacks.scoring import SetScore, score_sets
from protocols.transport import SERVER, Record, Transcript

__all__ = ["EmbeddingAttackResult", "embedding_topk_attack", "score", "server_view", "topk_items"]


@dataclass(frozen=True)
class EmbeddingAttackResult:
    """Per user: the items inferred and how many uploads were averaged."""

    inferred: dict[int, np.ndarray]
    uploads_used: dict[int, int]


def server_view(transcript: Transcript | Iterable[Record]) -> list[Record]:
    """The embedding uploads the server received (payloads must have been kept)."""
    recs = transcript.view(SERVER, kind="embedding") if isinstance(transcript, Transcript) else [
        r for r in transcript if r.receiver == SERVER and r.kind == "embedding"]
    return recs


def topk_items(embeddings: np.ndarray, item_table: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` items of highest ``embedding . item`` per row (ties by item id): ``[n, k]``."""
    scores = np.asarray(embeddings, np.float64) @ np.asarray(item_table, np.float64).T
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def embedding_topk_attack(view: list[Record], public: dict[str, Any], *, item_table: np.ndarray, k: int = 10,
                          uploads: int | None = None) -> EmbeddingAttackResult:
    """Average each user's last ``uploads`` noisy embeddings (all if ``None``) and guess its top ``k`` items.

    Args:
        view: the server's records (kind ``"embedding"`` with payloads).
        public: ``FedCL.public_info()`` (sizes; checked against ``item_table``).
        item_table: the global item embeddings the server holds ``[n_items, dim]``.
        k: items guessed per user.
        uploads: how many of each user's most recent uploads to average.
    """
    if item_table.shape[0] != public["n_items"]:
        raise ValueError(f"item_table has {item_table.shape[0]} rows; the protocol has {public['n_items']} items")
    if k < 1 or (uploads is not None and uploads < 1):
        raise ValueError(f"k and uploads must be >= 1; found k={k}, uploads={uploads}")
    by_user: dict[int, list[tuple[int, np.ndarray]]] = {}
    for r in view:
        if r.kind != "embedding" or r.payload is None:
            continue
        by_user.setdefault(int(r.sender.split(":")[1]), []).append((r.round, np.asarray(r.payload, np.float64)))
    if not by_user:
        raise ValueError("the view holds no embedding payloads (run the protocol with the transcript keeping them)")
    users = sorted(by_user)
    means, used = [], {}
    for u in users:
        ups = [v for _, v in sorted(by_user[u], key=lambda x: x[0])]
        ups = ups if uploads is None else ups[-uploads:]
        means.append(np.mean(ups, axis=0))
        used[u] = len(ups)
    top = topk_items(np.stack(means), item_table, k)
    return EmbeddingAttackResult(inferred={u: top[i] for i, u in enumerate(users)}, uploads_used=used)


def score(result: EmbeddingAttackResult, truth: dict[int, np.ndarray], n_items: int) -> SetScore:
    """Precision@k (``precision``) etc. against each attacked user's true items, with the random baseline."""
    return score_sets(result.inferred, {u: truth[u] for u in result.inferred}, n_items)


#: Items guessed per user on a run directory (the per-paper study's default k).
RUN_DIR_K = 10


def infer(view: list[Record], public: dict[str, Any]) -> EmbeddingAttackResult:
    """:func:`embedding_topk_attack` on a recorded view: every embedding upload averaged per user and
    ranked against the item table of the last model the server sent (it computed that table)."""
    from attacks.findings import NotApplicable

    models = [r for r in view if r.sender == SERVER and r.kind == "model" and isinstance(r.payload, dict)
              and isinstance(r.payload.get("item"), np.ndarray)]
    if not models:
        raise NotApplicable("the view holds no model the server sent (its item table ranks the embeddings)")
    if not any(r.kind == "embedding" and r.payload is not None for r in view):
        raise NotApplicable("the view holds no embedding upload payloads")
    table = max(models, key=lambda r: r.round).payload["item"]
    return embedding_topk_attack(view, public, item_table=np.asarray(table), k=RUN_DIR_K)


def assess(result: EmbeddingAttackResult, truth: Any, public: dict[str, Any]) -> list[Any]:
    """Precision@k of each attacked user's top-k against its training items, beside a random set
    and a fixed public guess of k items."""
    from attacks.findings import public_items, set_finding

    n_items = int(public["n_items"])
    users = sorted(result.inferred)
    guess = public_items(public, n_items, RUN_DIR_K)
    return [set_finding(attack="fedcl-embedding-topk", role=SERVER, target="training items", metric="precision",
                        inferred=result.inferred, truth={u: truth.items_of(u) for u in users}, n_candidates=n_items,
                        public_guess={u: guess for u in users}, rounds=(), status="ok",
                        extra={"uploads_per_user": float(np.mean(list(result.uploads_used.values())))})]


register_attack(AttackSpec(
    protocol="fedcl", name="fedcl-embedding-topk", view=SERVER, run=embedding_topk_attack,
    summary="top-k items of the averaged LDP user embeddings, as the server ranks them",
    infer=infer, assess=assess,
))
