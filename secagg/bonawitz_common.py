"""What SecAgg/SecAgg+'s client (:mod:`secagg.bonawitz`) and server (:mod:`secagg.bonawitz_server`)
share: the public parameters (:class:`MaskingConfig`), a client's own policy (:class:`ClientPolicy`),
the identity keys and PKI (:class:`SigningKey`, :func:`make_pki`), and the signed digests and checks
both ends compute. :mod:`secagg.bonawitz` re-exports every public name; the protocol is documented there.

Every Ed25519 check of the protocol goes through :func:`_verify` here, looked up at call time
(``bonawitz_common._verify``): one place for the simulation's shared verifications and for the
tests that count them.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from secagg import params, simshare
from secagg.errors import AbortError, MessageError
from secagg.graph import Graph, complete_graph, random_regular_graph
from secagg.messages import INSTANCE_BYTES, SERVER
from secagg.params import min_safe_threshold

__all__ = ["ClientPolicy", "MaskingConfig", "SigningKey", "make_pki"]


# ----------------------------------------------------------------------------------------------
# configuration
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MaskingConfig:
    """Public parameters of one aggregation, identical at every party.

    Attributes:
        n: number of clients.
        dim: vector length (uint64 words).
        t: Shamir threshold out of each client's ``k + 1`` holders.
        graph: ``graph[u]`` = sorted neighbours of ``u`` (complete for SecAgg).
        instance: 16-byte random id of this aggregation (binds every message and key).
        round: round number.
        unsafe_threshold: accept ``t`` at or below half of a client's holders. Such a ``t``
            voids the consistency check: a server that shows two disjoint groups of ``t``
            holders different survivor sets collects the shares of both secrets of one client
            (``tests/secagg/test_masking_attacks.py``). Only for attack demonstrations.
    """

    n: int
    dim: int
    t: int
    graph: Graph
    instance: bytes
    round: int = 0
    unsafe_threshold: bool = False

    def __post_init__(self) -> None:
        if type(self.n) is not int or self.n < 2:
            raise ValueError(f"SecAgg needs n >= 2 clients; found {self.n!r}.")
        if type(self.dim) is not int or not 0 < self.dim < 2**31:
            raise ValueError(f"dim must be an int in [1, 2^31); found {self.dim!r}.")
        if len(self.graph) != self.n:
            raise ValueError(f"graph has {len(self.graph)} adjacency lists; expected n = {self.n}.")
        lens = np.fromiter((len(nb) for nb in self.graph), dtype=np.int64, count=self.n)
        us = np.repeat(np.arange(self.n, dtype=np.int64), lens)
        vs = np.fromiter(itertools.chain.from_iterable(self.graph), dtype=np.int64, count=int(lens.sum()))
        fwd, rev = np.sort(us * self.n + vs), np.sort(vs * self.n + us)
        if (
            vs.size and (vs.min() < 0 or vs.max() >= self.n)
            or np.any(us == vs)
            or not np.array_equal(fwd, rev)
            or np.any(fwd[1:] == fwd[:-1])
        ):
            raise ValueError("graph must be symmetric, without self-loops or repeated neighbours, over clients 0..n-1.")
        min_holders = 1 + min(len(nb) for nb in self.graph)
        if type(self.t) is not int or not 1 <= self.t <= min_holders:
            raise ValueError(
                f"threshold t must be an int in [1, {min_holders}] (k + 1 holders per client); found {self.t!r}."
            )
        if not isinstance(self.instance, bytes) or len(self.instance) != INSTANCE_BYTES:
            raise ValueError(f"instance must be {INSTANCE_BYTES} bytes; found {self.instance!r}.")
        if type(self.unsafe_threshold) is not bool:
            raise ValueError(f"unsafe_threshold must be a bool; found {self.unsafe_threshold!r}.")
        max_holders = 1 + max(len(nb) for nb in self.graph)
        if not self.unsafe_threshold and self.t < min_safe_threshold(max_holders):
            raise ValueError(
                f"threshold t = {self.t} is at or below half of a client's {max_holders} holders: a server that "
                "shows two disjoint groups of t holders different survivor sets collects the shares of both "
                f"secrets of one client. Use t >= {min_safe_threshold(max_holders)}, or pass "
                "unsafe_threshold=True (--unsafe-threshold) to accept that attack (demonstrations only)."
            )

    @classmethod
    def secagg(
        cls, n: int, dim: int, *, t: int | None = None, round: int = 0, unsafe_threshold: bool = False  # noqa: A002
    ) -> MaskingConfig:
        """SecAgg: complete graph; default ``t = floor(2n/3) + 1`` (tolerates < 1/3 dropouts)."""
        t = (2 * n) // 3 + 1 if t is None else t
        return cls(n, dim, t, complete_graph(n), os.urandom(INSTANCE_BYTES), round, unsafe_threshold)

    @classmethod
    def secagg_plus(
        cls,
        n: int,
        dim: int,
        *,
        k: int | None = None,
        t: int | None = None,
        round: int = 0,  # noqa: A002
        dropout: float = params.DEFAULT_DROPOUT,
        corrupt: float = params.DEFAULT_CORRUPT,
        unsafe_threshold: bool = False,
    ) -> MaskingConfig:
        """SecAgg+ over a random k-regular graph.

        Without ``k`` and ``t``, both come from :func:`secagg.params.choose` for ``n``, the planned
        ``dropout`` fraction and the tolerated ``corrupt`` fraction (abort <= 2^-20 with up to
        ``ceil(dropout n)`` dropouts, security failure <= 2^-40); with ``k`` only, ``t`` comes from
        :func:`secagg.params.choose_t`; both raise ``ValueError`` naming the fix when the targets
        cannot be met. Explicit ``k`` and ``t`` are taken as given (``secagg.params.evaluate``
        reports their guarantees).
        """
        if t is None:
            g = params.choose(n, dropout=dropout, corrupt=corrupt) if k is None else params.choose_t(
                n, k, dropout=dropout, corrupt=corrupt)
            k, t = g.k, g.t
        elif k is None:
            k = params.choose(n, dropout=dropout, corrupt=corrupt).k
        graph = random_regular_graph(n, k)
        return cls(n, dim, t, graph, os.urandom(INSTANCE_BYTES), round, unsafe_threshold)

    @property
    def k(self) -> int:
        """The (maximum) degree of the graph."""
        return max(len(nb) for nb in self.graph)

    def holders(self, u: int) -> tuple[int, ...]:
        """Clients holding shares of ``u``'s secrets: its neighbours and itself, sorted."""
        return tuple(sorted((*self.graph[u], u)))

    def info(self, purpose: bytes) -> bytes:
        """HKDF ``info`` binding the instance, round and purpose."""
        return self.instance + struct.pack(">I", self.round) + purpose

    def survivors_digest(self, survivors: Sequence[int]) -> bytes:
        """What a client signs in the consistency check."""
        body = np.asarray(sorted(survivors), dtype=">u4").tobytes()
        return hashlib.sha256(b"secagg/consistency/v1" + self.info(b"") + body).digest()


