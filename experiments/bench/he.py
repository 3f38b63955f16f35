"""``secagg bench he``: seconds per FedMF iteration with each homomorphic backend.

One FedMF iteration (Chai et al., "full" variant) for one user: the client encrypts its item-gradient
upload (``items x dim`` reals), the server adds it to the encrypted item matrix, and the client
decrypts the updated matrix. The benchmark times those three steps (median over ``--repeats``)
for:

* ``paillier``: :mod:`secagg.he` (gmpy2, packing, CRT encryption by the key-holding client);
* ``phe``: python-paillier, one ciphertext per value, as in FedMF's reference code;
* ``ckks``: :mod:`secagg.he.ckks` (TenSEAL; ``--key-bits`` does not apply);
* ``all``: the three in turn, plus the ratios.

Timings on a shared machine are noisy: the output says so, and every figure is re-runnable with the
printed command. ``--json`` prints one JSON object as the last line of stdout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from experiments import jsonio
from experiments.errors import UserError

if TYPE_CHECKING:  # numpy is imported where used, so that --help stays fast
    import numpy as np

__all__ = ["register", "run", "bench_backend"]

BACKENDS = ("paillier", "phe", "ckks")


class _Timer:
    """Collects median and best-of times per step (best-of is the least load-sensitive figure)."""

    def __init__(self, repeats: int) -> None:
        self.repeats = repeats
        self.median: dict[str, float] = {}
        self.best: dict[str, float] = {}

    def __call__(self, step: str, fn: Callable[[], Any], repeats: int | None = None) -> Any:
        times, out = [], None
        for _ in range(repeats or self.repeats):
            start = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - start)
        self.median[step] = statistics.median(times)
        self.best[step] = min(times)
        return out

    def figures(self) -> dict[str, float]:
        out = {f"{k}_s": v for k, v in self.median.items()}
        out.update({f"{k}_best_s": v for k, v in self.best.items()})
        for suffix, table in (("s", self.median), ("best_s", self.best)):
            out[f"iteration_{suffix}"] = table["encrypt"] + table["add"] + table["decrypt"]
        return out


def _bench_pool(grad: np.ndarray, sk: Any, spec: Any, count: int, repeats: int) -> dict[str, float]:
    """Offline/online encryption: precompute the randomness while idle, then encrypt with one
    multiplication per ciphertext. Reported beside, never inside, the iteration time."""
    from secagg.he import ObfuscatorPool, encrypt_packed

    pool = ObfuscatorPool(sk)
    offline_times, online_times = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        pool.refill(count)
        offline_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        encrypt_packed(grad, sk, spec, pool=pool)
        online_times.append(time.perf_counter() - start)
    return {
        "pool_offline_s": statistics.median(offline_times),
        "encrypt_online_with_pool_s": statistics.median(online_times),
    }


def _bench_paillier(grad: np.ndarray, matrix: np.ndarray, args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from secagg.he import (
        InsecureKeySizeWarning,
        PackingSpec,
        decrypt_packed,
        encrypt_packed,
        generate_keypair,
    )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureKeySizeWarning)
        start = time.perf_counter()
        kp = generate_keypair(args.key_bits)
        keygen_s = time.perf_counter() - start
    spec = PackingSpec(value_bits=args.value_bits, frac_bits=args.frac_bits, max_summands=args.max_summands)
    pk, sk = kp.public_key, kp.private_key
    enc_matrix = encrypt_packed(matrix, sk, spec)
    timer = _Timer(args.repeats)
    upload = timer("encrypt", lambda: encrypt_packed(grad, sk, spec))
    if not args.skip_extras:
        timer("encrypt_public_key_path", lambda: encrypt_packed(grad, pk, spec), max(1, args.repeats // 2))
    updated = timer("add", lambda: enc_matrix.add(upload, pk))
    plain = timer("decrypt", lambda: decrypt_packed(updated, sk))
    extras: dict[str, float] = {}
    if not args.skip_extras:
        extras = _bench_pool(grad, sk, spec, upload.num_ciphertexts, args.repeats)
    return {
        "keygen_s": keygen_s,
        **timer.figures(),
        **extras,
        "ciphertexts": upload.num_ciphertexts,
        "slots_per_ciphertext": upload.slots,
        "upload_bytes": len(upload.to_bytes(pk)),
        "max_abs_error": float(np.max(np.abs(plain - (matrix + grad).ravel()))),
        "packing": {
            "value_bits": spec.value_bits,
            "frac_bits": spec.frac_bits,
            "max_summands": spec.max_summands,
            "slot_bits": spec.slot_bits,
        },
    }


def _bench_phe(grad: np.ndarray, matrix: np.ndarray, args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    try:
        from phe import paillier
    except ImportError as exc:  # pragma: no cover - phe is in the dev and bench extras
        raise UserError("the phe backend needs python-paillier: pip install phe") from exc
    start = time.perf_counter()
    pk, sk = paillier.generate_paillier_keypair(n_length=args.key_bits)
    keygen_s = time.perf_counter() - start
    flat_g, flat_m = grad.ravel().tolist(), matrix.ravel().tolist()
    enc_matrix = [pk.encrypt(v) for v in flat_m]
    timer = _Timer(args.repeats)
    upload = timer("encrypt", lambda: [pk.encrypt(v) for v in flat_g])
    updated = timer("add", lambda: [a + b for a, b in zip(enc_matrix, upload)])
    plain = timer("decrypt", lambda: [sk.decrypt(c) for c in updated])
    ct_bytes = (2 * args.key_bits + 7) // 8
    return {
        "keygen_s": keygen_s,
        **timer.figures(),
        "ciphertexts": len(upload),
        "slots_per_ciphertext": 1,
        "upload_bytes": len(upload) * ct_bytes,
        "max_abs_error": float(np.max(np.abs(np.array(plain) - (matrix + grad).ravel()))),
    }


def _bench_ckks(grad: np.ndarray, matrix: np.ndarray, args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from secagg.he.ckks import CKKSContext, decrypt_vector, encrypt_vector, sum_error_bound, sum_vectors

    start = time.perf_counter()
    client = CKKSContext.generate()
    keygen_s = time.perf_counter() - start
    server = client.public()
    enc_matrix = encrypt_vector(matrix, client)
    timer = _Timer(args.repeats)
    upload = timer("encrypt", lambda: encrypt_vector(grad, client))
    updated = timer("add", lambda: sum_vectors([enc_matrix, upload], server))
    plain = timer("decrypt", lambda: decrypt_vector(updated, client))
    p = client.params
    return {
        "keygen_s": keygen_s,
        **timer.figures(),
        "ciphertexts": len(upload.chunks),
        "slots_per_ciphertext": p.slots,
        "upload_bytes": len(upload.to_bytes()),
        "max_abs_error": float(np.max(np.abs(plain - (matrix + grad).ravel()))),
        "error_bound": sum_error_bound(2, p),
        "params": {
            "poly_modulus_degree": p.poly_modulus_degree,
            "coeff_mod_bit_sizes": list(p.coeff_mod_bit_sizes),
            "scale_bits": p.scale_bits,
        },
    }


_RUNNERS = {"paillier": _bench_paillier, "phe": _bench_phe, "ckks": _bench_ckks}


def bench_backend(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    """Time one FedMF iteration (encrypt upload, server add, decrypt) with ``backend``."""
    import numpy as np

    rng = np.random.default_rng(args.seed)  # CSPRNG-OK: synthetic gradients and items, not secrets
    grad = rng.normal(scale=0.1, size=(args.items, args.dim))
    matrix = rng.normal(scale=0.5, size=(args.items, args.dim))
    result = _RUNNERS[backend](grad, matrix, args)
    result = {"backend": backend, **result}
    if backend == "ckks":
        result["key_bits"] = None
    return result


def run(args: argparse.Namespace) -> int:
    """Entry point of ``secagg bench he``."""
    for name in ("items", "dim", "repeats"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be at least 1; found {getattr(args, name)}.")
    if args.key_bits < 1024 or args.key_bits % 8:
        raise UserError(f"--key-bits must be a multiple of 8 and at least 1024; found {args.key_bits}.")
    from secagg.he import HEError, PackingSpec

    try:
        PackingSpec(value_bits=args.value_bits, frac_bits=args.frac_bits, max_summands=args.max_summands)
    except HEError as exc:
        raise UserError(str(exc)) from None
    backends = BACKENDS if args.backend == "all" else (args.backend,)
    results: dict[str, dict[str, Any]] = {}
    for backend in backends:
        key = "CKKS N=8192" if backend == "ckks" else f"key {args.key_bits} bits"
        print(f"[bench he] {backend}: {args.items}x{args.dim} values, {key} ...", file=sys.stderr)
        results[backend] = bench_backend(backend, args)
    summary: dict[str, Any] = {
        "benchmark": "he",
        "items": args.items,
        "dim": args.dim,
        "values": args.items * args.dim,
        "key_bits": args.key_bits,
        "repeats": args.repeats,
        "note": "median (and best-of) seconds; measured on a shared machine under load: compare ratios, not absolutes",
        "results": results,
    }
    if "paillier" in results and "phe" in results:
        phe_r, ours = results["phe"], results["paillier"]
        summary["paillier_speedup_vs_phe"] = phe_r["iteration_s"] / ours["iteration_s"]
        summary["paillier_speedup_vs_phe_best"] = phe_r["iteration_best_s"] / ours["iteration_best_s"]
        summary["paillier_encrypt_speedup_vs_phe"] = phe_r["encrypt_s"] / ours["encrypt_s"]
    if "paillier" in results and "ckks" in results:
        summary["ckks_to_paillier_ratio"] = results["ckks"]["iteration_s"] / results["paillier"]["iteration_s"]
        summary["ckks_to_paillier_ratio_best"] = (
            results["ckks"]["iteration_best_s"] / results["paillier"]["iteration_best_s"]
        )
    print(
        f"{'backend':<10}{'encrypt s':>12}{'add s':>10}{'decrypt s':>12}{'iteration s':>13}"
        f"{'best-of s':>11}{'upload KiB':>12}{'max err':>11}"
    )
    for name, r in results.items():
        print(
            f"{name:<10}{r['encrypt_s']:>12.4f}{r['add_s']:>10.4f}{r['decrypt_s']:>12.4f}"
            f"{r['iteration_s']:>13.4f}{r['iteration_best_s']:>11.4f}{r['upload_bytes'] / 1024:>12.1f}"
            f"{r['max_abs_error']:>11.2e}"
        )
    ratio_keys = (
        "paillier_speedup_vs_phe",
        "paillier_speedup_vs_phe_best",
        "paillier_encrypt_speedup_vs_phe",
        "ckks_to_paillier_ratio",
        "ckks_to_paillier_ratio_best",
    )
    if "paillier" in results and "encrypt_online_with_pool_s" in results["paillier"]:
        r = results["paillier"]
        print(
            f"paillier online encryption with precomputed randomness: {r['encrypt_online_with_pool_s']:.4f} s "
            f"(offline precomputation {r['pool_offline_s']:.4f} s, not counted in the iteration)"
        )
    for key in ratio_keys:
        if key in summary:
            print(f"{key}: {summary[key]:.2f}")
    print(summary["note"])
    if args.json:
        print(jsonio.dumps(summary))
    return 0


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    """Add ``secagg bench he``."""
    p = bench_subparsers.add_parser(
        "he",
        help="seconds per FedMF iteration: packed Paillier vs python-paillier vs CKKS",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--backend", choices=(*BACKENDS, "all"), default="paillier", help="backend (default paillier)")
    p.add_argument("--items", type=int, default=40, help="items in the upload (default 40, FedMF's shape)")
    p.add_argument("--dim", type=int, default=100, help="latent dimensions per item (default 100)")
    p.add_argument("--key-bits", type=int, default=1024, help="Paillier modulus bits (default 1024, FedMF's)")
    p.add_argument("--value-bits", type=int, default=40, help="packed fixed-point value width (default 40)")
    p.add_argument("--frac-bits", type=int, default=24, help="packed fractional bits (default 24)")
    p.add_argument("--max-summands", type=int, default=1024, help="packing headroom in summands (default 1024)")
    p.add_argument(
        "--repeats", type=int, default=5, help="timed repetitions; median and best-of reported (default 5)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic gradients (default 0)")
    p.add_argument(
        "--skip-extras",
        action="store_true",
        help="paillier: skip the public-key-path and precomputed-randomness measurements (large shapes)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line of stdout")
    p.set_defaults(func=run)
