"""Paillier encryption on gmpy2: key generation, CRT decryption, fast encryption, key binding.

Parties and key model (FedMF, Chai et al.): every client holds the SAME key pair; the server holds
only the public key. Clients encrypt their item-gradient uploads, the server multiplies ciphertexts
(adds plaintexts) and returns the encrypted sum; any client can decrypt it.

Adversary: an honest-but-curious server that sees every ciphertext and holds the public key.

Promise: under the decisional composite residuosity assumption the server learns nothing about the
plaintexts beyond their number and size (ciphertexts are semantically secure, fresh CSPRNG
randomness ``r`` per encryption).

Limits (each demonstrated by a test):

* Shared-key weakness: ANY client can decrypt ANY other client's upload, so a server colluding with
  one client (or a client that eavesdrops on the server's link) learns every upload in the clear.
  Paillier here protects against the server alone, never against a coalition with a client.
* Malleability: whoever holds the public key (the server) can add ``Enc(delta)`` or multiply a
  ciphertext by a constant; decryption cannot detect such a change. What IS detected: a ciphertext
  bound to another key (its fingerprint), a value outside ``[1, n^2)`` or not invertible mod ``n^2``
  (a well-formed Paillier ciphertext always is), and, for packed plaintexts (see
  :mod:`secagg.he.packing`), random corruption, which decrypts to a plaintext whose guard bits or
  slots are out of range with overwhelming probability.
* 1024-bit keys (FedMF's setting) are below today's recommended strength; they are accepted with an
  :class:`~secagg.he.errors.InsecureKeySizeWarning` only, to reproduce the paper.

Decisions the papers leave open:

* Primes: ``gmpy2.next_prime`` applied to a ``secrets``-drawn odd candidate whose two top bits are set
  (so ``p*q`` has exactly ``bits`` bits), then confirmed with a Baillie-PSW test and 25 extra
  Miller-Rabin rounds; the candidate is redrawn if ``next_prime`` steps past ``bits/2`` bits. This is
  the "random start, incremental search" method (FIPS 186-5 B.3.x style); its slight bias toward
  primes after long prime gaps is known and does not help factoring.
* ``g = n + 1`` so that ``g^m = 1 + m*n (mod n^2)`` (no exponentiation), as in python-paillier.
* Encryption ``c = (1 + m*n) * r^n mod n^2`` with ``r`` uniform in ``Z_n^*`` from ``secrets``.
  Clients hold the private key in FedMF's model, so they may encrypt through the CRT
  (:meth:`PaillierPrivateKey.encrypt_int`): the n-th residue ``r^n`` is built as ``sp^p mod p^2``
  and ``sq^q mod q^2`` (uniform ``sp``, ``sq``) joined by the CRT, the same distribution as ``r^n``
  at a fraction of the cost; for a given ``r`` the output is identical to the public-key path (a
  known-answer test checks it against python-paillier's ``raw_encrypt``).
* Offline/online: :class:`ObfuscatorPool` precomputes single-use n-th residues while a client is
  idle, so online encryption is one multiplication per ciphertext.
* Serialization never contains ``p`` or ``q`` unless the caller asks for the secret key explicitly.
"""

from __future__ import annotations

import hashlib
import secrets
import struct
import warnings
from dataclasses import dataclass, field
from typing import Callable

import gmpy2
from gmpy2 import mpz

from secagg.he.errors import (
    CiphertextError,
    HEError,
    InsecureKeySizeWarning,
    KeyMismatchError,
    PlaintextOverflowError,
)

__all__ = [
    "DEFAULT_KEY_BITS",
    "MIN_KEY_BITS",
    "ObfuscatorPool",
    "PaillierCiphertext",
    "PaillierKeyPair",
    "PaillierPrivateKey",
    "PaillierPublicKey",
    "generate_keypair",
]

#: Default modulus size in bits: the floor of today's recommendations for factoring-based crypto.
DEFAULT_KEY_BITS = 2048
#: Smallest modulus accepted (with a warning): FedMF's 1024-bit setting.
MIN_KEY_BITS = 1024

_PUBKEY_MAGIC = b"PPK1"
_SECKEY_MAGIC = b"PSK1"
_CT_MAGIC = b"PCT1"
_FINGERPRINT_BYTES = 16
_MR_ROUNDS = 25


