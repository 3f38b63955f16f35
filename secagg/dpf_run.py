"""The in-process simulation of the two-server DPF sum (:mod:`secagg.dpf_sum`): every party in one
process, every message crossing as wire bytes, the clients' key sets generated in batches.

**Batched key generation.** A device generates its own key sets (:meth:`DpfSumClient.upload_parts`:
one pass over its ``m`` trees per key set). A simulation of hundreds of devices would pay that
pass's fixed costs (a few dozen array operations per tree level, whatever ``m`` is) once per
device; :func:`upload_many` instead places every client's rows one client at a time (each with its
own CSPRNG decoys, sliced from one keystream per batch: :class:`Draws`) and generates a batch of
clients' key sets (about :data:`_BATCH_BYTES` of keys) together (:func:`secagg.dpf.gen_many`: whole
key sets of about 8K trees per pass), each tree with its own root seeds from the CSPRNG (AES-256-CTR
under a fresh ``os.urandom`` key for a large batch). The key sets are exactly those each client's own call would make from the same seeds (tested byte for
byte), and each client is refused, in the same words, exactly when its own call would refuse it. The
seconds a client is charged (``client_s``) are its own placement and encoding plus its share of the
batch (by key sets); what one device pays alone is measured by ``secagg bench dpf`` and reported in
docs/dpf.md.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from secagg.cuckoo import CuckooError, CuckooLayout
from secagg.dpf import KeySet, gen_many, keygen_prg_bytes, prg_bytes_per_key_set
from secagg.dpf_sum import DpfDense, DpfSumClient, DpfSumConfig, DpfSumServer, DpfUpload
from secagg.errors import AbortError, MessageError
from secagg.messages import INSTANCE_BYTES, kind_of
from secagg.prg import random_words

__all__ = ["DpfSpec", "DpfSumResult", "Draws", "run_dpf", "run_dpf_rows", "upload_many"]

_BATCH_BYTES = 16 << 20  #: key-set bytes generated in one call of :func:`upload_many` in :func:`run_dpf_rows` (2 MB gave passes of fewer trees than a pass holds; 16 MB with 8K-tree passes: a third less key-generation time at ML-100K's shape)


def upload_many(cfg: DpfSumConfig, ids: Sequence[int], updates: Sequence[tuple[np.ndarray, np.ndarray]], *,
                floor: int = 2) -> Iterator[tuple[list[tuple[bytes, bytes]] | Exception, float]]:
    """What each client ``ids[i]`` would send for ``updates[i] = (rows, values)`` through its own
    :meth:`DpfSumClient.upload_parts`, with every key set of the batch generated in one pass
    (:func:`secagg.dpf.gen_many`; see the module docstring).

    Yields:
        per client, in order, ``(its uploads, or the ValueError / CuckooError its own call raises;
        the seconds it is charged)``: its own placement and encoding, plus its share (by key sets) of
        the batch's key generation. A client's uploads are encoded when it is reached, so no more
        than one client's upload bytes exist beside the batch's keys.
    """
    clients = [DpfSumClient(cfg, i, floor=floor) for i in ids]
    plans: list[list | Exception | None] = []
    seconds = np.zeros(len(clients))
    words = Draws(cfg.layout.buckets * sum(_sets(cfg, rows) for rows, _ in updates))
    for c, (client, (rows, values)) in enumerate(zip(clients, updates)):
        t0 = time.perf_counter()
        try:
            plans.append(client.plan(rows, values, words=words))
        except (ValueError, CuckooError) as exc:
            plans.append(exc)
        seconds[c] = time.perf_counter() - t0
    todo = [c for c, p in enumerate(plans) if isinstance(p, list)]
    sets = [len(plans[c]) for c in todo]  # type: ignore[arg-type]
    keys: list[tuple[KeySet, KeySet]] = []
    if todo:
        t0 = time.perf_counter()
        keys = gen_many([a for c in todo for a, _ in plans[c]], cfg.layout.depth,  # type: ignore[union-attr]
                        [b for c in todo for _, b in plans[c]], check=cfg.check)  # type: ignore[union-attr]
        seconds[todo] += (time.perf_counter() - t0) * np.asarray(sets) / sum(sets)
    at = 0
    for c, (client, plan) in enumerate(zip(clients, plans)):
        t0 = time.perf_counter()
        if isinstance(plan, Exception):
            yield plan, float(seconds[c])
            continue
        if plan is None:
            sent = [client._dense(*updates[c])]
        else:
            sent = client.encode(keys[at:at + len(plan)])
            at += len(plan)
        yield sent, float(seconds[c] + time.perf_counter() - t0)


class Draws:
    """Fresh CSPRNG words for a batch of simulated clients' decoys (:meth:`CuckooLayout.spread`'s
    ``words``), each word handed out once: the AES-256-CTR keystream of a fresh ``os.urandom`` key
    (:func:`secagg.prg.random_words`), about ``n`` words per draw, sliced client by client, where each
    client's own call draws ``os.urandom`` (``getrandom`` gives about 0.28 GB/s here: 24 us per client's
    6.6 KB at ML-100K's shape, 0.02 s per round of 943 clients, against about 1 ms for the batch's
    keystream). Slices of one CSPRNG stream are independent uniform words, as separate draws are; the
    batch's root seeds are drawn the same way (:func:`secagg.dpf.gen_many`)."""

    def __init__(self, n: int) -> None:
        self._n = max(1, int(n))
        self._buf = np.empty(0, np.uint64)
        self._at = 0

    def __call__(self, k: int) -> np.ndarray:
        if self._at + k > self._buf.size:  # the rest is dropped: no word is handed out twice
            self._buf = random_words(max(k, self._n), label=b"secagg/cuckoo/decoys")
            self._at = 0
        out = self._buf[self._at:self._at + k]
        self._at += k
        return out


