"""One SecAgg/SecAgg+ key setup reused by a round's several (possibly dependent) secure sums.

A round that sums twice (LightFR's rated union, then the values over it) pays SecAgg's public-key
setup (fresh X25519 keys, their signatures, ``k + 1`` verifications and ``2k`` agreements per
client) once per sum. Here the setup runs once per round and every *instance* of the round costs
only symmetric work plus its own signatures. docs/secagg.md "One setup per round" proves the joint
view reveals only the sums and states the cost.

Parties, adversary and promise: as :mod:`secagg.bonawitz` (an honest-but-curious server colluding
with fewer than ``t`` of any one client's ``k + 1`` holders; clients drop at any stage; every
relayed message authenticated), over a *sequence* of instances ``i = 0, 1, ...`` of one setup.
The server learns each instance's sum over that instance's survivors U3^(i) and nothing else.

Setup (once): each client advertises two fresh X25519 keys ``c_u`` (channel) and ``s_u`` (masks),
signed under its identity key; it verifies its neighbours' adverts and derives, per live neighbour
``v``, the channel key ``e_uv = HKDF(X25519(c_u, c_v))`` and the master pairwise secret
``m_uv = HKDF(X25519(s_u, s_v))``. Nothing about ``s_u`` is ever Shamir-shared.

Instance ``i`` (its id ``I_i = SHA-256(domain || setup id || round || i)[:16]`` binds every message,
AAD, commitment and signature; a message of one instance is refused in another):

1. SHARE: a fresh self-mask seed ``b_u^(i)`` (``os.urandom``), Shamir-shared t-of-(holders) among
   the client's live holders, each share sealed under ``e_uv`` with AAD (``I_i``, round, sender,
   receiver); a commitment to ``b_u^(i)``. U2^(i) = senders.
2. MASKED_INPUT: ``s_uv^(i) = HMAC-SHA256(m_uv, domain || I_i || round || min(u,v) || max(u,v))``;
   ``y = x + PRG(b_u^(i)) + sum_{v in N(u) & U2^(i)} sign(u, v) PRG(s_uv^(i))``, signed. U3^(i).
3. CONSISTENCY: as SecAgg (signed U3^(i), under ``I_i``).
4. UNMASK: after ``t`` valid holder signatures on U3^(i), the client reveals the ``b^(i)`` share of
   every neighbour in U3^(i) and its own, and for every neighbour ``v`` in U2^(i) but not U3^(i)
   **its own per-instance seed** ``s_uv^(i)`` (never both for one neighbour in one instance, and
   never anything from which ``m_uv`` or ``s_u`` follows). The server strips the survivors' self
   masks and, with the revealed seeds, the masks between survivors and dropped clients.

Rules that make the reuse safe (tests: ``tests/secagg/test_reuse.py``):

* a client takes part in instance ``i + 1`` only after it completed instance ``i``'s unmask (so a
  client the server declares dropped in an instance takes no part in the setup's later ones), and
  from then on treats every neighbour missing from a signed U3^(j), ``j <= i``, as gone (it neither
  shares with it nor masks with it);
* the long-term ``s_u`` is never shared: if a client drops in a later instance, no one can rebuild
  ``m_uv`` and unmask an earlier instance it completed (the trap of a naive reuse that shares
  ``s_u`` once and rebuilds it on a dropout, shown by a test to unmask the earlier input).

Cost of the choice: a survivor with a neighbour that dropped before masking must itself answer the
unmask (it alone can reveal that pair's seed); SecAgg instead rebuilds the dropped client's key
from any ``t`` holders. Such an instance aborts if that survivor is silent at the unmask.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from secagg import prg, shamir
from secagg import bonawitz_common as _common
from secagg.bonawitz_common import (
    ClientPolicy, MaskingConfig, SigningKey, _check_distinct_keys, check_survivors, holder_signatures, route_shares,
)
from secagg.bonawitz_wire import (
    SEED_BYTES, SHARE_BYTES, AdvertiseKeys, ConsistencySignature, KeyBroadcast, MaskedInput,
    SurvivorList, UnmaskRequest,
)
from secagg.channel import associated_data, open_sealed, seal
from secagg.errors import AbortError, AuthenticationError, MessageError
from secagg.keys import KEY_BYTES, KeyPair
from secagg.messages import SERVER, Message, decode
from secagg.params import min_safe_threshold
from secagg.reuse_wire import (
    B_SHARE_PT, REUSE_CLIENT_TRANSITIONS, REUSE_SERVER_TRANSITIONS, ForwardedInstanceShares, InstanceShares,
    ReuseClientStage, ReuseStage, UnmaskReveal,
)

__all__ = ["ReuseClient", "ReuseServer", "instance_id", "pair_seed"]

_R = struct.Struct(">I")


def instance_id(cfg: MaskingConfig, index: int) -> bytes:
    """The public 16-byte id of instance ``index`` of the setup ``cfg`` (bound into all its messages)."""
    if type(index) is not int or not 0 <= index < 2**32:
        raise ValueError(f"instance index must be an int in [0, 2^32); found {index!r}.")
    return hashlib.sha256(b"secagg/reuse/instance/v1" + cfg.instance + _R.pack(cfg.round) + _R.pack(index)).digest()[:16]


def pair_seed(master: bytes, inst: bytes, round_: int, u: int, v: int) -> bytes:
    """``s_uv^(i)``: the pair's per-instance mask seed, HMAC-SHA256 keyed by the master secret ``m_uv``
    (a PRF: seeds of different instances are independent to anyone without ``m_uv``)."""
    lo, hi = min(u, v), max(u, v)
    return hmac.digest(master, b"secagg/reuse/pair/v1" + inst + _R.pack(round_) + _R.pack(lo) + _R.pack(hi), "sha256")


def _info(inst: bytes, round_: int, purpose: bytes) -> bytes:
    return inst + _R.pack(round_) + purpose


def _advert_digest(cfg: MaskingConfig, who: int, c_pk: bytes, s_pk: bytes) -> bytes:
    return b"secagg/reuse/advertise/v1" + cfg.info(b"") + _R.pack(who) + c_pk + s_pk


def _commit(inst: bytes, round_: int, who: int, b: bytes) -> bytes:
    return hashlib.sha256(b"secagg/reuse/commit-b/v1" + _info(inst, round_, b"") + _R.pack(who) + b).digest()


def _input_digest(inst: bytes, round_: int, who: int, y: np.ndarray) -> bytes:
    body = hashlib.sha256(memoryview(np.ascontiguousarray(y, dtype="<u8")).cast("B")).digest()
    return b"secagg/reuse/masked-input/v1" + _info(inst, round_, b"") + _R.pack(who) + body


def _survivors_digest(inst: bytes, round_: int, survivors: Sequence[int]) -> bytes:
    body = np.asarray(sorted(survivors), dtype=">u4").tobytes()
    return hashlib.sha256(b"secagg/reuse/consistency/v1" + _info(inst, round_, b"") + body).digest()


def _aad(inst: bytes, round_: int, sender: int, receiver: int) -> bytes:
    return associated_data(instance=inst, round=round_, sender=sender, receiver=receiver, kind="secagg/reuse/share")


@dataclass
class _Instance:
    """A client's state inside one instance."""

    index: int
    inst: bytes
    dim: int
    b: bytes
    own_share: bytes
    received: dict[int, bytes] | None = None  # neighbour in U2 -> its b share held by me
    u2: frozenset[int] = frozenset()
    #: U3 within this client's neighbourhood and itself (all the unmask consults), and its signed digest
    u3: frozenset[int] = frozenset()
    digest: bytes = b""


