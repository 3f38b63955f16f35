"""Parse untrusted TenSEAL contexts in a throwaway child process first.

TenSEAL's (and SEAL's) deserialiser is not safe against crafted input: a 92-byte mutation of a valid
serialised context kills the process with SIGSEGV (found by ``tests/secagg/test_he_fuzz.py``; the
input is kept as ``tests/secagg/data/ckks_context_segv.bin``). A server that loads a context received
from a client must not die on it, so :func:`probe_context` parses the bytes in a child forked from a
single-threaded fork server first; only bytes that the child parsed cleanly are then parsed in
process. A context can also parse cleanly and crash on first use (the kept sample does, in
``serialize``), so the child exercises everything a server does with one before reporting. A crash,
a timeout or a TenSEAL parse error in the child becomes a :class:`CiphertextError`.

Cost: one fork per distinct context (results are cached by SHA-256), a few milliseconds once the
fork server runs (about a second to start it, once per process). Ciphertext chunks are parsed in
process: fuzzing them against a valid context (1,200 mutations) never crashed.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import signal
import threading

from secagg.he.errors import CiphertextError

__all__ = ["PROBE_TIMEOUT_S", "probe_context"]

#: Seconds a child may take to parse one context before the bytes are refused.
PROBE_TIMEOUT_S = 120.0

_ok: set[bytes] = set()
_lock = threading.Lock()


def _parse_in_child(body: bytes, scale_bits: int, conn) -> None:  # type: ignore[no-untyped-def]
    """Child side: parse, then exercise what a server does with a context; report on ``conn``.

    A context can parse and still crash on first use (the kept sample parses, then SIGSEGVs in
    ``serialize``), so the child also serialises it, encrypts, adds, and round-trips a ciphertext.
    Python errors in those later steps are left to the in-process code, which raises typed errors for
    them; only the parse result is reported, and a crash anywhere shows as the child's signal.
    """
    import tenseal as ts

    try:
        ctx = ts.context_from(body)
    except Exception as exc:  # noqa: BLE001 - every parser failure is reported, typed, by the parent
        conn.send(f"{type(exc).__name__}: {exc}")
        conn.close()
        return
    try:
        ctx.serialize(save_public_key=True, save_secret_key=False, save_galois_keys=False, save_relin_keys=False)
        ctx.global_scale = 2.0**scale_bits
        vec = ts.ckks_vector(ctx, [0.0, 1.0])
        ts.ckks_vector_from(ctx, (vec + vec).serialize())
    except Exception:  # noqa: BLE001, S110 - see the docstring: only crashes matter here
        pass
    conn.send("")
    conn.close()


def probe_context(body: bytes, scale_bits: int, *, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Raise :class:`CiphertextError` unless TenSEAL parses ``body`` in a child without crashing.

    Args:
        body: A serialised TenSEAL context (untrusted).
        scale_bits: The CKKS scale its header announces (used to exercise an encryption).
        timeout: Seconds before the child is killed and the bytes refused.

    Raises:
        CiphertextError: The child crashed (the signal is named), timed out, or TenSEAL rejected the bytes.
        The caller (:meth:`secagg.he.ckks.CKKSContext.from_bytes`) prefixes "cannot load CKKS context".
    """
    digest = hashlib.sha256(scale_bits.to_bytes(4, "big") + body).digest()
    with _lock:
        if digest in _ok:
            return
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["secagg.he.isolate", "tenseal"])  # children fork with tenseal imported
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_parse_in_child, args=(body, scale_bits, send), daemon=True)
    child.start()
    send.close()
    try:
        message = receive.recv() if receive.poll(timeout) else None
    except EOFError:  # the child died before reporting
        message = None
    finally:
        receive.close()
    child.join(timeout if message is None else None)
    if child.is_alive():
        child.kill()
        child.join()
        raise CiphertextError(f"TenSEAL did not parse it within {timeout:g} s.")
    code = child.exitcode
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        raise CiphertextError(f"it crashes TenSEAL's parser ({name}); refused.")
    if message is None or code != 0:
        raise CiphertextError(f"the parser exited with code {code}.")
    if message:
        raise CiphertextError(message)
    with _lock:
        _ok.add(digest)
