"""LightFR with ``secure_aggregation = "dpf"``: two non-colluding servers sum the clients' rated rows.

Parties: the clients; ``server`` (A: holds ``D``, learns the per-item sums) and ``server2`` (B).
Adversary: each server honest-but-curious, the two not colluding. Promise (tested): the plaintext
codes bit for bit; neither server's view holds a rated item id (no union phase, key sets only).
Limit (tested): without padding each server sees how many key sets a client sent.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.lightfr import LightFR, LightFRConfig, Upload
from protocols.secure_sum import SERVER2
from recmodels.synthetic import generate_synthetic


def _data(seed=0, n=6, m=9):
    return generate_synthetic(n_users=n, n_items=m, dim=3, mean_interactions=5, seed=seed)


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 500), server=st.sampled_from(["grad", "para", "dcd"]), points=st.integers(1, 6),
       pad=st.booleans(), n=st.integers(3, 6))
def test_dpf_gives_the_plaintext_codes_bit_for_bit(seed, server, points, pad, n):
    data = _data(seed, n=n)
    kw = dict(bits=6, lambda_item=0.05, server=server)
    plain = LightFR(data, LightFRConfig(**kw), seed=seed)
    dpf = LightFR(data, LightFRConfig(**kw, secure_aggregation="dpf", dpf_points=points, dpf_max_parts=12,
                                      dpf_pad_parts=pad), seed=seed)
    for _ in range(2):
        plain.run_round()
        dpf.run_round()
        np.testing.assert_array_equal(dpf.d, plain.d)
        np.testing.assert_array_equal(dpf.b, plain.b)
    recs = dpf.transport.transcript.records
    for party in ("server", SERVER2):  # key sets at both servers (LightFR keeps A's payloads), no union published
        ups = [r for r in recs if r.receiver == party and r.kind == "update"]
        assert ups and all(r.nbytes > 0 and (party != "server" or isinstance(r.payload, bytes)) for r in ups)
        assert len({r.nbytes for r in ups}) == 1  # one key-set size whatever a client rated
    assert not [r for r in recs if r.kind in ("lightfr:union", "lightfr:rated")]
    assert all(not isinstance(r.payload, Upload) for r in recs)


def test_a_client_with_more_rated_items_than_the_key_sets_carry_stops_the_round_in_words():
    m = LightFR(_data(1, n=6, m=9), LightFRConfig(bits=4, secure_aggregation="dpf", dpf_points=1, dpf_max_parts=1),
                seed=1)
    with pytest.raises(ValueError, match="points"):
        m.run_round()
    with pytest.raises(ValueError, match="dpf_points"):
        LightFRConfig(secure_aggregation="dpf", dpf_points=0)
