"""Plaintext packing for Paillier: many fixed-point values per ciphertext, with carry headroom.

Parties, adversary and promise are those of :mod:`secagg.he.paillier` (clients share the key pair,
the honest-but-curious server adds ciphertexts and learns nothing but lengths and counts).

Layout. A real value ``x`` is encoded as the signed fixed-point integer ``v = round(x * 2^frac_bits)``
with ``|v| <= 2^(value_bits-1) - 1``, then shifted by the offset ``2^(value_bits-1)`` into
``[1, 2^value_bits - 1]``. Each slot is ``slot_bits = value_bits + ceil(log2(max_summands))`` wide:
a sum of up to ``max_summands`` shifted values stays below ``2^slot_bits``, so no carry ever crosses
into the next slot. Every plaintext is::

    seal + sum_i slot_i * 2^(SEAL_BITS + i * slot_bits)      (the top guard_bits stay zero)

``slots`` slots sit above a ``SEAL_BITS = 91``-bit seal, packed little-end first, and the whole
plaintext stays below ``2^(bits(n) - 1 - guard_bits)``.

The seal binds the summand count and the layout inside the encrypted plaintext. A fresh
encryption's seal is ``T = 1 + (L << 32)``, where ``L`` packs ``value_bits``, ``frac_bits``,
``headroom_bits`` and ``guard_bits`` (27 bits, injective). Homomorphic addition of ``k`` uploads adds
their seals, giving ``k * T = k + (k * L << 32)`` with no carry (``k < 2^32``, ``k * L < 2^59``). The
header still carries ``k`` (public: the server counts the uploads it adds and refuses a sum beyond
``max_summands``), but decryption accepts a plaintext only if its seal equals ``k * T`` for the
header's ``k`` and layout: since ``k * T mod 2^32 = k``, equality forces both the count and ``L`` to
match. Editing ``summands``, ``frac_bits``, ``value_bits``, ``guard_bits`` or ``max_summands``
(beyond a value with the same headroom, which decodes identically) in a serialized vector, or
mixing ciphertexts of sums of different sizes, is therefore always detected; the seal sits at a
fixed position, so this does not depend on the (possibly altered) layout. A MAC under a client key
would not do: the server must produce the sum, whose count no client-side MAC could cover.

What is refused, before anything is encrypted or added:

* a value that does not fit ``value_bits`` after scaling (or is NaN/inf):
  :class:`~secagg.he.errors.PlaintextOverflowError`;
* an addition whose summand count would exceed ``max_summands``: the same error;
* vectors of different lengths or packing layouts: :class:`~secagg.he.errors.ShapeMismatchError`;
* ciphertexts under another key: :class:`~secagg.he.errors.KeyMismatchError`.

What decryption detects (:class:`~secagg.he.errors.CiphertextError`): a seal other than
``k * T`` (a wrong count or layout in the header, or mixed sums), non-zero guard bits or unused
tail slots, and a slot outside ``[k, k * (2^value_bits - 1)]``. A randomly corrupted ciphertext
decrypts to a near-uniform value mod ``n`` and passes these checks with probability below
``2^-(guard_bits + 91)``. A deliberate change by a public-key holder (adding ``Enc(delta)`` for a
small in-range ``delta``, to a slot or to the seal) is NOT detectable: Paillier is malleable, and
whoever can add ciphertexts can add any plaintext.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import gmpy2
import numpy as np
from gmpy2 import mpz

from secagg.he.errors import (
    CiphertextError,
    HEError,
    KeyMismatchError,
    PlaintextOverflowError,
    ShapeMismatchError,
)
from secagg.he.paillier import ObfuscatorPool, PaillierPrivateKey, PaillierPublicKey

__all__ = [
    "PackedCiphertext",
    "PackingSpec",
    "decrypt_packed",
    "encrypt_packed",
    "sum_packed",
]

_PACKED_MAGIC = b"PPV2"
_HEADER = struct.Struct(">4s16sBBIHHII")  # magic, fingerprint, value_bits, frac_bits, max_summands,
#                                           guard_bits, slots, length, summands
#: Bits of the seal at the bottom of every plaintext: a 32-bit count, then count * layout (59 bits).
SEAL_BITS = 91
_COUNT_BITS = 32
_MAX_SUMMANDS = (1 << _COUNT_BITS) - 1


@dataclass(frozen=True)
class PackingSpec:
    """Fixed-point packing layout.

    Attributes:
        value_bits: Width of one signed fixed-point value, sign included (2..56). Default 32.
        frac_bits: Fractional bits of the fixed-point grid (scale ``2^frac_bits``). Default 16.
        max_summands: Largest number of encrypted vectors that may be summed (1 .. 2^32 - 1).
            Default 1024.
        guard_bits: Zero bits kept above the slots of every plaintext for tamper detection.
            Default 40.
    """

    value_bits: int = 32
    frac_bits: int = 16
    max_summands: int = 1024
    guard_bits: int = 40

    def __post_init__(self) -> None:
        for name in ("value_bits", "frac_bits", "max_summands", "guard_bits"):
            value = getattr(self, name)
            if type(value) is not int:
                raise HEError(f"PackingSpec.{name} must be an int; found {value!r}.")
        if not 2 <= self.value_bits <= 56:
            raise HEError(f"PackingSpec.value_bits must lie in [2, 56]; found {self.value_bits}.")
        if not 0 <= self.frac_bits < self.value_bits:
            raise HEError(
                f"PackingSpec.frac_bits must lie in [0, value_bits={self.value_bits}); found {self.frac_bits}."
            )
        if not 1 <= self.max_summands <= _MAX_SUMMANDS:
            raise HEError(
                f"PackingSpec.max_summands must lie in [1, 2^32 - 1]; found {self.max_summands}."
            )
        if self.slot_bits > 64:
            raise HEError(
                f"slot width value_bits + ceil(log2(max_summands)) = {self.slot_bits} exceeds 64 bits; "
                "lower value_bits or max_summands."
            )
        if not 0 <= self.guard_bits <= 256:
            raise HEError(f"PackingSpec.guard_bits must lie in [0, 256]; found {self.guard_bits}.")

    @property
    def headroom_bits(self) -> int:
        """Carry headroom ``ceil(log2(max_summands))``."""
        return (self.max_summands - 1).bit_length()

    @property
    def slot_bits(self) -> int:
        """Slot width ``value_bits + headroom_bits``."""
        return self.value_bits + self.headroom_bits

    @property
    def offset(self) -> int:
        """Shift ``2^(value_bits-1)`` that makes every encoded value positive."""
        return 1 << (self.value_bits - 1)

    @property
    def max_abs_int(self) -> int:
        """Largest encodable ``|v|`` on the integer grid: ``2^(value_bits-1) - 1``."""
        return self.offset - 1

    @property
    def max_abs_value(self) -> float:
        """Largest encodable ``|x|``: ``(2^(value_bits-1) - 1) / 2^frac_bits`` (before rounding)."""
        return self.max_abs_int / (1 << self.frac_bits)

    @property
    def layout_code(self) -> int:
        """``L = value_bits | frac_bits << 6 | headroom_bits << 12 | guard_bits << 18`` (27 bits)."""
        return self.value_bits | self.frac_bits << 6 | self.headroom_bits << 12 | self.guard_bits << 18

    def seal(self, summands: int) -> int:
        """The seal of a sum of ``summands`` fresh encryptions: ``k * (1 + (L << 32))``."""
        return summands * (1 + (self.layout_code << _COUNT_BITS))

    def slots_for(self, public_key: PaillierPublicKey) -> int:
        """Slots per ciphertext: ``(bits(n) - 1 - guard_bits - SEAL_BITS) // slot_bits``.

        Raises:
            HEError: If not even one slot fits.
        """
        slots = (public_key.bits - 1 - self.guard_bits - SEAL_BITS) // self.slot_bits
        if slots < 1:
            raise HEError(
                f"no {self.slot_bits}-bit slot fits a {public_key.bits}-bit key beside the "
                f"{SEAL_BITS}-bit seal and {self.guard_bits} guard bits; use a larger key or fewer "
                "value/guard bits."
            )
        return slots

    # -- fixed point ----------------------------------------------------------------------------
    def quantize(self, values: np.ndarray | Sequence[float]) -> np.ndarray:
        """Round reals to the signed integer grid (int64), refusing what does not fit.

        Raises:
            PlaintextOverflowError: If a value is NaN/inf or ``|round(x * 2^frac_bits)|`` exceeds
                :attr:`max_abs_int`; the message names the value and the fix.
        """
        arr = np.asarray(values, dtype=np.float64).ravel()
        if not np.all(np.isfinite(arr)):
            bad = arr[~np.isfinite(arr)][0]
            raise PlaintextOverflowError(f"cannot encode non-finite value {bad}; clip or drop it first.")
        scaled = np.rint(arr * float(1 << self.frac_bits))
        if scaled.size and np.max(np.abs(scaled)) > self.max_abs_int:
            idx = int(np.argmax(np.abs(scaled)))
            raise PlaintextOverflowError(
                f"value {arr[idx]!r} at index {idx} does not fit a {self.value_bits}-bit slot with "
                f"{self.frac_bits} fractional bits (|x| <= {self.max_abs_value:.6g}); clip the values, "
                "or raise value_bits / lower frac_bits."
            )
        return scaled.astype(np.int64)

    def encode_ints(self, ints: np.ndarray) -> np.ndarray:
        """Shift signed grid integers by :attr:`offset` into unsigned slot values (uint64).

        Raises:
            PlaintextOverflowError: If an integer is outside ``[-max_abs_int, max_abs_int]``.
        """
        arr = np.asarray(ints)
        if arr.dtype.kind not in "iu":
            raise HEError(f"encode_ints needs an integer array; found dtype {arr.dtype}.")
        arr = arr.astype(np.int64).ravel()
        if arr.size and np.max(np.abs(arr)) > self.max_abs_int:
            idx = int(np.argmax(np.abs(arr)))
            raise PlaintextOverflowError(
                f"integer {int(arr[idx])} at index {idx} does not fit a {self.value_bits}-bit slot "
                f"(|v| <= {self.max_abs_int}); raise value_bits or scale down."
            )
        return (arr + self.offset).astype(np.uint64)

    def decode_ints(self, slots: np.ndarray, summands: int) -> np.ndarray:
        """Undo the offset of a sum of ``summands`` encoded vectors (int64 grid integers)."""
        # uint64 wrap-around then reinterpretation: exact because |result| < 2^63.
        shifted = np.asarray(slots, dtype=np.uint64) - np.uint64(summands * self.offset)
        return shifted.view(np.int64)

    # -- packing --------------------------------------------------------------------------------
    def pack(self, slot_values: np.ndarray, slots: int) -> list[mpz]:
        """Pack uint64 slot values into plaintext integers, ``slots`` per integer (little end first)."""
        vals = np.ascontiguousarray(slot_values, dtype="<u8").ravel()
        count = -(-vals.size // slots) if vals.size else 0
        padded = np.zeros(count * slots, dtype="<u8")
        padded[: vals.size] = vals
        bits = np.unpackbits(padded.view(np.uint8).reshape(-1, 8), axis=1, bitorder="little")
        bits = bits[:, : self.slot_bits].reshape(count, slots * self.slot_bits)
        packed = np.packbits(bits, axis=1, bitorder="little")
        return [mpz(int.from_bytes(row.tobytes(), "little")) for row in packed]

    def unpack(self, plaintexts: Sequence[int], slots: int) -> np.ndarray:
        """Inverse of :meth:`pack`: split plaintext integers into ``len * slots`` uint64 slot values.

        Raises:
            CiphertextError: If a plaintext has bits set above its ``slots`` slots (guard bits).
        """
        width = slots * self.slot_bits
        nbytes = (width + 7) // 8
        limit = mpz(1) << width
        raw = bytearray()
        for m in plaintexts:
            if m >= limit:
                raise CiphertextError(
                    "decrypted plaintext has non-zero guard bits: the ciphertext was corrupted, "
                    "forged, or packed with another layout."
                )
            raw += int(m).to_bytes(nbytes, "little")
        if not plaintexts:
            return np.zeros(0, dtype=np.uint64)
        rows = np.frombuffer(bytes(raw), dtype=np.uint8).reshape(len(plaintexts), nbytes)
        bits = np.unpackbits(rows, axis=1, bitorder="little")[:, :width].reshape(-1, self.slot_bits)
        full = np.zeros((bits.shape[0], 64), dtype=np.uint8)
        full[:, : self.slot_bits] = bits
        return np.packbits(full, axis=1, bitorder="little").view("<u8").ravel().astype(np.uint64)

    def to_tuple(self) -> tuple[int, int, int, int]:
        """``(value_bits, frac_bits, max_summands, guard_bits)``."""
        return (self.value_bits, self.frac_bits, self.max_summands, self.guard_bits)


@dataclass(frozen=True, eq=False)
class PackedCiphertext:
    """An encrypted vector of ``length`` packed fixed-point values holding a sum of ``summands``.

    Attributes:
        fingerprint: Fingerprint of the public key.
        spec: The packing layout.
        slots: Values per ciphertext (fixed by the key size and the layout).
        length: Number of packed values.
        summands: Number of encrypted vectors summed into this one (1 when fresh).
        values: The ``ceil(length / slots)`` ciphertext integers.
    """

    fingerprint: bytes
    spec: PackingSpec
    slots: int
    length: int
    summands: int
    values: tuple[mpz, ...]

    @property
    def num_ciphertexts(self) -> int:
        """Number of Paillier ciphertexts."""
        return len(self.values)

    def check_compatible(self, other: PackedCiphertext) -> None:
        """Raise unless ``other`` can be added to this vector (same key, layout and length)."""
        if other.fingerprint != self.fingerprint:
            raise KeyMismatchError(
                f"cannot add vectors under different keys ({self.fingerprint.hex()} vs "
                f"{other.fingerprint.hex()})."
            )
        if other.spec != self.spec or other.slots != self.slots:
            raise ShapeMismatchError(
                f"cannot add vectors packed with different layouts ({self.spec}, {self.slots} slots vs "
                f"{other.spec}, {other.slots} slots)."
            )
        if other.length != self.length:
            raise ShapeMismatchError(
                f"cannot add encrypted vectors of lengths {self.length} and {other.length}; "
                "both must have the same length."
            )

    def add(self, other: PackedCiphertext, public_key: PaillierPublicKey) -> PackedCiphertext:
        """Homomorphic slot-wise addition.

        Raises:
            KeyMismatchError: Different keys (or not ``public_key``'s).
            ShapeMismatchError: Different lengths or layouts.
            PlaintextOverflowError: If the summand count would exceed ``spec.max_summands``.
        """
        return sum_packed([self, other], public_key)

    def to_bytes(self, public_key: PaillierPublicKey) -> bytes:
        """Serialize: fixed header then each ciphertext padded to ``n^2`` bytes (never any key)."""
        if self.fingerprint != public_key.fingerprint:
            raise KeyMismatchError("this vector is bound to another key than the one given.")
        width = public_key.ciphertext_bytes
        head = _HEADER.pack(
            _PACKED_MAGIC,
            self.fingerprint,
            self.spec.value_bits,
            self.spec.frac_bits,
            self.spec.max_summands,
            self.spec.guard_bits,
            self.slots,
            self.length,
            self.summands,
        )
        return head + b"".join(int(v).to_bytes(width, "big") for v in self.values)

    @classmethod
    def from_bytes(
        cls,
        data: bytes,
        public_key: PaillierPublicKey,
        *,
        spec: PackingSpec | None = None,
        length: int | None = None,
    ) -> PackedCiphertext:
        """Parse and validate a packed vector received from another party.

        Args:
            data: The bytes from :meth:`to_bytes`.
            public_key: The key the vector must be bound to.
            spec: If given, the layout the receiver expects (anything else is refused).
            length: If given, the length the receiver expects (anything else is refused).

        Raises:
            CiphertextError: Bad magic, truncated or padded data, a value out of range or not
                invertible, an inconsistent header.
            KeyMismatchError: Bound to another key.
            ShapeMismatchError: Another layout or length than expected.
        """
        if len(data) < _HEADER.size:
            raise CiphertextError(f"packed ciphertext truncated: {len(data)} bytes < header {_HEADER.size}.")
        magic, fp, vb, fb, ms, gb, slots, n_values, summands = _HEADER.unpack_from(data)
        if magic != _PACKED_MAGIC:
            raise CiphertextError(f"not a packed Paillier vector: magic {magic!r}, expected {_PACKED_MAGIC!r}.")
        if fp != public_key.fingerprint:
            raise KeyMismatchError(
                f"packed vector is bound to key {fp.hex()}, not {public_key.fingerprint.hex()}."
            )
        try:
            got_spec = PackingSpec(vb, fb, ms, gb)
        except HEError as exc:
            raise CiphertextError(f"packed vector header holds an invalid layout: {exc}") from None
        if spec is not None and got_spec != spec:
            raise ShapeMismatchError(f"packed vector uses layout {got_spec}; expected {spec}.")
        if slots != got_spec.slots_for(public_key):
            raise CiphertextError(
                f"packed vector claims {slots} slots per ciphertext; this key and layout give "
                f"{got_spec.slots_for(public_key)}."
            )
        if length is not None and n_values != length:
            raise ShapeMismatchError(f"packed vector has length {n_values}; expected {length}.")
        if not 1 <= summands <= got_spec.max_summands:
            raise CiphertextError(
                f"packed vector claims {summands} summands; must lie in [1, {got_spec.max_summands}]."
            )
        count = -(-n_values // slots)
        width = public_key.ciphertext_bytes
        expected = _HEADER.size + count * width
        if len(data) != expected:
            raise CiphertextError(
                f"packed vector of length {n_values} must be {expected} bytes; found {len(data)} "
                "(truncated or padded)."
            )
        body = memoryview(data)[_HEADER.size :]
        values = tuple(
            public_key.validate_value(int.from_bytes(body[i * width : (i + 1) * width], "big"))
            for i in range(count)
        )
        return cls(fp, got_spec, slots, n_values, summands, values)


def encrypt_packed(
    values: np.ndarray | Sequence[float],
    key: PaillierPublicKey | PaillierPrivateKey,
    spec: PackingSpec | None = None,
    *,
    integers: bool = False,
    pool: ObfuscatorPool | None = None,
) -> PackedCiphertext:
    """Fixed-point encode, pack and encrypt a vector (any shape is flattened, C order).

    Args:
        values: Reals (or grid integers with ``integers=True``).
        key: A public key (public-key path) or a private key (CRT path, ~4x faster; FedMF's clients
            hold it).
        spec: The packing layout (default :class:`PackingSpec()`).
        integers: Treat ``values`` as already-scaled signed integers.
        pool: Precomputed single-use randomness for ``key`` (online encryption then costs one
            multiplication per ciphertext); entries are consumed.

    Returns:
        The packed ciphertext with ``summands == 1``.

    Raises:
        PlaintextOverflowError: If any value does not fit its slot (nothing is encrypted).
    """
    spec = spec or PackingSpec()
    public = key.public_key if isinstance(key, PaillierPrivateKey) else key
    ints = np.asarray(values).ravel() if integers else spec.quantize(values)
    slot_values = spec.encode_ints(ints)
    slots = spec.slots_for(public)
    seal = spec.seal(1)
    plaintexts = [seal + (m << SEAL_BITS) for m in spec.pack(slot_values, slots)]
    if pool is not None:
        if pool.public_key != public:
            raise KeyMismatchError("the obfuscator pool was precomputed for another key.")
        enc = [pool.encrypt_int(m).value for m in plaintexts]
    elif isinstance(key, PaillierPrivateKey):
        enc = [key._encrypt_int_with_parts(m, *key.random_parts()) for m in plaintexts]
    else:
        enc = [public._encrypt_int_with_r(m, public.random_r()) for m in plaintexts]
    return PackedCiphertext(public.fingerprint, spec, slots, int(slot_values.size), 1, tuple(enc))


def sum_packed(vectors: Iterable[PackedCiphertext], public_key: PaillierPublicKey) -> PackedCiphertext:
    """Homomorphically add packed vectors (the server's operation).

    Checks every vector before multiplying anything, so a bad vector never touches the sum.

    Raises:
        KeyMismatchError: A vector under another key than ``public_key``.
        ShapeMismatchError: Different lengths or layouts.
        PlaintextOverflowError: The total summand count exceeds ``spec.max_summands``.
        HEError: No vectors.
    """
    vectors = list(vectors)
    if not vectors:
        raise HEError("sum_packed needs at least one vector.")
    first = vectors[0]
    if first.fingerprint != public_key.fingerprint:
        raise KeyMismatchError(
            f"vector is bound to key {first.fingerprint.hex()}, not to {public_key.fingerprint.hex()}."
        )
    for other in vectors[1:]:
        first.check_compatible(other)
    expected = -(-first.length // first.slots) if first.length else 0
    for v in vectors:
        if len(v.values) != expected:
            raise ShapeMismatchError(
                f"packed vector of length {v.length} holds {len(v.values)} ciphertexts; expected {expected}."
            )
    total = sum(v.summands for v in vectors)
    if total > first.spec.max_summands:
        raise PlaintextOverflowError(
            f"summing {total} vectors exceeds the declared headroom max_summands="
            f"{first.spec.max_summands}; the slots would overflow. Use a PackingSpec with a larger "
            "max_summands."
        )
    nsq = public_key.nsquare
    acc = list(first.values)
    for other in vectors[1:]:
        acc = [gmpy2.mul(a, b) % nsq for a, b in zip(acc, other.values)]
    return PackedCiphertext(first.fingerprint, first.spec, first.slots, first.length, total, tuple(acc))


def decrypt_packed(
    ciphertext: PackedCiphertext, private_key: PaillierPrivateKey, *, integers: bool = False
) -> np.ndarray:
    """Decrypt, unpack and decode a packed vector (a sum of ``summands`` uploads).

    Args:
        ciphertext: The packed vector.
        private_key: The (shared) private key.
        integers: Return the int64 grid integers instead of float64 reals.

    Returns:
        A 1-D array of ``length`` values.

    Raises:
        KeyMismatchError: Bound to another key.
        CiphertextError: An invalid value, or a plaintext whose guard bits, tail slots or slot
            ranges show corruption.
    """
    pk = private_key.public_key
    if ciphertext.fingerprint != pk.fingerprint:
        raise KeyMismatchError(
            f"packed vector is bound to key {ciphertext.fingerprint.hex()}, not to "
            f"{pk.fingerprint.hex()}."
        )
    spec = ciphertext.spec
    expected_count = -(-ciphertext.length // ciphertext.slots) if ciphertext.length else 0
    if ciphertext.slots != spec.slots_for(pk) or len(ciphertext.values) != expected_count:
        raise ShapeMismatchError(
            f"packed vector has {len(ciphertext.values)} ciphertexts of {ciphertext.slots} slots for "
            f"length {ciphertext.length}; expected {expected_count} of {spec.slots_for(pk)}."
        )
    k = ciphertext.summands
    if not 1 <= k <= spec.max_summands:
        raise CiphertextError(f"packed vector claims {k} summands; must lie in [1, {spec.max_summands}].")
    plain = [private_key._decrypt_value(pk.validate_value(v)) for v in ciphertext.values]
    seal_mask = (mpz(1) << SEAL_BITS) - 1
    expected_seal = spec.seal(k)
    for m in plain:
        found = int(m & seal_mask)
        if found != expected_seal:
            raise CiphertextError(_seal_mismatch(found, k, spec))
    slot_values = spec.unpack([m >> SEAL_BITS for m in plain], ciphertext.slots)
    body, tail = slot_values[: ciphertext.length], slot_values[ciphertext.length :]
    if np.any(tail != 0):
        raise CiphertextError("decrypted padding slots are not zero: the ciphertext was corrupted or forged.")
    low, high = k, k * ((1 << spec.value_bits) - 1)
    if body.size and (int(body.min()) < low or int(body.max()) > high):
        raise CiphertextError(
            f"a decrypted slot lies outside [{low}, {high}] for a sum of {k} values: the ciphertext "
            "was corrupted, or its summand count is wrong."
        )
    ints = spec.decode_ints(body, k)
    if integers:
        return ints
    return ints.astype(np.float64) / float(1 << spec.frac_bits)


def _seal_mismatch(found: int, k: int, spec: PackingSpec) -> str:
    """Explain a seal that is not ``spec.seal(k)``: a wrong count, another layout, or corruption."""
    count = found & _MAX_SUMMANDS
    code, rest = divmod(found >> _COUNT_BITS, count) if count else (None, 1)
    if count and rest == 0 and code == spec.layout_code:
        return (
            f"the header claims {k} summands but the encrypted seal holds {count}: the summand count "
            "was altered, or ciphertexts of different sums were mixed."
        )
    if count and rest == 0 and code is not None and code < 1 << 27:
        return (
            "the packing layout in the header (value_bits, frac_bits, max_summands, guard_bits) is not "
            "the one sealed at encryption: the header was altered."
        )
    return "the encrypted seal is not valid: the ciphertext was corrupted, forged, or packed with another layout."
