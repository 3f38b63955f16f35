"""Secure aggregation: fixed-point ring encoding, secret sharing, pairwise-mask aggregation
(SecAgg, SecAgg+), the circular share chain, authenticated channels and homomorphic backends.

Depends on nothing above it (no torch, no models)."""
