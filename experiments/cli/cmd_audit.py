"""``secagg audit RUN_DIR``: the one-run privacy audit of a run made with ``--canaries K`` (docs/audit.md)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    from experiments.studies.audit import register as register_audit

    register_audit(subparsers)
