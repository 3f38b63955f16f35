"""Per-paper studies and attacks behind ``secagg attack`` and the sweeps the docs cite: each trains what it attacks or measures."""
