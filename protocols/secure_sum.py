"""One entry point for every protocol that sums client vectors through secure aggregation.

``secure_sum(values, ...)`` clips-checks, fixed-point encodes (Z_2^64, deterministic nearest
rounding so runs stay reproducible from their seed), runs one of :mod:`secagg.runner`'s
protocols (``"secagg"``, ``"secagg+"``, ``"chain"``, or ``"plain"`` for an unmasked sum
through the same wire format), records every message in the protocol's transcript (the masked
upload as the server received it, when the transcript keeps payloads) and returns the decoded
sum over the clients that survived. An abort raises :class:`SecureSumAborted` (never a wrong sum).

Promise (what the receiving server learns): only the sum over the survivors (see docs/secagg.md
and docs/chain.md for each protocol's collusion limits); the values must fit
``|v| <= value_clip`` and ``clients x value_clip x 2^frac_bits < 2^63`` (checked; the error
names the key to change).

``"dpf"`` (:data:`TWO_SERVER_PROTOCOLS`) sums sparse row updates through two servers that do not
collude (:mod:`secagg.dpf_sum`): the vector is a table of ``width / row_width`` rows, each client
nonzero on at most ``points`` of them; it sends one DPF key set to ``receiver`` and one to
``receiver2`` (both recorded in the transcript under ``kind``), the servers' own messages are
recorded as ``"dpf:<stage>"`` between them, and ``receiver`` learns the sum. Adversary: each server
honest-but-curious, the two not colluding (together they read every input); dropouts cost nothing
(``dropouts`` stages ``"A"``/``"B"``/``"upload"``: the upload to ``receiver``, to ``receiver2``, to
both is lost); ``min_survivors`` is every client's floor, which ``receiver2`` enforces before it
releases its share.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from protocols.transport import SERVER, InProcessTransport
from secagg import params
from secagg.bonawitz import MaskedInput
from secagg.dpf_run import DpfSpec, run_dpf_rows
from secagg.dpf_sum import distinct_in
from secagg.encoding import FixedPoint, check_budget, choose_ring_bits
from secagg.errors import BudgetError
from secagg.reuse_sim import ReuseSession
from secagg.runner import PROTOCOLS, EncodedRows, RunSpec

__all__ = ["SECURE_PROTOCOLS", "TWO_SERVER_PROTOCOLS", "RowStack", "SecureSumAborted", "SecureSumResult", "SparseRows",
           "observe", "secure_row_sum",
           "secure_sum", "small_cohort_protocol"]

#: Names accepted by :func:`secure_sum` (``"none"`` is the caller's plaintext path).
SECURE_PROTOCOLS = ("secagg", "secagg+", "chain", "plain")
#: Names accepted by :func:`secure_sum` that need a second server (``receiver2``) and sparse rows.
TWO_SERVER_PROTOCOLS = ("dpf",)
#: The second server's default party name for a two-server sum.
SERVER2 = "server2"

_OBSERVERS: list[Callable[[dict], None]] = []
#: values per block when range-checking the clients' vectors
_CHECK_VALUES = 1 << 18


def _largest_magnitude(vals: np.ndarray) -> float:
    """``max |v|`` over ``vals`` (NaN or inf if any value is not finite), in blocks of rows so that
    no ``n x dim`` temporary is made."""
    rows = max(1, _CHECK_VALUES // max(vals.shape[1], 1))
    big = 0.0
    for lo in range(0, vals.shape[0], rows):
        top = float(np.abs(vals[lo : lo + rows]).max(initial=0.0))
        if not top <= big:  # larger, or NaN
            big = top
            if not np.isfinite(big):
                return big
    return big


class RowStack:
    """The rows of an ``n x dim`` float matrix held as the ``n`` separate vectors they already are, or
    built one at a time when asked (:meth:`lazy`).

    An exchange receives every client's vector separately; stacking them for :func:`secure_sum` would
    hold a second ``n x dim`` copy at the round's peak (1.6 GB for LightFR's union rows on
    ml-latest-small). A dense update built from a client's few touched rows need not exist before its
    client masks it (FedAvg-GMF's 610 x 311,202 float64 updates on ml-latest-small are 1.5 GB).
    ``rows[i]`` is row ``i``, ``rows[a:b]`` a stacked block; ``shape`` and ``ndim`` are the matrix's.
    SecAgg/SecAgg+ encode one row at a time from it; the others a block of rows at a time (:func:`_encode_rows`).
    """

    ndim = 2

    def __init__(self, rows: Sequence[np.ndarray]) -> None:
        held = [np.asarray(r, dtype=np.float64) for r in rows]
        widths = {r.shape for r in held}
        if len(widths) > 1 or any(r.ndim != 1 for r in held):
            raise ValueError("RowStack needs 1-D rows of one length")
        self.shape = (len(held), held[0].shape[0] if held else 0)
        self._row = held.__getitem__

    @classmethod
    def lazy(cls, n: int, width: int, row: Callable[[int], np.ndarray]) -> "RowStack":
        """``n`` rows of ``width`` float64 values, row ``i`` built by ``row(i)`` each time it is asked for
        (so it must be a pure function of ``i``); a row of another shape raises."""
        self = cls.__new__(cls)
        self.shape = (int(n), int(width))

        def checked(i: int) -> np.ndarray:
            out = np.asarray(row(i), dtype=np.float64)
            if out.shape != (self.shape[1],):
                raise ValueError(f"RowStack.lazy: row {i} has shape {out.shape}, expected ({self.shape[1]},)")
            return out

        self._row = checked
        return self

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, i):  # noqa: ANN001, ANN204
        if isinstance(i, slice):
            idx = range(*i.indices(self.shape[0]))
            return np.stack([self._row(j) for j in idx]) if len(idx) else np.zeros((0, self.shape[1]))
        if not -self.shape[0] <= i < self.shape[0]:
            raise IndexError(f"row {i} of {self.shape[0]}")
        return self._row(i % self.shape[0] if self.shape[0] else i)

    def stacked(self) -> np.ndarray:
        return self[:]


def _encode_rows(vals, codec: FixedPoint) -> np.ndarray:  # noqa: ANN001 (float matrix or RowStack)
    """The fixed-point ``uint64 [n, dim]`` of ``vals``, encoded a block of rows at a time into one array:
    no stacked float copy and no ``n x dim`` temporaries of the encoder (the chain's 50 x 960,429 on
    ml-latest-small: 0.4 GB each, three at once)."""
    out = np.empty(vals.shape, dtype=np.uint64)
    rows = max(1, _CHECK_VALUES // max(vals.shape[1], 1))
    for lo in range(0, vals.shape[0], rows):
        out[lo : lo + rows] = codec.encode(vals[lo : lo + rows], rounding="nearest")
    return out


class _SizesOnly(list):
    """A runner's message record that keeps ``(stage, sender, size)`` instead of the wire bytes."""

    def append(self, item: tuple) -> None:  # type: ignore[override]
        stage, sender, blob = item
        super().append((stage, sender, len(blob)))


@contextlib.contextmanager
def observe(callback: Callable[[dict], None]) -> Iterator[None]:
    """Call ``callback(instance)`` after every masking, chain or two-server DPF instance :func:`secure_sum`
    or :func:`secure_row_sum` runs inside the block (``secagg bench secure`` uses it to price each
    masking instance against its cryptographic bound; the run loop adds each client's seconds to its
    device time). A ``"dpf"`` instance has ``k`` and ``t`` ``None`` and no masks, agreements or
    signatures; its ``client_seconds`` are each client's key generation, and ``prg_bytes``,
    ``dense_bytes`` and ``hashed_bytes`` the AES and SHA-256 bytes its two servers processed (:class:`secagg.dpf_run.DpfSumResult`, what
    :func:`secagg.costmodel.instance_cost` prices). ``instance`` holds public parameters and costs only: ``protocol``, ``n``, ``dim``, ``k``
    (neighbours; the chain's successors), ``t``, ``survivors``, ``senders`` (party names),
    ``client_seconds`` (list), ``server_seconds``, ``masks_expanded``, ``key_agreements`` and
    ``signatures_verified`` (the server's), ``aborted``, ``reuse`` (the instance ran in a setup reused
    across the round's sums, :mod:`secagg.reuse`) and ``setup`` (it paid that setup: the first of them,
    or any instance outside such a setup); masking instances also ``survivor_senders`` (the names of
    ``survivors``) and ``dropout`` (the planned dropout its clients accept), what decides whether a later
    sum could run in its setup (:meth:`secagg.reuse_sim.ReuseSession.check_cohort`)."""
    _OBSERVERS.append(callback)
    try:
        yield
    finally:
        _OBSERVERS.remove(callback)


def _notify(protocol: str, senders: Sequence[str], dim: int, res, session=None,  # noqa: ANN001
            dropout: float | None = None) -> None:
    if not _OBSERVERS:
        return
    reuse = {"reuse": session is not None, "setup": session is None or session.last_ran_setup}
    info = {**reuse, "protocol": protocol, "n": len(senders), "dim": int(dim), "k": res.k, "t": res.t,
            "survivors": len(res.survivors), "senders": list(senders),
            "survivor_senders": [senders[j] for j in sorted(res.survivors)], "dropout": dropout,
            "client_seconds": [float(x) for x in res.client_s], "server_seconds": float(res.server_s),
            "masks_expanded": int(res.masks_expanded), "key_agreements": int(res.key_agreements),
            "signatures_verified": int(res.signatures_verified), "aborted": res.total is None}
    for callback in list(_OBSERVERS):
        callback(info)


class SecureSumAborted(RuntimeError):
    """Secure aggregation aborted (too many dropouts, a failed check): no sum was produced."""


@dataclass(frozen=True)
class SecureSumResult:
    """The decoded sum and its costs.

    Attributes:
        total: float64 ``[dim]``, the sum over the survivors (up to ``2^-frac_bits`` per value).
        survivors: sorted indices (into the ``senders`` given) whose inputs are in the sum.
        bytes_sent: bytes each sender sent (0 for one that dropped before sending).
        bytes_server_sent: bytes the server sent in total (broadcasts and relayed shares).
        client_seconds: seconds of protocol work per sender.
        server_seconds: seconds of protocol work at the server.
    """

    total: np.ndarray
    survivors: np.ndarray
    bytes_sent: np.ndarray
    bytes_server_sent: int
    client_seconds: np.ndarray
    server_seconds: float

    @property
    def bytes_per_client(self) -> float:
        """Mean bytes a client sent plus its share of what the server sent."""
        n = len(self.bytes_sent)
        return float(self.bytes_sent.mean() + self.bytes_server_sent / max(n, 1))


def small_cohort_protocol(protocol: str, n: int, *, dropout: float | None, corrupt: float | None,
                          k: int | None = None, t: int | None = None) -> str:
    """The protocol to run for ``n`` clients: SecAgg+ (with chosen ``k``, ``t``) over too few clients
    for any graph to meet its abort target runs as SecAgg, the complete graph with its safe ``t``,
    whenever that graph meets the security target (the abort target is liveness only: such a sum
    tolerates fewer dropouts than planned, and aborts rather than release less). A cluster's sum of
    two clients (FedFast) is the case: one planned dropout of two leaves nothing to release."""
    if protocol != "secagg+" or k is not None or t is not None or n < 2:
        return protocol
    drop = params.DEFAULT_DROPOUT if dropout is None else dropout
    bad = params.DEFAULT_CORRUPT if corrupt is None else corrupt
    try:
        params.choose(n, dropout=drop, corrupt=bad)
        return protocol
    except ValueError:
        full = params.evaluate(n, n - 1, params.min_safe_threshold(n), dropout=drop, corrupt=bad)
        return "secagg" if full.security <= 2.0 ** -params.SECURITY_EXPONENT else protocol


def secure_sum(
    values: np.ndarray,
    *,
    protocol: str,
    frac_bits: int,
    value_clip: float,
    round: int,
    transport: InProcessTransport,
    senders: Sequence[str],
    kind: str = "update",
    receiver: str = SERVER,
    k: int | None = None,
    t: int | None = None,
    dropouts: Mapping[str, frozenset[int]] | None = None,
    where: str = "value_clip",
    dropout: float | None = None,
    corrupt: float | None = None,
    unsafe_threshold: bool = False,
    min_survivors: int = 2,
    row_width: int | None = None,
    points: int | None = None,
    receiver2: str = SERVER2,
    max_parts: int = 1,
    pad_parts: bool = False,
    session: ReuseSession | None = None,
) -> SecureSumResult:
    """Sum the rows of ``values`` (one per sender) through ``protocol``; see the module docstring.

    Args:
        values: float ``[n, dim]``, row ``i`` is ``senders[i]``'s vector, or the rows as a :class:`RowStack`;
            ``"dpf"`` also takes :class:`SparseRows` (a client's touched rows instead of its vector).
        protocol: one of :data:`SECURE_PROTOCOLS`.
        frac_bits, value_clip: the fixed-point encoding and the largest ``|value|`` allowed.
        round: the protocol round (bound into every message).
        transport: where the messages are recorded (kind ``kind`` for the masked upload,
            ``"secagg:<stage>"`` for the others, ``"secagg:server"`` for the server's sends).
        senders: party names of the rows, e.g. ``client(u)``.
        k, t: protocol parameters (``None``: the protocol's defaults).
        dropouts: stage -> set of row indices that drop before sending that stage.
        where: the configuration key named when a value exceeds ``value_clip``.
        dropout, corrupt: the dropout and colluding fractions SecAgg+ chooses ``k`` and ``t`` for
            (:func:`secagg.params.choose`; ``None``: the runner's defaults). ``dropout`` (or, when
            ``None``, the fraction ``dropouts`` lists) is also every simulated client's own
            ``max_dropout`` (:class:`secagg.bonawitz.ClientPolicy`, SecAgg and SecAgg+): a round
            that loses more than ``ceil(dropout * n)`` clients before their masked input aborts
            (:class:`SecureSumAborted`) instead of unmasking a sum over fewer clients than planned.
        unsafe_threshold: accept ``t`` at or below half of a client's holders (attack demos only).
        min_survivors: the clients' own minimum (:class:`secagg.bonawitz.ClientPolicy`, the chain's
            ``min_survivors``): no client helps unmask a sum over fewer survivors, so such a round
            aborts (:class:`SecureSumAborted`) before the server can decode anything.
        row_width, points, receiver2: ``"dpf"`` only: words per row, the rows of one key set, and
            the second server's party name.
        max_parts, pad_parts: ``"dpf"`` only: a client touches at most ``points x max_parts`` rows
            (more: refused in words), in ``ceil(rows / points)`` key sets whose count both servers
            see, or exactly ``max_parts`` with ``pad_parts``.
    """
    if protocol in TWO_SERVER_PROTOCOLS:
        return _two_server_sum(values, frac_bits=frac_bits, value_clip=value_clip, round=round, transport=transport,
                               senders=senders, kind=kind, receiver=receiver, receiver2=receiver2,
                               dropouts=dropouts, where=where, min_survivors=min_survivors, row_width=row_width,
                               points=points, max_parts=max_parts, pad_parts=pad_parts)
    if protocol not in SECURE_PROTOCOLS:
        raise ValueError(f"secure aggregation must be one of {SECURE_PROTOCOLS}; found {protocol!r}")
    vals = values if isinstance(values, RowStack) else np.asarray(values, dtype=np.float64)
    if vals.ndim != 2 or vals.shape[0] != len(senders):
        raise ValueError(f"values must be [n senders, dim]; found {vals.shape} for {len(senders)} senders")
    big = _largest_magnitude(vals)
    if not np.isfinite(big):
        raise ValueError(f"round {round}: a client's vector holds a non-finite value; nothing was aggregated")
    if big > value_clip:
        raise ValueError(
            f"round {round}: a client's vector holds {big:.4g}, above {where}={value_clip:g}; raise {where} "
            "(and check the bit budget) or lower the learning rate"
        )
    check_budget(n_summands=max(vals.shape[0], 1), clip=value_clip, frac_bits=frac_bits)
    codec = FixedPoint(frac_bits, value_clip)
    keep = bool(transport.transcript.keep_payloads)
    # without kept payloads only each message's size is recorded: holding every masked input until the
    # instance ends would cost clients x dim x 8 bytes more at the peak
    record: list = [] if keep else _SizesOnly()
    extra = {} if corrupt is None else {"corrupt": corrupt}
    spec = RunSpec(k=k, t=t, dropouts=dict(dropouts or {}), round=round, dropout=dropout,
                   unsafe_threshold=unsafe_threshold, min_survivors=min_survivors, **extra)
    if vals.shape[0] >= 2:
        protocol = small_cohort_protocol(protocol, vals.shape[0], dropout=spec.planned_dropout(vals.shape[0]),
                                         corrupt=spec.corrupt, k=k, t=t)
    runner = PROTOCOLS[protocol]
    if protocol == "chain":  # Z_2^32 when the public budget proves the sum fits (half the bytes), else Z_2^64
        spec = replace(spec, ring_bits=choose_ring_bits(
            n_summands=max(vals.shape[0], 1), clip=value_clip, frac_bits=frac_bits))
    if protocol not in ("secagg", "secagg+"):
        session = None
    if session is not None:  # the next instance of the round's one key setup
        if session.cfg is None:
            session.protocol = protocol
        protocol = session.protocol
        encoded = EncodedRows(vals, lambda row: codec.encode(row, rounding="nearest"))
        res = session.run(encoded, spec, names=list(senders), record=record)
    elif protocol in ("secagg", "secagg+"):  # each simulated client encodes its own row when it masks it
        encoded = EncodedRows(vals, lambda row: codec.encode(row, rounding="nearest"))
        res = runner(encoded, spec, record=record)
    else:
        res = runner(_encode_rows(vals, codec), spec)
    _notify(protocol, senders, vals.shape[1], res, session, dropout=spec.planned_dropout(vals.shape[0]))
    if record:
        for stage, sender, blob in record:
            nbytes = blob if isinstance(blob, int) else len(blob)
            if stage == "masked_input":
                payload = MaskedInput.from_bytes(blob).y if keep else None
                transport.send(senders[sender], receiver, round, kind, payload, nbytes)
            else:
                transport.send(senders[sender], receiver, round, f"secagg:{stage}", None, nbytes)
    else:  # runners without a message record: sizes per sender
        for i, nbytes in enumerate(res.bytes_sent):
            if nbytes:
                transport.send(senders[i], receiver, round, kind, None, int(nbytes))
    n = len(senders)
    for name in senders:  # the server's sends, apportioned evenly over the clients
        transport.send(receiver, name, round, f"{protocol}:server", None, res.bytes_server_sent // max(n, 1))
    if res.total is None:
        raise SecureSumAborted(f"{protocol} aborted in round {round}: {res.abort}")
    return SecureSumResult(
        total=codec.decode(res.total),
        survivors=np.array(sorted(res.survivors), dtype=np.int64),
        bytes_sent=np.asarray(res.bytes_sent),
        bytes_server_sent=int(res.bytes_server_sent),
        client_seconds=np.asarray(res.client_s),
        server_seconds=float(res.server_s),
    )


def _client_table_rows(update, n_rows: int, row_width: int, who: str) -> tuple[np.ndarray, np.ndarray]:
    """One client's ``"dpf"`` update as ``(rows, values)``: its rows holding a nonzero (or non-finite)
    value, ascending, and those rows (float64 ``[k, row_width]``). ``update`` is its dense vector
    (``[n_rows * row_width]``) or already ``(rows, values)`` (:class:`SparseRows`)."""
    if isinstance(update, tuple):
        rows, vals = np.asarray(update[0]), np.asarray(update[1], dtype=np.float64)
        if rows.ndim != 1 or rows.dtype.kind not in "iu" or vals.shape != (rows.size, row_width):
            raise ValueError(f"dpf: {who}'s rows must be int [k] with values [k, {row_width}]; found "
                             f"{rows.dtype} {rows.shape} and {vals.shape}")
        rows = rows.astype(np.int64)
        if not distinct_in(rows, n_rows):
            raise ValueError(f"dpf: {who}'s rows must be distinct and in [0, {n_rows})")
        order = np.argsort(rows, kind="stable")  # ascending, as the dense vector's rows are
        rows, vals = rows[order], vals[order]
        keep = np.flatnonzero(vals.any(axis=1))  # a zero row adds nothing and is not sent (as from a dense vector)
        return rows[keep], vals[keep]
    table = np.asarray(update, dtype=np.float64).reshape(n_rows, row_width)
    rows = np.flatnonzero(table.any(axis=1))
    return rows, table[rows]


class SparseRows:
    """The ``"dpf"`` clients' updates as each sends them: client ``i``'s dense vector, or its touched rows
    ``(rows int [k], values float [k, row_width])`` with no dense vector at all; ``shape`` is the dense
    ``n x width`` matrix's. :func:`secure_sum` handles one client's rows at a time from it, so neither
    the cohort's dense matrix nor its fixed-point copy exists (LightFR's 366 x 632,125 on ml-latest-small:
    1.9 GB each)."""

    ndim = 2

    def __init__(self, updates: Sequence, width: int) -> None:
        self._updates = list(updates)
        self.shape = (len(self._updates), int(width))

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, i: int):  # noqa: ANN204
        return self._updates[i]


def _two_server_sum(values, *, frac_bits: int, value_clip: float, round: int,  # noqa: ANN001
                    transport: InProcessTransport, senders: Sequence[str], kind: str, receiver: str, receiver2: str,
                    dropouts: Mapping[str, frozenset[int]] | None, where: str, min_survivors: int,
                    row_width: int | None, points: int | None, max_parts: int = 1,
                    pad_parts: bool = False) -> SecureSumResult:
    """``secure_sum`` for ``"dpf"`` (see the module docstring): one client's nonzero rows at a time, never
    an ``n x width`` array (``values``: a float matrix, :class:`RowStack` or :class:`SparseRows`)."""
    vals = values if isinstance(values, (RowStack, SparseRows)) else np.asarray(values, dtype=np.float64)
    if vals.ndim != 2 or vals.shape[0] != len(senders):
        raise ValueError(f"values must be [n senders, dim]; found {vals.shape} for {len(senders)} senders")
    if type(row_width) is not int or row_width < 1 or vals.shape[1] % row_width:
        raise ValueError(f"dpf: row_width must be a positive int dividing the width {vals.shape[1]}; found {row_width!r}")
    if type(points) is not int or points < 1:
        raise ValueError(f"dpf: points (the rows a client may touch) must be a positive int; found {points!r}")
    if receiver == receiver2:
        raise ValueError(f"dpf: the two servers need two names; both are {receiver!r}")
    rows = vals.shape[1] // row_width
    sparse = [_client_table_rows(vals[i], rows, row_width, senders[i]) for i in range(len(senders))]
    if not all(np.all(np.isfinite(v)) for _, v in sparse):
        raise ValueError(f"round {round}: a client's vector holds a non-finite value; nothing was aggregated")
    big = max((float(np.abs(v).max(initial=0.0)) for _, v in sparse), default=0.0)
    if big > value_clip:
        raise ValueError(f"round {round}: a client's vector holds {big:.4g}, above {where}={value_clip:g}; raise {where} "
                         "(and check the bit budget) or lower the learning rate")
    check_budget(n_summands=max(vals.shape[0], 1), clip=value_clip, frac_bits=frac_bits)
    codec = FixedPoint(frac_bits, value_clip)
    updates = []
    for i, (r, v) in enumerate(sparse):  # a row whose values all encode to 0 is not sent
        enc = codec.encode(v, rounding="nearest")
        nz = np.flatnonzero(enc.any(axis=1))
        updates.append((r[nz], enc[nz]))
        sparse[i] = None  # the client's float rows are done with
    touched = max((len(r) for r, _ in updates), default=0)
    if touched > points * max_parts:
        raise ValueError(f"round {round}: a client's update touches {touched} rows, above "
                         f"points={points}" + (f" x max_parts={max_parts}" if max_parts > 1 else "")
                         + "; raise points (every client's key set grows with it)")
    return _run_rows(updates, codec, rows=rows, row_width=row_width,
                     points=points, max_parts=max_parts, pad_parts=pad_parts, round=round, transport=transport, senders=senders,
                     kind=kind, receiver=receiver, receiver2=receiver2, dropouts=dropouts, min_survivors=min_survivors)


def secure_row_sum(
    rows: Sequence[np.ndarray],
    values: Sequence[np.ndarray],
    *,
    n_rows: int,
    frac_bits: int,
    value_clip: float,
    round: int,
    transport: InProcessTransport,
    senders: Sequence[str],
    points: int,
    max_parts: int = 1,
    pad_parts: bool = False,
    dense_above: int = 0,
    kind: str = "update",
    receiver: str = SERVER,
    receiver2: str = SERVER2,
    dropouts: Mapping[str, frozenset[int]] | None = None,
    where: str = "value_clip",
    min_survivors: int = 2,
) -> SecureSumResult:
    """The ``"dpf"`` two-server sum of sparse row updates, given as rows (no dense client vectors).

    Parties: the ``senders`` (clients), ``receiver`` (server A, learns the sum) and ``receiver2``
    (server B). Adversary: each server honest-but-curious, the two not colluding (together they read
    every input); clients may send anything (a key set that is not point functions is caught and
    left out). Promise: ``receiver`` learns only the sum over the survivors (at least every
    survivor's ``min_survivors``), neither server learns which rows a client touched nor their
    values; with ``max_parts > 1`` and not ``pad_parts``, each server learns how many key sets a
    client sent, ``ceil(rows / points)`` (its update's size class): the stated leak of the
    unpadded mode.

    Args:
        rows: per sender, the distinct row indices (``int``, below ``n_rows``) it sends.
        values: per sender, float ``[len(rows[i]), row_width]``, its values at those rows.
        n_rows: the table's rows ``N`` (public).
        points, max_parts, pad_parts: rows per key set, the most key sets per client, and whether
            every client sends exactly ``max_parts`` (:class:`secagg.dpf_sum.DpfSumConfig`).
        dense_above: a client needing more key sets sends a dense two-server share instead (both
            servers see that it is dense; 0: never).
        the rest: as :func:`secure_sum`.

    Returns:
        :class:`SecureSumResult` with ``total`` float64 ``[n_rows * row_width]`` (row-major).
    """
    if len(rows) != len(senders) or len(values) != len(senders):
        raise ValueError(f"rows and values need one entry per sender ({len(senders)}); found {len(rows)}, {len(values)}")
    if type(n_rows) is not int or n_rows < 1:
        raise ValueError(f"dpf: n_rows must be a positive int; found {n_rows!r}")
    if type(points) is not int or points < 1:
        raise ValueError(f"dpf: points (the rows of one key set) must be a positive int; found {points!r}")
    if receiver == receiver2:
        raise ValueError(f"dpf: the two servers need two names; both are {receiver!r}")
    vals = [np.asarray(v, dtype=np.float64) for v in values]
    idx = [np.asarray(r, dtype=np.int64) for r in rows]
    widths = {v.shape[1] for v in vals if v.ndim == 2}
    if len(widths) > 1 or any(v.ndim != 2 or v.shape[0] != r.shape[0] or r.ndim != 1 for v, r in zip(vals, idx)):
        raise ValueError("dpf: values[i] must be [len(rows[i]), row_width] with one row_width for every sender")
    row_width = widths.pop() if widths else 1
    for r in idx:
        if not distinct_in(r, n_rows):
            raise ValueError(f"dpf: a sender's rows must be distinct and in [0, {n_rows})")
    # every sender's values as one array, encoded in one pass that also checks them (finite, within the
    # clip); per-sender checks and encodings cost ~0.1 s of a 943-client round
    flat = np.concatenate(vals) if vals else np.zeros((0, row_width))
    codec = FixedPoint(frac_bits, value_clip)
    try:
        words = codec.encode(flat, rounding="nearest")
    except BudgetError:  # say which check failed, in the protocol's words
        if not np.isfinite(flat).all():
            raise ValueError(f"round {round}: a client's update holds a non-finite value; nothing was aggregated") from None
        big = float(np.abs(flat).max())
        raise ValueError(f"round {round}: a client's update holds {big:.4g}, above {where}={value_clip:g}; raise {where} "
                         "(and check the bit budget) or lower the learning rate") from None
    cap = max(len(r) for r in idx) if idx else 0
    if cap > points * max_parts:
        raise ValueError(f"round {round}: a client's update touches {cap} rows, above points x max_parts = "
                         f"{points} x {max_parts}; raise one of them")
    check_budget(n_summands=max(len(senders), 1), clip=value_clip, frac_bits=frac_bits)
    ends = np.cumsum([r.size for r in idx], dtype=np.int64)
    enc = [(r, words[e - r.size:e]) for r, e in zip(idx, ends.tolist())]  # views, sender by sender
    return _run_rows(enc, codec, rows=n_rows, row_width=row_width, points=points, max_parts=max_parts,
                     pad_parts=pad_parts, dense_above=dense_above, round=round, transport=transport, senders=senders, kind=kind,
                     receiver=receiver, receiver2=receiver2, dropouts=dropouts, min_survivors=min_survivors)


def _run_rows(updates, codec: FixedPoint, *, rows: int, row_width: int, points: int, max_parts: int, pad_parts: bool,
              round: int, dense_above: int = 0, transport: InProcessTransport, senders: Sequence[str], kind: str, receiver: str,
              receiver2: str, dropouts, min_survivors: int) -> SecureSumResult:  # noqa: ANN001
    """Run :func:`secagg.dpf_run.run_dpf_rows` on encoded sparse updates and record its messages."""
    keep = bool(transport.transcript.keep_payloads)
    # without kept payloads the uploads are recorded by size: the servers' parsed key sets are their only copy
    res = run_dpf_rows(updates, DpfSpec(rows, row_width, min(points, rows), round=round, min_survivors=min_survivors,
                                        dropouts=dict(dropouts or {}), max_parts=max_parts, pad_parts=pad_parts,
                                        dense_above=dense_above, keep_messages=keep))
    names = {"A": receiver, "B": receiver2}
    for sender, to, stage, blob in res.records:
        src = senders[sender] if isinstance(sender, int) else names[str(sender)]
        transport.send(src, names[str(to)], round, kind if stage == "upload" else f"dpf:{stage}",
                       blob if keep else None, blob if isinstance(blob, int) else len(blob))
    for callback in list(_OBSERVERS):  # the clients' key generation is their secure work (no masks, no agreements)
        callback({"reuse": False, "setup": True, "protocol": "dpf", "n": len(senders), "dim": int(rows * row_width),
                  "k": None, "t": None, "survivors": len(res.survivors), "senders": list(senders),
                  "client_seconds": [float(x) for x in res.client_s], "server_seconds": float(sum(res.server_s)),
                  "masks_expanded": 0, "key_agreements": 0, "signatures_verified": 0, "aborted": res.total is None,
                  "prg_bytes": int(sum(res.prg_bytes)), "dense_bytes": int(sum(res.dense_bytes)),
                  "hashed_bytes": int(sum(res.hashed_bytes)), "client_prg_bytes": int(res.client_prg_bytes),
                  "client_dense_bytes": int(res.client_dense_bytes)})
    if res.total is None:
        raise SecureSumAborted(f"dpf aborted in round {round}: {res.abort}")
    return SecureSumResult(
        total=codec.decode(res.total),
        survivors=np.array(sorted(res.survivors), dtype=np.int64),
        bytes_sent=res.bytes_up.sum(axis=1),
        bytes_server_sent=0,
        client_seconds=np.asarray(res.client_s),
        server_seconds=float(sum(res.server_s)),
    )