@dataclass(frozen=True)
class ClientPolicy:
    """What one client insists on whatever the server's parameters say: its operator's settings.

    The server chooses ``n``, ``k``, ``t`` and the survivor set; a client that trusted them would
    let a deviating server sum it with too few others, switch off the consistency check, or ignore
    as many clients as it takes to cut the SecAgg+ graph. These settings come from the client's own
    configuration (a Flower node's ``node_config``, :func:`fedflower.client_state.node_policy`; the
    run's plan in simulation, :class:`secagg.runner.RunSpec`), never from a server message.

    Attributes:
        min_survivors: the client takes part only in an aggregation announced for at least this
            many clients (``n``, refused at ADVERTISE) and signs a survivor set U3 only if it
            holds at least this many clients (refused at CONSISTENCY, so the sum over fewer is
            never unmasked). At least 2: a sum of one client is its input.
        unsafe_threshold: accept a ``t`` at or below half of this client's holders (attack
            demonstrations only; see :class:`MaskingConfig`).
        max_dropout: the largest fraction of the ``n`` announced clients this client lets drop:
            it signs U3 only if ``n - |U3| <= ceil(max_dropout * n)`` (refused at CONSISTENCY).
            SecAgg+'s ``k`` and ``t`` are chosen for a planned dropout fraction
            (:func:`secagg.params.choose`), and its security bound holds only while no more
            clients are missing than planned: a server that, after seeing the graph, ignores
            more clients than that can cut the honest survivors' graph and unmask one part's sum
            (``tests/secagg/test_adaptive_dropout.py``). Default:
            :data:`secagg.params.DEFAULT_DROPOUT`, the library's planned default; set it to the
            fraction the deployment's parameters were chosen for.
    """

    min_survivors: int = 2
    unsafe_threshold: bool = False
    max_dropout: float = params.DEFAULT_DROPOUT

    def __post_init__(self) -> None:
        if type(self.min_survivors) is not int or self.min_survivors < 2:
            raise ValueError(f"min_survivors must be an int >= 2 (a sum of one client is its input); "
                             f"found {self.min_survivors!r}.")
        if type(self.unsafe_threshold) is not bool:
            raise ValueError(f"unsafe_threshold must be a bool; found {self.unsafe_threshold!r}.")
        object.__setattr__(self, "max_dropout", params.check_fraction("max_dropout", self.max_dropout))

    def max_dropped(self, n: int) -> int:
        """How many of ``n`` announced clients may be missing from a survivor set this client signs."""
        return math.ceil(self.max_dropout * n - 1e-9)