def _sets(cfg: DpfSumConfig, rows: np.ndarray) -> int:
    """Key sets an update of these rows needs (an estimate for batching; :meth:`DpfSumClient.plan` decides)."""
    return cfg.max_parts if cfg.pad_parts else max(1, min(cfg.max_parts, -(-np.size(rows) // cfg.points)))


@dataclass(frozen=True)
class DpfSpec:
    """What :func:`run_dpf` simulates.

    Attributes:
        rows, width: the table shape ``N x d`` (inputs are ``uint64 [n, N * d]``).
        points: ``P``, rows a client may declare (more nonzero rows: that client is refused).
        round: the round number.
        min_survivors: every client's floor.
        dropouts: ``"A"`` / ``"B"`` / ``"upload"`` -> client indices whose upload to that server
            (both, for ``"upload"``) is lost.
        seed: the layout's public seed (``None``: zeros).
        check: verify the keys.
        failure_bits: the cuckoo failure target (buckets from :func:`secagg.cuckoo.buckets_for`).
        tamper: ``client -> (key_A, key_B) -> (key_A, key_B)`` replacing a client's keys (tests of
            malicious clients), applied to the parsed key sets before encoding (every part's).
        max_parts, pad_parts, dense_above: as :class:`DpfSumConfig`'s (a client with more than
            ``points`` rows sends several key sets, or above ``dense_above`` of them a dense share).
        keep_messages: ``records`` hold every message's bytes; ``False``: each upload's size (an int) in
            place of its bytes, so no client's upload outlives the sum (the servers' key sets are
            read-only views of the upload bytes while it runs).
    """

    rows: int
    width: int
    points: int
    round: int = 0
    min_survivors: int = 2
    dropouts: Mapping[str, frozenset[int]] = field(default_factory=dict)
    seed: bytes | None = None
    check: bool = True
    failure_bits: int = 40
    tamper: Mapping[int, object] = field(default_factory=dict)
    max_parts: int = 1
    pad_parts: bool = False
    dense_above: int = 0
    keep_messages: bool = True


@dataclass(frozen=True)
class DpfSumResult:
    """Outcome and costs of one simulated two-server sum.

    Attributes:
        total: ``uint64 [N * d]`` sum over ``survivors`` (``None`` after an abort, reason in ``abort``).
        survivors: clients in the sum; refused: ``client -> reason`` (bad rows, placement failure,
            failed check).
        client_s: seconds per client: its placement and encoding, plus its share of its batch's key
            generation (:func:`upload_many`).
        server_s: seconds at A and at B (everything after the uploads, including the check).
        bytes_up: ``[n, 2]`` bytes each client sent to A and to B.
        parts: ``[n]`` key sets each client sent (0: refused before sending or dense).
        records: ``(sender, receiver, stage, blob)`` for every message, in order; parties ``"A"``,
            ``"B"`` or a client index (an upload's ``blob`` is its size without ``keep_messages``).
        prg_bytes: the AES-128 output bytes A and B expanded to evaluate the survivors' key sets
            (:func:`secagg.dpf.prg_bytes_per_key_set` each); dense_bytes: the AES-256-CTR bytes each expanded
            from dense shares' seeds; hashed_bytes: the SHA-256 input of each server's public digests of
            the key sets (with the check); client_prg_bytes: the AES-128 output bytes every client together
            computed to generate its key sets (:func:`secagg.dpf.keygen_prg_bytes` each);
            client_dense_bytes: the AES-256-CTR bytes the dense clients expanded for their shares. The priced
            cryptographic work of the sum (``secagg bench secure``).
    """

    total: np.ndarray | None
    survivors: frozenset[int]
    refused: dict[int, str]
    abort: str | None
    client_s: np.ndarray
    server_s: tuple[float, float]
    bytes_up: np.ndarray
    records: list[tuple[object, object, str, bytes]]
    buckets: int = 0
    parts: np.ndarray | None = None
    prg_bytes: tuple[int, int] = (0, 0)
    dense_bytes: tuple[int, int] = (0, 0)
    hashed_bytes: tuple[int, int] = (0, 0)
    client_prg_bytes: int = 0
    client_dense_bytes: int = 0


def _split_rows(x: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    table = x.reshape(-1, width)
    rows = np.flatnonzero(table.any(axis=1))
    return rows, table[rows]


def run_dpf(inputs: np.ndarray, spec: DpfSpec) -> DpfSumResult:
    """Simulate one two-server sum over ``inputs`` (``uint64 [n, N * d]``, client ``i`` in row ``i``).

    A client whose update has more than ``max_parts x points`` nonzero rows, or whose rows cannot be
    placed, is refused (listed in ``refused``) and sends nothing. Every message crosses as wire bytes.
    """
    x = np.asarray(inputs)
    if x.dtype != np.uint64 or x.ndim != 2 or x.shape[1] != spec.rows * spec.width:
        raise ValueError(f"inputs must be uint64 [n, {spec.rows} x {spec.width}]; found {x.dtype} {x.shape}")
    return run_dpf_rows([_split_rows(row, spec.width) for row in x], spec)


def run_dpf_rows(updates: list[tuple[np.ndarray, np.ndarray]], spec: DpfSpec) -> DpfSumResult:
    """:func:`run_dpf` on sparse updates: ``updates[i] = (rows int64 [k_i], values uint64 [k_i, d])``,
    client ``i``'s nonzero rows (distinct, below ``spec.rows``) and their values; ``total`` is
    ``uint64 [N * d]``. The clients' work is proportional to their rows, not to the table."""
    n = len(updates)
    layout = CuckooLayout.for_points(spec.rows, spec.points, seed=spec.seed or bytes(32),
                                     failure_bits=spec.failure_bits)
    cfg = DpfSumConfig(n, layout, spec.width, spec.points, os.urandom(INSTANCE_BYTES), spec.round, spec.check,
                       max_parts=spec.max_parts, pad_parts=spec.pad_parts, dense_above=spec.dense_above)
    servers = (DpfSumServer(cfg, 0), DpfSumServer(cfg, 1))
    records: list[tuple[object, object, str, bytes]] = []
    refused: dict[int, str] = {}
    client_s = np.zeros(n)
    bytes_up = np.zeros((n, 2), np.int64)
    parts = np.zeros(n, np.int64)
    lost = {name: set(spec.dropouts.get(name, ())) for name in ("A", "B")}
    for name in spec.dropouts:
        if name not in ("A", "B", "upload"):
            raise ValueError(f"unknown dropout stage {name!r}; use 'A', 'B' or 'upload'")
    for i in spec.dropouts.get("upload", ()):
        lost["A"].add(i)
        lost["B"].add(i)
    dense_clients = 0  # clients that expanded a dense share (whether or not it arrived)
    per_batch = max(1, _BATCH_BYTES // cfg.key_bytes())  # key sets generated together (a few MB: the batch's keys stay small)
    lo = 0
    while lo < n:
        hi, sets = lo, 0
        while hi < n and (hi == lo or sets + _sets(cfg, updates[hi][0]) <= per_batch):
            sets += _sets(cfg, updates[hi][0])
            hi += 1
        made = upload_many(cfg, range(lo, hi), updates[lo:hi], floor=spec.min_survivors)
        for i, (sent, seconds) in zip(range(lo, hi), made):
            if isinstance(sent, Exception):
                refused[i] = str(sent)
                continue
            t0 = time.perf_counter()
            made_dense = not parts_of(sent)
            if i in spec.tamper and not made_dense:
                sent = [_tampered(cfg, blobs, spec.tamper[i]) for blobs in sent]
            client_s[i] = seconds + time.perf_counter() - t0
            dense_clients += made_dense
            parts[i] = 0 if made_dense else len(sent)
            for blobs in sent:
                for b, name in enumerate(("A", "B")):
                    if i in lost[name]:
                        continue
                    records.append((i, name, "upload", blobs[b] if spec.keep_messages else len(blobs[b])))
                    bytes_up[i, b] += len(blobs[b])
                    try:
                        servers[b].receive(blobs[b])
                    except MessageError as exc:
                        refused[i] = f"server {name}: {exc}"
        lo = hi
    timers = [0.0, 0.0]

    def timed(b: int, fn, *args):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        out = fn(*args)
        timers[b] += time.perf_counter() - t0
        return out

    ids = [timed(b, servers[b].received) for b in (0, 1)]
    records += [("A", "B", "ids", ids[0]), ("B", "A", "ids", ids[1])]
    timed(0, servers[0].agree, ids[1])
    timed(1, servers[1].agree, ids[0])
    chal = timed(0, servers[0].draw_challenge)
    records.append(("A", "B", "challenge", chal))
    timed(1, servers[1].take_challenge, chal)
    digests = [timed(b, servers[b].evaluate) for b in (0, 1)]
    sets = [sum(srv.declared[c] for c in srv.survivors or () if c not in srv.dense) for srv in servers]
    prg = tuple(prg_bytes_per_key_set(cfg.forest, cfg.width, cfg.check) * x for x in sets)
    public = KeySet.public_size(depth=layout.depth, points=layout.buckets, width=cfg.width) if cfg.check else 0
    hashed = tuple(public * x for x in sets)  # each key set's public digest (the check's one-function test)
    # a dense share's seed is expanded (AES-256-CTR) by the server that received the seed, not the vector
    dense = tuple(8 * cfg.layout.domain * cfg.width * sum(1 for c in srv.survivors or () if c in srv.dense and srv.dense[c].seed)
                  for srv in servers)
    records += [("A", "B", "digests", digests[0]), ("B", "A", "digests", digests[1])]
    for b in (0, 1):
        for c in timed(b, servers[b].reconcile, digests[1 - b]):
            refused[c] = "its key sets failed the check (not point functions, or different for A and B)"
    total, abort = None, None
    try:
        share = timed(1, servers[1].share)
        records.append(("B", "A", "share", share))
        total = timed(0, servers[0].combine, share).reshape(-1)
    except AbortError as exc:
        abort = str(exc)
    return DpfSumResult(total, frozenset(servers[0].survivors or ()), refused, abort, client_s,
                        (timers[0], timers[1]), bytes_up, records, layout.buckets, parts, prg, dense, hashed,
                        keygen_prg_bytes(depth=layout.depth, points=layout.buckets, width=cfg.width, check=cfg.check)
                        * int(parts.sum()), 8 * cfg.layout.domain * cfg.width * dense_clients)


def parts_of(sent: list[tuple[bytes, bytes]]) -> bool:
    """Whether a client's uploads are key sets (not a dense share): the kind in the header of its own
    upload to B (the servers parse every upload in full)."""
    return kind_of(sent[0][1]) != DpfDense.KIND


def _tampered(cfg: DpfSumConfig, blobs: tuple[bytes, bytes], fn) -> tuple[bytes, bytes]:  # noqa: ANN001
    """Re-encode a client's uploads after ``fn`` replaced its parsed key sets (malicious-client tests)."""
    msgs = [DpfUpload.from_bytes(b) for b in blobs]
    keys = fn(*(KeySet.from_bytes(m.key) for m in msgs))
    return tuple(DpfUpload(m.instance, m.round, m.sender, m.receiver, floor=m.floor, key=k.to_bytes(),
                           part=m.part, parts=m.parts).to_bytes()
                 for m, k in zip(msgs, keys))  # type: ignore[return-value]
