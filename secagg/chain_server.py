"""The aggregation server of the circular share chain (protocol, promise and re-run rule:
:mod:`secagg.chain`).

The server validates and relays messages, sums the uploads, asks for the pads once every ring
member's upload of an attempt arrived, and restarts attempts after dropouts following the
re-run rule:

* a member missing at ``SHARE`` or ``UPLOAD``: a new attempt over the clients that completed
  the stage, on a fresh CSPRNG ring (the abandoned uploads stay padded: useless);
* a member missing at ``UNLOCK``: one last attempt over exactly the clients that revealed their
  pads, on the same ring order with the others removed (:attr:`ChainServer.fixed`); from then
  on any missing member, at any stage, aborts the round;
* an ``UNLOCK`` that arrived but was refused, with no valid one following: abort.
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from secagg.chain import (
    _PAD_LABEL,
    ChainConfig,
    _receive,
    _server_channel_keys,
    _unlock_aad,
    _upload_tag,
    effective_successors,
)
from secagg.chain_wire import (
    ChainAdvert,
    ChainBundle,
    ChainDelivery,
    ChainRing,
    ChainUnlock,
    ChainUnlockRequest,
    ChainUpload,
    Kind,
)
from secagg.channel import open_sealed
from secagg.errors import AbortError, AuthenticationError, MessageError
from secagg.keys import KeyPair
from secagg.messages import _HEADER as _WIRE_HEADER
from secagg.messages import HEADER_BYTES, SERVER, Message
from secagg.prg import accumulate

__all__ = ["SERVER_ACCEPTS", "AttemptRecord", "ChainServer", "ServerStage", "ServerStep"]


class ServerStage(enum.Enum):
    """Server states: collect adverts, then per attempt collect bundles, uploads and pads."""

    ADVERTISE = "advertise"
    SHARE = "share"
    UPLOAD = "upload"
    UNLOCK = "unlock"
    DONE = "done"
    ABORTED = "aborted"


#: Which client message kind the server accepts in each state.
SERVER_ACCEPTS: dict[ServerStage, frozenset[Kind]] = {
    ServerStage.ADVERTISE: frozenset({Kind.ADVERT}),
    ServerStage.SHARE: frozenset({Kind.BUNDLE}),
    ServerStage.UPLOAD: frozenset({Kind.UPLOAD}),
    ServerStage.UNLOCK: frozenset({Kind.UNLOCK}),
    ServerStage.DONE: frozenset(),
    ServerStage.ABORTED: frozenset(),
}


@dataclass(frozen=True)
class ServerStep:
    """What the server sends when a stage closes.

    Attributes:
        kind: :attr:`Kind.RING` (an attempt starts), :attr:`Kind.DELIVERY` (seeds to relay),
            :attr:`Kind.UNLOCK_REQUEST` (pads wanted) or ``None`` when the round is finished
            (``messages`` is then empty).
        attempt: the attempt the messages belong to.
        messages: serialised message per receiving client id.
    """

    kind: Kind | None
    attempt: int
    messages: Mapping[int, bytes]


@dataclass(frozen=True)
class AttemptRecord:
    """How one attempt ended: its ring, the clients that completed it, and why it ended."""

    attempt: int
    ring: tuple[int, ...]
    completed: frozenset[int]
    outcome: str


class ChainServer:
    """The aggregation server: validates, relays, sums, and restarts attempts after dropouts.

    Args:
        config: the round's public parameters.
        clients: ids of the clients invited to the round.
    """

    def __init__(self, config: ChainConfig, clients: Iterable[int]) -> None:
        ids = list(clients)
        for cid in ids:
            if type(cid) is not int or not 0 <= cid < SERVER:
                raise ValueError(f"client ids must be ints in [0, 2^32 - 1); found {cid!r}.")
        if len(set(ids)) != len(ids):
            raise ValueError("client ids must be distinct; found duplicates.")
        if len(ids) < config.min_survivors:
            raise ValueError(
                f"{len(ids)} clients invited but min_survivors={config.min_survivors}; invite more clients."
            )
        self.config = config
        self.invited = frozenset(ids)
        self.stage = ServerStage.ADVERTISE
        self.attempt = 0
        self.ring: tuple[int, ...] = ()
        self.survivors: frozenset[int] = frozenset()
        self.history: list[AttemptRecord] = []
        #: after an unlock-stage dropout: the only client set the round may still complete with
        self.fixed: frozenset[int] | None = None
        self.masks_expanded = 0  #: pad expansions of length ``dim`` done to finish the round
        #: every pad seed the server opened, keyed ``(attempt, client)``: its own view, kept for tests
        self.revealed: dict[tuple[int, int], bytes] = {}
        self._public: dict[int, bytes] = {}
        self._position: dict[int, int] = {}
        self._s = 0
        self._bundles: dict[int, tuple[tuple[int, bytes], ...]] = {}
        self._uploaded: set[int] = set()
        self._pads: dict[int, bytes] = {}
        self._spoiled: set[int] = set()
        self._sum: np.ndarray | None = None
        self._shuffle = secrets.SystemRandom().shuffle  # OS CSPRNG
        self._keys = KeyPair.generate()  # authenticates uploads and opens pads (client <-> server, not relayed)
        self._keys_of: dict[int, tuple[bytes, bytes]] = {}  # client -> (upload tag key, pad key)

    @property
    def successors(self) -> int:
        """The effective ``s`` of the current attempt."""
        return self._s

    # -- stage ADVERTISE -----------------------------------------------------------------

    def receive_advert(self, message: bytes) -> None:
        """Accept one ADVERT (raises :class:`MessageError` and changes nothing if invalid)."""
        msg = self._accept(message, Kind.ADVERT)
        assert isinstance(msg, ChainAdvert)
        if msg.sender not in self.invited:
            raise MessageError(f"server stage ADVERTISE: client {msg.sender} was not invited to this round.")
        if msg.sender in self._public:
            raise MessageError(f"server stage ADVERTISE: replayed message from client {msg.sender} (already received).")
        self._public[msg.sender] = msg.public_key

    def close_advertise(self) -> ServerStep:
        """Close ADVERTISE: draw the ring over the advertisers and return their RING messages.

        Raises:
            AbortError: fewer than ``min_survivors`` clients advertised.
        """
        self._require(ServerStage.ADVERTISE, "close_advertise")
        return self._new_attempt(sorted(self._public), reason="advertised")

    # -- stage SHARE ---------------------------------------------------------------------

    def receive_bundle(self, message: bytes) -> None:
        """Accept one BUNDLE of sealed seeds (validated: exactly the sender's successors)."""
        msg = self._accept(message, Kind.BUNDLE)
        assert isinstance(msg, ChainBundle)
        where = f"server stage SHARE (attempt {self.attempt})"
        if msg.sender in self._bundles:
            raise MessageError(f"{where}: replayed message from client {msg.sender} (already received).")
        expected = self._successors_of(msg.sender)
        found = [pid for pid, _ in msg.seeds]
        if found != expected:
            raise MessageError(
                f"{where}: bundle from {msg.sender} addressed to {found}, expected its successors {expected}."
            )
        self._bundles[msg.sender] = msg.seeds

    def close_share(self) -> ServerStep:
        """Close SHARE: relay the seeds, or restart the attempt if a ring member sent none."""
        self._require(ServerStage.SHARE, "close_share")
        if len(self._bundles) != len(self.ring):
            missing = sorted(set(self.ring) - set(self._bundles))
            return self._restart(sorted(self._bundles), reason=f"no seeds from {missing}")
        inbox: dict[int, list[tuple[int, bytes]]] = {cid: [] for cid in self.ring}
        for sender in self.ring:
            for receiver, blob in self._bundles[sender]:
                inbox[receiver].append((sender, blob))
        messages = {
            cid: ChainDelivery(self.config.instance, self.config.round, SERVER, cid,
                               attempt=self.attempt, seeds=tuple(entries)).to_bytes()
            for cid, entries in inbox.items()
        }
        self._bundles = {}
        self._uploaded = set()
        self._sum = np.zeros(self.config.dim, dtype=np.uint64)
        self.stage = ServerStage.UPLOAD
        return ServerStep(Kind.DELIVERY, self.attempt, messages)

    # -- stage UPLOAD --------------------------------------------------------------------

    def receive_upload(self, message: bytes) -> None:
        """Accept one UPLOAD and add it into the running sum (validated and authenticated first).

        A refused upload needs no special care: it is padded by a seed its owner reveals only if
        the attempt completes, which it cannot without a valid upload from that owner.

        Raises:
            MessageError: malformed, replayed, stale or wrong-length upload (state unchanged).
            AuthenticationError: the tag does not verify (tampered vector or header; state
                unchanged; the client counts as dropped unless a valid upload follows).
        """
        msg = self._accept(message, Kind.UPLOAD)
        assert isinstance(msg, ChainUpload) and self._sum is not None
        where = f"server stage UPLOAD (attempt {self.attempt})"
        if msg.sender in self._uploaded:
            raise MessageError(f"{where}: replayed message from client {msg.sender} (already received).")
        width = getattr(msg, "ring_bits", 64)  # format 1 (ChainUpload) is a 64-bit ring's
        if width != self.config.ring_bits:
            raise MessageError(
                f"{where}: upload from {msg.sender} is in a {width}-bit ring, this round's is "
                f"{self.config.ring_bits} bits (ChainConfig.ring_bits); refused."
            )
        if msg.vector.shape != (self.config.dim,):
            raise MessageError(
                f"{where}: upload from {msg.sender} has {msg.vector.size} values, expected dim={self.config.dim}."
            )
        key = self._channel_keys(msg.sender)[0]
        _upload_tag(key, self.config, msg.attempt, msg.sender, msg.vector, tag=msg.tag)
        np.add(self._sum, msg.vector, out=self._sum)
        self._uploaded.add(msg.sender)

    def close_upload(self) -> ServerStep:
        """Close UPLOAD: ask for the pads if every ring member uploaded, else re-run (rule 1)."""
        self._require(ServerStage.UPLOAD, "close_upload")
        if len(self._uploaded) != len(self.ring):
            missing = sorted(set(self.ring) - self._uploaded)
            self._sum = None  # an abandoned attempt's sum is padded: discard it
            return self._restart(sorted(self._uploaded), reason=f"no upload from {missing}")
        self._pads, self._spoiled = {}, set()
        self.stage = ServerStage.UNLOCK
        messages = {
            cid: ChainUnlockRequest(self.config.instance, self.config.round, SERVER, cid,
                                    attempt=self.attempt).to_bytes()
            for cid in self.ring
        }
        return ServerStep(Kind.UNLOCK_REQUEST, self.attempt, messages)

    # -- stage UNLOCK --------------------------------------------------------------------

    def receive_unlock(self, message: bytes) -> None:
        """Accept one UNLOCK: open the sealed pad seed (state unchanged on any error).

        Raises:
            MessageError: malformed, replayed or stale (the sender counts as dropped unless a
                valid one follows).
            AuthenticationError: the sealed pad does not open; if no valid one follows, the
                round aborts at :meth:`close_unlock` (the refused bytes may carry the pad).
        """
        try:
            self._receive_unlock(message)
        except (MessageError, AuthenticationError):
            self._note_spoiled(message)
            raise

    def _receive_unlock(self, message: bytes) -> None:
        msg = self._accept(message, Kind.UNLOCK)
        assert isinstance(msg, ChainUnlock)
        if msg.sender in self._pads:
            raise MessageError(
                f"server stage UNLOCK (attempt {self.attempt}): replayed message from client {msg.sender} "
                "(already received)."
            )
        key = self._channel_keys(msg.sender)[1]
        pad = open_sealed(key, msg.sealed_pad, aad=_unlock_aad(self.config, msg.attempt, msg.sender))
        self._pads[msg.sender] = self.revealed[(self.attempt, msg.sender)] = pad

    def _note_spoiled(self, message: bytes) -> None:
        """Remember a ring member whose unlock for this attempt arrived but was refused."""
        if self.stage is not ServerStage.UNLOCK or not isinstance(message, (bytes, bytearray, memoryview)):
            return
        data = bytes(message[: HEADER_BYTES + 4])
        if len(data) < HEADER_BYTES + 4:
            return
        _, _, _, _, instance, rnd, sender, _, _ = _WIRE_HEADER.unpack_from(data)
        attempt = int.from_bytes(data[HEADER_BYTES:], "big")
        if (instance, rnd, attempt) == (self.config.instance, self.config.round, self.attempt) and (
            sender in self._position and sender not in self._pads
        ):
            self._spoiled.add(sender)

    def close_unlock(self) -> ServerStep:
        """Close UNLOCK: strip the pads and finish, or apply rule 2 of the re-run rule."""
        self._require(ServerStage.UNLOCK, "close_unlock")
        assert self._sum is not None
        if len(self._pads) == len(self.ring):
            accumulate(self._sum, [(self._pads[cid], _PAD_LABEL, True) for cid in self.ring])
            self.masks_expanded = len(self.ring)
            self._pads = {}
            self.survivors = frozenset(self.ring)
            self.history.append(AttemptRecord(self.attempt, self.ring, self.survivors, "complete"))
            self.stage = ServerStage.DONE
            return ServerStep(None, self.attempt, {})
        self._sum, pads = None, self._pads
        self._pads = {}
        missing = sorted(set(self.ring) - set(pads))
        spoiled = sorted(self._spoiled - set(pads))
        if spoiled:
            self._abort(sorted(pads), f"unlocks from {spoiled} arrived but were refused (tampered or malformed) "
                        "and no valid one followed; their bytes may carry the pads, so no re-run can be safe. "
                        "Check the transport.")
        if self.fixed is not None:
            self._abort(sorted(pads), f"no unlock from {missing} in the one re-run allowed after an unlock-stage "
                        "dropout; completing without them would give the server a second sum over another set.")
        self.fixed = frozenset(pads)
        self.history.append(AttemptRecord(self.attempt, self.ring, self.fixed, f"no unlock from {missing}"))
        if self.attempt >= self.config.max_attempts:
            self._abort_max(f"no unlock from {missing}")
        spliced = tuple(cid for cid in self.ring if cid in self.fixed)  # same order: neighbourhoods only merge
        if len(spliced) < self.config.min_survivors:
            self._abort_few(len(spliced), f"no unlock from {missing}")
        return self._start_ring(spliced)

    # -- generic -------------------------------------------------------------------------

    def receive(self, message: bytes) -> None:
        """Dispatch a client message to the receiver of the current stage."""
        receivers = {
            ServerStage.ADVERTISE: self.receive_advert,
            ServerStage.SHARE: self.receive_bundle,
            ServerStage.UPLOAD: self.receive_upload,
            ServerStage.UNLOCK: self.receive_unlock,
        }
        if self.stage not in receivers:
            raise MessageError(f"server stage {self.stage.name}: the round is over; message refused.")
        receivers[self.stage](message)

    def close(self) -> ServerStep:
        """Close the current stage (its deadline passed)."""
        closers = {
            ServerStage.ADVERTISE: self.close_advertise,
            ServerStage.SHARE: self.close_share,
            ServerStage.UPLOAD: self.close_upload,
            ServerStage.UNLOCK: self.close_unlock,
        }
        if self.stage not in closers:
            raise MessageError(f"server stage {self.stage.name}: nothing to close.")
        return closers[self.stage]()

    def result(self) -> np.ndarray:
        """The ``uint64`` sum over :attr:`survivors` mod ``2^ring_bits`` (only after the round completed)."""
        if self.stage is not ServerStage.DONE or self._sum is None:
            raise AbortError(f"no result: the chain round is in stage {self.stage.name}, not DONE.")
        if self.config.ring_bits != 64:
            return self._sum & self.config.ring_mask
        return self._sum.copy()

    # -- internals -----------------------------------------------------------------------

    def _require(self, stage: ServerStage, action: str) -> None:
        if self.stage is not stage:
            raise MessageError(f"server: {action} called in stage {self.stage.name}, expected {stage.name}.")

    def _accept(self, data: bytes, kind: Kind) -> Message:
        """Decode and check stage, kind, instance, round, routing, attempt and membership."""
        where = f"server stage {self.stage.name} (attempt {self.attempt})"
        msg = _receive(data, kind, where=where, config=self.config)
        if kind not in SERVER_ACCEPTS[self.stage]:
            raise MessageError(
                f"{where}: a {kind.name} message from client {msg.sender} arrived outside its stage "
                "(late or early); refused unread."
            )
        if msg.receiver != SERVER:
            raise MessageError(f"{where}: message addressed to {msg.receiver}, not the server.")
        if kind is not Kind.ADVERT:
            if msg.attempt != self.attempt:  # type: ignore[attr-defined]
                raise MessageError(
                    f"{where}: message from client {msg.sender} for attempt {msg.attempt}, "  # type: ignore[attr-defined]
                    f"expected {self.attempt} (stale or replayed)."
                )
            if msg.sender not in self._position:
                raise MessageError(f"{where}: client {msg.sender} is not in this attempt's ring.")
        return msg

    def _channel_keys(self, cid: int) -> tuple[bytes, bytes]:
        keys = self._keys_of.get(cid)
        if keys is None:
            keys = self._keys_of[cid] = _server_channel_keys(self._keys, self._public[cid], self.config)
        return keys

    def _abort(self, completed: Sequence[int], reason: str) -> None:
        self._sum = None
        self.history.append(AttemptRecord(self.attempt, self.ring, frozenset(completed), "aborted"))
        self.stage = ServerStage.ABORTED
        raise AbortError(f"chain round {self.config.round}, attempt {self.attempt}: {reason} No sum produced.")

    def _abort_max(self, reason: str) -> None:
        self.stage = ServerStage.ABORTED
        raise AbortError(
            f"chain round {self.config.round}: attempt {self.attempt} failed ({reason}) and "
            f"max_attempts={self.config.max_attempts} is reached; no sum produced. Raise max_attempts "
            "or lengthen the stage deadlines."
        )

    def _abort_few(self, count: int, reason: str) -> None:
        self.stage = ServerStage.ABORTED
        raise AbortError(
            f"chain round {self.config.round}, attempt {self.attempt + 1}: only {count} clients left "
            f"({reason}), fewer than min_survivors={self.config.min_survivors}; no sum produced."
        )

    def _restart(self, members: Sequence[int], *, reason: str) -> ServerStep:
        if self.fixed is not None:
            self._abort(members, f"{reason} in the one re-run allowed after an unlock-stage dropout; the pads "
                        f"of {sorted(self.fixed)} are known, so the round may only complete with exactly them.")
        self.history.append(AttemptRecord(self.attempt, self.ring, frozenset(members), reason))
        if self.attempt >= self.config.max_attempts:
            self._abort_max(reason)
        return self._new_attempt(members, reason=reason)

    def _new_attempt(self, members: Sequence[int], *, reason: str) -> ServerStep:
        if len(members) < self.config.min_survivors:
            self._abort_few(len(members), reason)
        ring = list(members)
        self._shuffle(ring)
        return self._start_ring(tuple(ring))

    def _start_ring(self, ring: tuple[int, ...]) -> ServerStep:
        """Start the next attempt on an explicit ring order (known-answer core; tests fix it)."""
        self.attempt += 1
        self.ring = ring
        self._position = {cid: i for i, cid in enumerate(ring)}
        self._s = effective_successors(self.config.successors, len(ring))
        self._bundles, self._uploaded, self._sum = {}, set(), None
        self._pads, self._spoiled = {}, set()
        self.stage = ServerStage.SHARE
        messages = {}
        for cid in ring:
            succ = tuple((v, self._public[v]) for v in self._successors_of(cid))
            pred = tuple((w, self._public[w]) for w in self._predecessors_of(cid))
            messages[cid] = ChainRing(self.config.instance, self.config.round, SERVER, cid, attempt=self.attempt,
                                      ring_size=len(ring), server_key=self._keys.public_bytes,
                                      successors=succ, predecessors=pred).to_bytes()
        return ServerStep(Kind.RING, self.attempt, messages)

    def _successors_of(self, cid: int) -> list[int]:
        p, m = self._position[cid], len(self.ring)
        return [self.ring[(p + j) % m] for j in range(1, self._s + 1)]

    def _predecessors_of(self, cid: int) -> list[int]:
        p, m = self._position[cid], len(self.ring)
        return [self.ring[(p - j) % m] for j in range(1, self._s + 1)]
