"""Letter-trigram word hashing (DSSM, Huang et al. 2013) and the two-tower feature rules.

A text is lower-cased and split into words (runs of letters and digits); each word ``w`` is
wrapped as ``#w#`` and cut into its letter trigrams (``#ca``, ``cat``, ``at#`` for "cat").
:class:`TrigramVocab` maps trigrams to ``hash_dim`` input columns. It is built **once from public
data** (the item catalogue's titles and genres, plus the public vocabulary of the demographic
fields): the ``hash_dim - 1`` most frequent trigrams get a column each (ties by the trigram's
text, so the build is deterministic), and every other trigram shares the last column
(out-of-vocabulary). Nothing private enters the vocabulary. The paper gives no hashing size
(notes G17); the default 1024 matches the ~1.2k input the paper's Table 3 bytes imply.

Features are sparse count matrices (``scipy.sparse.csr_matrix``, rows = entities):

* :meth:`TrigramVocab.bag`: one row per text, the trigram counts of all its words (DSSM input);
* :meth:`TrigramVocab.words`: ``[n, max_words, hash_dim]`` per-word counts as a CSR over
  ``n * max_words`` rows (CLSM input: a convolution over word positions).

:func:`hashed_ids` maps item ids to the buckets of a salted public hash (the click-id user input,
``click_id_dim``; docs/sttfedrec.md). The feature rules of STTFedRec (issue 10) are here too: :func:`item_texts` (title and genres),
:func:`demographic_texts` (age band, gender, occupation, zip region) and
:func:`first_click_features` (the titles of a user's first ``n`` clicks, which are then removed
from that user's training positives so the label never leaks into the feature; notes G17).
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from recmodels.data import Interactions, subset
from recmodels.side import AGE_BANDS, ML1M_OCCUPATIONS, ItemMeta, UserDemographics

__all__ = [
    "TrigramVocab",
    "demographic_texts",
    "first_click_features",
    "hashed_ids",
    "item_texts",
    "letter_trigrams",
    "public_field_texts",
    "words",
]

_WORD = re.compile(r"[^\W_]+", re.UNICODE)


def words(text: str) -> list[str]:
    """Lower-cased words (runs of letters/digits) of ``text``."""
    return _WORD.findall(text.lower())


def letter_trigrams(word: str) -> list[str]:
    """The letter trigrams of ``#word#`` (a one-letter word gives ``#a#``)."""
    w = f"#{word}#"
    return [w[i : i + 3] for i in range(len(w) - 2)]


@dataclass(frozen=True)
class TrigramVocab:
    """Trigram -> column map over ``hash_dim`` columns; the last column is out-of-vocabulary.

    Build with :meth:`build`; :attr:`trigrams` (the kept trigrams in column order) is all the
    state, so a vocabulary is saved and compared as a list of strings.
    """

    trigrams: tuple[str, ...]
    hash_dim: int

    def __post_init__(self) -> None:
        if self.hash_dim < 2:
            raise ValueError(f"hash_dim must be >= 2 (one column is out-of-vocabulary); found {self.hash_dim}")
        if len(self.trigrams) > self.hash_dim - 1:
            raise ValueError(f"{len(self.trigrams)} trigrams do not fit hash_dim={self.hash_dim}")

    @classmethod
    def build(cls, public_texts: Sequence[str], hash_dim: int) -> TrigramVocab:
        """The ``hash_dim - 1`` most frequent trigrams of ``public_texts`` (ties by text)."""
        counts: Counter[str] = Counter()
        for text in public_texts:
            for w in words(text):
                counts.update(letter_trigrams(w))
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return cls(tuple(t for t, _ in ranked[: hash_dim - 1]), int(hash_dim))

    @property
    def oov(self) -> int:
        """The shared out-of-vocabulary column."""
        return self.hash_dim - 1

    def _index(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self.trigrams)}

    def _word_columns(self, word: str, index: dict[str, int]) -> list[int]:
        return [index.get(t, self.oov) for t in letter_trigrams(word)]

    def bag(self, texts: Sequence[str]) -> sp.csr_matrix:
        """float32 ``[len(texts), hash_dim]`` trigram counts per text."""
        index = self._index()
        rows, cols = [], []
        for r, text in enumerate(texts):
            for w in words(text):
                c = self._word_columns(w, index)
                cols.extend(c)
                rows.extend([r] * len(c))
        m = sp.csr_matrix((np.ones(len(cols), np.float32), (rows, cols)), shape=(len(texts), self.hash_dim))
        m.sum_duplicates()
        return m

    def words(self, texts: Sequence[str], max_words: int) -> tuple[sp.csr_matrix, np.ndarray]:
        """Per-word counts as CSR ``[len(texts) * max_words, hash_dim]`` and the word count per text.

        Row ``i * max_words + j`` is word ``j`` of text ``i`` (words past ``max_words`` are cut,
        missing ones are zero rows).
        """
        if max_words < 1:
            raise ValueError(f"max_words must be >= 1; found {max_words}")
        index = self._index()
        rows, cols, lengths = [], [], np.zeros(len(texts), np.int64)
        for r, text in enumerate(texts):
            ws = words(text)[:max_words]
            lengths[r] = len(ws)
            for j, w in enumerate(ws):
                c = self._word_columns(w, index)
                cols.extend(c)
                rows.extend([r * max_words + j] * len(c))
        m = sp.csr_matrix((np.ones(len(cols), np.float32), (rows, cols)),
                          shape=(len(texts) * max_words, self.hash_dim))
        m.sum_duplicates()
        return m, lengths


