"""Before/after in one process (docs/dpf.md, "Evaluation speed").

Usage, from the repository root::

    git show 74a3119:secagg/dpf.py > /tmp/dpf_main.py
    PYTHONPATH=$PWD python docs/scripts/dpf_speed_ab.py /tmp/dpf_main.py 3

Before/after in one process: main's Accumulator (74a3119) vs this branch's, the same 8 key sets at
10^6 x 32, P = 100, verification on; CPU seconds per key set (process_time), page faults of the sum
excluded from both (the sum is touched before timing); interleaved repetitions, so load hits both."""
import importlib.util
import os
import sys
import time


spec = importlib.util.spec_from_file_location("dpf_main", sys.argv[1])
dpf_main = importlib.util.module_from_spec(spec)
sys.modules["dpf_main"] = dpf_main  # dataclasses look their module up
spec.loader.exec_module(dpf_main)
import numpy as np

from secagg import dpf
from secagg.cuckoo import CuckooLayout
try:
    from experiments.bench_dpf import _prg_bytes, aes_throughput
except ImportError:  # after main's move of experiments/ into cli/, run/, bench/, studies/
    from experiments.bench.dpf import _prg_bytes, aes_throughput
layout = CuckooLayout.for_points(10**6, 100, seed=bytes(32))
forest_new = dpf.Forest(layout.sizes, layout.depth)
forest_old = dpf_main.Forest(layout.sizes, layout.depth)
forest_new.tweaks(); forest_old.tweaks()
rng = np.random.default_rng(0)  # CSPRNG-OK: simulated points and values only
keys = []
for _ in range(8):
    alphas = np.array([rng.integers(0, s) for s in layout.sizes])
    keys.append(dpf.gen(alphas, layout.depth, rng.integers(0, 2**64, (layout.buckets, 32), dtype=np.uint64))[0])
ch = os.urandom(16)
prg = _prg_bytes(forest_new, 32, True)
res = {"main": [], "branch": []}
for rep in range(int(sys.argv[2]) if len(sys.argv) > 2 else 2):
    acc = dpf_main.Accumulator(forest_old, 32, 0, challenge=ch); acc._acc.fill(0); acc._positions()
    c = time.process_time()
    d_old = [acc.add(k) for k in keys]; acc._flush()
    res["main"].append((time.process_time() - c) / len(keys))
    tot_old = acc.total(); del acc
    acc = dpf.Accumulator(forest_new, 32, 0, challenge=ch); acc._positions()  # the MAC's first blocks: per round
    c = time.process_time()
    d_new = acc.add_many(keys)
    res["branch"].append((time.process_time() - c) / len(keys))
    assert d_new == d_old and np.array_equal(acc.total(), tot_old)
    del acc
    bound = prg / aes_throughput(cpu=True)
    print(f"rep {rep}: main {res['main'][-1]:.3f} CPU s per key set, branch {res['branch'][-1]:.3f}; "
          f"PRG bound (CPU) {bound:.3f} s; load {os.getloadavg()[0]:.1f}", flush=True)
