"""SecAgg (Bonawitz et al. 2017) and SecAgg+ (Bell et al. 2020) as transport-agnostic state machines.

Parties:
    ``n`` clients (ids ``0..n-1``), each holding a ``uint64`` vector of length ``dim``, and one
    aggregation server that relays every message. A public-key infrastructure (``pki``: client id
    -> Ed25519 verification key) is set up out of band; the runner plays that trusted setup.

Adversary:
    An honest-but-curious server, possibly colluding with fewer than ``t`` clients *among the
    holders of any one client's shares* (for SecAgg all clients; for SecAgg+ the client's ``k``
    neighbours plus itself). Clients may drop out at any stage. Messages are authenticated (AEAD
    for relayed shares, Ed25519 signatures under the PKI for advertised keys, masked inputs and
    the survivor set), so a server or network that tampers with, replays or reroutes them is
    detected; the signed consistency check stops a server from telling different clients
    different survivor sets, which needs ``t`` above half of a client's ``k + 1`` holders (a
    lower ``t`` is refused unless the client's own :class:`ClientPolicy` sets
    ``unsafe_threshold``: two disjoint groups of holders shown different sets would hand over
    both secrets of one client). The server also chooses whom to treat as dropped, possibly after
    seeing the graph: each client's own :class:`ClientPolicy` (its operator's settings, never the
    server's) bounds what that buys it. A client signs a survivor set only if it holds at least
    ``min_survivors`` clients, misses at most ``ceil(max_dropout * n)`` of the ``n`` announced
    ones (the dropout SecAgg+'s parameters were chosen for: ignoring more, an adaptive server cuts
    the graph and unmasks one part, ``tests/secagg/test_adaptive_dropout.py``), and names none of
    its neighbours whose shares never reached it (U3 within U2). All advertised public keys
    must differ (Bonawitz et al.'s ShareKeys check; a colluder re-advertising another client's
    mask key would make a third client's masks cancel). A holder that reveals a wrong share is
    detected (the rebuilt self-mask seed must match the SHA-256 commitment its owner sent with
    its shares; a rebuilt mask key must match the advertised public key) and the round aborts.
    Not covered: robust reconstruction around such a holder (no retry with other share
    subsets), validation of inputs beyond their length, and a malicious server choosing the
    SecAgg+ graph (the graph is a public parameter fixed before the round; SecAgg+'s ``k`` and
    ``t`` come from :mod:`secagg.params`).

Promise:
    The server obtains the exact sum in Z_(2^64) of the inputs of the clients in U3 (those whose
    masked input arrived) when every client in U3 follows the protocol, or a clean
    :class:`~secagg.errors.AbortError`. A deviation the protocol can see (a wrong share, a key
    that does not match, a repeated key, an altered message) aborts or excludes the deviator; a
    client in U3 that deviates otherwise can shift the sum by an amount of its choosing, exactly
    as if it had chosen another input (inputs are not validated, so no check can tell the two
    apart). Its view is simulatable from that sum alone: every masked upload is uniform given the
    others. No honest client ever reveals both its self-mask-seed share and its mask-key share of
    the same client, nor signs a survivor set smaller than its ``min_survivors`` or missing more
    clients than its ``max_dropout`` allows. Limits (each shown by a test): ``t`` colluding holders
    of a client plus the server reconstruct its self-mask seed and mask key and hence its input;
    with ``|U3| = 2`` each survivor learns the other's input from the sum (a client's
    ``min_survivors`` can demand more); within the planned dropouts a server choosing them after
    seeing the graph may still cut it, with the probability
    :func:`secagg.params.adaptive_partition` bounds. docs/security.md lists every promise with its
    test.

Stages (one method per stage on each side, driven by the server)::

    client: INIT --advertise--> ADVERTISED --share_keys--> SHARED --mask_input--> MASKED
            --sign_survivors--> SIGNED --unmask--> DONE
    server: ADVERTISE --broadcast_keys--> SHARE_KEYS --forward_shares--> MASKED_INPUT
            --request_consistency--> CONSISTENCY --request_unmask--> UNMASK --finish--> DONE

1. ADVERTISE: each client sends two fresh X25519 public keys (``c`` for the share channel,
   ``s`` for pairwise masks), signed. U1 = senders.
2. SHARE_KEYS: the server sends each client its neighbours' keys in U1 (the client checks
   every signature and that no key repeats, its own included). The client draws a
   32-byte self-mask seed ``b``, Shamir-shares ``b`` and the raw ``s`` private key t-of-(k+1)
   among its holders (neighbours and itself), and seals each neighbour's pair of shares with
   AES-256-GCM under ``HKDF(X25519(c_u, c_v))``, the AAD binding instance, round, sender,
   receiver and kind; it also sends the server ``SHA-256(context || b)``. U2 = senders.
3. MASKED_INPUT: the server forwards each client the ciphertexts addressed to it. The client
   sends ``y = x + PRG(b) + sum_{v in N(u) & U2} sign(u, v) PRG(s_uv)``, where
   ``s_uv = HKDF(X25519(s_u, s_v))`` and ``sign = +1`` if ``u < v`` else ``-1``, signed over
   (instance, round, sender, SHA-256(y)). U3 = senders.
4. CONSISTENCY: the server sends U3 to every client in U3; each checks it against its own state
   and policy (sorted, itself included, every neighbour listed in its U2, at least
   ``min_survivors`` clients, at most ``ceil(max_dropout * n)`` missing, at least ``t`` of its
   holders) and signs (instance, round, U3).
5. UNMASK: the server sends each signer its holders' signatures; the client checks at least
   ``t`` valid ones on the same U3, then reveals, for each neighbour ``v`` in U2, the share of
   ``b_v`` if ``v`` is in U3 or the share of ``s_v`` otherwise (never both). It never reveals
   an ``s`` share of a client in U3 nor a ``b`` share of one outside it.
6. finish: the server reconstructs (one vectorised Shamir combine for all owners), removes the
   self masks of U3 and the pairwise masks between U2 minus U3 and U3, and returns the sum.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from secagg import bonawitz_common as _common
from secagg import prg, shamir
from secagg.bonawitz_common import (  # noqa: F401 (re-exported here)
    ClientPolicy, MaskingConfig, SigningKey, _advert_digest, _check_distinct_keys, _commit_seed, _input_digest,
    check_survivors,
    _verify, make_pki,
)
from secagg.bonawitz_wire import (  # noqa: F401 (the wire format, re-exported here)
    _KIND_B, _KIND_S, _SHARE_PT,
    CLIENT_TRANSITIONS, COMMIT_BYTES, SEED_BYTES, SERVER_TRANSITIONS, SHARE_BYTES,
    AdvertiseKeys, ClientStage, ConsistencySignature, EncryptedShares, ForwardedShares, KeyBroadcast,
    MaskedInput, ServerStage, SurvivorList, UnmaskRequest, UnmaskResponse,
)
from secagg.channel import associated_data, open_sealed, seal
from secagg.errors import AbortError, AuthenticationError, MessageError
from secagg.keys import KEY_BYTES, KeyPair
from secagg.messages import SERVER, Message
from secagg.params import min_safe_threshold

__all__ = [
    "CLIENT_TRANSITIONS",
    "SERVER_TRANSITIONS",
    "AdvertiseKeys",
    "ClientPolicy",
    "ClientStage",
    "ConsistencySignature",
    "EncryptedShares",
    "ForwardedShares",
    "KeyBroadcast",
    "MaskedInput",
    "MaskingConfig",
    "MaskingClient",
    "MaskingServer",
    "ServerStage",
    "SigningKey",
    "SurvivorList",
    "UnmaskRequest",
    "UnmaskResponse",
    "make_pki",
]



# ----------------------------------------------------------------------------------------------
# client
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Advertised:
    c: KeyPair
    s: KeyPair


@dataclass(frozen=True)
class _Shared:
    c: KeyPair
    s: KeyPair
    b: bytes
    peers_s_pk: Mapping[int, bytes]  # neighbours in U1 (not self)
    enc_keys: Mapping[int, bytes]  # neighbour -> AEAD key
    own_b_share: bytes
    own_s_share: bytes


@dataclass(frozen=True)
class _Masked:
    received: Mapping[int, tuple[bytes, bytes]]  # neighbour in U2 -> (its b share, its s share) held by me
    u2: frozenset[int]
    own_b_share: bytes


@dataclass(frozen=True)
class _Signed:
    received: Mapping[int, tuple[bytes, bytes]]
    u2: frozenset[int]
    #: U3 within this client's neighbourhood and itself (all the unmask consults; the whole list of n
    #: ids held by each of n simulated clients was the simulation's O(n^2) memory peak)
    u3: frozenset[int]
    own_b_share: bytes
    #: the digest of the signed U3, checked against the holders' signatures at UNMASK
    digest: bytes


class MaskingClient:
    """One SecAgg/SecAgg+ client (see the module docstring for the stages)."""

    def __init__(self, cfg: MaskingConfig, client_id: int, identity: SigningKey, pki: Mapping[int, bytes],
                 policy: ClientPolicy | None = None) -> None:
        if type(client_id) is not int or not 0 <= client_id < cfg.n:
            raise ValueError(f"client_id must be in [0, {cfg.n}); found {client_id!r}.")
        self.cfg = cfg
        #: the client's own settings (:class:`ClientPolicy`); the default refuses an unsafe ``t``
        #: even when the server's configuration opted into it
        self.policy = ClientPolicy() if policy is None else policy
        self.id = client_id
        self._identity = identity
        self._pki = pki
        self.stage = ClientStage.INIT
        self._state: object = None
        self._nbrs = frozenset(cfg.graph[client_id])

    def require_survivors(self, minimum: int) -> None:
        """Raise this aggregation's ``min_survivors`` to ``minimum`` (never lower it).

        For a caller whose input must never be unmasked over fewer clients than the node's floor
        allows (a distributed-DP noise share sized for ``minimum`` survivors): the survivor set is
        then refused at CONSISTENCY below ``max(policy.min_survivors, minimum)``. Allowed until
        the survivor set is signed.

        Raises:
            ValueError: ``minimum`` is not an int >= 2.
            MessageError: the survivor set was already signed.
            AbortError: ``minimum`` exceeds the ``n`` announced clients (no survivor set can reach it).
        """
        if self.stage in (ClientStage.SIGNED, ClientStage.DONE):
            raise MessageError(f"client {self.id}: min_survivors can only be raised before the survivor set is signed")
        if type(minimum) is not int or minimum < 2:
            raise ValueError(f"min_survivors must be an int >= 2 (a sum of one client is its input); found {minimum!r}.")
        policy = replace(self.policy, min_survivors=max(self.policy.min_survivors, minimum))
        if policy.min_survivors > self.cfg.n:
            raise AbortError(f"an aggregation of n = {self.cfg.n} clients is below this input's min_survivors = "
                             f"{policy.min_survivors}; it is not masked")
        self.policy = policy

    # -- helpers -------------------------------------------------------------------------------
    def _enter(self, method: str) -> None:
        need, _ = CLIENT_TRANSITIONS[method]
        if self.stage != need:
            raise MessageError(
                f"client {self.id}: {method} is not allowed in stage {self.stage.name} (expected {need.name})"
            )

    def _leave(self, method: str, state: object) -> None:
        self._state = state
        self.stage = CLIENT_TRANSITIONS[method][1]

    def _check_header(self, msg: Message, stage_name: str) -> None:
        cfg = self.cfg
        if msg.instance != cfg.instance:
            raise MessageError(f"stage {stage_name}: message for another protocol instance")
        if msg.round != cfg.round:
            raise MessageError(f"stage {stage_name}: wrong round {msg.round} (expected {cfg.round})")
        if msg.sender != SERVER or msg.receiver != self.id:
            raise MessageError(
                f"stage {stage_name}: message from {msg.sender} to {msg.receiver}, expected server -> {self.id}"
            )

    def _head(self) -> dict:
        return {"instance": self.cfg.instance, "round": self.cfg.round, "sender": self.id, "receiver": SERVER}

    def _aad(self, sender: int, receiver: int) -> bytes:
        return associated_data(
            instance=self.cfg.instance, round=self.cfg.round, sender=sender, receiver=receiver, kind="secagg/share"
        )

    # -- stages ------------------------------------------------------------------------------
    def advertise(self) -> AdvertiseKeys:
        """Stage 1: fresh X25519 keys for the share channel (``c``) and the masks (``s``)."""
        self._enter("advertise")
        holders = len(self._nbrs) + 1
        if self.cfg.n < self.policy.min_survivors:
            raise AbortError(f"stage ADVERTISE: an aggregation of n = {self.cfg.n} clients is below this client's "
                             f"min_survivors = {self.policy.min_survivors}; it does not take part")
        if not self.policy.unsafe_threshold and self.cfg.t < min_safe_threshold(holders):
            raise AbortError(f"stage ADVERTISE: threshold t = {self.cfg.t} is at or below half of this client's "
                             f"{holders} holders; it refuses unless its own policy sets unsafe_threshold")
        c, s = KeyPair.generate(), KeyPair.generate()
        sig = self._identity.sign(_advert_digest(self.cfg, self.id, c.public_bytes, s.public_bytes))
        self._leave("advertise", _Advertised(c, s))
        return AdvertiseKeys(**self._head(), c_pk=c.public_bytes, s_pk=s.public_bytes, sig=sig)

    def share_keys(self, blob: bytes) -> EncryptedShares:
        """Stage 2: verify neighbours' keys, Shamir-share ``b`` and ``s_sk``, seal the shares."""
        self._enter("share_keys")
        msg = KeyBroadcast.from_bytes(blob)
        self._check_header(msg, "SHARE_KEYS")
        st: _Advertised = self._state  # type: ignore[assignment]
        cfg = self.cfg
        peers: dict[int, tuple[bytes, bytes]] = {}
        seen_self = False
        for who, rec in msg.entries:
            if who in peers or (who == self.id and seen_self):
                raise MessageError(f"stage SHARE_KEYS: client {who} listed twice")
            if who != self.id and who not in self._nbrs:
                raise MessageError(f"stage SHARE_KEYS: client {who} is not a neighbour of {self.id}")
            c_pk, s_pk, sig = rec[:KEY_BYTES], rec[KEY_BYTES : 2 * KEY_BYTES], rec[2 * KEY_BYTES :]
            if not _common._verify(self._pki, who, sig, _advert_digest(cfg, who, c_pk, s_pk)):
                raise AuthenticationError("authenticated decryption failed")
            if who == self.id:
                if (c_pk, s_pk) != (st.c.public_bytes, st.s.public_bytes):
                    raise MessageError("stage SHARE_KEYS: the server relayed a wrong key for this client")
                seen_self = True
                continue
            peers[who] = (c_pk, s_pk)
        own = [(self.id, st.c.public_bytes), (self.id, st.s.public_bytes)]
        _check_distinct_keys(own + [(v, key) for v, pair in peers.items() for key in pair], "stage SHARE_KEYS")
        if len(peers) + 1 < cfg.t:
            raise AbortError(
                f"stage SHARE_KEYS: client {self.id} has {len(peers) + 1} live holders, fewer than t = {cfg.t}"
            )
        b = os.urandom(SEED_BYTES)
        holders = sorted((*peers, self.id))
        vals = shamir.split_many([b, st.s.private_bytes()], t=cfg.t, xs=[h + 1 for h in holders])
        out = []
        enc_keys = {}
        own = None
        for i, h in enumerate(holders):
            b_sh = shamir.encode_share(SEED_BYTES, vals[i, 0])
            s_sh = shamir.encode_share(SEED_BYTES, vals[i, 1])
            if h == self.id:
                own = (b_sh, s_sh)
                continue
            key = st.c.agree(peers[h][0], info=cfg.info(b"secagg/enc"))
            enc_keys[h] = key
            pt = _SHARE_PT.pack(self.id, h, b_sh, s_sh)
            out.append((h, seal(key, pt, aad=self._aad(self.id, h))))
        assert own is not None
        self._leave(
            "share_keys",
            _Shared(st.c, st.s, b, {v: pk[1] for v, pk in peers.items()}, enc_keys, own[0], own[1]),
        )
        return EncryptedShares(**self._head(), b_commit=_commit_seed(cfg, self.id, b), shares=tuple(out))

    def mask_input(self, blob: bytes, x: np.ndarray) -> MaskedInput:
        """Stage 3: open the shares addressed to me and send the masked input."""
        self._enter("mask_input")
        msg = ForwardedShares.from_bytes(blob)
        self._check_header(msg, "MASKED_INPUT")
        st: _Shared = self._state  # type: ignore[assignment]
        cfg = self.cfg
        x = np.asarray(x)
        if x.dtype != np.uint64 or x.shape != (cfg.dim,):
            raise ValueError(f"input must be a uint64 vector of length {cfg.dim} (encode it first); found {x.dtype} {x.shape}.")
        received: dict[int, tuple[bytes, bytes]] = {}
        for sender, ct in msg.shares:
            if sender in received:
                raise MessageError(f"stage MASKED_INPUT: replayed shares from client {sender}")
            if sender not in st.enc_keys:
                raise MessageError(f"stage MASKED_INPUT: shares from {sender}, not a neighbour in U1")
            pt = open_sealed(st.enc_keys[sender], ct, aad=self._aad(sender, self.id))
            owner, holder, b_sh, s_sh = _SHARE_PT.unpack(pt)
            if owner != sender or holder != self.id:
                raise AuthenticationError("authenticated decryption failed")
            received[sender] = (b_sh, s_sh)
        if len(received) + 1 < cfg.t:
            raise AbortError(
                f"stage MASKED_INPUT: client {self.id} has {len(received) + 1} holders in U2, fewer than t = {cfg.t}"
            )
        y = x.copy()
        info = cfg.info(b"secagg/mask")
        masks = [(st.b, b"self", False)]
        masks += [(st.s.agree(st.peers_s_pk[v], info=info), b"pair", self.id > v) for v in received]
        prg.accumulate(y, masks)
        self._leave("mask_input", _Masked(received, frozenset(received) | {self.id}, st.own_b_share))
        return MaskedInput(**self._head(), y=y, sig=self._identity.sign(_input_digest(cfg, self.id, y)))

    def sign_survivors(self, blob: bytes) -> ConsistencySignature:
        """Stage 4: check and sign U3 (the consistency check)."""
        self._enter("sign_survivors")
        msg = SurvivorList.from_bytes(blob)
        self._check_header(msg, "CONSISTENCY")
        st: _Masked = self._state  # type: ignore[assignment]
        u3 = check_survivors(msg.survivors, me=self.id, n=self.cfg.n, nbrs=self._nbrs, u2=st.u2,
                             policy=self.policy, t=self.cfg.t)
        digest = self.cfg.survivors_digest(msg.survivors)
        sig = self._identity.sign(digest)
        self._leave("sign_survivors", _Signed(st.received, st.u2, u3 & (self._nbrs | {self.id}), st.own_b_share,
                                              digest))
        return ConsistencySignature(**self._head(), sig=sig)

    def unmask(self, blob: bytes) -> UnmaskResponse:
        """Stage 5: verify >= t signatures on U3, then reveal exactly one share kind per neighbour."""
        self._enter("unmask")
        msg = UnmaskRequest.from_bytes(blob)
        self._check_header(msg, "UNMASK")
        st: _Signed = self._state  # type: ignore[assignment]
        digest = st.digest
        # the decision is "at least t valid signatures from holders in U3": checking stops at the t-th
        # valid one (the same decision as checking them all, for t instead of k + 1 verifications)
        valid: set[int] = set()
        for who, sig in msg.signatures:
            if len(valid) >= self.cfg.t:
                break
            if (who not in valid and who in st.u3  # (st.u3 holds only neighbours and this client)
                    and _common._verify(self._pki, who, sig, digest)):
                valid.add(who)
        if len(valid) < self.cfg.t:
            raise AbortError(
                f"stage UNMASK: only {len(valid)} valid consistency signatures from holders, fewer than t = {self.cfg.t}"
            )
        out = [(self.id, _KIND_B, st.own_b_share)]
        for v, (b_sh, s_sh) in sorted(st.received.items()):
            out.append((v, _KIND_B, b_sh) if v in st.u3 else (v, _KIND_S, s_sh))
        self._leave("unmask", None)
        return UnmaskResponse(**self._head(), shares=tuple(out))


# the server lives in secagg/bonawitz_server.py (imported last: it uses the helpers above)
from secagg.bonawitz_server import MaskingServer  # noqa: E402