def item_texts(meta: ItemMeta | None, item_ids: np.ndarray) -> list[str]:
    """``"title genre genre ..."`` per item; without a side file, the raw id spelled out.

    The fallback (synthetic data, files without titles) makes the item feature a hashed id:
    ``"item 123"`` shares trigrams with ``"item 1234"``, so it is a weak feature, and the
    documentation says so.
    """
    if meta is None:
        return [f"item {x}" for x in np.asarray(item_ids).tolist()]
    return [
        f"{t} {' '.join(g)}".strip() if k else f"item {x}"
        for t, g, k, x in zip(meta.titles, meta.genres, meta.known, np.asarray(item_ids).tolist())
    ]


def demographic_texts(demo: UserDemographics) -> list[str]:
    """``"age25 gender_m occupation words zip9"`` per user (unknown fields left out)."""
    band = demo.age_band()
    out = []
    for u in range(len(demo.gender)):
        parts = []
        if band[u] >= 0:
            parts.append(f"age{AGE_BANDS[band[u]]}")
        if demo.gender[u]:
            parts.append(f"gender{demo.gender[u].lower()}")
        if demo.occupation[u]:
            parts.append(demo.occupation[u])
        if demo.zip[u][:1]:
            parts.append(f"zip{demo.zip[u][:1].lower()}")
        out.append(" ".join(parts))
    return out


def public_field_texts() -> list[str]:
    """Every value the demographic fields can take (public schema, no user data)."""
    return ([f"age{a}" for a in AGE_BANDS] + ["genderm", "genderf"] + list(ML1M_OCCUPATIONS)
            + [f"zip{c}" for c in "0123456789abcdefghijklmnopqrstuvwxyz"])


def first_click_features(
    train: Interactions, item_text: Sequence[str], n_clicks: int
) -> tuple[list[str], Interactions, np.ndarray]:
    """The Adressa rule: a user's feature is the titles of its first ``n_clicks`` clicks.

    Clicks are ordered by timestamp (ties by item index). A user keeps at least one training
    positive: with ``c`` positives it uses ``min(n_clicks, c - 1)`` clicks as its feature. The
    clicks used are removed from the returned training interactions (notes G17: otherwise the
    label would sit inside the feature).

    Returns:
        ``(texts, remaining train, feature pairs)`` where ``feature pairs`` is int64 ``[m, 2]``
        of ``(user, item)`` moved into features.
    """
    if n_clicks < 1:
        raise ValueError(f"n_clicks must be >= 1; found {n_clicks}")
    order = np.lexsort((train.items, train.timestamps, train.users))
    users = train.users[order]
    start = np.searchsorted(users, np.arange(train.n_users + 1))
    count = np.diff(start)
    rank = np.arange(len(users)) - start[users]
    used = rank < np.minimum(n_clicks, count - 1)[users]
    texts = [""] * train.n_users
    chosen = order[used]
    for u, i in zip(train.users[chosen].tolist(), train.items[chosen].tolist()):
        texts[u] = f"{texts[u]} {item_text[i]}".strip()
    keep = np.sort(order[~used])
    pairs = np.stack([train.users[chosen], train.items[chosen]], 1).astype(np.int64)
    return texts, subset(train, keep), pairs


def hashed_ids(item_ids: Sequence[object], dim: int, salt: str) -> np.ndarray:
    """The bucket in ``0 .. dim - 1`` of each raw item id under a salted public hash.

    ``blake2b(str(id), key=salt)`` (first 8 bytes, little-endian) modulo ``dim``. The salt is a
    public configuration value, not a secret: anyone (RS, SAS) can compute the bucket of any item;
    it only picks which items collide. Raw ids (not the dense indices) are hashed, so the buckets
    do not depend on which items a split happens to contain.
    """
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 2:
        raise ValueError(f"the click-id hash needs dim >= 2 buckets; found {dim!r}")
    key = salt.encode()
    if not 0 < len(key) <= 64:
        raise ValueError(f"the click-id salt must be 1..64 UTF-8 bytes; found {len(key)}")
    out = np.empty(len(item_ids), np.int64)
    for j, x in enumerate(np.asarray(item_ids).tolist()):
        digest = hashlib.blake2b(str(x).encode(), digest_size=8, key=key).digest()
        out[j] = int.from_bytes(digest, "little") % dim
    return out