def _fingerprint(n: int) -> bytes:
    """16-byte SHA-256 fingerprint binding ciphertexts to the modulus ``n``."""
    nbytes = (int(n).bit_length() + 7) // 8
    digest = hashlib.sha256(b"secagg/he/paillier/v1" + int(n).to_bytes(nbytes, "big")).digest()
    return digest[:_FINGERPRINT_BYTES]


@dataclass(frozen=True, eq=False)
class PaillierPublicKey:
    """A Paillier public key ``n`` with ``g = n + 1``.

    Args:
        n: The RSA modulus ``p*q`` (at least :data:`MIN_KEY_BITS` bits, odd).

    Raises:
        HEError: If ``n`` is too small or even.
    """

    n: mpz
    nsquare: mpz = field(init=False, repr=False)
    fingerprint: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        n = mpz(self.n)
        if n.bit_length() < MIN_KEY_BITS or n % 2 == 0:
            raise HEError(
                f"Paillier modulus must be odd and at least {MIN_KEY_BITS} bits; found "
                f"{n.bit_length()} bits{' (even)' if n % 2 == 0 else ''}. Generate one with "
                "generate_keypair()."
            )
        object.__setattr__(self, "n", n)
        object.__setattr__(self, "nsquare", n * n)
        object.__setattr__(self, "fingerprint", _fingerprint(n))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PaillierPublicKey) and self.n == other.n

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    @property
    def bits(self) -> int:
        """Bit length of ``n``."""
        return int(self.n.bit_length())

    @property
    def ciphertext_bytes(self) -> int:
        """Fixed byte width of one serialized ciphertext value (``n^2`` rounded up to bytes)."""
        return (int(self.nsquare.bit_length()) + 7) // 8

    @property
    def max_plaintext(self) -> int:
        """Largest plaintext integer accepted by :meth:`encrypt_int` (``n - 1``)."""
        return int(self.n) - 1

    # -- randomness -------------------------------------------------------------------------
    def random_r(self) -> mpz:
        """Draw the encryption randomness ``r`` uniformly from ``Z_n^*`` with ``secrets``."""
        while True:
            r = mpz(secrets.randbelow(int(self.n) - 1) + 1)
            if gmpy2.gcd(r, self.n) == 1:
                return r

    # -- encryption -------------------------------------------------------------------------
    def _check_plaintext(self, m: int) -> mpz:
        if not isinstance(m, (int, type(mpz(0)))) or isinstance(m, bool):
            raise TypeError(f"plaintext must be an int; found {type(m).__name__}.")
        if m < 0 or m >= self.n:
            raise PlaintextOverflowError(
                f"Paillier plaintext must lie in [0, n) with n of {self.bits} bits; found a value of "
                f"{int(m).bit_length()} bits{' (negative)' if m < 0 else ''}. Encode signed or real "
                "values with secagg.he.packing.PackingSpec."
            )
        return mpz(m)

    def _encrypt_int_with_r(self, m: int, r: int) -> mpz:
        """Deterministic core: ``(1 + m*n) * r^n mod n^2`` for a given ``r`` (known-answer tests)."""
        m = self._check_plaintext(m)
        r = mpz(r)
        if not 0 < r < self.n or gmpy2.gcd(r, self.n) != 1:
            raise HEError("encryption randomness r must lie in Z_n^* (0 < r < n, gcd(r, n) = 1).")
        return gmpy2.mul(1 + m * self.n, gmpy2.powmod(r, self.n, self.nsquare)) % self.nsquare

    def encrypt_int(self, m: int) -> PaillierCiphertext:
        """Encrypt an integer ``0 <= m < n`` with fresh CSPRNG randomness (public-key path).

        Args:
            m: The plaintext integer.

        Returns:
            The ciphertext, bound to this key's fingerprint.

        Raises:
            PlaintextOverflowError: If ``m`` is outside ``[0, n)``.
        """
        return PaillierCiphertext(self.fingerprint, self._encrypt_int_with_r(m, self.random_r()))

    # -- validation and homomorphic addition -------------------------------------------------
    def validate_value(self, value: int) -> mpz:
        """Check that a raw ciphertext value can be a ciphertext under this key.

        A Paillier ciphertext is a unit of ``Z_{n^2}``: it lies in ``[1, n^2)`` and is coprime to
        ``n``.

        Raises:
            CiphertextError: If ``value`` is out of range or not invertible mod ``n^2``.
        """
        value = mpz(value)
        if not 0 < value < self.nsquare:
            raise CiphertextError(
                f"ciphertext value out of range: expected 0 < c < n^2 ({2 * self.bits} bits), found "
                f"{'a non-positive value' if value <= 0 else f'{int(value).bit_length()} bits'}; "
                "the ciphertext was modified or belongs to another key."
            )
        if gmpy2.gcd(value, self.n) != 1:
            raise CiphertextError(
                "ciphertext value is not invertible mod n^2 (it shares a factor with n); it was "
                "modified or forged."
            )
        return value

    def check_bound(self, ciphertext: PaillierCiphertext) -> None:
        """Raise :class:`KeyMismatchError` unless ``ciphertext`` was made under this key."""
        if ciphertext.fingerprint != self.fingerprint:
            raise KeyMismatchError(
                f"ciphertext is bound to key {ciphertext.fingerprint.hex()}, not to this key "
                f"{self.fingerprint.hex()}; it was encrypted under another Paillier key."
            )

    def add(self, a: PaillierCiphertext, b: PaillierCiphertext) -> PaillierCiphertext:
        """Homomorphic addition: ``Dec(add(a, b)) = Dec(a) + Dec(b) mod n``."""
        self.check_bound(a)
        self.check_bound(b)
        return PaillierCiphertext(self.fingerprint, gmpy2.mul(a.value, b.value) % self.nsquare)

    # -- serialization ------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """Serialize the public key (magic, bit length, ``n`` big-endian)."""
        nbytes = (self.bits + 7) // 8
        return _PUBKEY_MAGIC + struct.pack(">I", self.bits) + int(self.n).to_bytes(nbytes, "big")

    @classmethod
    def from_bytes(cls, data: bytes) -> PaillierPublicKey:
        """Parse :meth:`to_bytes` output.

        Raises:
            CiphertextError: If the encoding is malformed (wrong magic or length).
        """
        if len(data) < 8 or data[:4] != _PUBKEY_MAGIC:
            raise CiphertextError("not a serialized Paillier public key (bad magic or truncated).")
        (bits,) = struct.unpack(">I", data[4:8])
        if len(data) != 8 + (bits + 7) // 8:
            raise CiphertextError(
                f"serialized Paillier public key has {len(data)} bytes; expected "
                f"{8 + (bits + 7) // 8} for a {bits}-bit modulus (truncated or padded)."
            )
        n = int.from_bytes(data[8:], "big")
        if n.bit_length() != bits:
            raise CiphertextError(f"public key header says {bits} bits, modulus has {n.bit_length()}.")
        return cls(mpz(n))


