"""In-process runner: simulates ``n`` clients and the server of an aggregation protocol.

Per-protocol interface (to add a protocol, add one line to :data:`PROTOCOLS`)::

    def run_<name>(inputs: np.ndarray, spec: RunSpec) -> RunResult

* ``inputs``: ``uint64`` array of shape ``(n, dim)``, client ``i``'s encoded vector in row ``i``;
* ``spec``: :class:`RunSpec`: optional ``k``/``t`` (protocol-specific meaning; ``None`` = the
  protocol's default; for SecAgg+ chosen by :func:`secagg.params.choose` from ``n``, the planned
  ``dropout`` fraction and the tolerated ``corrupt`` fraction), ``unsafe_threshold`` (accept a
  ``t`` at or below half of a client's holders), ``min_survivors`` and the planned ``dropout``
  (every simulated client's own :class:`secagg.bonawitz.ClientPolicy`: a survivor set smaller than
  ``min_survivors`` or missing more than ``ceil(dropout n)`` clients is never signed, so the round
  aborts), and ``dropouts``: stage name -> set of clients that drop *before sending their
  message of that stage* (and never come back). Every protocol must honour the common key
  :data:`INPUT_STAGE` (``"masked_input"``: drop after key sharing, before sending the masked
  input) and ignore unknown keys' clients only if it has no such stage (document which);
* returns a :class:`RunResult`: the ``uint64`` sum (``None`` after an abort, with the reason in
  ``abort``), the set of clients whose inputs are in the sum, seconds spent per client and at the
  server, bytes sent per client and received/sent by the server, and ``masks_expanded`` (the
  number of ``dim``-long PRG expansions the server did, for the PRG-throughput bound) and
  ``key_agreements`` (X25519 + HKDF evaluations the server did) and ``signatures_verified``
  (Ed25519 verifications at the server); all default to 0.

Every message crosses the runner as wire bytes (``to_bytes``/``decode``), so bytes are exact and
every stage boundary exercises the parsers. Messages are delivered in client-id order.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np

from secagg.bonawitz import ClientPolicy, MaskingClient, MaskingConfig, MaskingServer, make_pki
from secagg.chain_sim import run_chain
from secagg.encoding import FixedPoint, check_budget
from secagg.errors import AbortError
from secagg.messages import INSTANCE_BYTES
from secagg.plain import PlainClient, PlainConfig, PlainServer
from secagg import simshare
from secagg.runspec import INPUT_STAGE, MASKING_STAGES, RunResult, RunSpec

__all__ = [
    "INPUT_STAGE",
    "MASKING_STAGES",
    "PROTOCOLS",
    "RunResult",
    "RunSpec",
    "run",
    "run_plain",
    "run_real",
    "run_secagg",
    "run_secagg_plus",
]

Runner = Callable[[np.ndarray, RunSpec], RunResult]


class EncodedRows:
    """``n x dim`` ``uint64`` inputs encoded one row at a time, when a client needs its own.

    A simulation of ``n`` clients holds every client's real vector anyway; encoding them all at once
    costs ``n x dim`` words more (and the encoder's float temporaries three times that), which on
    catalogue-sized vectors is the peak of the whole run. ``rows[i]`` encodes row ``i`` (the value
    each device would encode); ``shape`` and ``dtype`` are the encoded array's. The SecAgg/SecAgg+
    runners accept it wherever they accept an array; the values must already be range-checked.
    """

    dtype = np.dtype(np.uint64)
    ndim = 2

    def __init__(self, values: np.ndarray, encode: Callable[[np.ndarray], np.ndarray]) -> None:
        self._values = values
        self._encode = encode
        self.shape = tuple(values.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, i: int) -> np.ndarray:
        return np.ascontiguousarray(self._encode(self._values[i]), dtype=np.uint64)


def _check_inputs(inputs: np.ndarray | EncodedRows) -> tuple[int, int]:
    if isinstance(inputs, EncodedRows):
        if len(inputs.shape) != 2 or inputs.shape[1] < 1:
            raise ValueError(f"inputs must be (n, dim) rows; found {inputs.shape}.")
        return inputs.shape
    arr = np.asarray(inputs)
    if arr.dtype != np.uint64 or arr.ndim != 2 or arr.shape[1] < 1:
        raise ValueError(f"inputs must be a (n, dim) uint64 array (encode first); found {arr.dtype} {arr.shape}.")
    return arr.shape


def run_plain(inputs: np.ndarray, spec: RunSpec) -> RunResult:
    """Plain summation; only ``INPUT_STAGE`` dropouts apply."""
    n, dim = _check_inputs(inputs)
    cfg = PlainConfig(n, dim, os.urandom(INSTANCE_BYTES), spec.round)
    server = PlainServer(cfg)
    client_s = np.zeros(n)
    sent = np.zeros(n, dtype=np.int64)
    server_s = 0.0
    received = 0
    dropped = spec.dropped_before(INPUT_STAGE)
    for i in range(n):
        if i in dropped:
            continue
        t0 = time.perf_counter()
        blob = PlainClient(cfg, i).send(inputs[i]).to_bytes()
        t1 = time.perf_counter()
        server.receive(blob)
        server_s += time.perf_counter() - t1
        client_s[i] = t1 - t0
        sent[i] = len(blob)
        received += len(blob)
    t0 = time.perf_counter()
    try:
        total, abort = server.finish(), None
    except AbortError as exc:
        total, abort = None, str(exc)
    server_s += time.perf_counter() - t0
    return RunResult("plain", total, frozenset(server.received), abort, client_s, server_s, sent, received, 0)


def _run_masking(
    name: str, cfg: MaskingConfig, inputs: np.ndarray, spec: RunSpec, record: list | None = None
) -> RunResult:
    with simshare.shared_work(spec.shared_work):
        return _run_masking_in(name, cfg, inputs, spec, record)


def _run_masking_in(
    name: str, cfg: MaskingConfig, inputs: np.ndarray, spec: RunSpec, record: list | None
) -> RunResult:
    n = cfg.n
    identities, pki = make_pki(n)
    # (a plan that lists every client as dropping lets the clients accept n - 1 missing: ClientPolicy's
    # fraction is below 1, and nothing can survive such a plan anyway)
    policy = ClientPolicy(min_survivors=spec.min_survivors, unsafe_threshold=spec.unsafe_threshold,
                          max_dropout=min(spec.planned_dropout(n), (n - 1) / n))
    clients = [MaskingClient(cfg, i, identities[i], pki, policy) for i in range(n)]
    server = MaskingServer(cfg, pki)
    client_s = np.zeros(n)
    sent = np.zeros(n, dtype=np.int64)
    acct = {"server_s": 0.0, "recv": 0, "sent": 0}
    gone: set[int] = set()  # dropped or aborted clients

    def deliver(stage: str, make: Callable[[int], object], who: list[int]) -> None:
        gone.update(spec.dropped_before(stage))
        for i in who:
            if i in gone:
                continue
            t0 = time.perf_counter()
            try:
                blob = make(i).to_bytes()  # type: ignore[attr-defined]
            except AbortError:
                gone.add(i)  # a client that aborts simply stops (it has revealed nothing more)
                client_s[i] += time.perf_counter() - t0
                continue
            t1 = time.perf_counter()
            client_s[i] += t1 - t0
            sent[i] += len(blob)
            acct["recv"] += len(blob)
            if record is not None:
                record.append((stage, i, blob))
            server.receive(blob)
            acct["server_s"] += time.perf_counter() - t1

    def close(method: str) -> dict[int, bytes]:
        t0 = time.perf_counter()
        try:
            out = getattr(server, method)()
        finally:
            acct["server_s"] += time.perf_counter() - t0
        acct["sent"] += sum(len(b) for b in out.values())
        return out

    total, abort = None, None
    try:
        deliver("advertise", lambda i: clients[i].advertise(), list(range(n)))
        inbox = close("broadcast_keys")
        deliver("share_keys", lambda i: clients[i].share_keys(inbox[i]), sorted(inbox))
        inbox = close("forward_shares")
        deliver("masked_input", lambda i: clients[i].mask_input(inbox[i], inputs[i]), sorted(inbox))
        inbox = close("request_consistency")
        deliver("consistency", lambda i: clients[i].sign_survivors(inbox[i]), sorted(inbox))
        inbox = close("request_unmask")
        deliver("unmask", lambda i: clients[i].unmask(inbox[i]), sorted(inbox))
        t0 = time.perf_counter()
        try:
            total = server.finish()
        finally:
            acct["server_s"] += time.perf_counter() - t0
    except AbortError as exc:
        abort = str(exc)
    return RunResult(
        name, total, server.u3 if total is not None else frozenset(), abort, client_s, acct["server_s"], sent,
        acct["recv"], acct["sent"], server.masks_expanded, cfg.k, cfg.t, server.key_agreements,
        server.signatures_verified,
    )


def run_secagg(inputs: np.ndarray, spec: RunSpec, *, record: list | None = None) -> RunResult:
    """SecAgg (complete graph); ``spec.k`` is ignored, ``spec.t`` defaults to ``floor(2n/3)+1``.

    ``record``, if given, receives ``(stage, sender, wire bytes)`` of every message the server got.
    """
    n, dim = _check_inputs(inputs)
    cfg = MaskingConfig.secagg(n, dim, t=spec.t, round=spec.round, unsafe_threshold=spec.unsafe_threshold)
    return _run_masking("secagg", cfg, inputs, spec, record)


def run_secagg_plus(inputs: np.ndarray, spec: RunSpec, *, record: list | None = None) -> RunResult:
    """SecAgg+ over a random k-regular graph; ``k``/``t`` default to :func:`secagg.params.choose`
    for ``spec.planned_dropout(n)`` and ``spec.corrupt``."""
    n, dim = _check_inputs(inputs)
    cfg = MaskingConfig.secagg_plus(
        n, dim, k=spec.k, t=spec.t, round=spec.round, dropout=spec.planned_dropout(n), corrupt=spec.corrupt,
        unsafe_threshold=spec.unsafe_threshold,
    )
    return _run_masking("secagg+", cfg, inputs, spec, record)


#: protocol name -> runner (see the module docstring for the interface)
PROTOCOLS: dict[str, Runner] = {
    "plain": run_plain,
    "secagg": run_secagg,
    "secagg+": run_secagg_plus,
    "chain": run_chain,
}


def run(protocol: str, inputs: np.ndarray, spec: RunSpec | None = None) -> RunResult:
    """Run a registered protocol on ``uint64`` inputs."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; choose one of {sorted(PROTOCOLS)}.")
    return PROTOCOLS[protocol](inputs, spec or RunSpec())


def run_real(
    protocol: str, values: np.ndarray, codec: FixedPoint, spec: RunSpec | None = None, *, rounding: str = "stochastic"
) -> tuple[np.ndarray | None, RunResult]:
    """Encode real inputs, check the bit budget, aggregate, and decode the survivors' sum."""
    vals = np.asarray(values, dtype=np.float64)
    if vals.ndim != 2:
        raise ValueError(f"values must be a (n, dim) array; found shape {vals.shape}.")
    check_budget(n_summands=vals.shape[0], clip=codec.clip, frac_bits=codec.frac_bits)
    res = run(protocol, codec.encode(vals, rounding=rounding), spec)
    return (None if res.total is None else codec.decode(res.total)), res
