"""Scale-out on Flower (optional extra: ``pip install -e '.[flower]'``).

This package is the only place that imports ``flwr``. It carries the framework's secure aggregation into
Flower (a server workflow and a client mod that run ``secagg``'s state machines over Flower messages, every
payload still validated by our decoders) and runs the registered protocols as Flower ServerApps/ClientApps,
in simulation and in a real SuperLink/SuperNode deployment.

Layering: ``fedflower`` sits beside ``attacks`` (it may import ``protocols``, ``secagg``, ``dp`` and
``recmodels``); only ``experiments`` imports it, and only lazily, so the core framework and the ``secagg``
command work without Flower installed. ``tests/test_layers.py`` enforces both.
"""

from __future__ import annotations

__all__: list[str] = []