@dataclass(frozen=True, eq=False)
class PaillierCiphertext:
    """One Paillier ciphertext bound to the fingerprint of its public key.

    Attributes:
        fingerprint: 16-byte fingerprint of the public key it was made under.
        value: The ciphertext integer in ``Z_{n^2}^*``.
    """

    fingerprint: bytes
    value: mpz

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, PaillierCiphertext)
            and self.fingerprint == other.fingerprint
            and self.value == other.value
        )

    def __hash__(self) -> int:
        return hash((self.fingerprint, int(self.value)))

    def to_bytes(self, public_key: PaillierPublicKey) -> bytes:
        """Constant-size encoding: magic, fingerprint, value padded to ``n^2`` bytes."""
        public_key.check_bound(self)
        return _CT_MAGIC + self.fingerprint + int(self.value).to_bytes(public_key.ciphertext_bytes, "big")

    @classmethod
    def from_bytes(cls, data: bytes, public_key: PaillierPublicKey) -> PaillierCiphertext:
        """Parse and validate one ciphertext for ``public_key``.

        Raises:
            CiphertextError: Wrong magic, wrong length, or an invalid value.
            KeyMismatchError: If it is bound to another key.
        """
        expected = 4 + _FINGERPRINT_BYTES + public_key.ciphertext_bytes
        if len(data) != expected or data[:4] != _CT_MAGIC:
            raise CiphertextError(
                f"serialized Paillier ciphertext must be {expected} bytes starting with {_CT_MAGIC!r}; "
                f"found {len(data)} bytes starting with {bytes(data[:4])!r}."
            )
        ct = cls(bytes(data[4 : 4 + _FINGERPRINT_BYTES]), mpz(int.from_bytes(data[4 + _FINGERPRINT_BYTES :], "big")))
        public_key.check_bound(ct)
        public_key.validate_value(ct.value)
        return ct