class SigningKey:
    """A client's long-term Ed25519 identity key (registered in the PKI out of band)."""

    def __init__(self, private: Ed25519PrivateKey | None = None) -> None:
        self._sk = private or Ed25519PrivateKey.generate()
        self.public_bytes = self._sk.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def __repr__(self) -> str:
        return f"SigningKey(public={self.public_bytes.hex()[:16]}...)"

    def sign(self, data: bytes) -> bytes:
        """Ed25519 signature of ``data``."""
        return self._sk.sign(data)


def make_pki(n: int) -> tuple[list[SigningKey], dict[int, bytes]]:
    """Trusted setup for a simulation: one identity key per client and the public directory."""
    keys = [SigningKey() for _ in range(n)]
    return keys, {i: k.public_bytes for i, k in enumerate(keys)}


def _verify_now(public: bytes, sig: bytes, data: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(sig, data)
        return True
    except (InvalidSignature, ValueError, TypeError):
        return False


def _verify(pki: Mapping[int, bytes], who: int, sig: bytes, data: bytes) -> bool:
    """Ed25519 check of ``sig`` on ``data`` under ``who``'s directory key; inside a simulation's
    :func:`secagg.simshare.shared_work` memoised by the exact (key, signature, message) triple."""
    public = pki.get(who)
    if public is None:
        return False
    memo = simshare.active()
    if memo is None or not isinstance(sig, (bytes, bytearray)) or not isinstance(data, (bytes, bytearray)):
        return _verify_now(public, sig, data)
    return memo.verify(public, sig, data, lambda: _verify_now(public, sig, data))


def _commit_seed(cfg: MaskingConfig, who: int, b: bytes) -> bytes:
    """Hiding, binding commitment to a 256-bit random seed: SHA-256 with domain and context."""
    return hashlib.sha256(b"secagg/commit-b/v1" + cfg.info(b"") + struct.pack(">I", who) + b).digest()


def _advert_digest(cfg: MaskingConfig, who: int, c_pk: bytes, s_pk: bytes) -> bytes:
    return b"secagg/advertise/v1" + cfg.info(b"") + struct.pack(">I", who) + c_pk + s_pk


def _input_digest(cfg: MaskingConfig, who: int, y: np.ndarray) -> bytes:
    """What a client signs with its masked input: instance, round, sender and SHA-256(y)."""
    body = hashlib.sha256(memoryview(np.ascontiguousarray(y, dtype="<u8")).cast("B")).digest()
    return b"secagg/masked-input/v1" + cfg.info(b"") + struct.pack(">I", who) + body


def _check_distinct_keys(keys: Sequence[tuple[int, bytes]], where: str) -> None:
    """Bonawitz et al.'s ShareKeys check: all advertised public keys differ (both kinds, all owners).

    A client that re-advertises another client's mask key under its own signature would make a
    third client's pairwise masks with the two cancel (exposing its input to the normal unmask)
    and the sum wrong; one that copies an encryption key would receive shares sealed for another.

    Raises:
        MessageError: naming the two owners of the duplicated key.
    """
    seen: dict[bytes, int] = {}
    for who, key in keys:
        key = bytes(key)
        if key in seen:
            raise MessageError(
                f"{where}: duplicate public key advertised by clients {seen[key]} and {who} (all advertised keys "
                "must differ); refusing to go on with this key set"
            )
        seen[key] = who


def check_client_message(msg, *, round: int, n: int, name: str) -> int:  # noqa: A002, ANN001
    """A server's routing check of a client message (SecAgg and the reused setup alike): this round,
    addressed to the server, from a client id in range; returns the sender (``MessageError`` otherwise)."""
    if msg.round != round:
        raise MessageError(f"stage {name}: wrong round {msg.round} (expected {round})")
    if msg.receiver != SERVER or not 0 <= msg.sender < n:
        raise MessageError(f"stage {name}: bad sender {msg.sender} or receiver {msg.receiver}")
    return msg.sender


def require_new(u: int, allowed, done, name: str) -> None:  # noqa: ANN001
    """A server's stage check: ``u`` survived the previous stage (is in ``allowed``) and has not been heard
    from in this one (is not in ``done``); ``MessageError`` otherwise."""
    if u not in allowed:
        raise MessageError(f"stage {name}: client {u} is not in the previous stage's survivor set")
    if u in done:
        raise MessageError(f"stage {name}: replayed message from client {u} (already received)")


def check_survivors(survivors: Sequence[int], *, me: int, n: int, nbrs: frozenset[int], u2: frozenset[int],
                    policy: ClientPolicy, t: int, scope: str = "") -> frozenset[int]:
    """A client's consistency check of the server's survivor list ``U3`` before it signs (SecAgg and the
    reused setup's instances alike); returns ``U3``.

    Refuses (``MessageError``) a list that is unsorted or repeats an id, omits this client, names an id
    out of range, or names a neighbour whose shares never reached this client (``U3`` must lie within
    ``U2``); aborts (``AbortError``) below the client's ``min_survivors``, beyond its ``max_dropout``, or
    with fewer than ``t`` of its holders alive. ``scope`` (e.g. ``" in this instance"``) is added to the
    words of the ``U2`` refusal.
    """
    u3 = frozenset(survivors)
    if len(u3) != len(survivors) or list(survivors) != sorted(u3):
        raise MessageError("stage CONSISTENCY: survivor list must be sorted without duplicates")
    if me not in u3:
        raise MessageError(f"stage CONSISTENCY: survivor list omits this client ({me})")
    if any(not 0 <= v < n for v in u3):
        raise MessageError("stage CONSISTENCY: survivor id out of range")
    ghosts = (u3 & nbrs) - u2
    if ghosts:
        raise MessageError(f"stage CONSISTENCY: the survivor list names neighbours {sorted(ghosts)[:8]} whose shares "
                           f"never reached this client{scope} (U3 must lie within U2); it does not sign")
    if len(u3) < policy.min_survivors:
        raise AbortError(f"stage CONSISTENCY: {len(u3)} survivors, below this client's min_survivors = "
                         f"{policy.min_survivors}; it does not sign (the sum is never unmasked)")
    missing, allowed = n - len(u3), policy.max_dropped(n)
    if missing > allowed:
        raise AbortError(f"stage CONSISTENCY: {missing} of the n = {n} announced clients are missing "
                         f"from the survivor set, more than the {allowed} this client's max_dropout = "
                         f"{policy.max_dropout:g} allows; it does not sign (the sum is never unmasked)")
    live = len(u3 & (u2 | {me}) & (nbrs | {me}))
    if live < t:
        raise AbortError(f"stage CONSISTENCY: {live} of this client's holders survived, fewer than t = {t}")
    return u3


def route_shares(shares: Mapping[int, Sequence[tuple[int, bytes]]], u2: frozenset[int]) -> dict[int, list[tuple[int, bytes]]]:
    """The server's forwarding at the close of the share stage: for each client in ``U2``, the
    ``(sender, ciphertext)`` pairs addressed to it, senders in increasing order (a ciphertext for a
    client outside ``U2`` is dropped with its addressee)."""
    inbox: dict[int, list[tuple[int, bytes]]] = {u: [] for u in u2}
    for sender in sorted(u2):
        for receiver, ct in shares[sender]:
            if receiver in inbox:
                inbox[receiver].append((sender, ct))
    return inbox


def holder_signatures(cfg: MaskingConfig, signatures: Mapping[int, bytes]) -> dict[int, tuple[tuple[int, bytes], ...]]:
    """The server's UNMASK request contents: for each client that signed the survivor set, the
    signatures of its holders (``cfg.holders(u)``) that signed too, in holder order."""
    return {u: tuple((v, signatures[v]) for v in cfg.holders(u) if v in signatures) for u in sorted(signatures)}
