"""A training process's heap: settled after the first round (:func:`settle_heap`), released after the last
(:func:`release_heap`).

After its first round a run's process holds its long-lived state (torch, numba's compiled loops, the data,
the model), and every later round allocates and frees about the same working set (a secure round at
ML-100K's shape: ~1.2 GB of key sets and messages). Two process-wide settings make those rounds cheaper;
:func:`release_heap` undoes both when training ends (``secagg run`` before its evaluation, ``secagg bench
secure`` after each timed run):

* **The cyclic GC's full scans skip the long-lived objects** (``gc.freeze``, after one full collection).
  The heap then holds several hundred thousand of them, and each full collection walked them all: 0.17-0.2 s
  every few rounds at ML-100K's shape. Later garbage is collected as before; a cycle among the frozen
  objects that dies later is not reclaimed until they are released.
* **glibc's allocator keeps the pages a round frees for the next round** (``mallopt``: ``M_TRIM_THRESHOLD``
  1 GB, so the top of the heap is not handed back to the kernel after each round, and ``M_MMAP_THRESHOLD``
  32 MB, the ceiling of glibc's own adaptive threshold, so blocks up to that size come from the heap).
  Without it each ``fedavg-gmf-dpf`` round at ML-100K's shape faulted ~16K fresh pages back in: 0.06-0.1 s
  of kernel time, against 0.02-0.03 s with it (``/usr/bin/time`` peak memory unchanged). Setting either
  parameter ends glibc's adaptive thresholds for the process, so the release leaves them where the adaptive
  scheme stops (trim 64 MB, mmap 32 MB) and returns the free pages at once (``malloc_trim``). With another C
  library (musl, macOS) the allocator is left alone.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import sys

__all__ = ["release_heap", "settle_heap"]

_M_TRIM_THRESHOLD = -1  #: glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
_KEEP = 1 << 30  #: bytes free at the heap's top kept mapped between rounds
_MMAP = 32 << 20  #: glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit hosts
_RELEASED_TRIM = 2 * _MMAP  #: the trim threshold glibc's adaptive scheme reaches with that mmap threshold


@functools.cache
def _glibc():  # noqa: ANN202 - (mallopt, malloc_trim) or None
    """glibc's ``mallopt`` and ``malloc_trim`` through ctypes, or ``None`` on another platform or C library."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the C library the interpreter itself runs on
        mallopt, trim = libc.mallopt, libc.malloc_trim
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl has no such call (AttributeError)
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return mallopt, trim


def _allocator(trim: int, mmap: int) -> bool:
    """Set glibc's trim and mmap thresholds; whether the allocator took them (``False`` off glibc)."""
    libc = _glibc()
    if libc is None:
        return False
    mallopt, _ = libc
    return bool(mallopt(_M_TRIM_THRESHOLD, trim)) and bool(mallopt(_M_MMAP_THRESHOLD, mmap))


def settle_heap() -> bool:
    """After a run's first round: freeze the live objects out of the cyclic GC's scans and keep the pages
    later rounds free (see the module docstring). Returns whether the allocator's setting applied (glibc)."""
    gc.collect()
    gc.freeze()
    return _allocator(_KEEP, _MMAP)


def release_heap() -> None:
    """Undo :func:`settle_heap` once training ends: the frozen objects are collectable again, and the free
    pages go back to the kernel now and at glibc's adaptive ceiling afterwards."""
    gc.unfreeze()
    if _allocator(_RELEASED_TRIM, _MMAP):  # glibc only
        _glibc()[1](0)