class PaillierPrivateKey:
    """The Paillier secret key ``(p, q)`` with CRT decryption and CRT encryption.

    Args:
        public_key: The matching public key.
        p: First prime factor of ``n``.
        q: Second prime factor of ``n``.

    Raises:
        HEError: If ``p * q != n`` or ``p == q``.
    """

    __slots__ = ("public_key", "_p", "_q", "_psq", "_qsq", "_hp", "_hq", "_p_inv_q", "_psq_inv_qsq")

    def __init__(self, public_key: PaillierPublicKey, p: int, q: int) -> None:
        p, q = mpz(p), mpz(q)
        if p == q or p * q != public_key.n:
            raise HEError("private key factors do not match the public key (need p*q == n, p != q).")
        if q < p:
            p, q = q, p
        self.public_key = public_key
        self._p, self._q = p, q
        self._psq, self._qsq = p * p, q * q
        self._p_inv_q = gmpy2.invert(p, q)
        self._psq_inv_qsq = gmpy2.invert(self._psq, self._qsq)
        self._hp = self._h(p, self._psq)
        self._hq = self._h(q, self._qsq)

    def __repr__(self) -> str:
        return f"PaillierPrivateKey(<secret>, fingerprint={self.public_key.fingerprint.hex()})"

    def _h(self, x: mpz, xsq: mpz) -> mpz:
        g = self.public_key.n + 1
        return gmpy2.invert((gmpy2.powmod(g, x - 1, xsq) - 1) // x, x)

    # -- decryption ----------------------------------------------------------------------------
    def _decrypt_value(self, c: mpz) -> mpz:
        mp = gmpy2.mul((gmpy2.powmod(c, self._p - 1, self._psq) - 1) // self._p, self._hp) % self._p
        mq = gmpy2.mul((gmpy2.powmod(c, self._q - 1, self._qsq) - 1) // self._q, self._hq) % self._q
        return mp + self._p * (gmpy2.mul(mq - mp, self._p_inv_q) % self._q)

    def decrypt_int(self, ciphertext: PaillierCiphertext) -> int:
        """Decrypt to the plaintext integer in ``[0, n)`` (CRT: two half-size exponentiations).

        Raises:
            KeyMismatchError: If the ciphertext is bound to another key.
            CiphertextError: If its value is not a valid ciphertext.
        """
        self.public_key.check_bound(ciphertext)
        self.public_key.validate_value(ciphertext.value)
        return int(self._decrypt_value(ciphertext.value))

    # -- encryption with the secret key (client side in FedMF's shared-key model) ---------------
    def _obfuscator_from_parts(self, sp: mpz, sq: mpz) -> mpz:
        """``x`` with ``x = sp^p (mod p^2)`` and ``x = sq^q (mod q^2)``, joined by the CRT.

        The n-th residues of ``Z_{n^2}^*`` are, mod ``p^2``, exactly the p-th powers (the subgroup of
        order ``p - 1``) because ``gcd(q, p - 1) = 1`` (implied by ``gcd(n, phi(n)) = 1``). So a
        uniform ``sp`` in ``Z_p^*`` and ``sq`` in ``Z_q^*`` give a uniform n-th residue, the same
        distribution as ``r^n`` for uniform ``r``, at the cost of two half-size exponentiations
        with half-size exponents.
        """
        xp = gmpy2.powmod(sp, self._p, self._psq)
        xq = gmpy2.powmod(sq, self._q, self._qsq)
        return xp + self._psq * (gmpy2.mul(xq - xp, self._psq_inv_qsq) % self._qsq)

    def _encrypt_int_with_parts(self, m: int, sp: int, sq: int) -> mpz:
        pk = self.public_key
        m = pk._check_plaintext(m)
        return gmpy2.mul(1 + m * pk.n, self._obfuscator_from_parts(mpz(sp), mpz(sq))) % pk.nsquare

    def _encrypt_int_with_r(self, m: int, r: int) -> mpz:
        """Deterministic CRT core; equals :meth:`PaillierPublicKey._encrypt_int_with_r` for the same r.

        ``r^n = (r^q)^p``, and ``(r^q)^p mod p^2`` depends only on ``r^q mod p``.
        """
        pk = self.public_key
        r = mpz(r)
        if not 0 < r < pk.n or gmpy2.gcd(r, pk.n) != 1:
            raise HEError("encryption randomness r must lie in Z_n^* (0 < r < n, gcd(r, n) = 1).")
        sp, sq = gmpy2.powmod(r, self._q, self._p), gmpy2.powmod(r, self._p, self._q)
        return self._encrypt_int_with_parts(m, sp, sq)

    def random_parts(self) -> tuple[mpz, mpz]:
        """Draw ``(sp, sq)`` uniformly from ``Z_p^* x Z_q^*`` with ``secrets`` (CRT randomness)."""
        return (
            mpz(secrets.randbelow(int(self._p) - 1) + 1),
            mpz(secrets.randbelow(int(self._q) - 1) + 1),
        )

    def encrypt_int(self, m: int) -> PaillierCiphertext:
        """Encrypt ``0 <= m < n`` through the CRT with fresh CSPRNG randomness (about 4x faster).

        Only holders of the secret key can use this path: in FedMF's model, every client.
        """
        sp, sq = self.random_parts()
        return PaillierCiphertext(self.public_key.fingerprint, self._encrypt_int_with_parts(m, sp, sq))

    # -- serialization -------------------------------------------------------------------------
    def secret_bytes(self) -> bytes:
        """Serialize the SECRET key (magic, bit lengths, ``p``, ``q``). Handle as a secret."""
        pb, qb = (int(self._p).bit_length() + 7) // 8, (int(self._q).bit_length() + 7) // 8
        return (
            _SECKEY_MAGIC
            + struct.pack(">II", pb, qb)
            + int(self._p).to_bytes(pb, "big")
            + int(self._q).to_bytes(qb, "big")
        )

    @classmethod
    def from_secret_bytes(cls, data: bytes) -> PaillierPrivateKey:
        """Parse :meth:`secret_bytes` output (checks that ``p`` and ``q`` are probable primes)."""
        if len(data) < 12 or data[:4] != _SECKEY_MAGIC:
            raise CiphertextError("not a serialized Paillier secret key (bad magic or truncated).")
        pb, qb = struct.unpack(">II", data[4:12])
        if len(data) != 12 + pb + qb:
            raise CiphertextError(f"serialized Paillier secret key has {len(data)} bytes; expected {12 + pb + qb}.")
        p = mpz(int.from_bytes(data[12 : 12 + pb], "big"))
        q = mpz(int.from_bytes(data[12 + pb :], "big"))
        if p < 2 or q < 2 or not (gmpy2.is_bpsw_prp(p) and gmpy2.is_bpsw_prp(q)):
            raise HEError("serialized Paillier secret key factors are not prime.")
        return cls(PaillierPublicKey(p * q), p, q)


@dataclass(frozen=True)
class PaillierKeyPair:
    """A public/private key pair (FedMF: shared by all clients; the server gets :attr:`public_key`)."""

    public_key: PaillierPublicKey
    private_key: PaillierPrivateKey = field(repr=False)

    def serialize(self, save_secret_key: bool = False) -> bytes:
        """Serialize the pair; the secret key is included ONLY when ``save_secret_key=True``.

        Args:
            save_secret_key: Include ``p`` and ``q`` (for distributing the shared key to clients
                over an authenticated, confidential channel). Default ``False``: public key only.
        """
        if not save_secret_key:
            return self.public_key.to_bytes()
        return self.private_key.secret_bytes()


class ObfuscatorPool:
    """Precomputed, single-use encryption randomness (offline/online Paillier encryption).

    Each entry is a fresh uniform n-th residue ``r^n mod n^2``, the expensive part of an
    encryption. A client fills the pool while idle (:meth:`refill`, between rounds); online
    encryption then costs one modular multiplication. Every entry is handed out once and dropped
    (reusing one would let the server subtract two ciphertexts' randomness away); when the pool
    runs dry, fresh randomness is computed on the spot. Entries are drawn through the CRT when the
    pool holds the private key, through ``r^n`` otherwise; both give the same distribution.

    Args:
        key: The key to precompute for (private: CRT, about 4x faster; public: ``r^n``).
    """

    def __init__(self, key: PaillierPublicKey | PaillierPrivateKey) -> None:
        self._key = key
        self.public_key = key.public_key if isinstance(key, PaillierPrivateKey) else key
        self._entries: list[mpz] = []

    def __len__(self) -> int:
        return len(self._entries)

    def _fresh(self) -> mpz:
        if isinstance(self._key, PaillierPrivateKey):
            return self._key._obfuscator_from_parts(*self._key.random_parts())
        pk = self._key
        return gmpy2.powmod(pk.random_r(), pk.n, pk.nsquare)

    def refill(self, count: int) -> None:
        """Precompute ``count`` more entries (the offline phase)."""
        if type(count) is not int or count < 0:
            raise HEError(f"refill count must be a non-negative int; found {count!r}.")
        self._entries.extend(self._fresh() for _ in range(count))

    def take(self) -> mpz:
        """Remove and return one entry (computed on the spot if the pool is empty)."""
        return self._entries.pop() if self._entries else self._fresh()

    def encrypt_int(self, m: int) -> PaillierCiphertext:
        """Online encryption ``(1 + m*n) * obfuscator mod n^2`` with a single-use entry."""
        pk = self.public_key
        m = pk._check_plaintext(m)
        return PaillierCiphertext(pk.fingerprint, gmpy2.mul(1 + m * pk.n, self.take()) % pk.nsquare)


def _random_prime(bits: int, randbits: Callable[[int], int]) -> mpz:
    """A prime of exactly ``bits`` bits with its two top bits set, from a random odd start."""
    top = mpz(3) << (bits - 2)
    while True:
        candidate = mpz(randbits(bits)) | top | 1
        p = gmpy2.next_prime(candidate)
        if p.bit_length() == bits and gmpy2.is_bpsw_prp(p) and gmpy2.is_strong_prp(p, 2) and gmpy2.is_prime(p, _MR_ROUNDS):
            return p


def _generate_keypair_from(bits: int, randbits: Callable[[int], int]) -> PaillierKeyPair:
    """Deterministic core of :func:`generate_keypair` over an explicit bit source (tests only)."""
    half = bits // 2
    while True:
        p = _random_prime(half, randbits)
        q = _random_prime(bits - half, randbits)
        if p == q:
            continue
        n = p * q
        # gcd(n, (p-1)(q-1)) == 1 holds for equal-size primes, checked anyway.
        if n.bit_length() == bits and gmpy2.gcd(n, (p - 1) * (q - 1)) == 1:
            public = PaillierPublicKey(n)
            return PaillierKeyPair(public, PaillierPrivateKey(public, p, q))


def generate_keypair(bits: int = DEFAULT_KEY_BITS) -> PaillierKeyPair:
    """Generate a Paillier key pair from the OS CSPRNG (``secrets``).

    Args:
        bits: Modulus size; a multiple of 8 and at least :data:`MIN_KEY_BITS`. Below
            :data:`DEFAULT_KEY_BITS` an :class:`InsecureKeySizeWarning` is issued (1024 is allowed
            only to reproduce FedMF).

    Returns:
        The key pair. Distribute ``serialize(save_secret_key=True)`` only to clients.

    Raises:
        HEError: If ``bits`` is too small or not a multiple of 8.
    """
    if isinstance(bits, bool) or not isinstance(bits, int) or bits < MIN_KEY_BITS or bits % 8:
        raise HEError(
            f"Paillier key size must be a multiple of 8 and at least {MIN_KEY_BITS} bits; found {bits!r}. "
            f"Use the default {DEFAULT_KEY_BITS}."
        )
    if bits < DEFAULT_KEY_BITS:
        warnings.warn(
            f"{bits}-bit Paillier keys are below the recommended {DEFAULT_KEY_BITS} bits; use them only "
            "to reproduce FedMF's setting.",
            InsecureKeySizeWarning,
            stacklevel=2,
        )
    return _generate_keypair_from(bits, secrets.randbits)
