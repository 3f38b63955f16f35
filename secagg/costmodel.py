"""What one secure-aggregation instance must cost: its cryptographic work priced at unit costs measured
on this machine, per client and at the server.

A bound here is the floor an implementation of the protocol cannot go below on this machine's crypto
library: the operations the protocol's messages force (key generations, X25519 agreements with HKDF,
Ed25519 signatures and verifications, Shamir sharing and reconstruction of the two seeds, SHA-256 over
the signed masked input, the AES-CTR keystream of every mask, one uint64 add per mask word and per
summed word), each counted from the instance's public parameters and multiplied by its unit cost
measured in the same process (:meth:`UnitCosts.measure`). Not counted: message encoding, the
small AES-GCM seals of the shares, Python dispatch; so a measured time divided by the bound is the
overhead an optimisation could still remove.

Counts per client of one SecAgg/SecAgg+ instance with ``k`` neighbours (SecAgg: ``k = n - 1``) and
threshold ``t`` over ``d`` words (:mod:`secagg.bonawitz`):

* ADVERTISE: 2 X25519 key generations, 1 signature;
* SHARE_KEYS: ``k + 1`` verifications (the neighbours' adverts and its own), one Shamir split of
  two 32-byte seeds into ``k + 1`` shares at threshold ``t``, ``k`` agreements (share encryption);
* MASKED_INPUT: ``k`` agreements (mask seeds), ``k + 1`` keystreams of ``8 d`` bytes and as many
  ``d``-word adds, SHA-256 over ``8 d`` bytes and 1 signature;
* CONSISTENCY: 1 signature; UNMASK: ``t`` verifications (it stops at the ``t``-th valid holder
  signature, the decision the protocol needs).

One key setup reused by a round's instances (:mod:`secagg.reuse`, ``reuse=True``): the instance that
runs the setup (``setup=True``) pays 2 key generations, 1 signature, ``k + 1`` verifications and
``2k`` agreements once; every instance pays one Shamir split of *one* seed, ``k`` HMAC-SHA256
per-instance pair seeds, the ``k + 1`` keystreams and adds, SHA-256 over ``8 d`` bytes, 2 signatures
(masked input, survivor set) and ``t`` verifications. Its server does no agreement (the survivors
reveal the pair seeds of dropped neighbours) and rebuilds only the survivors' self-mask seeds.

The server's counts come from the run (:class:`secagg.runner.RunResult`: ``masks_expanded``,
``key_agreements``, ``signatures_verified``, exact for that instance's dropouts), plus SHA-256 over
every masked input, the plain sum of the survivors' inputs (one add per word) and the Shamir
reconstruction of one seed per survivor and per dropped client with a surviving neighbour.

The circular chain (:mod:`secagg.chain`, ``s`` successors, docs/chain.md "Cost") per client and
attempt: 1 key generation, ``2 s + 1`` agreements (ring neighbours and the server), ``2 s + 1``
keystreams and adds of ``d`` words, an AES-GCM tag over ``8 d`` bytes; the server per upload: 1
agreement, the tag check and a ``d``-word add, then the ``masks_expanded`` pads. One attempt is
priced (a re-run after dropouts costs more: the bound stays a floor).

The two-server DPF sum (:mod:`secagg.dpf_sum`, ``"dpf"``) has no masks, agreements or signatures: its
cryptographic work is each server's full-domain evaluation of every surviving key set, the AES-128
output bytes of :func:`secagg.dpf.prg_bytes_per_key_set` (tree nodes, value blocks and the check's
MAC blocks; the run reports the total as ``prg_bytes``), priced at the measured AES-128-ECB throughput
(``aes_ecb_bps``), plus the AES-256-CTR expansion of any dense share's seed and, with the check, the
SHA-256 of each key set's public parts (the servers' one-client-one-function digest); each client's
is the AES-128 output of generating its key sets (:func:`secagg.dpf.keygen_prg_bytes`: a few blocks
per tree and level, and its values twice; the run reports the total as ``client_prg_bytes``) and, for
a client that sends a dense share, the AES-256-CTR expansion of its seed (``client_dense_bytes``);
each client is charged the mean. Not counted: the clients' other array work and the servers' adds of the
values into the sum, so the DPF bound is a floor too.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

__all__ = ["InstanceCost", "UnitCosts", "best_of", "instance_cost", "nesting_setups", "reusable_setup_s",
           "setup_client_s"]


def best_of(fn: Callable[[], object], repeats: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """The fastest of ``repeats`` calls of ``fn`` in seconds of ``clock`` (the least disturbed by other
    load: a floor)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


