"""Secure aggregation: fixed-point ring encoding, secret sharing, pairwise-mask aggregation
(SecAgg, SecAgg+), the circular share chain, authenticated channels and homomorphic backends.

Depends on nothing above it (no torch, no models).

Import the submodules explicitly (``from secagg.runner import run``): the package exports nothing,
so importing one primitive never pulls in the protocols."""

__all__: list[str] = []
