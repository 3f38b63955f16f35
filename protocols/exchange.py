"""A protocol's round as named exchanges between its server and clients on separate devices.

FedAvg-GMF and FEL split into parties through their sample -> local round -> aggregate hooks
(:class:`protocols.registry.DeviceSplit`). Protocols whose round is anything else (several
round trips, per-client messages, server steps between them, sums through secure aggregation)
describe it as a sequence of **exchanges** instead, and then run unchanged in one process, on
simulated separate devices (:func:`run_on_devices`, tests) and on Flower (``fedflower``), with no
runtime-specific code of their own:

* the **server half** is a generator, ``trainer.device_round()``, that yields :class:`Exchange`
  objects (*who takes part*, *what each receives*, *what the reply must hold*) and is sent back a
  :class:`Replies` for each (the validated plaintext replies of the clients that answered, or only
  the decoded sum of their vectors when the exchange asks for secure aggregation), and finally
  returns the round's :class:`protocols.base.RoundStats`;
* the **client half** is ``trainer.device_step(kind, round, users, broadcast, per_user)``, which
  runs the client step named ``kind`` for ``users`` on the trainer's own data and returns each
  user's reply. In one process the same trainer plays every client at once (batched); on a
  device it is built on that client's data only and plays one client;
* the **client's own state** (e.g. its user embedding or code) is ``trainer.device_state(user)``
  and ``trainer.load_device_state(user, state)``, a dict of arrays that stays on the device
  between exchanges and rounds;
* the **global model a client needs to score** is ``trainer.device_model()`` on the server and
  ``trainer.load_device_model(model)`` on the client (evaluation runs where the user's state is);
* ``trainer.device_requires_secure(kind) -> bool``: whether this configuration sends the reply of
  step ``kind`` only through secure aggregation. A client asked for such a step in plaintext
  refuses (so a server cannot simply ask for a raw update the protocol promises to sum);
* ``trainer.ONCE_PER_INSTANCE`` (optional): the steps whose vector depends on the client's static
  data only, answered at most once per protocol instance;
* ``trainer.device_check(kind, round, user, broadcast, own, *, secure)`` (optional): the protocol's
  own refusals, checked before a step runs (raises :class:`protocols.guard.RefusedStep`), e.g. a
  group that is not the client's own, or FedCL's second embedding upload in a round;
* ``trainer.device_ldp_epsilon(kind) -> float`` (optional): the local-DP epsilon one answer of step
  ``kind`` spends (0: not an LDP upload). The guard charges it when it admits the step, before the
  step is computed, and refuses it beyond the client's budget.

Every runtime admits each client's step through the client's :class:`protocols.guard.StepGuard`
first (:func:`protocols.guard.device_guard`): rounds only move forward, a secure step is answered
once per round, a once-per-instance step once, no plaintext where the configuration promises a sum,
a local-DP upload charged to the client's own count (and refused beyond its budget), and the
client's own minimum sum size inside the secure aggregation. A refused client is dropped
from the exchange with the reason; nothing is computed for it.

A secure exchange may be **grouped** (:attr:`Exchange.groups`): each group of members is summed by
its own secure aggregation (the server learns one sum per group, never a sum of a group below the
clients' minimum). The server routes a client by what the client reported; the client checks
that the group it is asked to join (its ``per_user`` entry ``"group"``) is its own, so the server
never chooses the slot of a client's value.

A protocol that runs this way sets ``ProtocolSpec.exchanges`` (:class:`protocols.registry.Exchanges`)
and implements its in-process ``run_round`` as ``run_exchanges(self, self.device_step)``: one
code path, so the in-process run is the reference the device runs are tested against.

Rules a protocol must keep (the device tests check the first three):

1. The generator never reads client data: the server half is built on a *census* (one
   placeholder row per participating user), so anything it needs from the clients (a loss, a
   count, a statistic) must come back in a reply.
2. ``device_step`` for a cohort equals ``device_step`` for each member alone: client randomness
   comes from per-user keyed streams (:mod:`recmodels.streams`), never from one generator shared
   by the cohort.
3. A client step reads only the trainer's rows of ``users``, the broadcast and its own
   ``per_user`` entry, and writes only those users' state.
4. Replies are arrays only (``np.ndarray``; scalars as 0-d arrays). A plaintext reply must hold
   exactly :attr:`Exchange.reply_keys`; the exchange's ``validate`` checks its values and raises
   ``ValueError`` (the runtime then drops that client, with the reason, and the round goes on
   without it). A secure exchange's reply is ``{"vector": float64 [width]}``; a two-server
   (``"dpf"``) one may instead send only the rows it touches, ``{"rows": int [k] distinct,
   "row_values": float64 [k, row_width]}`` (the sum is the same; no dense vector need exist).

The transcript: the generator records what the server sends and receives in plaintext exchanges
itself (it knows the protocol's message kinds and sizes); the runtime records the messages of a
secure sum (:func:`protocols.secure_sum.secure_sum` in process, the SecAgg workflow on Flower).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protocols.base import RoundStats
from protocols.guard import RefusedStep, device_guard
from protocols.secure_sum import RowStack, SecureSumAborted, SparseRows, secure_sum
from protocols.transport import SERVER, client
from secagg.dpf_sum import distinct_in
from secagg.reuse_sim import ReuseSession

__all__ = [
    "SECURE_CHUNK",
    "Exchange",
    "Replies",
    "SecureSum",
    "admit",
    "admit_step",
    "answer_in_process",
    "census",
    "drive",
    "group_members",
    "merge_groups",
    "run_exchanges",
    "run_on_devices",
    "setup_reuse",
]

#: Client-values per secure-aggregation instance in process. Every instance pays a full key setup
#: (agreements, signatures, Shamir), so a vector is summed in one instance whenever it fits: the
#: simulated clients encode their own rows when they mask them (secagg.runner.EncodedRows) and the
#: record keeps only sizes, so an instance adds no clients x dim array beyond the vectors themselves.
#: Wider sums are cut into chunks (exact in Z_2^64, so chunking never changes the sum).
SECURE_CHUNK = 1 << 28
#: The keys of a two-server (``"dpf"``) secure reply that sends only its touched rows.
_ROW_KEYS = frozenset({"rows", "row_values"})

ArrayDict = Mapping[str, np.ndarray]
DeviceRound = Generator["Exchange", "Replies", RoundStats]


@dataclass(frozen=True)
class SecureSum:
    """Ask for the replies summed through secure aggregation; the server learns only the sum.

    Attributes:
        protocol: ``"secagg"`` or ``"secagg+"`` (``"chain"``/``"plain"``, and ``"dpf"`` with two
            servers, in process only).
        width: the length of every client's ``"vector"``.
        frac_bits, value_clip: the fixed-point encoding and the largest ``|value|`` allowed
            (a client whose vector exceeds it is refused in words, in process the run stops).
        where: the configuration key named when a value exceeds ``value_clip``.
        kind: the transcript kind of the masked upload.
        dropout, corrupt: the fractions SecAgg+ chooses its ``k`` and ``t`` for.
        receiver: the party that learns the sum (``"server"``; a protocol with two servers names
            the one, e.g. STTFedRec's ``"sas"``).
        k, t: the protocol's parameters (``None``: chosen; for the chain ``k`` is its ``s``
            successors).
        dropouts: simulated dropouts in process only (stage -> indices into the cohort's
            senders, as :func:`protocols.secure_sum.secure_sum` takes them); a runtime with real
            devices refuses them (its dropouts are real).
        row_width, points, receiver2: ``"dpf"`` only (two servers, :mod:`secagg.dpf_sum`): the
            vector is rows of ``row_width`` words, a key set carries at most ``points`` rows, and
            ``receiver2`` is the second server (in process and on simulated devices).
        max_parts, pad_parts: ``"dpf"`` only: a client with more rows sends up to ``max_parts`` key
            sets (the servers see how many unless ``pad_parts``: every client sends ``max_parts``).
        setup: ``"secagg"``/``"secagg+"`` in process: the round's secure exchanges with the same
            ``setup`` name (and group) share one key setup, each sum (and each chunk of one) running
            as the next instance of it (:mod:`secagg.reuse`, docs/secagg.md "One setup per round");
            the first fixes the clients, ``k`` and ``t``; a later one whose clients did not all survive
            the previous instance, or that leaves out more of the setup's clients than their
            ``max_dropout``, is refused (:class:`secagg.reuse_sim.SetupCohortError`, a ``ValueError``)
            instead of being run. ``None``: every sum pays its own setup.
    """

    protocol: str
    width: int
    frac_bits: int
    value_clip: float
    where: str = "value_clip"
    kind: str = "update"
    dropout: float | None = None
    corrupt: float | None = None
    receiver: str = SERVER
    k: int | None = None
    t: int | None = None
    dropouts: Mapping[str, frozenset[int]] | None = None
    row_width: int | None = None
    points: int | None = None
    receiver2: str = "server2"
    max_parts: int = 1
    pad_parts: bool = False
    setup: str | None = None

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"a secure exchange needs a vector of width >= 1; found {self.width}")
        if self.protocol == "dpf" and (self.row_width is None or self.points is None or self.width % self.row_width):
            raise ValueError(f"a 'dpf' secure exchange needs row_width dividing the width {self.width} and points; "
                             f"found {self.row_width!r}, {self.points!r}")

    def two_server(self) -> dict:
        """The extra :func:`protocols.secure_sum.secure_sum` arguments of a two-server sum (none otherwise)."""
        if self.protocol != "dpf":
            return {}
        return {"row_width": self.row_width, "points": self.points, "receiver2": self.receiver2,
                "max_parts": self.max_parts, "pad_parts": self.pad_parts}


@dataclass(frozen=True)
class Exchange:
    """One server -> cohort -> server step of a round.

    Attributes:
        kind: the client step to run (``device_step``'s ``kind``), e.g. ``"train"``.
        users: the cohort, distinct dense user ids (public: the server addresses them).
        broadcast: arrays every member receives.
        per_user: arrays only one member receives (``user -> arrays``); a member without an
            entry receives none.
        reply_keys: the exact keys of a plaintext reply.
        validate: ``(user, reply) -> value`` for a plaintext reply; raises ``ValueError`` to
            drop the client; the value is what :attr:`Replies.values` holds (default: the reply).
        secure: sum the clients' ``"vector"`` replies through secure aggregation instead.
        groups: secure only: ``user -> group``; each group is summed by its own secure
            aggregation (:attr:`Replies.groups`). Every member's ``per_user`` entry must carry
            ``"group"``, the same id, which the client checks against its own.
    """

    kind: str
    users: np.ndarray
    broadcast: ArrayDict = field(default_factory=dict)
    per_user: Mapping[int, ArrayDict] = field(default_factory=dict)
    reply_keys: frozenset[str] = frozenset()
    validate: Callable[[int, dict[str, np.ndarray]], Any] | None = None
    secure: SecureSum | None = None
    groups: Mapping[int, int] | None = None

    def __post_init__(self) -> None:
        users = np.asarray(self.users, dtype=np.int64)
        if users.ndim != 1 or len(np.unique(users)) != len(users):
            raise ValueError(f"exchange {self.kind!r}: the cohort must be distinct user ids; found {self.users!r}")
        object.__setattr__(self, "users", users)
        extra = set(self.per_user) - set(users.tolist())
        if extra:
            raise ValueError(f"exchange {self.kind!r}: per-user arrays for users outside the cohort {sorted(extra)[:5]}")
        if self.secure is None and not self.reply_keys:
            raise ValueError(f"exchange {self.kind!r}: give the reply keys of a plaintext exchange")
        if self.groups is not None:
            if self.secure is None:
                raise ValueError(f"exchange {self.kind!r}: groups apply to a secure exchange only")
            groups = {int(u): int(g) for u, g in self.groups.items()}
            if set(groups) != set(users.tolist()):
                raise ValueError(f"exchange {self.kind!r}: groups must name every member of the cohort, and only them")
            for u, g in groups.items():
                got = self.per_user.get(u, {}).get("group")
                if got is None or np.asarray(got).shape != () or int(np.asarray(got)) != g:
                    raise ValueError(f"exchange {self.kind!r}: user {u}'s per-user 'group' must be its group {g}")
            object.__setattr__(self, "groups", groups)

    def message_for(self, user: int) -> dict[str, np.ndarray]:
        """What ``user`` receives: the broadcast and its own per-user arrays (names must not clash)."""
        own = self.per_user.get(int(user), {})
        clash = set(own) & set(self.broadcast)
        if clash:
            raise ValueError(f"exchange {self.kind!r}: per-user keys {sorted(clash)} clash with the broadcast")
        return {**self.broadcast, **own}

    def check_reply(self, user: int, reply: Any) -> Any:
        """The structural check every runtime applies, then the exchange's own ``validate``."""
        if not isinstance(reply, Mapping):
            raise ValueError(f"user {user}: a reply must be a mapping of arrays; found {type(reply).__name__}")
        keys = {"vector"} if self.secure is not None else set(self.reply_keys)
        if self.secure is not None and self.secure.protocol == "dpf" and set(reply) == _ROW_KEYS:
            keys = _ROW_KEYS
        if set(reply) != keys:
            raise ValueError(f"user {user}: reply keys {sorted(reply)}; expected {sorted(keys)}")
        for name, value in reply.items():
            if not isinstance(value, np.ndarray):
                raise ValueError(f"user {user}: reply {name!r} is a {type(value).__name__}, not an array")
        if keys == _ROW_KEYS:
            return self._check_rows(user, reply)
        if self.secure is not None:
            v = reply["vector"]
            if v.shape != (self.secure.width,) or v.dtype != np.float64:
                raise ValueError(f"user {user}: expected a float64 vector of {self.secure.width}; found "
                                 f"{v.dtype} {v.shape}")
            return reply
        return self.validate(int(user), dict(reply)) if self.validate is not None else dict(reply)

    def _check_rows(self, user: int, reply: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """A ``"dpf"`` reply of touched rows: distinct ids below ``width / row_width``, float64 values per row."""
        assert self.secure is not None and self.secure.row_width is not None
        rows, vals, w = reply["rows"], reply["row_values"], self.secure.row_width
        n_rows = self.secure.width // w
        if rows.ndim != 1 or rows.dtype.kind not in "iu" or vals.dtype != np.float64 or vals.shape != (rows.size, w):
            raise ValueError(f"user {user}: expected int rows [k] and float64 row_values [k, {w}]; found "
                             f"{rows.dtype} {rows.shape} and {vals.dtype} {vals.shape}")
        if not distinct_in(rows, n_rows):
            raise ValueError(f"user {user}: its rows must be distinct and in [0, {n_rows})")
        return reply

    def secure_value(self, reply: Mapping[str, np.ndarray]) -> Any:
        """What a checked secure reply adds to the sum: its ``"vector"``, or ``(rows, row_values)``."""
        return (reply["rows"], reply["row_values"]) if "rows" in reply else reply["vector"]


@dataclass
class Replies:
    """What the server half gets back for one exchange.

    Attributes:
        values: plaintext: ``user -> validated reply`` for the clients that answered validly,
            in cohort order.
        dropped: ``user -> reason`` for the clients left out (silent, late, failed, refused).
        total: secure: the decoded sum over ``survivors`` (``None`` after an abort).
        survivors: secure: the users whose vectors are in ``total``.
        aborted: secure: why no sum was produced (``None`` if it was).
        bytes_per_client: secure: protocol bytes per client (sent plus its share of the server's).
        client_seconds, server_seconds: secure: protocol work per client and at the server.
        groups: grouped secure exchange: ``group -> Replies`` of that group's own sum (``total``
            and ``survivors``, or ``aborted``); the top-level ``survivors`` are every group's.
    """

    values: dict[int, Any] = field(default_factory=dict)
    dropped: dict[int, str] = field(default_factory=dict)
    total: np.ndarray | None = None
    survivors: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    aborted: str | None = None
    bytes_per_client: float = 0.0
    client_seconds: float = 0.0
    server_seconds: float = 0.0
    groups: dict[int, Replies] = field(default_factory=dict)


Step = Callable[[str, int, np.ndarray, ArrayDict, Mapping[int, ArrayDict]], Mapping[int, Mapping[str, np.ndarray]]]


_REUSE = contextvars.ContextVar("exchange_reuse_setups", default=True)


@contextlib.contextmanager
def setup_reuse(enabled: bool) -> Iterator[None]:
    """Inside the block, ``enabled=False`` makes every secure sum pay its own key setup even when its
    exchange names a shared ``setup`` (``secagg bench secure --no-setup-reuse``: the cost before it)."""
    token = _REUSE.set(bool(enabled))
    try:
        yield
    finally:
        _REUSE.reset(token)


def _setup_session(server: Any, round_: int, spec: SecureSum, group: int | None) -> ReuseSession | None:
    """The round's shared key setup named ``spec.setup`` (per group), kept on ``server`` for this round only."""
    if spec.setup is None or spec.protocol not in ("secagg", "secagg+") or not _REUSE.get():
        return None
    store = getattr(server, "_secure_setups", None)
    if store is None or store[0] != round_:
        store = (round_, {})
        server._secure_setups = store
    return store[1].setdefault((spec.setup, group), ReuseSession(None))


def _local_secure(server: Any, ex: Exchange, round_: int, vectors: dict[int, np.ndarray], users: list[int],
                  min_survivors: int, group: int | None = None) -> Replies:
    """Sum ``users``' vectors through :func:`protocols.secure_sum.secure_sum`, in chunks; every
    simulated client refuses a sum below ``min_survivors`` (its own policy). With ``ex.secure.setup``
    the sums (and chunks) run as instances of the round's one key setup of that name."""
    spec = ex.secure
    assert spec is not None
    session = _setup_session(server, round_, spec, group)
    users = [u for u in users if u in vectors]
    if session is not None:  # a later instance must nest in the previous one's survivors: refused in words
        session.check_cohort([client(u) for u in users])
    if len(users) < min_survivors:  # no client takes part in a sum this small (a sum of one is its vector)
        return Replies(dropped={u: "secure aggregation aborted" for u in users},
                       aborted=f"secure aggregation needs at least {min_survivors} clients (the clients' "
                               f"min_survivors); {len(users)} sent a vector")
    senders = [client(u) for u in users]
    step = max(1, SECURE_CHUNK // len(users)) if spec.protocol != "dpf" else spec.width  # dpf: sparse, whole rows
    # one chunk: the vectors as they are (no stacked n x width copy at the round's peak)
    whole = spec.protocol != "dpf" and step >= spec.width
    if spec.protocol == "dpf":  # one client's touched rows at a time (dense vectors or rows as sent)
        values = SparseRows([vectors[u] for u in users], spec.width)
    else:
        values = RowStack([vectors[u] for u in users]) if whole else np.stack([vectors[u] for u in users])
    total = np.empty(spec.width)
    nbytes = client_s = server_s = 0.0
    survivors = None
    try:
        for lo in range(0, spec.width, step):
            hi = min(spec.width, lo + step)
            res = secure_sum(values if whole or spec.protocol == "dpf" else values[:, lo:hi], protocol=spec.protocol, frac_bits=spec.frac_bits,
                             value_clip=spec.value_clip, round=round_, transport=server.transport, senders=senders,
                             kind=spec.kind, where=spec.where, dropout=spec.dropout, corrupt=spec.corrupt,
                             receiver=spec.receiver, k=spec.k, t=spec.t, dropouts=spec.dropouts,
                             min_survivors=min_survivors, session=session, **spec.two_server())
            total[lo:hi] = res.total
            nbytes += res.bytes_per_client
            client_s += float(np.mean(res.client_seconds))
            server_s += res.server_seconds
            if survivors is not None and not np.array_equal(survivors, res.survivors):
                # e.g. a client silent at one chunk's unmask: summed in that chunk, gone from the setup's next
                raise SecureSumAborted(f"the chunks of one sum ended with different survivors ({len(survivors)} "
                                       f"then {len(res.survivors)}): their totals are not one cohort's sum")
            survivors = res.survivors
    except SecureSumAborted as exc:
        return Replies(aborted=str(exc), dropped={u: "secure aggregation aborted" for u in users})
    kept = np.asarray(users, np.int64)[survivors]
    dropped = {u: "dropped during secure aggregation" for u in users if u not in set(kept.tolist())}
    return Replies(total=total, survivors=kept, dropped=dropped, bytes_per_client=nbytes,
                   client_seconds=client_s, server_seconds=server_s)


def merge_groups(parts: Mapping[int, Replies], dropped: dict[int, str]) -> Replies:
    """One :class:`Replies` for a grouped secure exchange from each group's own (``parts``)."""
    out = Replies(dropped=dict(dropped), groups=dict(parts))
    surv = [p.survivors for p in parts.values() if p.total is not None]
    out.survivors = np.sort(np.concatenate(surv)) if surv else np.zeros(0, np.int64)
    n = max(sum(len(p.survivors) + len(p.dropped) for p in parts.values()), 1)
    for p in parts.values():
        out.dropped.update(p.dropped)
        members = len(p.survivors) + len(p.dropped)
        out.bytes_per_client += p.bytes_per_client * members / n
        out.client_seconds += p.client_seconds * members / n
        out.server_seconds += p.server_seconds
    if parts and all(p.total is None for p in parts.values()):
        out.aborted = "every group's secure aggregation aborted: " + "; ".join(
            f"group {g}: {p.aborted}" for g, p in sorted(parts.items()))
    return out


def group_members(ex: Exchange, users: list[int]) -> dict[int, list[int]]:
    """``group -> members`` (in cohort order) of a grouped exchange, restricted to ``users``."""
    assert ex.groups is not None
    out: dict[int, list[int]] = {}
    for u in users:
        out.setdefault(ex.groups[u], []).append(u)
    return dict(sorted(out.items()))


def _answer(server: Any, ex: Exchange, round_: int, replies: Mapping[int, Any], dropped: dict[int, str], *,
            devices: bool = False, min_survivors: int = 2) -> Replies:
    """Validate each reply (structurally, then the exchange's ``validate``); secure: sum the vectors
    (one sum per group of a grouped exchange), the clients refusing a sum below ``min_survivors``.

    With ``devices`` a secure vector holding a non-finite value or one beyond ``value_clip`` drops
    its client (as a device's secure-aggregation mod refuses to encode it); in one process it
    stops the run in words (:func:`protocols.secure_sum.secure_sum`: a configuration to fix).
    """
    values: dict[int, Any] = {}
    for u in ex.users.tolist():
        if u in dropped:
            continue
        if u not in replies:
            dropped[u] = "no reply"
            continue
        try:
            value = ex.check_reply(u, replies[u])
            if devices and ex.secure is not None:
                v = value["row_values"] if "row_values" in value else value["vector"]
                if not np.all(np.isfinite(v)) or float(np.abs(v).max(initial=0.0)) > ex.secure.value_clip:
                    raise ValueError(f"user {u}: its vector holds a non-finite value or one beyond "
                                     f"{ex.secure.where}={ex.secure.value_clip:g}; refused before encoding")
            values[u] = value
        except ValueError as exc:
            dropped[u] = str(exc)
    if ex.secure is not None:
        vectors = {u: ex.secure_value(v) for u, v in values.items()}
        if ex.groups is not None:
            parts = {g: _local_secure(server, ex, round_, vectors, members, min_survivors, g)
                     for g, members in group_members(ex, ex.users.tolist()).items()}
            return merge_groups(parts, dropped)
        out = _local_secure(server, ex, round_, vectors, ex.users.tolist(), min_survivors)
        out.dropped = {**dropped, **out.dropped}
        return out
    return Replies(values=values, dropped=dropped)


def admit_step(trainer: Any, kind: str, round_: int, user: int, broadcast: ArrayDict, own: ArrayDict, *,
               secure: bool) -> None:
    """Admit ``user``'s step ``kind`` of ``round_`` on the client ``trainer``: its guard's rules
    (:class:`protocols.guard.StepGuard`), then the protocol's own (``trainer.device_check``,
    optional); the admitted step is recorded as answered. Raises
    :class:`protocols.guard.RefusedStep` (nothing recorded) when the client refuses."""
    guard = device_guard(trainer)
    guard.check(user, kind, round_, secure=secure)
    check = getattr(trainer, "device_check", None)
    if check is not None:
        check(kind, round_, user, broadcast, own, secure=secure)
    guard.admit(user, kind, round_, secure=secure)


def admit(trainer: Any, ex: Exchange, round_: int, users: list[int]) -> tuple[list[int], dict[int, str]]:
    """The members of ``users`` whose client admits step ``ex.kind`` of ``round_``
    (:func:`admit_step`), and the others with the reason they refused."""
    ok: list[int] = []
    refused: dict[int, str] = {}
    for u in users:
        try:
            admit_step(trainer, ex.kind, round_, u, ex.broadcast, ex.per_user.get(u, {}), secure=ex.secure is not None)
            ok.append(u)
        except RefusedStep as exc:
            refused[u] = f"refused: {exc}"
    return ok, refused


def drive(round_gen: DeviceRound, answer: Callable[[Exchange], Replies]) -> RoundStats:
    """Run one round's generator to its end, answering every exchange with ``answer``."""
    try:
        ex = next(round_gen)
        while True:
            if not isinstance(ex, Exchange):
                raise TypeError(f"device_round yielded a {type(ex).__name__}, not an Exchange")
            ex = round_gen.send(answer(ex))
    except StopIteration as stop:
        if not isinstance(stop.value, RoundStats):
            raise TypeError(f"device_round returned a {type(stop.value).__name__}, not RoundStats") from None
        return stop.value


def answer_in_process(server: Any, ex: Exchange, step: Step, round_: int) -> Replies:
    """One exchange in one process: ``step`` (the trainer's own ``device_step``) plays the whole
    cohort at once, each member admitted by its guard first (:func:`protocols.guard.device_guard`
    of the trainer, which plays every client); a secure exchange goes through
    :func:`protocols.secure_sum.secure_sum`."""
    guard = device_guard(server)
    ok, refused = admit(server, ex, round_, ex.users.tolist())
    users = np.asarray(ok, np.int64)
    per_user = {u: ex.per_user[u] for u in ok if u in ex.per_user}
    replies = step(ex.kind, round_, users, ex.broadcast, per_user) if len(users) else {}
    return _answer(server, ex, round_, replies, refused, devices=False, min_survivors=guard.policy.min_survivors)


def run_exchanges(server: Any, step: Step) -> RoundStats:
    """One round in one process: every exchange of ``server.device_round()`` answered by
    :func:`answer_in_process`."""
    round_ = int(server.round)
    return drive(server.device_round(), lambda ex: answer_in_process(server, ex, step, round_))


def run_on_devices(server: Any, clients: Mapping[int, Any], *, silent: Callable[[Exchange, int], bool] | None = None,
                   tamper: Callable[[Exchange, int, dict], dict] | None = None) -> RoundStats:
    """One round with every client on its own (simulated) device: the reference for a runtime.

    ``server`` is the server half built on a census, ``clients[u]`` user ``u``'s half built on its
    own data. Each member of an exchange gets a deep copy of its message and runs
    ``device_step`` alone; its reply is deep-copied back (nothing is shared by reference, as
    on a wire). ``silent(exchange, user)`` makes a client drop out of that exchange and
    ``tamper(exchange, user, reply)`` replaces its reply (tests of the server's checks). Each
    device admits the step through its own guard (:func:`protocols.guard.device_guard`); the
    secure sums' simulated clients refuse sums below the largest ``min_survivors`` among the
    cohort's devices.
    """
    round_ = int(server.round)

    def answer(ex: Exchange) -> Replies:
        replies: dict[int, Any] = {}
        dropped: dict[int, str] = {}
        floor = 2
        for u in ex.users.tolist():
            if silent is not None and silent(ex, u):
                dropped[u] = "silent"
                continue
            if u not in clients:
                dropped[u] = "no such device"
                continue
            ex.message_for(u)  # the names of the broadcast and of the client's own arrays must not clash
            floor = max(floor, device_guard(clients[u]).policy.min_survivors)
            ok, refused = admit(clients[u], ex, round_, [u])
            if refused:
                dropped.update(refused)
                continue
            bcast = copy.deepcopy(dict(ex.broadcast))
            own = {u: copy.deepcopy(dict(ex.per_user[u]))} if u in ex.per_user else {}
            out = clients[u].device_step(ex.kind, round_, np.array([u], np.int64), bcast, own)
            reply = copy.deepcopy(dict(out[u])) if u in out else None
            if reply is None:
                dropped[u] = "no reply"
                continue
            replies[u] = tamper(ex, u, reply) if tamper is not None else reply
        return _answer(server, ex, round_, replies, dropped, devices=True, min_survivors=floor)

    return drive(server.device_round(), answer)


def census(users: np.ndarray, n_users: int, n_items: int, user_ids: np.ndarray | None = None,
           item_ids: np.ndarray | None = None) -> Any:
    """The server half's data: one placeholder row (item 0, rating 1) per participating user.

    Who takes part is public; what they hold is not. A protocol's server half must not read
    anything from it beyond ``n_users``, ``n_items`` and which users take part.
    """
    from recmodels.data import Interactions

    users = np.asarray(users, np.int64)
    return Interactions(
        users=users, items=np.zeros(len(users), np.int64), ratings=np.ones(len(users), np.float32),
        timestamps=np.zeros(len(users), np.int64),
        user_ids=np.arange(n_users) if user_ids is None else np.asarray(user_ids),
        item_ids=np.arange(n_items) if item_ids is None else np.asarray(item_ids),
    )