class ReuseClient:
    """One client of a reused setup (see the module docstring)."""

    def __init__(self, cfg: MaskingConfig, client_id: int, identity: SigningKey, pki: Mapping[int, bytes],
                 policy: ClientPolicy | None = None) -> None:
        if type(client_id) is not int or not 0 <= client_id < cfg.n:
            raise ValueError(f"client_id must be in [0, {cfg.n}); found {client_id!r}.")
        self.cfg = cfg
        self.policy = ClientPolicy() if policy is None else policy
        self.id = client_id
        self._identity = identity
        self._pki = pki
        self.stage = ReuseClientStage.INIT
        self._nbrs = frozenset(cfg.graph[client_id])
        self._c: KeyPair | None = None
        self._s: KeyPair | None = None
        self._enc: dict[int, bytes] = {}  # live neighbour -> channel key e_uv
        self._master: dict[int, bytes] = {}  # live neighbour -> m_uv
        self.next_index = 0  #: the only instance this client will take part in next
        self._cur: _Instance | None = None
        #: neighbours this client treats as gone (missing from a signed U3, or never set up)
        self.gone: set[int] = set()

    # -- helpers --------------------------------------------------------------------------------
    def _enter(self, method: str) -> None:
        need, _ = REUSE_CLIENT_TRANSITIONS[method]
        if self.stage != need:
            raise MessageError(f"client {self.id}: {method} is not allowed in stage {self.stage.name} "
                               f"(expected {need.name})")

    def _leave(self, method: str) -> None:
        self.stage = REUSE_CLIENT_TRANSITIONS[method][1]

    def _check_header(self, msg: Message, inst: bytes, stage: str) -> None:
        if msg.instance != inst:
            raise MessageError(f"stage {stage}: message for another protocol instance")
        if msg.round != self.cfg.round:
            raise MessageError(f"stage {stage}: wrong round {msg.round} (expected {self.cfg.round})")
        if msg.sender != SERVER or msg.receiver != self.id:
            raise MessageError(f"stage {stage}: message from {msg.sender} to {msg.receiver}, expected server -> {self.id}")

    def _head(self, inst: bytes) -> dict:
        return {"instance": inst, "round": self.cfg.round, "sender": self.id, "receiver": SERVER}

    def _live(self) -> list[int]:
        return sorted(v for v in self._enc if v not in self.gone)

    # -- setup ----------------------------------------------------------------------------------
    def advertise(self) -> AdvertiseKeys:
        """Setup, stage 1: fresh X25519 keys for the channel (``c``) and the masks (``s``), signed."""
        self._enter("advertise")
        holders = len(self._nbrs) + 1
        if self.cfg.n < self.policy.min_survivors:
            raise AbortError(f"stage ADVERTISE: an aggregation of n = {self.cfg.n} clients is below this client's "
                             f"min_survivors = {self.policy.min_survivors}; it does not take part")
        if not self.policy.unsafe_threshold and self.cfg.t < min_safe_threshold(holders):
            raise AbortError(f"stage ADVERTISE: threshold t = {self.cfg.t} is at or below half of this client's "
                             f"{holders} holders; it refuses unless its own policy sets unsafe_threshold")
        self._c, self._s = KeyPair.generate(), KeyPair.generate()
        c_pk, s_pk = self._c.public_bytes, self._s.public_bytes
        sig = self._identity.sign(_advert_digest(self.cfg, self.id, c_pk, s_pk))
        self._leave("advertise")
        return AdvertiseKeys(**self._head(self.cfg.instance), c_pk=c_pk, s_pk=s_pk, sig=sig)

    def setup(self, blob: bytes) -> None:
        """Setup, stage 2: verify the neighbours' signed keys (no key repeats, its own included) and
        derive every channel key and master pairwise secret. Nothing is sent."""
        self._enter("setup")
        msg = KeyBroadcast.from_bytes(blob)
        self._check_header(msg, self.cfg.instance, "SETUP")
        assert self._c is not None and self._s is not None
        peers: dict[int, tuple[bytes, bytes]] = {}
        seen_self = False
        for who, rec in msg.entries:
            if who in peers or (who == self.id and seen_self):
                raise MessageError(f"stage SETUP: client {who} listed twice")
            if who != self.id and who not in self._nbrs:
                raise MessageError(f"stage SETUP: client {who} is not a neighbour of {self.id}")
            c_pk, s_pk, sig = rec[:KEY_BYTES], rec[KEY_BYTES: 2 * KEY_BYTES], rec[2 * KEY_BYTES:]
            if not _common._verify(self._pki, who, sig, _advert_digest(self.cfg, who, c_pk, s_pk)):
                raise AuthenticationError("authenticated decryption failed")
            if who == self.id:
                if (c_pk, s_pk) != (self._c.public_bytes, self._s.public_bytes):
                    raise MessageError("stage SETUP: the server relayed a wrong key for this client")
                seen_self = True
                continue
            peers[who] = (c_pk, s_pk)
        own = [(self.id, self._c.public_bytes), (self.id, self._s.public_bytes)]
        _check_distinct_keys(own + [(v, key) for v, pair in peers.items() for key in pair], "stage SETUP")
        if len(peers) + 1 < self.cfg.t:
            raise AbortError(f"stage SETUP: client {self.id} has {len(peers) + 1} live holders, fewer than t = {self.cfg.t}")
        enc_info, mask_info = self.cfg.info(b"secagg/reuse/enc"), self.cfg.info(b"secagg/reuse/master")
        for v, (c_pk, s_pk) in sorted(peers.items()):
            self._enc[v] = self._c.agree(c_pk, info=enc_info)
            self._master[v] = self._s.agree(s_pk, info=mask_info)
        self.gone = set(self._nbrs) - set(peers)
        self._leave("setup")

    # -- one instance ---------------------------------------------------------------------------
    def share(self, index: int, dim: int) -> InstanceShares:
        """Instance ``index``, stage 1: a fresh self-mask seed, Shamir-shared among the live holders."""
        self._enter("share")
        if index != self.next_index:
            raise MessageError(f"client {self.id}: instance {index} requested, but the next instance of this setup "
                               f"is {self.next_index} (instances run once each, in order)")
        if type(dim) is not int or not 0 < dim < 2**31:
            raise ValueError(f"dim must be an int in [1, 2^31); found {dim!r}.")
        live = self._live()
        t = self.cfg.t
        if len(live) + 1 < t:
            raise AbortError(f"stage SHARE: client {self.id} has {len(live) + 1} live holders, fewer than t = {t}")
        inst, rnd = instance_id(self.cfg, index), self.cfg.round
        b = os.urandom(SEED_BYTES)
        holders = sorted((*live, self.id))
        vals = shamir.split_many([b], t=t, xs=[h + 1 for h in holders])
        out, own = [], b""
        for j, h in enumerate(holders):
            sh = shamir.encode_share(SEED_BYTES, vals[j, 0])
            if h == self.id:
                own = sh
                continue
            out.append((h, seal(self._enc[h], B_SHARE_PT.pack(self.id, h, sh), aad=_aad(inst, rnd, self.id, h))))
        self._cur = _Instance(index, inst, dim, b, own)
        self._leave("share")
        return InstanceShares(**self._head(inst), b_commit=_commit(inst, rnd, self.id, b), shares=tuple(out))

    def mask_input(self, blob: bytes, x: np.ndarray) -> MaskedInput:
        """Instance stage 2: open the shares addressed to me, send the masked input (signed)."""
        self._enter("mask_input")
        st = self._cur
        assert st is not None
        msg = ForwardedInstanceShares.from_bytes(blob)
        self._check_header(msg, st.inst, "MASKED_INPUT")
        x = np.asarray(x)
        if x.dtype != np.uint64 or x.shape != (st.dim,):
            raise ValueError(f"input must be a uint64 vector of length {st.dim} (encode it first); found {x.dtype} {x.shape}.")
        live = set(self._live())
        received: dict[int, bytes] = {}
        for sender, ct in msg.shares:
            if sender in received:
                raise MessageError(f"stage MASKED_INPUT: replayed shares from client {sender}")
            if sender not in live:
                raise MessageError(f"stage MASKED_INPUT: shares from {sender}, not a live neighbour of this setup")
            pt = open_sealed(self._enc[sender], ct, aad=_aad(st.inst, self.cfg.round, sender, self.id))
            owner, holder, sh = B_SHARE_PT.unpack(pt)
            if owner != sender or holder != self.id:
                raise AuthenticationError("authenticated decryption failed")
            received[sender] = sh
        if len(received) + 1 < self.cfg.t:
            raise AbortError(f"stage MASKED_INPUT: client {self.id} has {len(received) + 1} holders in U2, "
                             f"fewer than t = {self.cfg.t}")
        y = x.copy()
        rnd = self.cfg.round
        masks = [(st.b, b"self", False)]
        masks += [(pair_seed(self._master[v], st.inst, rnd, self.id, v), b"pair", self.id > v) for v in sorted(received)]
        prg.accumulate(y, masks)
        st.received, st.u2 = received, frozenset(received) | {self.id}
        self._leave("mask_input")
        return MaskedInput(**self._head(st.inst), y=y, sig=self._identity.sign(_input_digest(st.inst, rnd, self.id, y)))

    def sign_survivors(self, blob: bytes) -> ConsistencySignature:
        """Instance stage 3: check U3 against this client's own view and policy, and sign it."""
        self._enter("sign_survivors")
        st = self._cur
        assert st is not None
        msg = SurvivorList.from_bytes(blob)
        self._check_header(msg, st.inst, "CONSISTENCY")
        u3 = check_survivors(msg.survivors, me=self.id, n=self.cfg.n, nbrs=self._nbrs, u2=st.u2,
                             policy=self.policy, t=self.cfg.t, scope=" in this instance")
        st.u3 = u3 & (self._nbrs | {self.id})
        st.digest = _survivors_digest(st.inst, self.cfg.round, msg.survivors)
        self._leave("sign_survivors")
        return ConsistencySignature(**self._head(st.inst), sig=self._identity.sign(st.digest))

    def unmask(self, blob: bytes) -> UnmaskReveal:
        """Instance stage 4: with ``t`` valid holder signatures on U3, reveal per neighbour in U2 exactly
        one thing: its ``b^(i)`` share if it survived, else this client's own seed ``s_uv^(i)``."""
        self._enter("unmask")
        st = self._cur
        assert st is not None and st.received is not None
        msg = UnmaskRequest.from_bytes(blob)
        self._check_header(msg, st.inst, "UNMASK")
        digest = st.digest
        valid: set[int] = set()
        for who, sig in msg.signatures:
            if len(valid) >= self.cfg.t:
                break
            if (who not in valid and who in st.u3  # (st.u3 holds only neighbours and this client)
                    and _common._verify(self._pki, who, sig, digest)):
                valid.add(who)
        if len(valid) < self.cfg.t:
            raise AbortError(f"stage UNMASK: only {len(valid)} valid consistency signatures from holders, "
                             f"fewer than t = {self.cfg.t}")
        b_shares = [(self.id, st.own_share)]
        seeds = []
        for v, sh in sorted(st.received.items()):
            if v in st.u3:
                b_shares.append((v, sh))
            else:
                seeds.append((v, pair_seed(self._master[v], st.inst, self.cfg.round, self.id, v)))
        # every neighbour missing from this signed U3 is gone for the setup's later instances
        self.gone |= set(self._nbrs) - st.u3
        self.next_index = st.index + 1
        self._cur = None
        self._leave("unmask")
        return UnmaskReveal(**self._head(st.inst), b_shares=tuple(sorted(b_shares)), seeds=tuple(seeds))


