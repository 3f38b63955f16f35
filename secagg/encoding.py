"""Fixed-point encoding of reals into the ring Z_(2^64) (numpy ``uint64`` wrap-around).

A real ``x`` with ``|x| <= clip`` becomes the integer ``round(x * 2^frac_bits)`` stored in two's
complement as ``uint64``. Sums of encodings are computed with wrap-around ``uint64`` adds and
decoded as signed integers, which is exact as long as the true integer sum stays inside
``(-2^63, 2^63)``: :func:`check_budget` verifies that up front. A protocol may run in the smaller
ring ``Z_(2^32)`` (the low 32 bits of each encoding; half the bytes) when the sum provably fits in
``(-2^31, 2^31)``: :func:`choose_ring_bits` decides from public parameters only, and
:func:`sign_extend` (or ``decode(..., ring_bits=32)``) maps such a sum back.

Rounding modes:

* ``"stochastic"`` (default): ``floor(x*2^f) + Bernoulli(frac)``, unbiased, the Bernoulli drawn
  from the OS CSPRNG (53-bit uniforms, :func:`csprng_uniform`);
* ``"nearest"`` (deterministic): round half to even (``numpy.rint``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from secagg.errors import BudgetError
from secagg.prg import random_words

__all__ = ["FixedPoint", "check_budget", "choose_ring_bits", "csprng_uniform", "sign_extend"]

_ROUNDINGS = ("stochastic", "nearest")


def csprng_uniform(shape: int | tuple[int, ...]) -> np.ndarray:
    """Uniform float64 in ``[0, 1)`` with 53 random bits each, from the operating system's CSPRNG
    (:func:`secagg.prg.random_words`: ``os.urandom`` for up to 512 values, beyond that the AES-256-CTR
    keystream of a fresh ``os.urandom`` seed, since ``getrandom`` takes 26 ms for one 647k-value
    vector, where AES-NI takes about 1 ms)."""
    size = int(np.prod(shape))
    words = random_words(size, label=b"stochastic-rounding")
    return ((words >> np.uint64(11)).astype(np.float64) * 2.0**-53).reshape(shape)


@dataclass(frozen=True)
class FixedPoint:
    """Fixed-point codec into Z_(2^64).

    Attributes:
        frac_bits: fractional bits ``f`` (resolution ``2^-f``), in ``[0, 62]``.
        clip: largest accepted magnitude; values beyond it are refused (clip them first).
    """

    frac_bits: int
    clip: float

    def __post_init__(self) -> None:
        if type(self.frac_bits) is not int or not 0 <= self.frac_bits <= 62:
            raise BudgetError(f"frac_bits must be an int in [0, 62]; found {self.frac_bits!r}.")
        if not (isinstance(self.clip, (int, float)) and math.isfinite(self.clip) and self.clip > 0):
            raise BudgetError(f"clip must be a finite positive number; found {self.clip!r}.")
        if self.max_abs_int >= 2**62:
            raise BudgetError(
                f"clip * 2^frac_bits = {self.clip} * 2^{self.frac_bits} does not fit in 62 bits; "
                "lower frac_bits or clip."
            )

    @property
    def scale(self) -> float:
        """The grid scale ``2^frac_bits``."""
        return float(2**self.frac_bits)

    @property
    def max_abs_int(self) -> int:
        """Largest magnitude of one encoded value (``ceil(clip * 2^f)``, stochastic rounding)."""
        return math.ceil(self.clip * 2**self.frac_bits)

    def encode(self, x: np.ndarray | float, *, rounding: str = "stochastic") -> np.ndarray:
        """Encode reals as ``uint64`` ring elements.

        Args:
            x: array-like of finite reals with ``|x| <= clip``.
            rounding: ``"stochastic"`` (unbiased, CSPRNG) or ``"nearest"`` (deterministic).

        Returns:
            ``uint64`` array of the same shape (two's complement).

        Raises:
            BudgetError: a value is not finite or exceeds ``clip``.
            ValueError: unknown rounding mode.
        """
        arr = np.asarray(x, dtype=np.float64)
        if rounding == "stochastic":
            return self._encode_with_uniform(arr, csprng_uniform(arr.shape))
        if rounding == "nearest":
            if arr.size >= _FUSE_FROM:  # one compiled pass: the range check, the scaling and the rounding
                flat = np.ascontiguousarray(arr).reshape(-1)
                out = np.empty(flat.shape, dtype=np.int64)
                from secagg.encoding_fused import encode_nearest  # numba: imported on the first large encode

                if encode_nearest(flat, self.scale, float(self.clip), out) >= 0:
                    self._check_range(arr)  # raises, with the worst value in the message
                return out.view(np.uint64).reshape(arr.shape)
            self._check_range(arr)
            return np.rint(arr * self.scale).astype(np.int64).view(np.uint64)
        raise ValueError(f"rounding must be one of {_ROUNDINGS}; found {rounding!r}.")

    def _encode_with_uniform(self, arr: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Stochastic rounding with explicit uniforms ``u`` in ``[0, 1)`` (known-answer core)."""
        self._check_range(arr)
        scaled = arr * self.scale
        low = np.floor(scaled)
        out = low + (u < (scaled - low))
        return out.astype(np.int64).view(np.uint64)

    def _check_range(self, arr: np.ndarray) -> None:
        if arr.size == 0:
            return
        if not np.all(np.isfinite(arr)):
            raise BudgetError("encode: input contains NaN or infinity; clean the input first.")
        worst = float(np.max(np.abs(arr)))
        if worst > self.clip:
            raise BudgetError(
                f"encode: |x| = {worst!r} exceeds clip = {self.clip!r}; clip inputs first "
                f"(np.clip(x, -{self.clip}, {self.clip})) or raise clip (and re-check the budget)."
            )

    def decode(self, u: np.ndarray, *, ring_bits: int = 64) -> np.ndarray:
        """Signed decode of an encoding or of a sum of encodings (mod ``2^ring_bits``) into float64."""
        arr = np.asarray(u)
        if arr.dtype != np.uint64:
            raise ValueError(f"decode expects a uint64 array; found dtype {arr.dtype}.")
        return sign_extend(arr, ring_bits).view(np.int64).astype(np.float64) / self.scale


_FUSE_FROM = 4096  # below this many values numpy's passes cost less than a call into the compiled loop


def sign_extend(u: np.ndarray, ring_bits: int) -> np.ndarray:
    """The ``Z_(2^64)`` two's-complement word of each ``Z_(2^ring_bits)`` element (its low bits).

    ``ring_bits`` is 32 or 64; with 64 the words are returned as they are (a view)."""
    arr = np.asarray(u)
    if arr.dtype != np.uint64:
        raise ValueError(f"sign_extend expects a uint64 array; found dtype {arr.dtype}.")
    if ring_bits == 64:
        return arr
    if ring_bits != 32:
        raise ValueError(f"ring_bits must be 32 or 64; found {ring_bits!r}.")
    return arr.astype(np.uint32).view(np.int32).astype(np.int64).view(np.uint64)


def choose_ring_bits(*, n_summands: int, clip: float, frac_bits: int, noise_headroom_bits: int = 0) -> int:
    """32 when a sum of ``n_summands`` encodings provably fits ``Z_(2^32)`` (:func:`check_budget`
    with ``ring_bits = 32``), else 64. Every argument is public, so every party computes the same
    ring without talking.

    Raises:
        BudgetError: not even ``Z_(2^64)`` holds the sum (the message says what to lower).
    """
    try:
        check_budget(n_summands=n_summands, clip=clip, frac_bits=frac_bits,
                     noise_headroom_bits=noise_headroom_bits, ring_bits=32)
        return 32
    except BudgetError:
        check_budget(n_summands=n_summands, clip=clip, frac_bits=frac_bits,
                     noise_headroom_bits=noise_headroom_bits, ring_bits=64)
        return 64


def check_budget(
    *,
    n_summands: int,
    clip: float,
    frac_bits: int,
    noise_headroom_bits: int = 0,
    ring_bits: int = 64,
) -> None:
    """Check that a sum of ``n_summands`` encodings (plus noise headroom) decodes exactly.

    Requires ``n_summands * ceil(clip * 2^frac_bits) * 2^noise_headroom_bits < 2^(ring_bits-1)``
    (one bit is the sign).

    Raises:
        BudgetError: the configuration does not fit; the message names the largest ``frac_bits``
            that would fit and the bits missing.
    """
    if type(n_summands) is not int or n_summands < 1:
        raise BudgetError(f"n_summands must be a positive int; found {n_summands!r}.")
    if type(ring_bits) is not int or not 2 <= ring_bits <= 64:
        raise BudgetError(f"ring_bits must be an int in [2, 64]; found {ring_bits!r}.")
    if type(noise_headroom_bits) is not int or noise_headroom_bits < 0:
        raise BudgetError(f"noise_headroom_bits must be an int >= 0; found {noise_headroom_bits!r}.")
    per_value = math.ceil(clip * 2**frac_bits)
    needed = n_summands * per_value * 2**noise_headroom_bits
    limit = 2 ** (ring_bits - 1)
    if needed >= limit:
        fit = frac_bits
        while fit >= 0 and n_summands * math.ceil(clip * 2**fit) * 2**noise_headroom_bits >= limit:
            fit -= 1
        fix = f"lower frac_bits to at most {fit}" if fit >= 0 else "no frac_bits fits: lower clip"
        raise BudgetError(
            f"bit budget exceeded: {n_summands} summands x clip {clip} x 2^{frac_bits} x "
            f"2^{noise_headroom_bits} headroom needs {needed.bit_length() + 1} bits but the ring has "
            f"{ring_bits}; {fix}, or lower clip, the number of clients, or the noise headroom."
        )
