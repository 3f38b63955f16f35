"""FedMF's configuration (the ``[fedmf]`` section) and the error a refused upload raises.

Split out of :mod:`protocols.fedmf` so that its HE key and ciphertext helpers (:mod:`protocols.fedmf_he`)
can name them without importing the protocol; every name stays importable from :mod:`protocols.fedmf`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from recmodels.mf import MFConfig

__all__ = ["DEFENSES", "VARIANTS", "FedMFConfig", "UpdateError"]

DEFENSES = ("none", "paillier", "ckks", "secagg", "ldp")
VARIANTS = ("full", "part")


class UpdateError(ValueError):
    """A client upload was refused (wrong round, sender, replay, item ids, shape or values)."""


@dataclass(frozen=True)
class FedMFConfig:
    """Configuration of a FedMF run.

    Attributes:
        mf: the MF hyper-parameters (``mf.user_update`` picks FedMF's item-by-item rule or batch).
        variant: ``"full"`` (dense upload, default) or ``"part"`` (rated rows with their ids).
        defense: one of :data:`DEFENSES` (default ``"none"``).
        rounds: training rounds (default 10).
        key_bits: Paillier modulus bits (default 2048; 1024 warns).
        frac_bits: fixed-point fractional bits for Paillier packing and secure aggregation (24).
        value_clip: largest ``|delta|`` accepted per coordinate for fixed-point encodings (8.0).
        epsilon: LDP epsilon per upload (``defense="ldp"``).
        ldp_clip: L1 clipping bound of one upload before the Laplace noise (``defense="ldp"``).
        rating_scale: ``[lo, hi]``, the public rating scale predictions are clipped to. Empty
            (default): the training ratings' min and max, which only a party holding every rating
            has, so runs on separate devices must give it (:func:`check_devices`).
        he_keys: ``paillier``/``ckks``: a folder with the shared key files of
            :func:`write_he_keys`. Empty (default): fresh keys for an in-process run. Set, the
            server half (``build``) reads only the public key file and never holds the secret;
            a client half (``build_client``) reads the secret key file.
    """

    mf: MFConfig = field(default_factory=MFConfig)
    variant: str = "full"
    defense: str = "none"
    rounds: int = 10
    key_bits: int = 2048
    frac_bits: int = 24
    value_clip: float = 8.0
    epsilon: float = 1.0
    ldp_clip: float = 1.0
    rating_scale: list[float] = field(default_factory=list)
    he_keys: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.mf, dict):  # sent as JSON (a Flower node rebuilds its config from the server's)
            try:
                object.__setattr__(self, "mf", MFConfig(**self.mf))
            except TypeError as exc:
                raise ValueError(f"fedmf.mf does not fit MFConfig: {exc}") from None
        if not isinstance(self.mf, MFConfig):
            raise ValueError(f"fedmf.mf must be an MFConfig (or its fields); found {type(self.mf).__name__}.")
        scale = list(self.rating_scale)
        if scale and (len(scale) != 2 or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in scale)
                      or not scale[0] < scale[1]):
            raise ValueError(f"fedmf.rating_scale must be empty or [lo, hi] with finite lo < hi; found {scale!r}.")
        if self.variant not in VARIANTS:
            raise ValueError(f"fedmf.variant must be one of {VARIANTS}; found {self.variant!r}.")
        if self.defense not in DEFENSES:
            raise ValueError(f"fedmf.defense must be one of {DEFENSES}; found {self.defense!r}.")
        if type(self.rounds) is not int or self.rounds < 1:
            raise ValueError(f"fedmf.rounds must be an int >= 1; found {self.rounds!r}.")
        for name in ("epsilon", "ldp_clip", "value_clip"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"fedmf.{name} must be a positive finite number; found {v!r}.")
