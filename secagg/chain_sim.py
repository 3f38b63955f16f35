"""In-process driver for the circular share chain: n clients, one server, dropouts, tampering.

:func:`simulate` plays one round of :mod:`secagg.chain` in memory. Every message crosses a
single choke point where an optional ``tamper`` hook may rewrite or drop it, and where its size
is counted. Dropouts are scheduled per client with :class:`Dropout` (the stage and attempt at
which the client vanishes). The result records the sum, the survivors, the server's view (every
message it received, as bytes) and per-party costs, so tests can check the promise (the sum over
survivors), the view (uniform uploads) and the limits (collusions) on the same run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from secagg.chain import ChainClient, ChainConfig, Kind, effective_successors
from secagg.chain_server import ChainServer, ServerStep
from secagg.encoding import sign_extend
from secagg.errors import AbortError, AuthenticationError, MessageError
from secagg.messages import SERVER
from secagg.runspec import RunResult, RunSpec

__all__ = ["DROP_STAGES", "RUNNER_STAGES", "ChainRun", "Dropout", "run_chain", "simulate"]

#: Where a client can vanish: before advertising its key; after receiving the ring but before
#: sending its seeds; after sending its seeds but before receiving its predecessors'; after
#: receiving them (and masking) but before its upload arrives; after uploading but before its
#: pad (UNLOCK) arrives.
DROP_STAGES = ("advertise", "share", "receive", "upload", "unlock")

#: How :func:`run_chain` maps the runner's dropout stages (``secagg.runner.MASKING_STAGES``) onto
#: the chain's: a client dropping "before sending its message of that stage". The chain has no
#: consistency or unmask stage; a client that leaves after its masked input leaves before its
#: unlock, the chain's last message.
RUNNER_STAGES: dict[str, str | None] = {
    "advertise": "advertise",
    "share_keys": "share",
    "masked_input": "receive",
    "consistency": "unlock",
    "unmask": "unlock",
}

#: ``tamper(kind, sender, receiver, data) -> data | None`` (``None`` drops the message).
Tamper = Callable[[Kind, int, int, bytes], "bytes | None"]


@dataclass(frozen=True)
class Dropout:
    """A client vanishing at ``stage`` (one of :data:`DROP_STAGES`) of attempt ``attempt``.

    ``attempt=None`` means the first attempt that reaches ``stage`` (an attempt abandoned
    earlier never reaches its later stages).
    """

    stage: str
    attempt: int | None = 1

    def __post_init__(self) -> None:
        if self.stage not in DROP_STAGES:
            raise ValueError(f"stage must be one of {DROP_STAGES}; found {self.stage!r}.")
        if self.attempt is not None and (type(self.attempt) is not int or self.attempt < 1):
            raise ValueError(f"attempt must be None or an int >= 1; found {self.attempt!r}.")


@dataclass
class ChainRun:
    """Outcome of one simulated round.

    Attributes:
        result: the ``uint64`` sum over ``survivors``, or ``None`` after an abort.
        survivors: clients whose inputs are in ``result``.
        abort: the :class:`AbortError` if the round aborted.
        server: the server state machine (its ``history`` lists every attempt).
        clients: the client state machines (their private views, for collusion tests).
        server_view: every message the server accepted, ``(kind, sender, attempt, bytes)``.
        rejected: ``(party, error)`` for every message a party refused.
        client_seconds: time spent inside each client's methods.
        server_seconds: time spent inside the server's methods.
        bytes_sent: bytes each client sent.
        bytes_received: bytes each client received.
        bytes_server_received: bytes the server received.
        bytes_server_sent: bytes the server sent.
    """

    result: np.ndarray | None
    survivors: frozenset[int]
    abort: AbortError | None
    server: ChainServer
    clients: dict[int, ChainClient]
    server_view: list[tuple[Kind, int, int, bytes]] = field(default_factory=list)
    rejected: list[tuple[int, Exception]] = field(default_factory=list)
    client_seconds: dict[int, float] = field(default_factory=dict)
    server_seconds: float = 0.0
    bytes_sent: dict[int, int] = field(default_factory=dict)
    bytes_received: dict[int, int] = field(default_factory=dict)
    bytes_server_received: int = 0
    bytes_server_sent: int = 0


def simulate(
    config: ChainConfig,
    inputs: Mapping[int, np.ndarray],
    *,
    dropouts: Mapping[int, Dropout] | None = None,
    tamper: Tamper | None = None,
    keep_view: bool = True,
) -> ChainRun:
    """Run one round of the chain in process.

    Args:
        config: public parameters.
        inputs: ``uint64`` input vector per client id.
        dropouts: when each dropping client vanishes (absent clients never drop).
        tamper: optional hook applied to every message in flight.
        keep_view: keep the server's received messages in :attr:`ChainRun.server_view`.

    Returns:
        A :class:`ChainRun`; an abort is reported in ``abort`` (not raised).
    """
    dropouts = dict(dropouts or {})
    clients = {cid: ChainClient(config, cid, np.asarray(x)) for cid, x in inputs.items()}
    t0 = time.perf_counter()
    server = ChainServer(config, clients)
    run = ChainRun(None, frozenset(), None, server, clients, server_seconds=time.perf_counter() - t0)
    run.client_seconds = dict.fromkeys(clients, 0.0)
    run.bytes_sent = dict.fromkeys(clients, 0)
    run.bytes_received = dict.fromkeys(clients, 0)
    gone: set[int] = set()

    def drops(cid: int, stage: str, attempt: int) -> bool:
        d = dropouts.get(cid)
        if cid in gone:
            return True
        if d is not None and d.stage == stage and (stage == "advertise" or d.attempt in (None, attempt)):
            gone.add(cid)
            return True
        return False

    def to_server(kind: Kind, cid: int, data: bytes | None) -> None:
        if data is None:
            return
        if tamper is not None:
            data = tamper(kind, cid, SERVER, data)
            if data is None:
                return
        run.bytes_sent[cid] += len(data)
        run.bytes_server_received += len(data)
        t = time.perf_counter()
        try:
            server.receive(data)
        except (MessageError, AuthenticationError) as exc:
            run.rejected.append((SERVER, exc))
            return
        finally:
            run.server_seconds += time.perf_counter() - t
        if keep_view:
            run.server_view.append((kind, cid, server.attempt, data))

    def to_client(kind: Kind, cid: int, data: bytes) -> bytes | None:
        if tamper is not None:
            data = tamper(kind, SERVER, cid, data)
            if data is None:
                return None
        run.bytes_server_sent += len(data)
        run.bytes_received[cid] += len(data)
        t = time.perf_counter()
        try:
            return clients[cid].handle(data)
        except (MessageError, AuthenticationError) as exc:
            run.rejected.append((cid, exc))
            return None
        finally:
            run.client_seconds[cid] += time.perf_counter() - t

    def close() -> ServerStep:
        t = time.perf_counter()
        try:
            return server.close()
        finally:
            run.server_seconds += time.perf_counter() - t

    try:
        for cid, client in clients.items():
            if drops(cid, "advertise", 0):
                continue
            t = time.perf_counter()
            msg = client.advertise()
            run.client_seconds[cid] += time.perf_counter() - t
            to_server(Kind.ADVERT, cid, msg)
        step = close()
        while step.kind is not None:
            attempt = step.attempt
            if step.kind is Kind.RING:
                for cid, data in step.messages.items():
                    if drops(cid, "share", attempt):
                        continue
                    to_server(Kind.BUNDLE, cid, to_client(Kind.RING, cid, data))
            elif step.kind is Kind.DELIVERY:
                for cid, data in step.messages.items():
                    if drops(cid, "receive", attempt):
                        continue
                    reply = to_client(Kind.DELIVERY, cid, data)
                    if drops(cid, "upload", attempt):
                        continue
                    to_server(Kind.UPLOAD, cid, reply)
            else:
                for cid, data in step.messages.items():
                    if drops(cid, "unlock", attempt):
                        continue
                    to_server(Kind.UNLOCK, cid, to_client(Kind.UNLOCK_REQUEST, cid, data))
            step = close()
    except AbortError as exc:
        run.abort = exc
        return run
    run.result = server.result()
    run.survivors = server.survivors
    return run


def run_chain(inputs: np.ndarray, spec: RunSpec) -> RunResult:
    """Adapter for :data:`secagg.runner.PROTOCOLS`: ``run_chain(inputs, spec) -> RunResult``.

    ``spec.k`` is the number of successors ``s`` (default 1, the paper's chain; each client then
    has ``2s`` ring neighbours); ``spec.t`` has no meaning for the chain and is reported as
    ``None``. Dropout stages are mapped with :data:`RUNNER_STAGES`; ``masks_expanded`` counts the
    pads the server stripped (one per survivor; it never expands a ring mask: recovery re-runs,
    it never unmasks). Client seconds include every attempt a client took part in. A spec with
    ``ring_bits = 32`` (:func:`secagg.encoding.choose_ring_bits`) runs the round in ``Z_2^32``
    (4 bytes per value); the sum is returned sign-extended to ``Z_2^64`` words either way.
    """
    from secagg.messages import INSTANCE_BYTES

    arr = np.asarray(inputs)
    if arr.dtype != np.uint64 or arr.ndim != 2 or arr.shape[1] < 1:
        raise ValueError(f"inputs must be a (n, dim) uint64 array (encode first); found {arr.dtype} {arr.shape}.")
    n, dim = arr.shape
    s = 1 if spec.k is None else spec.k
    dropouts: dict[int, Dropout] = {}
    for stage, who in spec.dropouts.items():
        if stage not in RUNNER_STAGES:
            raise ValueError(f"unknown dropout stage {stage!r}; use one of {tuple(RUNNER_STAGES)}.")
        mapped = RUNNER_STAGES[stage]
        for c in sorted(who):
            if mapped is None:
                continue
            if c not in dropouts or DROP_STAGES.index(mapped) < DROP_STAGES.index(dropouts[c].stage):
                dropouts[c] = Dropout(mapped, None)  # the earliest stage wins
    ring_bits = spec.ring_bits
    config = ChainConfig(instance=os.urandom(INSTANCE_BYTES), round=spec.round, dim=dim,
                         successors=effective_successors(s, n), min_survivors=getattr(spec, "min_survivors", 2),
                         ring_bits=ring_bits)
    chain = simulate(config, {i: arr[i] for i in range(n)}, dropouts=dropouts, keep_view=False)
    return RunResult(
        "chain",
        None if chain.result is None else sign_extend(chain.result, ring_bits),  # callers decode Z_2^64 words
        chain.survivors,
        None if chain.abort is None else str(chain.abort),
        np.array([chain.client_seconds[i] for i in range(n)]),
        chain.server_seconds,
        np.array([chain.bytes_sent[i] for i in range(n)], dtype=np.int64),
        chain.bytes_server_received,
        chain.bytes_server_sent,
        chain.server.masks_expanded,
        s,
        None,
    )
