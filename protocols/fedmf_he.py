"""FedMF's shared-key homomorphic encryption: fresh key material, the key files a device run reads, and
ciphertexts as reply arrays (one blob, or row blobs with their lengths) checked on the way in.

Split out of :mod:`protocols.fedmf` (issue 28: no module over ~800 lines); every name stays importable
from :mod:`protocols.fedmf`, where :func:`write_he_keys` is documented.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from protocols.fedmf_config import FedMFConfig, UpdateError
from secagg.errors import SecAggError
from secagg.he.backends import HEClient, HEServer, make_backend
from secagg.he.packing import PackingSpec

__all__ = ["HE_PUBLIC", "HE_SECRET", "write_he_keys"]

#: File names of the shared HE key material in ``FedMFConfig.he_keys``.
HE_PUBLIC, HE_SECRET = "fedmf-{}.public", "fedmf-{}.secret"


def _size(obj: Any) -> int:
    if isinstance(obj, bytes):
        return len(obj)
    if isinstance(obj, tuple):
        return sum(len(b) for b in obj)
    return int(np.asarray(obj).nbytes)


def _ct_arrays(enc: bytes | tuple[bytes, ...]) -> dict[str, np.ndarray]:
    """Ciphertexts as reply arrays: one blob as uint8 ``ct``; row blobs concatenated, with ``ct_lengths``."""
    if isinstance(enc, bytes):
        return {"ct": np.frombuffer(enc, np.uint8).copy()}
    return {"ct": np.frombuffer(b"".join(enc), np.uint8).copy(),
            "ct_lengths": np.array([len(b) for b in enc], np.int64)}


def _ct_from(arrays: Any, variant: str, rows: int, *, who: str = "the server") -> bytes | tuple[bytes, ...]:
    """Ciphertext bytes from arrays (:func:`_ct_arrays`), checking types, lengths and the row count."""
    ct = arrays.get("ct")
    if not isinstance(ct, np.ndarray) or ct.dtype != np.uint8 or ct.ndim != 1 or not len(ct):
        raise UpdateError(f"{who}: ciphertexts must be a non-empty 1-D uint8 array; found "
                          f"{getattr(ct, 'dtype', type(ct).__name__)} {getattr(ct, 'shape', '')}.")
    if variant == "full":
        return ct.tobytes()
    lengths = arrays.get("ct_lengths")
    if (not isinstance(lengths, np.ndarray) or lengths.dtype != np.int64 or lengths.shape != (rows,)
            or (lengths < 1).any() or int(lengths.sum()) != len(ct)):
        raise UpdateError(f"{who}: ct_lengths must be {rows} positive int64 lengths summing to the {len(ct)} "
                          "ciphertext bytes.")
    ends = np.cumsum(lengths)
    raw = ct.tobytes()
    return tuple(raw[e - n:e] for n, e in zip(lengths.tolist(), ends.tolist()))


def _new_he(config: FedMFConfig, n_users: int) -> HEClient:
    """Fresh shared key material (FedMF's: every client holds the secret key)."""
    if config.defense == "ckks":
        return make_backend("ckks")
    summands = 1 << (n_users + 1).bit_length()
    spec = PackingSpec(value_bits=config.frac_bits + 16, frac_bits=config.frac_bits, max_summands=summands)
    return make_backend("paillier", key_bits=config.key_bits, spec=spec)


def write_he_keys(directory: str | Path, config: FedMFConfig, n_users: int) -> Path:
    """Write fresh shared HE key files for ``config.defense`` and ``n_users`` users into ``directory``.

    ``fedmf-<scheme>.public`` goes to the server and every client, ``fedmf-<scheme>.secret``
    (mode 0600) to the clients only, out of band (FedMF's shared-key model). Point
    ``fedmf.he_keys`` at the folder. Returns the folder.
    """
    if config.defense not in ("paillier", "ckks"):
        raise ValueError(f"HE key files are for defense paillier or ckks; found {config.defense!r}.")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    he = _new_he(config, n_users)
    (out / HE_PUBLIC.format(config.defense)).write_bytes(he.public_bytes)
    secret = out / HE_SECRET.format(config.defense)
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(he.secret_bytes)
    return out


def _load_he_keys(config: FedMFConfig, n_users: int, *, secret: bool) -> Any:
    """The key files in ``config.he_keys``: an :class:`HEClient` (``secret``) or the public :class:`HEServer`."""
    scheme = config.defense
    folder = Path(config.he_keys)
    public_path = folder / HE_PUBLIC.format(scheme)
    if not public_path.is_file():
        raise ValueError(f"fedmf.he_keys: no public key file {public_path} (write the files with "
                         "protocols.fedmf.write_he_keys).")
    public = public_path.read_bytes()
    if scheme == "paillier":
        from secagg.he.backends import _spec_from_bytes

        spec = _spec_from_bytes(public[:12])
        if spec.frac_bits != config.frac_bits or spec.max_summands < n_users + 1:
            raise ValueError(f"fedmf.he_keys: the key files were written for frac_bits {spec.frac_bits} and at most "
                             f"{spec.max_summands - 1} users; this run has frac_bits {config.frac_bits} and "
                             f"{n_users} users: write new ones.")
    if not secret:
        return HEServer(scheme, public)  # type: ignore[arg-type]
    secret_path = folder / HE_SECRET.format(scheme)
    if not secret_path.is_file():
        raise ValueError(f"fedmf.he_keys: a client needs the shared secret key file {secret_path}.")
    he = HEClient(scheme, secret_path.read_bytes(), public)  # type: ignore[arg-type]
    try:
        he.decrypt(he.encrypt(np.zeros(1)), 1)  # the secret key matches the public key it came with
    except (SecAggError, ValueError) as exc:
        raise ValueError(f"fedmf.he_keys: the secret key file does not match the public one ({exc}).") from None
    return he
