"""The heap settings a run applies after its first round (``experiments.run.heap``): the GC freeze and, on
glibc, an allocator that keeps the pages a round frees for the next one."""

from __future__ import annotations

import json
import subprocess
import sys

from experiments.run import heap

# A round's pattern: many blocks of 1 MB (key sets, messages) allocated, touched and freed together, three
# times; the page faults of the third round are printed. Run in a fresh interpreter: the allocator's
# thresholds are process-wide and glibc's adaptive ones depend on the process's history.
_ROUNDS = """
import json, resource, sys
from experiments.run import heap
def round_():
    blocks = [bytearray(1 << 20) for _ in range(64)]  # zero-filled: every page touched
    del blocks
round_()
if sys.argv[1] == "settle":
    applied = heap.settle_heap()
else:
    applied = None
round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
round_()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
heap.release_heap()
print(json.dumps({"applied": applied, "faults": faults}))
"""


def _faults(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _ROUNDS, mode], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_settled_heap_keeps_the_pages_a_round_frees_for_the_next_round():
    """Without the setting, glibc hands the freed top of the heap back to the kernel after each round and
    the next round faults its 64 MB back in (16K pages); settled, the next round reuses them. Off glibc the
    allocator is left alone and ``settle_heap`` says so."""
    if heap._glibc() is None:  # musl, macOS: nothing to set
        assert _faults("settle")["applied"] is False
        return
    plain, settled = _faults("plain"), _faults("settle")
    assert settled["applied"] is True
    assert plain["faults"] > 8000  # 64 MB of 4 KB pages, faulted again
    assert settled["faults"] < 1000


def test_release_undoes_the_freeze_and_leaves_the_allocator_at_glibcs_adaptive_ceiling(monkeypatch):
    """``release_heap`` unfreezes the GC and sets glibc's thresholds to where its adaptive scheme stops (trim
    64 MB, mmap 32 MB), then returns the free pages; ``settle_heap`` had kept 1 GB at the top."""
    import gc

    calls = []
    if heap._glibc() is not None:
        mallopt, trim = heap._glibc()
        monkeypatch.setattr(heap, "_glibc", lambda: (lambda p, v: calls.append((p, v)) or mallopt(p, v),
                                                      lambda pad: calls.append(("trim", pad)) or trim(pad)))
    assert heap.settle_heap() is (heap._glibc() is not None)
    assert gc.get_freeze_count() > 0
    heap.release_heap()
    assert gc.get_freeze_count() == 0
    if calls:
        assert calls == [(-1, 1 << 30), (-3, 32 << 20), (-1, 64 << 20), (-3, 32 << 20), ("trim", 0)]
