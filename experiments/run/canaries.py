"""Canary users for the one-run privacy audit (``[audit] canaries = K``, ``secagg run --canaries K``).

Each of the ``K`` canaries is a new user with two sets of fresh items of its own (``items_a``,
``items_b``: ``canary_items`` each, held by nobody else). The canary holds set A when its bit is 1
("included") and set B when it is 0, the bit drawn from the OS CSPRNG (:mod:`dp.rng`) with
probability 1/2, independently per canary. Both sets exist in every run, so the catalogue's
size, the users and the number of interactions do not depend on the bits: only which of its two
sets a canary holds does, which is one replacement of one user's data (the neighbouring relation
of local DP; under add/remove DP a replacement is a group of two, see docs/audit.md).

Files in the run directory:

* ``canaries.json`` (public: what an auditor knows before the run): the design, and per canary its
  dense user index and both item sets;
* ``audit-secret/inclusion.json`` (secret: only ``secagg audit`` reads it, after the scores are
  computed from the views): the bits, and the SHA-256 of ``canaries.json`` they belong to.

The canaries have no held-out item: they are never evaluated, and their items are candidates in
full-ranking evaluation like any item nobody else rated.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np

from experiments.errors import UserError
from recmodels.data import Interactions

__all__ = ["CANARIES_JSON", "SECRET_DIR", "SECRET_FILE", "Canaries", "draw", "insert", "load_public", "load_secret",
           "write"]

CANARIES_JSON = "canaries.json"
SECRET_DIR = "audit-secret"
SECRET_FILE = f"{SECRET_DIR}/inclusion.json"
FORMAT = "secagg-fedrec-canaries/1"


@dataclass(frozen=True)
class Canaries:
    """The canaries of a run: ``users[c]`` holds ``items_a[c]`` if ``included[c]`` else ``items_b[c]``
    (dense indices after insertion). ``included`` is ``None`` where only the public part was read."""

    users: np.ndarray            # [K] int64
    items_a: np.ndarray          # [K, n] int64
    items_b: np.ndarray          # [K, n] int64
    included: np.ndarray | None  # [K] bool, secret

    def public_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "canaries": len(self.users),
                "design": "each canary holds items_a if its secret bit is 1, else items_b; bits from the OS "
                          "CSPRNG with probability 1/2, independent; every item here is held by its canary only",
                "users": self.users.tolist(), "items_a": self.items_a.tolist(), "items_b": self.items_b.tolist()}


def draw(k: int) -> np.ndarray:
    """``k`` independent fair bits from the OS CSPRNG (:mod:`secrets`, i.e. ``os.urandom``)."""
    nbytes = (k + 7) // 8
    raw = np.frombuffer(secrets.token_bytes(nbytes), np.uint8)
    return np.unpackbits(raw)[:k].astype(bool)


def _new_ids(existing: np.ndarray, n: int, prefix: str) -> np.ndarray:
    if existing.dtype.kind in "iu":
        start = int(existing.max()) + 1 if len(existing) else 0
        return np.concatenate([existing, np.arange(start, start + n, dtype=existing.dtype)])
    return np.concatenate([existing.astype(object), np.array([f"{prefix}{i}" for i in range(n)], dtype=object)])


def _remap(inter: Interactions | None, user_ids: np.ndarray, item_ids: np.ndarray) -> Interactions | None:
    return None if inter is None else dataclasses.replace(inter, user_ids=user_ids, item_ids=item_ids)


def insert(prep: Any, k: int, n_items: int, included: np.ndarray, *, keeps_ratings: bool) -> tuple[Any, Canaries]:
    """``prep`` (:class:`experiments.run.prepare.Prepared`) with ``k`` canary users and ``2 k n_items``
    fresh items added to the training data; returns it and the :class:`Canaries`."""
    included = np.asarray(included, bool)
    if included.shape != (k,):
        raise ValueError(f"need {k} inclusion bits; found {included.shape}")
    split = prep.split
    train: Interactions = split.train
    n_users0, n_items0 = len(train.user_ids), len(train.item_ids)
    users = np.arange(n_users0, n_users0 + k, dtype=np.int64)
    fresh = np.arange(n_items0, n_items0 + 2 * k * n_items, dtype=np.int64).reshape(k, 2, n_items)
    items_a, items_b = fresh[:, 0, :], fresh[:, 1, :]
    user_ids = _new_ids(np.asarray(train.user_ids), k, "canary-user-")
    item_ids = _new_ids(np.asarray(train.item_ids), 2 * k * n_items, "canary-item-")
    held = np.where(included[:, None], items_a, items_b)
    rating = float(train.ratings.max()) if keeps_ratings and len(train) else 1.0
    t0 = int(train.timestamps.max()) + 1 if len(train) else 0
    new = Interactions(
        users=np.concatenate([train.users, np.repeat(users, n_items)]),
        items=np.concatenate([train.items, held.ravel()]),
        ratings=np.concatenate([train.ratings, np.full(k * n_items, rating, np.float32)]),
        timestamps=np.concatenate([train.timestamps, t0 + np.tile(np.arange(n_items), k)]),
        user_ids=user_ids, item_ids=item_ids, source=train.source + f" + {k} audit canaries",
    )
    if hasattr(split, "test_items"):  # leave-one-out: the canaries hold nothing out
        pad = np.full(k, -1, np.int64)
        split = dataclasses.replace(
            split, train=new, test_items=np.concatenate([split.test_items, pad]),
            valid_items=None if split.valid_items is None else np.concatenate([split.valid_items, pad]))
    else:  # ratio split
        split = dataclasses.replace(split, train=new, test=_remap(split.test, user_ids, item_ids))
    prep = dataclasses.replace(prep, split=split, data=_remap(prep.data, user_ids, item_ids),
                               exclude=_remap(prep.exclude, user_ids, item_ids))
    prep.description["audit_canaries"] = {"canaries": k, "items_each": n_items, "design": "docs/audit.md"}
    return prep, Canaries(users, items_a, items_b, included)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def write(rd: Any, canaries: Canaries) -> None:
    """``canaries.json`` and the secret ``audit-secret/inclusion.json`` (mode 0600 in a 0700 directory)."""
    from experiments.run.rundir import atomic_write_text

    public = json.dumps(canaries.public_dict(), sort_keys=True) + "\n"
    atomic_write_text(rd.file(CANARIES_JSON), public)
    secret_dir = rd.file(SECRET_DIR)
    secret_dir.mkdir(mode=0o700, exist_ok=True)
    secret = json.dumps({"format": FORMAT, "canaries_sha256": _sha(public),
                         "included": [int(b) for b in canaries.included]}, sort_keys=True) + "\n"
    path = rd.file(SECRET_FILE)
    atomic_write_text(path, secret)
    path.chmod(0o600)


def _read(path: Any, what: str) -> tuple[str, dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
        obj = json.loads(text)
    except FileNotFoundError:
        raise UserError(f"{path} is missing: {what}") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise UserError(f"{path} is not a {FORMAT} file")
    return text, obj


def load_public(run_dir: Any) -> Canaries:
    """The public part (``canaries.json``): users and item sets, no bits."""
    from pathlib import Path

    path = Path(run_dir) / CANARIES_JSON
    _, obj = _read(path, "the run has no audit canaries (run it with --canaries K)")
    try:
        users = np.asarray(obj["users"], np.int64)
        a, b = np.asarray(obj["items_a"], np.int64), np.asarray(obj["items_b"], np.int64)
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{path}: malformed canary list ({exc})") from None
    if users.ndim != 1 or a.ndim != 2 or a.shape != b.shape or len(a) != len(users):
        raise UserError(f"{path}: users, items_a and items_b do not describe the same canaries")
    return Canaries(users, a, b, None)


def load_secret(run_dir: Any) -> Canaries:
    """The canaries with their secret bits, checked against the ``canaries.json`` they were drawn for."""
    from pathlib import Path

    pub = load_public(run_dir)
    public_text = (Path(run_dir) / CANARIES_JSON).read_text(encoding="utf-8")
    path = Path(run_dir) / SECRET_FILE
    _, obj = _read(path, "the canaries' inclusion bits were deleted, so the run cannot be audited")
    if obj.get("canaries_sha256") != _sha(public_text):
        raise UserError(f"{path} belongs to another canaries.json (its SHA-256 differs): the audit would be wrong")
    bits = obj.get("included")
    if not isinstance(bits, list) or len(bits) != len(pub.users) or any(x not in (0, 1) for x in bits):
        raise UserError(f"{path}: 'included' must hold one 0/1 bit per canary ({len(pub.users)})")
    return dataclasses.replace(pub, included=np.asarray(bits, bool))


def for_run(prep: Any, config: Any, run_dir: Any | None) -> tuple[Any, Canaries | None]:
    """``prep`` with the run's canaries (``[audit] canaries``): fresh bits for a new run (``run_dir``
    ``None``), the recorded ones for an existing run directory (``--resume``, and the scoring side of
    ``secagg attack`` / ``secagg audit``). ``(prep, None)`` without canaries."""
    k = config.audit.canaries
    if not k:
        return prep, None
    if not config.spec.federated:
        raise UserError(f"audit.canaries: {config.run.protocol!r} is not federated, so no server sees anything to "
                        "audit; run a federated protocol")
    bits = draw(k) if run_dir is None else load_secret(run_dir).included
    prep, canaries = insert(prep, k, config.audit.canary_items, bits, keeps_ratings=config.spec.keeps_ratings)
    if run_dir is not None:
        pub = load_public(run_dir)
        if not (np.array_equal(pub.users, canaries.users) and np.array_equal(pub.items_a, canaries.items_a)
                and np.array_equal(pub.items_b, canaries.items_b)):
            raise UserError(f"{run_dir}/{CANARIES_JSON} does not match the canaries this data and configuration give")
    return prep, canaries
