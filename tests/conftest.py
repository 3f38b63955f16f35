"""Shared test fixtures.

Real data lives in ``<repo root>/../shared/datasets`` and is never copied into the project.
Tests that need it use the ``ml_latest_small`` fixture: it skips when the folder is absent (a
user's machine) but fails under ``CI=true``, where a missing dataset is a broken set-up.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED = REPO_ROOT.parent / "shared"


def require_shared(relative: str) -> Path:
    """Return ``../shared/<relative>``; skip if absent, fail if absent under CI=true."""
    path = SHARED / relative
    if not path.exists():
        message = f"real data not found at {path}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + " (CI=true: ../shared must sit beside the repository)")
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def ml_latest_small() -> Path:
    """Path of MovieLens latest-small's ``ratings.csv`` in ../shared."""
    return require_shared("datasets/ml-latest-small/ratings.csv")


@pytest.fixture
def one_torch_thread():
    """One torch thread, as ``secagg run`` sets it (the batched simulation's small ops lose to thread
    contention); modules that train many small batches use it with ``pytestmark``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
