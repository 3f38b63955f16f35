"""The federated baselines share one check of their sampling and secure-aggregation fields."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.fcf import FCFConfig
from protocols.fedrec import FedRecConfig
from protocols.metamf import MetaMFConfig
from protocols.ncf_fed import NCFFedConfig

CONFIGS = [(FCFConfig, "fcf"), (FedRecConfig, "fedrec"), (NCFFedConfig, "ncffed"), (MetaMFConfig, "metamf")]


@pytest.mark.parametrize("cls, section", CONFIGS)
@pytest.mark.parametrize("field, value", [("client_fraction", 0.0), ("client_fraction", True),
                                          ("clients_per_round", -1), ("clients_per_round", 1.5),
                                          ("secure_aggregation", "chain"), ("frac_bits", 62),
                                          ("value_clip", float("inf")), ("secagg_corrupt", 0.6)])
def test_a_bad_field_is_refused_naming_its_section_and_key(cls, section, field, value):
    with pytest.raises(ValueError) as err:
        cls(**{field: value})
    assert f"{section}." in str(err.value)


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(CONFIGS), st.floats(0.001, 1.0), st.integers(0, 50), st.integers(1, 2000))
def test_clients_in_round_is_the_count_or_the_fraction_never_zero_or_above_n(conf, fraction, count, n):
    cls, _ = conf
    m = cls(client_fraction=fraction, clients_per_round=count).clients_in_round(n)
    assert 1 <= m <= n
    assert m == (min(count, n) if count else max(1, min(n, -(-int(round(fraction * n * 1e9)) // int(1e9)))))
