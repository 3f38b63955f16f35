"""The plain baseline: exact sums and the same message validation as the masked protocols."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secagg.errors import AbortError, MessageError
from secagg.plain import PlainClient, PlainConfig, PlainServer


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 64), st.integers(1, 16), st.data())
def test_sum_is_exact(n, d, data):
    cfg = PlainConfig(n, d, os.urandom(16))
    x = np.array(data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=n * d, max_size=n * d)), dtype=np.uint64)
    x = x.reshape(n, d)
    server = PlainServer(cfg)
    for i in range(n):
        server.receive(PlainClient(cfg, i).send(x[i]).to_bytes())
    assert server.finish().tolist() == x.sum(axis=0).tolist()


def test_validation():
    cfg = PlainConfig(3, 4, os.urandom(16))
    server = PlainServer(cfg)
    msg = PlainClient(cfg, 0).send(np.arange(4, dtype=np.uint64))
    for blob, match in [
        (dataclasses.replace(msg, x=msg.x[:3]).to_bytes(), "length 3, expected 4"),
        (dataclasses.replace(msg, round=2).to_bytes(), "wrong instance or round 2"),
        (dataclasses.replace(msg, sender=9).to_bytes(), "bad sender 9"),
        (msg.to_bytes()[:-1], "truncated"),
    ]:
        with pytest.raises(MessageError, match=match):
            server.receive(blob)
    server.receive(msg.to_bytes())
    with pytest.raises(MessageError, match="replayed"):
        server.receive(msg.to_bytes())
    assert server.finish().tolist() == [0, 1, 2, 3]
    with pytest.raises(MessageError, match="finish called twice"):
        server.finish()
    with pytest.raises(AbortError, match="no input"):
        PlainServer(cfg).finish()
    c = PlainClient(cfg, 1)
    c.send(np.zeros(4, dtype=np.uint64))
    with pytest.raises(MessageError, match="not allowed"):
        c.send(np.zeros(4, dtype=np.uint64))
