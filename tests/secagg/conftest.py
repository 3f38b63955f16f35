"""Fixtures shared by the secagg tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from secagg.bonawitz import ClientPolicy, MaskingClient, MaskingConfig, MaskingServer, make_pki


def _start_round(cfg: MaskingConfig):
    """A fresh PKI, clients and server, run honestly through ShareKeys.

    Returns ``(identities, clients, server, inbox)`` with ``inbox`` the forwarded shares, ready
    for the masked-input stage. The clients' own policy opts into an unsafe ``t`` exactly when
    ``cfg`` does (the attack demonstrations play clients whose operators chose it).
    """
    identities, pki = make_pki(cfg.n)
    policy = ClientPolicy(unsafe_threshold=cfg.unsafe_threshold)
    clients = [MaskingClient(cfg, i, identities[i], pki, policy) for i in range(cfg.n)]
    server = MaskingServer(cfg, pki)
    for c in clients:
        server.receive(c.advertise().to_bytes())
    inbox = server.broadcast_keys()
    for c in clients:
        server.receive(c.share_keys(inbox[c.id]).to_bytes())
    return identities, clients, server, server.forward_shares()


@pytest.fixture
def start_round() -> Callable[[MaskingConfig], tuple]:
    """``start_round(cfg) -> (identities, clients, server, inbox)``: a round up to masked input."""
    return _start_round