@dataclass
class UnitCosts:
    """Unit costs on this machine (seconds, or bytes/words per second), measured by :meth:`measure`.

    ``aes_ctr_bps`` is AES-256-CTR keystream into a preallocated buffer (``update_into``, no
    allocation), the fastest way ``cryptography`` offers; ``gcm_bps`` AES-256-GCM over a large buffer;
    ``add_wps`` uint64 adds in place (numpy); ``sha256_bps`` hashing. Shamir costs depend on
    ``(holders, t)`` and are measured on first use with this package's own batched implementation
    (:mod:`secagg.shamir`; no library does Shamir over our field vectorised), then cached.
    """

    aes_ctr_bps: float
    gcm_bps: float
    add_wps: float
    sha256_bps: float
    keygen_s: float
    agree_s: float
    sign_s: float
    verify_s: float
    prf_s: float = 0.0  #: one HMAC-SHA256 per-instance pair seed (:func:`secagg.reuse.pair_seed`)
    cpu: bool = False  #: measured in process CPU seconds (:meth:`measure` with ``cpu=True``), not wall-clock
    aes_ecb_bps: float = 0.0  #: AES-128-ECB into a preallocated buffer: the DPF's fixed-key PRG (0: not measured)
    _split: dict[tuple[int, int, int], float] = field(default_factory=dict, repr=False)
    _combine: dict[int, float] = field(default_factory=dict, repr=False)

    @classmethod
    def measure(cls, *, buffer_mb: int = 16, repeats: int = 5, cpu: bool = False) -> UnitCosts:
        """Measure every unit cost once (about a second); ``cpu``: in process CPU seconds
        (``time.process_time``), the clock a machine loaded by other jobs distorts least."""
        import hashlib

        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        from secagg.keys import KeyPair

        clock = time.process_time if cpu else time.perf_counter
        nbytes = buffer_mb << 20
        src = bytearray(nbytes)
        out = bytearray(nbytes + 16)
        key = os.urandom(32)

        def ctr() -> None:
            Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor().update_into(src, out)

        aes = nbytes / best_of(ctr, repeats, clock)
        ecb_enc = Cipher(algorithms.AES(key[:16]), modes.ECB()).encryptor()
        ecb = nbytes / best_of(lambda: ecb_enc.update_into(src, out), repeats, clock)
        gcm_key = AESGCM(key)
        gcm = nbytes / best_of(lambda: gcm_key.encrypt(bytes(12), bytes(src), None), max(2, repeats // 2), clock)
        a = np.zeros(nbytes // 8, dtype=np.uint64)
        b = np.ones(nbytes // 8, dtype=np.uint64)
        add = a.size / best_of(lambda: np.add(a, b, out=a), repeats, clock)
        sha = nbytes / best_of(lambda: hashlib.sha256(src).digest(), repeats, clock)
        reps = 200
        keygen = best_of(lambda: [KeyPair.generate() for _ in range(reps)], 3, clock) / reps
        p, q = KeyPair.generate(), KeyPair.generate()
        agree = best_of(lambda: [p.agree(q.public_bytes, info=b"bound") for _ in range(reps)], 3, clock) / reps
        sk = Ed25519PrivateKey.generate()
        pk, sig = sk.public_key(), sk.sign(b"bound")
        sign = best_of(lambda: [sk.sign(b"bound") for _ in range(reps)], 3, clock) / reps
        verify = best_of(lambda: [pk.verify(sig, b"bound") for _ in range(reps)], 3, clock) / reps
        from secagg.reuse import pair_seed

        prf = best_of(lambda: [pair_seed(key, bytes(16), 0, 1, 2) for _ in range(reps)], 3, clock) / reps
        return cls(aes, gcm, add, sha, keygen, agree, sign, verify, prf, cpu, ecb)

    @property
    def _clock(self) -> Callable[[], float]:
        return time.process_time if self.cpu else time.perf_counter

    def shamir_split_s(self, holders: int, t: int, seeds: int = 2) -> float:
        """One client's Shamir split of its ``seeds`` seeds (SecAgg: two; a reused setup's instance: one)
        into ``holders`` shares at threshold ``t``."""
        key = (holders, t, seeds)
        if key not in self._split:
            from secagg import shamir

            secrets = [os.urandom(32) for _ in range(seeds)]
            xs = list(range(1, holders + 1))
            self._split[key] = best_of(lambda: shamir.split_many(secrets, t=t, xs=xs), 3, self._clock)
        return self._split[key]

    def shamir_combine_s(self, secrets: int, t: int) -> float:
        """Reconstructing ``secrets`` seeds at threshold ``t`` (one batched call)."""
        if secrets <= 0:
            return 0.0
        if t not in self._combine:
            from secagg import shamir

            batch = 64
            xs = np.tile(np.arange(1, t + 1, dtype=np.uint64), (batch, 1))
            ys = np.asarray(np.frombuffer(os.urandom(batch * t * 11 * 4), dtype="<u4") % np.uint32(shamir.PRIME),
                            dtype=np.uint64).reshape(batch, t, 11)
            self._combine[t] = best_of(lambda: shamir.combine_batch(xs, ys), 3, self._clock) / batch
        return self._combine[t] * secrets

    def as_dict(self) -> dict[str, float]:
        return {"aes256_ctr_gbps": self.aes_ctr_bps / 1e9, "aes256_gcm_gbps": self.gcm_bps / 1e9,
                "uint64_add_gwps": self.add_wps / 1e9, "sha256_gbps": self.sha256_bps / 1e9,
                "x25519_keygen_us": self.keygen_s * 1e6, "x25519_hkdf_agree_us": self.agree_s * 1e6,
                "ed25519_sign_us": self.sign_s * 1e6, "ed25519_verify_us": self.verify_s * 1e6,
                "hmac_pair_seed_us": self.prf_s * 1e6, "aes128_ecb_gbps": self.aes_ecb_bps / 1e9}


@dataclass(frozen=True)
class InstanceCost:
    """The bound of one instance: seconds per client (each client's own device) and at the server,
    broken down by kind of work."""

    client_s: float
    server_s: float
    client_parts: dict[str, float]
    server_parts: dict[str, float]


def instance_cost(protocol: str, *, n: int, dim: int, k: int | None, t: int | None, survivors: int,
                  masks_expanded: int, key_agreements: int, signatures_verified: int,
                  units: UnitCosts, reuse: bool = False, setup: bool = True, prg_bytes: int = 0,
                  dense_bytes: int = 0, hashed_bytes: int = 0, client_prg_bytes: int = 0,
                  client_dense_bytes: int = 0) -> InstanceCost:
    """The bound of one instance (see the module docstring for the counts); ``reuse``: an instance of a
    key setup reused across the round (``setup``: the one that ran that setup); ``prg_bytes`` and
    ``dense_bytes``: a ``"dpf"`` instance's servers' AES-128 evaluation bytes and dense-seed expansion,
    ``hashed_bytes`` the SHA-256 input of their key sets' public digests, ``client_prg_bytes`` the AES-128
    bytes all its ``n`` clients computed for their key sets and ``client_dense_bytes`` the AES-256-CTR
    bytes its dense clients expanded (each client is charged the mean of both)."""
    word = 8 * dim
    if protocol == "dpf":
        if (prg_bytes or client_prg_bytes) and not units.aes_ecb_bps:
            raise ValueError("a dpf instance needs the AES-128-ECB throughput (UnitCosts.measure measures it)")
        s = {"prg": (prg_bytes / units.aes_ecb_bps if prg_bytes else 0.0) + dense_bytes / units.aes_ctr_bps,
             "adds_hash": hashed_bytes / units.sha256_bps}
        clients = (client_prg_bytes / units.aes_ecb_bps if client_prg_bytes else 0.0) + client_dense_bytes / units.aes_ctr_bps
        c = {"prg": clients / max(n, 1)} if clients else {}
        return InstanceCost(sum(c.values()), sum(s.values()), c, s)
    if protocol in ("secagg", "secagg+") and reuse:
        k = n - 1 if k is None else k
        t = 1 if t is None else t
        c = {
            "public_key": (2 * units.keygen_s + 2 * k * units.agree_s) if setup else 0.0,
            "signatures": (units.sign_s + (k + 1) * units.verify_s if setup else 0.0)
            + 2 * units.sign_s + t * units.verify_s,
            "shamir": units.shamir_split_s(k + 1, t, seeds=1),
            "pair_seeds": k * units.prf_s,
            "prg": (k + 1) * word / units.aes_ctr_bps,
            "adds_hash": (k + 1) * dim / units.add_wps + word / units.sha256_bps,
        }
        s = {
            "public_key": key_agreements * units.agree_s,
            "signatures": signatures_verified * units.verify_s,
            "shamir": units.shamir_combine_s(survivors, t),
            "prg": masks_expanded * word / units.aes_ctr_bps,
            "adds_hash": (survivors + masks_expanded) * dim / units.add_wps + n * word / units.sha256_bps,
        }
    elif protocol in ("secagg", "secagg+"):
        k = n - 1 if k is None else k
        t = 1 if t is None else t
        c = {
            "public_key": 2 * units.keygen_s + 2 * k * units.agree_s,
            "signatures": 3 * units.sign_s + (k + 1 + t) * units.verify_s,
            "shamir": units.shamir_split_s(k + 1, t),
            "prg": (k + 1) * word / units.aes_ctr_bps,
            "adds_hash": (k + 1) * dim / units.add_wps + word / units.sha256_bps,
        }
        # each dropped client whose seed is rebuilt has at most k surviving neighbours: a floor on their number
        dropped_with_nbrs = -(-key_agreements // max(k, 1))
        s = {
            "public_key": key_agreements * units.agree_s,
            "signatures": signatures_verified * units.verify_s,
            "shamir": units.shamir_combine_s(survivors + dropped_with_nbrs, t),
            "prg": masks_expanded * word / units.aes_ctr_bps,
            "adds_hash": (survivors + masks_expanded) * dim / units.add_wps + n * word / units.sha256_bps,
        }
    elif protocol == "chain":
        succ = 1 if k is None else k
        c = {
            "public_key": units.keygen_s + (2 * succ + 1) * units.agree_s,
            "prg": (2 * succ + 1) * word / units.aes_ctr_bps,
            "adds_hash": (2 * succ + 1) * dim / units.add_wps + word / units.gcm_bps,
        }
        s = {
            "public_key": n * units.agree_s,
            "prg": masks_expanded * word / units.aes_ctr_bps,
            "adds_hash": survivors * word / units.gcm_bps + (survivors + masks_expanded) * dim / units.add_wps,
        }
    elif protocol == "plain":
        c = {}
        s = {"adds_hash": survivors * dim / units.add_wps}
    else:
        raise ValueError(f"no cost model for protocol {protocol!r}")
    return InstanceCost(sum(c.values()), sum(s.values()), c, s)


def setup_client_s(k: int, units: UnitCosts) -> float:
    """One client's key setup over ``k`` neighbours: 2 key generations, ``2k`` agreements, 1 signature and
    ``k + 1`` verifications. A reused setup pays it once (:func:`instance_cost` with ``reuse=True``:
    exactly its ``setup=True`` instance minus a ``setup=False`` one); a SecAgg/SecAgg+ instance with its
    own setup pays it again every sum."""
    return 2 * units.keygen_s + 2 * k * units.agree_s + units.sign_s + (k + 1) * units.verify_s


def reusable_setup_s(setups: dict[str, list[float]]) -> float:
    """What one setup per client per round could save at most: given each client's setup costs in a
    round (``client -> [setup_client_s of every instance that ran its own setup]``), the sum over
    clients of every setup but the client's dearest (the one a round-wide setup would have to cover).
    A reused setup also needs the instances' cohorts to nest (:meth:`secagg.reuse_sim.ReuseSession.check_cohort`),
    so this is a ceiling, not a promise."""
    return float(sum(sum(c) - max(c) for c in setups.values() if c))


def nesting_setups(instances: list[dict]) -> list[int]:
    """Indices of the masking instances (``secure_sum`` observer records, in the round's order) that ran
    their own setup although their senders nest in an earlier instance's survivors and leave out at most
    that instance's planned ``dropout``: the setups one setup per round could spare under the nesting
    rule (:meth:`secagg.reuse_sim.ReuseSession.check_cohort`). A ceiling: it ignores that a setup's
    instances form one chain."""
    out = []
    done: list[tuple[frozenset, int, float]] = []  # (survivors, n, dropout) of the earlier completed instances
    for j, inst in enumerate(instances):
        if inst["protocol"] not in ("secagg", "secagg+"):
            continue
        senders = set(inst["senders"])
        if inst.get("setup", True) and any(
                senders <= surv and n - len(senders) <= math.ceil((d or 0.0) * n - 1e-9) for surv, n, d in done):
            out.append(j)
        if not inst["aborted"]:
            done.append((frozenset(inst.get("survivor_senders", inst["senders"])), inst["n"], inst.get("dropout")))
    return out