class ReuseServer:
    """The server of a reused setup: ``receive`` validates and stores one client message of the
    current stage (raising :class:`MessageError` / :class:`AuthenticationError`, state unchanged);
    the stage methods close a stage and return the messages to send (client id -> wire bytes)."""

    def __init__(self, cfg: MaskingConfig, pki: Mapping[int, bytes]) -> None:
        self.cfg = cfg
        self._pki = pki
        self.stage = ReuseStage.ADVERTISE
        self.adverts: dict[int, bytes] = {}
        self._key_owner: dict[bytes, int] = {}
        self.u1: frozenset[int] = frozenset()
        self.live: frozenset[int] = frozenset()  #: clients invited to the next instance
        #: U1 and every completed instance's U3: whom the clients of this setup still share with
        self.view: frozenset[int] = frozenset()
        self.index = -1  #: the current (or last) instance
        self.signatures_verified = 0  #: Ed25519 verifications in the current instance (adverts: the setup's)
        self.masks_expanded = 0  #: PRG expansions in the last :meth:`finish`
        self._reset(0)

    def _reset(self, dim: int) -> None:
        self.dim = dim
        self.inst = instance_id(self.cfg, max(self.index, 0))
        self.shares: dict[int, tuple[tuple[int, bytes], ...]] = {}
        self.commits: dict[int, bytes] = {}
        self.acc = np.zeros(dim, dtype=np.uint64)
        self.u2: frozenset[int] = frozenset()
        self.u3: frozenset[int] = frozenset()
        self._u3_list: list[int] = []
        self._u3_seen: set[int] = set()  # the same ids, for the duplicate check (a set per message was O(n^2))
        self.signatures: dict[int, bytes] = {}
        self._digest = b""
        self.responses: dict[int, UnmaskReveal] = {}

    def _advance(self, method: str) -> None:
        need, nxt = REUSE_SERVER_TRANSITIONS[method]
        if self.stage != need:
            raise MessageError(f"server: {method} is not allowed in stage {self.stage.name} (expected {need.name})")
        self.stage = nxt

    def _head(self, to: int) -> dict:
        inst = self.cfg.instance if self.index < 0 else self.inst
        return {"instance": inst, "round": self.cfg.round, "sender": SERVER, "receiver": to}

    def _need(self, have: int, stage: str, what: str) -> None:
        if have < self.cfg.t:
            self.stage = ReuseStage.READY
            self.live = frozenset()  # an aborted instance ends the setup: no later instance can start
            raise AbortError(f"stage {stage}: only {have} {what}, fewer than t = {self.cfg.t}; aggregation aborted")

    def receive(self, blob: bytes) -> int:
        """Validate and record one client message of the current stage; returns the sender id."""
        msg = decode(blob)
        name = self.stage.name
        if msg.STAGE != self.stage or self.stage == ReuseStage.READY:
            raise MessageError(f"stage {name}: {type(msg).__name__} does not belong to this stage")
        want = self.cfg.instance if self.stage == ReuseStage.ADVERTISE else self.inst
        if msg.instance != want:
            raise MessageError(f"stage {name}: message for another protocol instance")
        u = _common.check_client_message(msg, round=self.cfg.round, n=self.cfg.n, name=name)
        if isinstance(msg, AdvertiseKeys):
            if u in self.adverts:
                raise MessageError(f"stage {name}: replayed message from client {u} (already received)")
            self.signatures_verified += 1
            if not _common._verify(self._pki, u, msg.sig, _advert_digest(self.cfg, u, msg.c_pk, msg.s_pk)):
                raise AuthenticationError("authenticated decryption failed")
            clash = [self._key_owner[key] for key in (msg.c_pk, msg.s_pk) if key in self._key_owner]
            if clash or msg.c_pk == msg.s_pk:
                raise MessageError(f"stage {name}: duplicate public key advertised by clients "
                                   f"{clash[0] if clash else u} and {u}; advert refused")
            self.adverts[u] = msg.c_pk + msg.s_pk + msg.sig
            self._key_owner[msg.c_pk] = self._key_owner[msg.s_pk] = u
        elif isinstance(msg, InstanceShares):
            _common.require_new(u, self.live, self.shares, name)
            expected = {v for v in self.cfg.graph[u] if v in self.view}
            got = [v for v, _ in msg.shares]
            if len(set(got)) != len(got) or set(got) != expected:
                raise MessageError(f"stage {name}: client {u} sent shares for {sorted(got)[:8]}, expected its live neighbours")
            self.shares[u] = msg.shares
            self.commits[u] = msg.b_commit
        elif isinstance(msg, MaskedInput):
            _common.require_new(u, self.u2, self._u3_seen, name)
            if msg.y.shape != (self.dim,):
                raise MessageError(f"stage {name}: masked input of length {msg.y.size}, expected {self.dim}")
            self.signatures_verified += 1
            if not _common._verify(self._pki, u, msg.sig, _input_digest(self.inst, self.cfg.round, u, msg.y)):
                raise AuthenticationError("authenticated decryption failed")
            np.add(self.acc, msg.y, out=self.acc)
            self._u3_list.append(u)
            self._u3_seen.add(u)
        elif isinstance(msg, ConsistencySignature):
            _common.require_new(u, self.u3, self.signatures, name)
            self.signatures_verified += 1
            if not _common._verify(self._pki, u, msg.sig, self._digest):
                raise AuthenticationError("authenticated decryption failed")
            self.signatures[u] = msg.sig
        elif isinstance(msg, UnmaskReveal):
            _common.require_new(u, self.signatures, self.responses, name)
            nb = {v for v in self.cfg.graph[u] if v in self.u2}
            owners = [o for o, _ in msg.b_shares]
            peers = [v for v, _ in msg.seeds]
            if len(set(owners)) != len(owners) or set(owners) != (nb & self.u3) | {u}:
                raise MessageError(f"stage {name}: client {u} revealed self-mask shares for unexpected owners")
            if len(set(peers)) != len(peers) or set(peers) != nb - self.u3:
                raise MessageError(f"stage {name}: client {u} revealed pair seeds for unexpected neighbours")
            self.responses[u] = msg
        else:
            raise MessageError(f"stage {name}: unexpected {type(msg).__name__}")
        return u


    def broadcast_keys(self) -> dict[int, bytes]:
        """Close the setup's ADVERTISE: each client in U1 gets its neighbours' (and its own) signed keys."""
        self._advance("broadcast_keys")
        self.u1 = self.live = self.view = frozenset(self.adverts)
        self._need(len(self.u1), "ADVERTISE", "clients advertised keys")
        out = {}
        for u in sorted(self.u1):
            entries = tuple((v, self.adverts[v]) for v in self.cfg.holders(u) if v in self.u1)
            out[u] = KeyBroadcast(**self._head(u), entries=entries).to_bytes()
        return out

    def start(self, dim: int) -> bytes:
        """Open the next instance over ``dim`` words; returns its 16-byte id. Its cohort is the members
        of the previous instance's U3 that completed its unmask (the setup's U1 for the first)."""
        self._advance("start")
        if not self.live:
            self.stage = ReuseStage.READY
            raise AbortError("this setup has no live clients left (an instance aborted); run a new setup")
        if self.index >= 0:  # the first instance's count keeps the setup's advert verifications
            self.signatures_verified = 0
        self.index += 1
        self._reset(dim)
        return self.inst

    def forward_shares(self) -> dict[int, bytes]:
        """Close SHARE: forward to each client in U2 the sealed shares addressed to it."""
        self._advance("forward_shares")
        self.u2 = frozenset(self.shares)
        self._need(len(self.u2), "SHARE", "clients sent shares")
        inbox = route_shares(self.shares, self.u2)
        return {u: ForwardedInstanceShares(**self._head(u), shares=tuple(inbox[u])).to_bytes() for u in sorted(self.u2)}

    def request_consistency(self) -> dict[int, bytes]:
        """Close MASKED_INPUT: send U3 to every client in it."""
        self._advance("request_consistency")
        self.u3 = frozenset(self._u3_list)
        self._need(len(self.u3), "MASKED_INPUT", "masked inputs arrived")
        surv = tuple(sorted(self.u3))
        self._digest = _survivors_digest(self.inst, self.cfg.round, surv)
        return SurvivorList(**self._head(SERVER), survivors=surv).broadcast(list(surv))

    def request_unmask(self) -> dict[int, bytes]:
        """Close CONSISTENCY: send each signer the signatures of its holders."""
        self._advance("request_unmask")
        self._need(len(self.signatures), "CONSISTENCY", "clients signed the survivor set")
        return {u: UnmaskRequest(**self._head(u), signatures=sigs).to_bytes()
                for u, sigs in holder_signatures(self.cfg, self.signatures).items()}

    def finish(self) -> np.ndarray:
        """Close UNMASK: rebuild the survivors' self-mask seeds, strip them and the masks between
        survivors and dropped clients (with the survivors' revealed seeds), return the sum of U3."""
        self._advance("finish")
        cfg, t, rnd = self.cfg, self.cfg.t, self.cfg.round
        self.live = frozenset()  # set again below only if the instance completes
        owners = sorted(self.u3)
        got: dict[int, list[tuple[int, bytes]]] = {o: [] for o in owners}
        for holder in sorted(self.responses):
            for owner, sh in self.responses[holder].b_shares:
                lst = got.get(owner)
                if lst is not None and len(lst) < t:
                    lst.append((holder + 1, sh))
        short = [o for o in owners if len(got[o]) < t]
        if short:
            raise AbortError(f"stage UNMASK: {len(short)} clients lack shares (client {short[0]} has "
                             f"{len(got[short[0]])} of t = {t}); aggregation aborted")
        strip: list[tuple[bytes, bytes, bool]] = []
        for u in owners:  # pairwise masks between survivors and clients that dropped after sharing
            lost = [v for v in cfg.graph[u] if v in self.u2 and v not in self.u3]
            if not lost:
                continue
            resp = self.responses.get(u)
            if resp is None:
                raise AbortError(f"stage UNMASK: survivor {u} did not reveal its pair seeds with the dropped neighbours "
                                 f"{lost[:8]} (only it holds them in a reused setup); aggregation aborted")
            for v, seed in resp.seeds:
                strip.append((bytes(seed), b"pair", u < v))
        xs = np.array([[x for x, _ in got[o]] for o in owners], dtype=np.uint64).reshape(len(owners), t)
        raw = np.frombuffer(b"".join(sh for o in owners for _, sh in got[o]), dtype=np.uint8)
        raw = raw.reshape(len(owners), t, SHARE_BYTES)
        ys = raw[:, :, 2:].copy().view("<u4").astype(np.uint64)
        if np.any(raw[:, :, 0:2] != np.frombuffer(struct.pack(">H", SEED_BYTES), dtype=np.uint8)) or np.any(
                ys >= np.uint64(shamir.PRIME)):
            raise AbortError("stage UNMASK: malformed share revealed; aggregation aborted")
        limbs = shamir.combine_batch(xs, ys)
        try:
            seeds = {o: shamir.limbs_to_bytes(limbs[i], SEED_BYTES) for i, o in enumerate(owners)}
        except ValueError as exc:
            raise AbortError(f"stage UNMASK: inconsistent shares ({exc}); aggregation aborted") from exc
        for u in owners:
            if _commit(self.inst, rnd, u, seeds[u]) != self.commits[u]:
                raise AbortError(f"stage UNMASK: the self-mask seed rebuilt for client {u} does not match its "
                                 "commitment (a holder revealed a wrong share); aggregation aborted")
        strip = [(seeds[u], b"self", True) for u in owners] + strip
        acc = self.acc.copy()
        prg.accumulate(acc, strip)
        self.masks_expanded = len(strip)
        self.live = frozenset(self.responses)  # U3's members that completed this instance's unmask
        self.view = self.view & self.u3  # each client drops the neighbours missing from the U3 it signed
        return acc

