"""The SecAgg/SecAgg+ server (:class:`MaskingServer`); the protocol, its parties and its promise are
described in :mod:`secagg.bonawitz`, which re-exports this class. Signature checks go through
``secagg.bonawitz_common._verify`` at call time (one place for the simulation's shared verifications and
for the tests that count them)."""

from __future__ import annotations

import struct
from collections.abc import Mapping

import numpy as np

from secagg import bonawitz_common as _bw
from secagg import prg, shamir
from secagg.bonawitz_wire import (
    _KIND_B, _KIND_S, COMMIT_BYTES, SEED_BYTES, SERVER_TRANSITIONS, SHARE_BYTES, AdvertiseKeys, ConsistencySignature,
    EncryptedShares, ForwardedShares, KeyBroadcast, MaskedInput, ServerStage, SurvivorList, UnmaskRequest,
    UnmaskResponse,
)
from secagg.errors import AbortError, AuthenticationError, MessageError
from secagg.keys import KEY_BYTES, KeyPair
from secagg.messages import SERVER, decode

__all__ = ["MaskingServer"]


class MaskingServer:
    """The SecAgg/SecAgg+ server. ``receive`` validates and stores one client message; the stage
    methods close a stage and return the messages to send (client id -> wire bytes).

    ``receive`` raises :class:`MessageError` / :class:`AuthenticationError` for a bad message and
    leaves the state unchanged (the sender is then treated as dropped unless a valid message
    follows). Stage methods raise :class:`AbortError` when too few clients remain.
    """

    def __init__(self, cfg: _bw.MaskingConfig, pki: Mapping[int, bytes]) -> None:
        self.cfg = cfg
        self._pki = pki
        self.stage = ServerStage.ADVERTISE
        self.adverts: dict[int, bytes] = {}
        self._key_owner: dict[bytes, int] = {}  # every advertised public key -> its advertiser
        self.shares: dict[int, tuple[tuple[int, bytes], ...]] = {}
        self.commits: dict[int, bytes] = {}
        self.acc = np.zeros(cfg.dim, dtype=np.uint64)
        self.u1: frozenset[int] = frozenset()
        self.u2: frozenset[int] = frozenset()
        self.u3: frozenset[int] = frozenset()
        self._u3_list: list[int] = []
        self._u3_seen: dict[int, bool] = {}
        self.signatures: dict[int, bytes] = {}
        self._digest = b""  # what U3's signers sign (set when U3 is fixed)
        self.responses: dict[int, tuple[tuple[int, int, bytes], ...]] = {}
        self.masks_expanded = 0  #: PRG expansions of length ``dim`` done in :meth:`finish`
        self.key_agreements = 0  #: X25519 + HKDF evaluations done in :meth:`finish`
        self.signatures_verified = 0  #: Ed25519 verifications done in :meth:`receive`
        #: what the server reconstructed in :meth:`finish`: owner -> ("b" | "s", 32-byte secret)
        self.revealed: dict[int, tuple[str, bytes]] = {}

    def _advance(self, method: str) -> None:
        need, nxt = SERVER_TRANSITIONS[method]
        if self.stage != need:
            raise MessageError(f"server: {method} is not allowed in stage {self.stage.name} (expected {need.name})")
        self.stage = nxt

    def _head(self, to: int) -> dict:
        return {"instance": self.cfg.instance, "round": self.cfg.round, "sender": SERVER, "receiver": to}

    def receive(self, blob: bytes) -> int:
        """Validate and record one client message of the current stage; returns the sender id."""
        msg = decode(blob)
        name = self.stage.name
        if msg.STAGE != self.stage:
            raise MessageError(f"stage {name}: {type(msg).__name__} belongs to stage {ServerStage(msg.STAGE).name}")
        if msg.instance != self.cfg.instance:
            raise MessageError(f"stage {name}: message for another protocol instance")
        u = _bw.check_client_message(msg, round=self.cfg.round, n=self.cfg.n, name=name)
        if isinstance(msg, AdvertiseKeys):
            if u in self.adverts:
                raise MessageError(f"stage {name}: replayed message from client {u} (already received)")
            self.signatures_verified += 1
            if not _bw._verify(self._pki, u, msg.sig, _bw._advert_digest(self.cfg, u, msg.c_pk, msg.s_pk)):
                raise AuthenticationError("authenticated decryption failed")
            clash = [self._key_owner[key] for key in (msg.c_pk, msg.s_pk) if key in self._key_owner]
            if clash or msg.c_pk == msg.s_pk:
                raise MessageError(
                    f"stage {name}: duplicate public key advertised by clients {clash[0] if clash else u} and {u} "
                    "(all advertised keys must differ); advert refused"
                )
            self.adverts[u] = msg.c_pk + msg.s_pk + msg.sig
            self._key_owner[msg.c_pk] = self._key_owner[msg.s_pk] = u
        elif isinstance(msg, EncryptedShares):
            _bw.require_new(u, self.u1, self.shares, name)
            expected = {v for v in self.cfg.graph[u] if v in self.u1}
            got = [v for v, _ in msg.shares]
            if len(set(got)) != len(got) or set(got) != expected:
                raise MessageError(f"stage {name}: client {u} sent shares for {sorted(got)[:8]}..., expected its neighbours in U1")
            if len(msg.b_commit) != COMMIT_BYTES:  # pragma: no cover - the parser fixes the size
                raise MessageError(f"stage {name}: commitment of {len(msg.b_commit)} bytes")
            self.shares[u] = msg.shares
            self.commits[u] = msg.b_commit
        elif isinstance(msg, MaskedInput):
            _bw.require_new(u, self.u2, self._u3_seen, name)
            if msg.y.shape != (self.cfg.dim,):
                raise MessageError(f"stage {name}: masked input of length {msg.y.size}, expected {self.cfg.dim}")
            self.signatures_verified += 1
            if not _bw._verify(self._pki, u, msg.sig, _bw._input_digest(self.cfg, u, msg.y)):
                raise AuthenticationError("authenticated decryption failed")
            np.add(self.acc, msg.y, out=self.acc)
            self._u3_list.append(u)
            self._u3_seen[u] = True
        elif isinstance(msg, ConsistencySignature):
            _bw.require_new(u, self.u3, self.signatures, name)
            self.signatures_verified += 1
            if not _bw._verify(self._pki, u, msg.sig, self._digest):
                raise AuthenticationError("authenticated decryption failed")
            self.signatures[u] = msg.sig
        elif isinstance(msg, UnmaskResponse):
            _bw.require_new(u, self.signatures, self.responses, name)
            allowed = {v for v in self.cfg.graph[u] if v in self.u2} | {u}
            owners = [o for o, _, _ in msg.shares]
            if len(set(owners)) != len(owners) or set(owners) != allowed:
                raise MessageError(f"stage {name}: client {u} revealed shares for unexpected owners")
            for owner, kind, _ in msg.shares:
                if kind != (_KIND_B if owner in self.u3 else _KIND_S):
                    raise MessageError(f"stage {name}: client {u} sent the wrong share kind for {owner}")
            self.responses[u] = msg.shares
        else:  # pragma: no cover - registry guarantees one of the above for these stages
            raise MessageError(f"stage {name}: unexpected {type(msg).__name__}")
        return u


    def _need(self, have: int, stage: str, what: str) -> None:
        if have < self.cfg.t:
            self.stage = ServerStage.DONE
            raise AbortError(f"stage {stage}: only {have} {what}, fewer than t = {self.cfg.t}; aggregation aborted")

    def broadcast_keys(self) -> dict[int, bytes]:
        """Close ADVERTISE: send each client in U1 its neighbours' (and its own) signed keys."""
        self._advance("broadcast_keys")
        self.u1 = frozenset(self.adverts)
        self._need(len(self.u1), "ADVERTISE", "clients advertised keys")
        out = {}
        for u in sorted(self.u1):
            entries = tuple((v, self.adverts[v]) for v in self.cfg.holders(u) if v in self.u1)
            out[u] = KeyBroadcast(**self._head(u), entries=entries).to_bytes()
        return out

    def forward_shares(self) -> dict[int, bytes]:
        """Close SHARE_KEYS: forward to each client in U2 the ciphertexts addressed to it."""
        self._advance("forward_shares")
        self.u2 = frozenset(self.shares)
        self._need(len(self.u2), "SHARE_KEYS", "clients sent shares")
        inbox = _bw.route_shares(self.shares, self.u2)
        return {u: ForwardedShares(**self._head(u), shares=tuple(inbox[u])).to_bytes() for u in sorted(self.u2)}

    def request_consistency(self) -> dict[int, bytes]:
        """Close MASKED_INPUT: send U3 to every client in it."""
        self._advance("request_consistency")
        self.u3 = frozenset(self._u3_list)
        self._need(len(self.u3), "MASKED_INPUT", "masked inputs arrived")
        surv = tuple(sorted(self.u3))
        self._digest = self.cfg.survivors_digest(surv)
        return SurvivorList(**self._head(SERVER), survivors=surv).broadcast(list(surv))

    def request_unmask(self) -> dict[int, bytes]:
        """Close CONSISTENCY: send each signer the signatures of its holders."""
        self._advance("request_unmask")
        self._need(len(self.signatures), "CONSISTENCY", "clients signed the survivor set")
        return {u: UnmaskRequest(**self._head(u), signatures=sigs).to_bytes()
                for u, sigs in _bw.holder_signatures(self.cfg, self.signatures).items()}

    def finish(self) -> np.ndarray:
        """Close UNMASK: reconstruct the needed secrets, strip the masks, return the sum of U3."""
        self._advance("finish")
        cfg, t = self.cfg, self.cfg.t
        # Secrets needed: b of every u in U3; s of every v in U2 \ U3 with a neighbour in U3.
        dropped = [v for v in sorted(self.u2 - self.u3) if any(u in self.u3 for u in cfg.graph[v])]
        owners = sorted(self.u3) + dropped
        got: dict[int, list[tuple[int, bytes]]] = {o: [] for o in owners}
        for holder in sorted(self.responses):
            for owner, _kind, sh in self.responses[holder]:
                lst = got.get(owner)
                if lst is not None and len(lst) < t:
                    lst.append((holder + 1, sh))
        short = [o for o in owners if len(got[o]) < t]
        if short:
            o = short[0]
            raise AbortError(
                f"stage UNMASK: {len(short)} clients lack shares (client {o} has {len(got[o])} of t = {t}); "
                "aggregation aborted"
            )
        xs = np.array([[x for x, _ in got[o]] for o in owners], dtype=np.uint64).reshape(len(owners), t)
        raw = np.frombuffer(b"".join(sh for o in owners for _, sh in got[o]), dtype=np.uint8)
        raw = raw.reshape(len(owners), t, SHARE_BYTES)
        ys = raw[:, :, 2:].copy().view("<u4").astype(np.uint64)
        if np.any(raw[:, :, 0:2] != np.frombuffer(struct.pack(">H", SEED_BYTES), dtype=np.uint8)) or np.any(
            ys >= np.uint64(shamir.PRIME)
        ):
            raise AbortError("stage UNMASK: malformed share revealed; aggregation aborted")
        limbs = shamir.combine_batch(xs, ys) if owners else np.zeros((0, 11), dtype=np.uint64)
        try:
            secrets = {o: shamir.limbs_to_bytes(limbs[i], SEED_BYTES) for i, o in enumerate(owners)}
        except ValueError as exc:
            raise AbortError(f"stage UNMASK: inconsistent shares ({exc}); aggregation aborted") from exc
        for u in sorted(self.u3):
            if _bw._commit_seed(cfg, u, secrets[u]) != self.commits[u]:
                raise AbortError(
                    f"stage UNMASK: the self-mask seed rebuilt for client {u} does not match its commitment "
                    "(a holder revealed a wrong share); aggregation aborted instead of returning a wrong sum"
                )
        self.revealed = {o: ("b" if o in self.u3 else "s", sec) for o, sec in secrets.items()}
        acc = self.acc.copy()
        # (seed, label, subtract?) of every mask to strip, then one cache-blocked pass.
        strip: list[tuple[bytes, bytes, bool]] = [(secrets[u], b"self", True) for u in sorted(self.u3)]
        info = cfg.info(b"secagg/mask")
        for v in dropped:
            sk = KeyPair.from_private_bytes(secrets[v])
            s_pk_v = self.adverts[v][KEY_BYTES : 2 * KEY_BYTES]
            if sk.public_bytes != s_pk_v:
                raise AbortError(f"stage UNMASK: reconstructed mask key of client {v} does not match its advertised key")
            for u in cfg.graph[v]:
                if u in self.u3:
                    seed = sk.agree(self.adverts[u][KEY_BYTES : 2 * KEY_BYTES], info=info, shared=False)
                    # u added sign(u, v) * PRG(s_uv): remove it.
                    strip.append((seed, b"pair", u < v))
                    self.key_agreements += 1
        prg.accumulate(acc, strip)
        masks = len(strip)
        self.masks_expanded = masks
        return acc
