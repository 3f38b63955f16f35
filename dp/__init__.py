"""Differential privacy: clipping, CSPRNG-backed mechanisms, LDP, accountants, the privacy ledger.

The core needs no torch and never imports ``secagg`` or ``recmodels``."""
