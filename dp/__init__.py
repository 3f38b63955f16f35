"""Differential privacy: clipping, CSPRNG-backed mechanisms, LDP, accountants, the privacy ledger.

The core needs no torch and never imports ``secagg`` or ``recmodels``.

Modules:
    clipping: L1/L2 clipping of vectors and rows, returning the scale applied.
    mechanisms: float Laplace/Gaussian noise from the OS CSPRNG (floating-point caveat inside).
    discrete: exact discrete Laplace/Gaussian on an integer grid (Canonne-Kamath-Steinke 2020).
    ldp: FedCL's clip-L1 + Laplace upload, a Gaussian variant, composition of repeated uploads.
    events: immutable privacy events (Gaussian, Laplace, sampling, composition, parallel, FEL).
    rdp: the pure RDP numeric core (sampled Gaussian, Laplace, Balle et al. conversion).
    accountant: RDP and PLD accountants, pure-DP composition, ``best_epsilon``.
    calibration: noise for a target (epsilon, delta).
    ledger: the durable SQLite privacy ledger with budget enforcement.
"""

from dp.accountant import PldAccountant, PrivacyReport, RdpAccountant, best_epsilon, pure_epsilon
from dp.calibration import calibrate_gaussian_noise_multiplier, calibrate_laplace_epsilon0, gaussian_training_event
from dp.clipping import clip_l1, clip_l2, clip_rows_l1, clip_rows_l2
from dp.discrete import discrete_gaussian, discrete_gaussian_noise, discrete_laplace, discrete_laplace_noise
from dp.errors import BudgetExceededError, LedgerError, UnsupportedEventError
from dp.events import (
    Composed,
    DpEvent,
    FelTotal,
    Gaussian,
    Laplace,
    NoOp,
    NonPrivate,
    ParallelComposed,
    PoissonSampled,
    SampledWithoutReplacement,
    SelfComposed,
)
from dp.ledger import LedgerEntry, PrivacyLedger
from dp.ldp import LdpRelease, ldp_gaussian, ldp_laplace, ldp_repeated_uploads
from dp.mechanisms import gaussian_noise, laplace_noise
from dp.rdp import OrderRangeWarning, default_orders

__all__ = [
    "BudgetExceededError",
    "Composed",
    "DpEvent",
    "FelTotal",
    "Gaussian",
    "Laplace",
    "LdpRelease",
    "LedgerEntry",
    "LedgerError",
    "NoOp",
    "NonPrivate",
    "OrderRangeWarning",
    "ParallelComposed",
    "PldAccountant",
    "PoissonSampled",
    "PrivacyLedger",
    "PrivacyReport",
    "RdpAccountant",
    "SampledWithoutReplacement",
    "SelfComposed",
    "UnsupportedEventError",
    "best_epsilon",
    "calibrate_gaussian_noise_multiplier",
    "calibrate_laplace_epsilon0",
    "clip_l1",
    "clip_l2",
    "clip_rows_l1",
    "clip_rows_l2",
    "default_orders",
    "discrete_gaussian",
    "discrete_gaussian_noise",
    "discrete_laplace",
    "discrete_laplace_noise",
    "gaussian_noise",
    "gaussian_training_event",
    "laplace_noise",
    "ldp_gaussian",
    "ldp_laplace",
    "ldp_repeated_uploads",
    "pure_epsilon",
]
