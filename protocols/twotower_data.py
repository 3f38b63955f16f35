"""Features, requests and the configuration shared by STTFedRec, FL-DSSM/CLSM and the centralised towers.

:func:`build_features` applies the feature rules of issue 10: item features are the letter
trigrams of each item's title and genres (``recmodels.side.load_item_meta``); user features are
the demographics where the dataset has them (``u.user``, ``users.dat``), otherwise the titles of
the user's first ``user_clicks`` clicks, which are removed from that user's training positives
(notes G17). The trigram vocabulary is built once from the public item texts and the public
field values (:mod:`recmodels.trigram`).

:func:`sample_requests` draws the obfuscated requests (notes G5/G6): ``n_neg = round(rho * T)``
non-clicked items and ``n_pos = T - n_neg`` clicks per request, positives without replacement
from the client's history (a client with fewer positives fills the rest with non-clicked items,
so every request has exactly ``T`` ids), shuffled so the position reveals nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

from recmodels.data import Interactions
from recmodels.sampling import sample_negatives_keyed, sample_train_negatives
from recmodels.side import load_item_meta, load_user_demographics
from recmodels.streams import shuffle_keys, stream_keys
from recmodels.trigram import (
    TrigramVocab,
    demographic_texts,
    first_click_features,
    hashed_ids,
    item_texts,
    public_field_texts,
)
from recmodels.twotower import TOWERS

__all__ = ["TwoTowerConfig", "TwoTowerData", "build_features", "sample_requests", "sample_requests_keyed"]

_USER_FEATURES = ("auto", "demographics", "clicks", "history")
_DECOYS = ("fresh", "fixed-pool", "download-all", "pir")
_ITEM_AGG = ("secagg+", "secagg", "chain", "none", "dpf")
_CLICK_NORM = ("mean", "sqrt")


@dataclass(frozen=True)
class TwoTowerConfig:
    """The ``[sttfedrec]`` section (shared by ``sttfedrec``, ``fl-twotower``, ``centralized-twotower``).

    Attributes:
        tower: ``"dssm"`` or ``"clsm"`` (both towers).
        hash_dim: trigram input columns (the last one out-of-vocabulary).
        max_words: words per text the CLSM convolution sees.
        dim: embedding size k.
        dropout, init_std: dropout rate and N(0, init_std) initialisation (paper: 0.2, 0.1).
        clients_per_round: K.
        request_size: T, ids per request (= local batch).
        rho: fraction of non-clicked ids in a request (notes G5: ``n_neg = round(rho T)``).
        temperature: softmax temperature over cosines (notes G15; 1 is the paper's).
        lr, beta1, beta2, tau: FedAdam (or the centralised Adam-style step).
        lr_decay, decay_every: ``lr *= lr_decay`` every ``decay_every`` rounds (notes G4).
        user_features: ``"auto"`` (demographics if present, else clicks), ``"demographics"``, ``"clicks"``,
            or ``"history"`` (DSSM only; our decision, docs/sttfedrec.md): the mean trigram vector of
            the titles and genres of all the user's training clicks, computed on the device, with
            each request's own clicks left out of it so the label is never in the feature.
        user_clicks: clicks used as the user feature under the click rule.
        click_id_dim: 0 (off, the paper) or the number of hash buckets ``B >= 2`` of the click-id
            user input (DSSM only; our decision, docs/sttfedrec.md): ``B`` columns appended to the
            user tower's input (after the ``hash_dim`` trigram columns of ``user_features``), the
            bag of the salted public hashes (:func:`recmodels.trigram.hashed_ids`) of the item ids
            of all the device's own training clicks, computed on the device, with each request's
            own clicks left out exactly as under ``"history"``. The user tower's first layer, and
            so its download and chain upload, grows by ``256 x B`` parameters.
        click_id_norm: ``"mean"`` (each click weighs ``1 / n``) or ``"sqrt"`` (``1 / sqrt(n)``:
            unit norm without collisions), ``n`` the clicks in the bag.
        click_id_salt: the public salt of the click-id hash (picks the collisions; not a secret).
        decoys: ``"fresh"`` (the paper: new random non-clicked ids per request) or ``"fixed-pool"``
            (the defense against request intersection: a per-user, popularity-matched pool
            drawn once, ``pool_factor`` times the history scaled by ``n_neg / n_pos``) or
            ``"download-all"`` (the defense that resists it: each sampled client receives all ``M``
            embeddings, sends RS no item id, picks its ``T`` training items on the device, and its
            embedding gradients are scattered into all ``M`` ids before the secure sum) or ``"pir"``
            (two-server private retrieval, docs/dpf.md: the client draws the same ``T`` ids as under
            ``"fresh"`` and fetches their embeddings from RS and SAS, which both hold the table, with
            one DPF key set each; neither server learns which ids; sttfedrec only).
        pool_factor: pool size multiplier of ``"fixed-pool"``.
        item_aggregation: how the per-item-id gradients reach RS (notes G1): ``"secagg+"``,
            ``"secagg"``, ``"chain"`` (sum only), ``"dpf"`` (the two-server DPF sum with RS as the
            receiver and SAS as the second server: each client sends only its ``T`` rows, as key sets
            neither server can read; docs/dpf.md) or ``"none"`` (each client's rows in plaintext,
            the naive fix that attack ``item-gradient`` exploits).
        chain_successors: s of the circular chain carrying the user-tower gradients to SAS.
        frac_bits, value_clip: fixed-point encoding of every secure sum.
        batch_size: requests per step of the centralised trainer (``centralized-twotower``).
        item_id_embedding: add a learned per-item-id vector (``M x dim``, held with the item
            tower) to the item tower's output, so the item side can memorise what titles and
            genres do not carry (popularity, collaborative signal). Our decision, not the paper's
            (docs/sttfedrec.md): the item ids are RS's own data; under ``sttfedrec`` the vectors
            stay on RS and are trained by the same per-id gradient sums, under ``fl-twotower``
            each client downloads the rows of its request and uploads their gradients.
    """

    tower: str = "dssm"
    hash_dim: int = 1024
    max_words: int = 16
    dim: int = 128
    dropout: float = 0.2
    init_std: float = 0.1
    clients_per_round: int = 50
    request_size: int = 10
    rho: float = 0.9
    temperature: float = 1.0
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3
    lr_decay: float = 0.99
    decay_every: int = 10
    user_features: str = "auto"
    user_clicks: int = 5
    decoys: str = "fresh"
    pool_factor: float = 1.0
    item_aggregation: str = "secagg+"
    chain_successors: int = 1
    frac_bits: int = 24
    value_clip: float = 64.0
    batch_size: int = 256
    item_id_embedding: bool = False
    click_id_dim: int = 0
    click_id_norm: str = "mean"
    click_id_salt: str = "sttfedrec-click-ids"

    def __post_init__(self) -> None:
        def bad(key: str, want: str) -> ValueError:
            return ValueError(f"sttfedrec.{key} must be {want}; found {getattr(self, key)!r}")

        if self.tower not in TOWERS:
            raise bad("tower", f"one of {TOWERS}")
        for key in ("hash_dim", "max_words", "dim", "clients_per_round", "request_size", "user_clicks",
                    "decay_every", "chain_successors", "batch_size"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < (2 if key in ("hash_dim", "request_size") else 1):
                raise bad(key, "a positive integer" + (" >= 2" if key in ("hash_dim", "request_size") else ""))
        if not (0 <= self.dropout < 1):
            raise bad("dropout", "in [0, 1)")
        if not (0 <= self.rho < 1):
            raise bad("rho", "in [0, 1) (a request needs at least one click)")
        if self.request_size - round(self.rho * self.request_size) < 1:
            raise bad("rho", "such that T - round(rho T) >= 1")
        for key in ("init_std", "temperature", "lr", "tau", "pool_factor", "value_clip"):
            v = getattr(self, key)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise bad(key, "a positive number")
        for key in ("beta1", "beta2"):
            if not (0 <= getattr(self, key) < 1):
                raise bad(key, "in [0, 1)")
        if not (0 < self.lr_decay <= 1):
            raise bad("lr_decay", "in (0, 1]")
        if self.user_features not in _USER_FEATURES:
            raise bad("user_features", f"one of {_USER_FEATURES}")
        if self.user_features == "history" and self.tower != "dssm":
            raise bad("user_features", "'auto', 'demographics' or 'clicks' with tower = 'clsm' ('history' is a bag "
                      "of trigrams, a DSSM input)")
        if (not isinstance(self.click_id_dim, int) or isinstance(self.click_id_dim, bool) or self.click_id_dim < 0
                or self.click_id_dim == 1 or self.click_id_dim > 1 << 20):
            raise bad("click_id_dim", "0 (off) or a number of hash buckets in 2..1048576")
        if self.click_id_dim and self.tower != "dssm":
            raise bad("click_id_dim", "0 with tower = 'clsm' (the click-id bag is a DSSM input; CLSM convolves words)")
        if self.click_id_norm not in _CLICK_NORM:
            raise bad("click_id_norm", f"one of {_CLICK_NORM}")
        if not isinstance(self.click_id_salt, str) or not 0 < len(self.click_id_salt.encode()) <= 64:
            raise bad("click_id_salt", "a string of 1..64 UTF-8 bytes")
        if self.decoys not in _DECOYS:
            raise bad("decoys", f"one of {_DECOYS}")
        if self.item_aggregation not in _ITEM_AGG:
            raise bad("item_aggregation", f"one of {_ITEM_AGG}")
        if not isinstance(self.item_id_embedding, bool):
            raise bad("item_id_embedding", "true or false")
        if not (0 < self.frac_bits < 62):
            raise bad("frac_bits", "in 1..61")

    @property
    def user_in_dim(self) -> int:
        """Input width of the user tower: the trigram columns plus the click-id buckets."""
        return self.hash_dim + self.click_id_dim

    @property
    def n_neg(self) -> int:
        return int(round(self.rho * self.request_size))

    @property
    def n_pos(self) -> int:
        return self.request_size - self.n_neg

    def lr_at(self, round_: int) -> float:
        """The learning rate of round ``round_`` (0-based) after step decay."""
        return self.lr * self.lr_decay ** (round_ // self.decay_every)


@dataclass
class TwoTowerData:
    """Everything the towers train on, built once from public item data and each user's own data.

    Attributes:
        train: training positives (the click-rule feature clicks removed).
        never_negative: every pair never drawn as a non-clicked id (all training clicks, the
            feature clicks, and the run's sub-threshold ratings).
        vocab: the trigram vocabulary.
        item_x, item_len: item features (CSR; per-word rows for CLSM) and word counts.
        user_x, user_len: user features, likewise.
        user_rule: ``"demographics"``, ``"clicks"`` or ``"history"``.
        user_count: training clicks per user (``"history"``: ``user_x`` is their mean item vector).
        click_bucket: ``click_id_dim``: each item's hash bucket ``[M]`` (public).
        click_bag: ``click_id_dim``: each user's bucket counts over all its training clicks
            (the feature clicks included) ``[n_users, B]``; the last ``B`` columns of ``user_x``
            are this bag scaled by :meth:`_click_scale` of ``click_count``.
        click_count: ``click_id_dim``: the clicks in each user's bag.
        click_norm: ``"mean"`` or ``"sqrt"``.
        feature_pairs: ``(user, item)`` moved from positives into features.
        item_text_bytes: UTF-8 bytes of the raw item data (what FL baselines download to infer).
    """

    train: Interactions
    never_negative: Interactions
    vocab: TrigramVocab
    item_x: sp.csr_matrix
    item_len: np.ndarray | None
    user_x: sp.csr_matrix
    user_len: np.ndarray | None
    user_rule: str
    feature_pairs: np.ndarray
    item_text_bytes: int
    user_count: np.ndarray | None = None
    click_bucket: np.ndarray | None = None
    click_bag: sp.csr_matrix | None = None
    click_count: np.ndarray | None = None
    click_norm: str = "mean"

    def request_user_x(self, users: np.ndarray, labels: np.ndarray, request_item_x: torch.Tensor | None = None,
                       ids: np.ndarray | None = None) -> torch.Tensor:
        """The user inputs ``[K, hash_dim (+ click_id_dim)]`` of one request each, its clicks left out.

        What each device computes from its own data for a request with item ids ``ids`` ``[K, T]``
        and click labels ``labels``:

        * ``"history"``: ``request_item_x`` is ``[K, T, hash_dim]``, the item inputs of each
          request; the trigram part is ``(count * mean - sum of the request's clicked items) /
          max(count - clicks, 1)``, i.e. the mean over the user's other training clicks;
          other rules keep their fixed trigram part (their feature clicks are never labels);
        * with ``click_id_dim``: the click-id part is the bag of the user's click buckets minus
          the buckets of the request's clicks, scaled by ``1 / max(n, 1)`` (``"mean"``) or
          ``1 / sqrt(max(n, 1))`` (``"sqrt"``), ``n`` the clicks left in the bag.
        """
        users = np.asarray(users, dtype=np.int64)
        lab = torch.as_tensor(labels, dtype=torch.float32)
        h = self.vocab.hash_dim
        if self.user_rule == "history":
            if request_item_x is None:
                raise ValueError("user_features = 'history' needs the request's item inputs")
            count = torch.as_tensor(self.user_count[users], dtype=torch.float32)
            total = torch.from_numpy(self.user_x[users][:, :h].toarray()) * count[:, None]
            left = total - (lab.unsqueeze(-1) * request_item_x).sum(1)
            words = left / (count - lab.sum(1)).clamp_min(1.0)[:, None]
        else:
            words = torch.from_numpy(self.user_x[users][:, :h].toarray())
        if self.click_bag is None:
            return words
        if ids is None:
            raise ValueError("click_id_dim > 0 needs the request's item ids")
        ids = np.asarray(ids, dtype=np.int64)
        bag = torch.from_numpy(self.click_bag[users].toarray().astype(np.float64))  # integer counts
        k_idx, t_idx = np.nonzero(np.asarray(labels) > 0)
        bag.index_put_((torch.as_tensor(k_idx), torch.as_tensor(self.click_bucket[ids[k_idx, t_idx]])),
                       torch.full((len(k_idx),), -1.0, dtype=torch.float64), accumulate=True)
        left_n = torch.as_tensor(self.click_count[users], dtype=torch.float64) - lab.double().sum(1)
        return torch.cat([words, (bag / self._click_scale(left_n)[:, None]).float()], 1)

    def _click_scale(self, n: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
        n = n.clamp_min(1.0) if isinstance(n, torch.Tensor) else np.maximum(n, 1.0)
        return n if self.click_norm == "mean" else n ** 0.5

    def describe(self) -> dict[str, Any]:
        return {"user_features": self.user_rule, "feature_clicks_removed": int(len(self.feature_pairs)),
                "vocabulary": len(self.vocab.trigrams), "hash_dim": self.vocab.hash_dim,
                "click_id_dim": 0 if self.click_bag is None else int(self.click_bag.shape[1]),
                "click_id_norm": self.click_norm if self.click_bag is not None else None}


def _concat(a: Interactions, users: np.ndarray, items: np.ndarray) -> Interactions:
    return Interactions(
        users=np.concatenate([a.users, users]), items=np.concatenate([a.items, items]),
        ratings=np.ones(len(a) + len(users), np.float32), timestamps=np.zeros(len(a) + len(users), np.int64),
        user_ids=a.user_ids, item_ids=a.item_ids, check_duplicates=False,
    )


def build_features(train: Interactions, source: str, config: TwoTowerConfig,
                   exclude: Interactions | None = None) -> TwoTowerData:
    """Apply the feature rules (module docstring) to ``train`` read from ``source``."""
    meta = None if source == "synthetic" else load_item_meta(source, train.item_ids)
    texts = item_texts(meta, train.item_ids)
    vocab = TrigramVocab.build(texts + public_field_texts(), config.hash_dim)
    demo = None
    if config.user_features in ("auto", "demographics") and source != "synthetic":
        demo = load_user_demographics(source, train.user_ids)
    if config.user_features == "demographics" and demo is None:
        raise ValueError(f"sttfedrec.user_features = 'demographics' but no u.user/users.dat lies beside {source}; "
                         "use 'auto' or 'clicks'")
    never = train if exclude is None else _concat(train, exclude.users, exclude.items)
    text_bytes = sum(len(t.encode()) for t in texts)
    clicks = sp.csr_matrix((np.ones(len(train)), (train.users, train.items)), shape=(train.n_users, train.n_items))
    count = np.bincount(train.users, minlength=train.n_users)
    if config.user_features == "history":
        item_x = vocab.bag(texts)
        user_x = sp.diags(1.0 / np.maximum(count, 1)) @ (clicks @ item_x)
        data = TwoTowerData(train, never, vocab, item_x, None, sp.csr_matrix(user_x, dtype=np.float32), None,
                            "history", np.zeros((0, 2), np.int64), text_bytes, count)
        return _add_click_ids(data, clicks, count, config)
    if demo is not None:
        user_texts, rest, pairs, rule = demographic_texts(demo), train, np.zeros((0, 2), np.int64), "demographics"
    else:
        user_texts, rest, pairs = first_click_features(train, texts, config.user_clicks)
        rule = "clicks"
    if config.tower == "dssm":
        item_x, item_len = vocab.bag(texts), None
        user_x, user_len = vocab.bag(user_texts), None
    else:
        item_x, item_len = vocab.words(texts, config.max_words)
        user_x, user_len = vocab.words(user_texts, config.max_words)
    data = TwoTowerData(rest, never, vocab, item_x, item_len, user_x, user_len, rule, pairs, text_bytes)
    return _add_click_ids(data, clicks, count, config)


def _add_click_ids(data: TwoTowerData, clicks: sp.csr_matrix, count: np.ndarray,
                   config: TwoTowerConfig) -> TwoTowerData:
    """Append the click-id bag (``click_id_dim`` columns) to the user inputs; a no-op at 0.

    ``clicks`` is ``[n_users, M]`` over all the user's training clicks (under the click rule the
    feature clicks too: they are never a label), ``count`` their number per user.
    """
    if not config.click_id_dim:
        return data
    if data.user_len is not None:
        raise ValueError("sttfedrec.click_id_dim is a DSSM input (found per-word CLSM user features)")
    b = config.click_id_dim
    bucket = hashed_ids(data.train.item_ids, b, config.click_id_salt)
    onehot = sp.csr_matrix((np.ones(len(bucket)), (np.arange(len(bucket)), bucket)), shape=(len(bucket), b))
    bag = sp.csr_matrix(clicks @ onehot)
    bag.sum_duplicates()
    data.click_bucket, data.click_bag, data.click_count, data.click_norm = bucket, bag, count, config.click_id_norm
    scaled = sp.diags(1.0 / data._click_scale(count.astype(np.float64))) @ bag
    data.user_x = sp.csr_matrix(sp.hstack([data.user_x, scaled]), dtype=np.float32)
    return data


def positive_lists(train: Interactions) -> tuple[np.ndarray, np.ndarray]:
    """``(items sorted by user, start offsets [n_users + 1])``."""
    order = np.argsort(train.users, kind="stable")
    start = np.concatenate([[0], np.cumsum(np.bincount(train.users, minlength=train.n_users))])
    return train.items[order], start


def _top_per_group(group: np.ndarray, n_groups: int, take: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Indices of a uniformly random ``take[g]`` members of each group (``group`` sorted)."""
    keys = rng.random(len(group))
    order = np.lexsort((keys, group))
    start = np.searchsorted(group[order], np.arange(n_groups))
    rank = np.arange(len(group)) - start[group[order]]
    return order[rank < take[group[order]]]


def sample_requests(users: np.ndarray, pos_items: np.ndarray, pos_start: np.ndarray, n_pos: int, n_neg: int,
                    never: Interactions, rng: np.random.Generator,
                    pool: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Obfuscated requests ``[len(users), T]`` and their click labels (module docstring).

    ``pool = (items sorted by user, offsets)`` draws the non-clicked ids from each user's fixed
    decoy pool instead of fresh from the catalogue.
    """
    k, T = len(users), n_pos + n_neg
    counts = pos_start[users + 1] - pos_start[users]
    slot = np.repeat(np.arange(k), counts)
    flat = np.concatenate([pos_items[pos_start[u]:pos_start[u + 1]] for u in users]) if k else np.zeros(0, np.int64)
    take = np.minimum(counts, n_pos)
    chosen = _top_per_group(slot, k, take, rng)
    chosen = chosen[np.lexsort((np.arange(len(chosen)), slot[chosen]))]
    need = T - take  # non-clicked ids per request
    if pool is None:
        sub = Interactions(users=users.astype(np.int64), items=pos_items[pos_start[users]].astype(np.int64),
                           ratings=np.ones(k, np.float32), timestamps=np.zeros(k, np.int64),
                           user_ids=never.user_ids, item_ids=never.item_ids, check_duplicates=False)
        _, neg = sample_train_negatives(sub, n_neg=int(need.max(initial=0)), rng=rng, exclude=never)
        neg = neg.reshape(k, -1)
        neg_flat = neg[np.arange(neg.shape[1])[None, :] < need[:, None]]
    else:
        p_items, p_start = pool
        pc = p_start[users + 1] - p_start[users]
        pslot = np.repeat(np.arange(k), pc)
        pflat = np.concatenate([p_items[p_start[u]:p_start[u + 1]] for u in users])
        if np.any(pc < need):
            raise ValueError("a decoy pool is smaller than the non-clicked ids a request needs; raise sttfedrec.pool_factor")
        pick = _top_per_group(pslot, k, need, rng)
        pick = pick[np.lexsort((np.arange(len(pick)), pslot[pick]))]
        neg_flat = pflat[pick]
    ids = np.empty((k, T), np.int64)
    labels = np.zeros((k, T), np.float32)
    pos_mask = np.arange(T)[None, :] < take[:, None]
    ids[pos_mask] = flat[chosen]
    ids[~pos_mask] = neg_flat
    labels[pos_mask] = 1.0
    perm = np.argsort(rng.random((k, T)), axis=1)
    return np.take_along_axis(ids, perm, 1), np.take_along_axis(labels, perm, 1)


def sample_requests_keyed(users: np.ndarray, pos_items: np.ndarray, pos_start: np.ndarray, n_pos: int, n_neg: int,
                          forbidden: np.ndarray, n_items: int, keys: np.ndarray,
                          pool: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`sample_requests` with each client's draws from its own stream (:mod:`recmodels.streams`).

    Row ``i`` (the request of ``users[i]``) depends only on that user's positives (and pool),
    ``forbidden`` and ``keys[i]``: a client drawing its request alone on its device draws exactly
    the row it draws batched with the cohort in one process. The composition is
    :func:`sample_requests`'s: ``min(clicks, n_pos)`` clicks without replacement, the rest
    non-clicked ids (uniform over the catalogue minus ``forbidden``, independently, or without
    replacement from the user's fixed pool), in a uniformly random order.

    Args:
        forbidden: sorted unique pair keys (:func:`recmodels.data.pair_keys`) never drawn as a
            non-clicked id (the users' training clicks, feature clicks and excluded ratings).
        keys: uint64 ``[len(users)]``, each client's stream for this round.
    """
    users = np.asarray(users, dtype=np.int64)
    keys = np.asarray(keys, dtype=np.uint64)
    k, T = len(users), n_pos + n_neg
    sub = stream_keys(keys[:, None], np.arange(3, dtype=np.int64)[None, :]).reshape(k, 3)  # clicks, decoys, order
    counts = pos_start[users + 1] - pos_start[users]
    take = np.minimum(counts, n_pos)
    need = T - take
    ids = np.empty((k, T), np.int64)
    labels = np.zeros((k, T), np.float32)
    if pool is None:
        neg_flat = sample_negatives_keyed(np.repeat(users, need), np.repeat(sub[:, 1], need),
                                          np.concatenate([np.arange(n) for n in need]) if k else np.zeros(0, np.int64),
                                          n_items=n_items, forbidden=forbidden)
        negs = np.split(neg_flat, np.cumsum(need)[:-1]) if k else []
    else:
        p_items, p_start = pool
        negs = []
        for r, u in enumerate(users):
            mine = p_items[p_start[u]:p_start[u + 1]]
            if len(mine) < need[r]:
                raise ValueError("a decoy pool is smaller than the non-clicked ids a request needs; raise "
                                 "sttfedrec.pool_factor")
            negs.append(mine[np.argsort(shuffle_keys(sub[r, 1], np.arange(len(mine))), kind="stable")[:need[r]]])
    for r, u in enumerate(users):
        mine = pos_items[pos_start[u]:pos_start[u + 1]]
        clicks = mine[np.argsort(shuffle_keys(sub[r, 0], np.arange(len(mine))), kind="stable")[:take[r]]]
        row = np.concatenate([clicks, negs[r]])
        lab = (np.arange(T) < take[r]).astype(np.float32)
        order = np.argsort(shuffle_keys(sub[r, 2], np.arange(T)), kind="stable")
        ids[r], labels[r] = row[order], lab[order]
    return ids, labels


def decoy_pools(train: Interactions, never: Interactions, n_pos: int, n_neg: int, factor: float,
                rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Each user's fixed, popularity-matched decoy pool (the request-intersection defense).

    Pool size ``ceil(factor * |history| * n_neg / n_pos)`` (at least ``T``), so that a decoy
    recurs across requests as often as a click does; decoys are drawn without replacement with
    probability proportional to the item's training popularity (plus one) among the items the
    user never interacted with, so the pool looks like the clicks to a popularity prior.
    """
    pop = np.bincount(train.items, minlength=train.n_items).astype(np.float64) + 1.0
    hist = np.bincount(train.users, minlength=train.n_users)
    size = np.maximum(np.ceil(factor * hist * n_neg / n_pos).astype(np.int64), n_pos + n_neg)  # a short history fills up
    size[hist == 0] = 0
    seen = sp.csr_matrix((np.ones(len(never)), (never.users, never.items)), shape=(never.n_users, never.n_items))
    items, start = [], [0]
    gumbel = -np.log(-np.log(rng.random((train.n_users, train.n_items))))  # Gumbel top-k: weighted, no replacement
    keys = np.log(pop)[None, :] + gumbel
    keys[seen.nonzero()] = -np.inf
    for u in range(train.n_users):
        s = int(min(size[u], np.isfinite(keys[u]).sum()))
        top = np.argpartition(-keys[u], s - 1)[:s] if s else np.zeros(0, np.int64)
        items.append(np.sort(top))
        start.append(start[-1] + s)
    return np.concatenate(items).astype(np.int64), np.asarray(start, np.int64)
