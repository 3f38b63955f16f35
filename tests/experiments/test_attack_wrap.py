"""The per-paper attack commands' run configurations (experiments.studies.attack_wrap): each
command's defense is a cell of the attack matrix's CELLS, and its options land on config keys.
No run is made here; the commands' own tests run them (tests/attacks, test_cmd_attack.py)."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from experiments.studies.attack_matrix import CELLS, cell_config
from experiments.studies.attack_fedfast import CELL as FEDFAST_CELL
from experiments.studies.attack_lightfr import DEFENSES as LIGHTFR_DEFENSES
from experiments.cli.cmd_attack import CELL as FEDMF_CELL


def test_every_command_defense_is_a_matrix_cell():
    for protocol, cells in (("fedfast", FEDFAST_CELL.values()), ("fedmf", FEDMF_CELL.values()),
                            ("lightfr", [c for c, _ in LIGHTFR_DEFENSES.values()])):
        assert set(cells) <= set(CELLS[protocol][2]), protocol


@settings(max_examples=25, deadline=None)
@given(clients=st.integers(1, 60), clusters=st.integers(1, 30), dim=st.integers(1, 64), rounds=st.integers(1, 50),
       seed=st.integers(0, 2**31 - 1), users=st.integers(4, 500), items=st.integers(10, 900),
       defense=st.sampled_from(sorted(FEDFAST_CELL)))
def test_fedfast_options_land_on_config_keys(clients, clusters, dim, rounds, seed, users, items, defense):
    synthetic = {"synthetic_users": users, "synthetic_items": items, "synthetic_dim": 8,
                 "synthetic_mean_interactions": 5}
    cfg = cell_config("fedfast", FEDFAST_CELL[defense], data=None, rounds=rounds, seed=seed, synthetic=synthetic,
                      overrides={"clients_per_round": clients, "clusters": clusters, "dim": dim})
    d = cfg.to_dict()
    f = d["fedfast"]
    assert (f["clients_per_round"], f["clusters"], f["dim"]) == (clients, clusters, dim)
    assert f["secure_aggregation"] == ("none" if defense == "none" else "secagg+")
    assert d["run"]["rounds"] == rounds and d["run"]["seed"] == seed and d["run"]["record_views"]
    assert d["data"]["synthetic_users"] == users and d["data"]["synthetic_items"] == items


def test_lightfr_para_and_dpf_and_fedmf_ldp_configs():
    para = cell_config("lightfr", "none", data=None, rounds=1, seed=0, overrides={"server": "para", "bits": 16})
    assert para.to_dict()["lightfr"]["server"] == "para" and para.to_dict()["lightfr"]["bits"] == 16
    dpf = cell_config("lightfr", "dpf", data=None, rounds=1, seed=0, overrides={"bits": 8})
    assert dpf.to_dict()["lightfr"]["secure_aggregation"] == "dpf" and dpf.to_dict()["lightfr"]["bits"] == 8
    ldp = cell_config("fedmf", FEDMF_CELL["ldp"], data=None, rounds=2, seed=0,
                      overrides={"epsilon": 2.5, "mf": {"dim": 4, "user_update": "batch"}})
    f = ldp.to_dict()["fedmf"]
    assert f["defense"] == "ldp" and f["epsilon"] == 2.5 and f["mf"]["dim"] == 4 and f["mf"]["user_update"] == "batch"
