"""Attacks on STTFedRec's RS view: request intersection and item-gradient signs, beside random guessing."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attacks.registry import get_attack
from attacks.scoring import score_sets
from attacks.sttfedrec import ChainView, requests_by_client, ring_neighbours
from experiments.cli import main
from protocols.sttfedrec import RS, STTFedRec
from protocols.transport import InProcessTransport, Record, Transcript
from protocols.twotower_data import TwoTowerConfig
from recmodels.data import binarize
from recmodels.splits import leave_one_out
from recmodels.synthetic import generate_synthetic
from secagg.chain import ChainConfig, Kind
from secagg.chain_sim import simulate
from secagg.chain_wire import ChainUpload


@pytest.fixture(scope="module")
def plain():
    return _view_and_truth("none")


def _view_and_truth(item_aggregation: str, rounds: int = 2):
    raw = generate_synthetic(n_users=30, n_items=120, seed=1, dim=8, mean_interactions=8)
    train = leave_one_out(binarize(raw), seed=1).train
    cfg = TwoTowerConfig(hash_dim=64, dim=16, clients_per_round=10, item_aggregation=item_aggregation, temperature=0.1)
    tr = STTFedRec(train, cfg, seed=0, transport=InProcessTransport(Transcript(keep_payloads=lambda r: r.receiver == RS)))
    for _ in range(rounds):
        tr.run_round()
    view = tr.transport.transcript.view(RS)
    requested = {u: np.unique(np.concatenate(r)) for u, r in requests_by_client(view).items()}
    truth = {u: np.intersect1d(ids, tr.pos_items[tr.pos_start[u]:tr.pos_start[u + 1]]) for u, ids in requested.items()}
    return tr, view, truth


def test_item_gradient_signs_reveal_every_click_from_plaintext_rows(plain):
    tr, view, truth = plain
    inferred = get_attack("sttfedrec", "item-gradient").run(view, tr.public_info())
    sc = score_sets(inferred, truth, n_candidates=tr.n_items)
    assert sc.f1 > 0.95 and sc.random_f1 < 0.05


def test_item_gradient_sum_still_leaks_the_ids_one_client_requested(plain):
    """Notes G1's limit, shown: SecAgg hides each row, but an id with one requester is that client's row."""
    tr, view, truth = _view_and_truth("secagg+")
    assert not any(r.kind == "item-gradient" and isinstance(r.payload, tuple) for r in view)
    inferred = get_attack("sttfedrec", "item-gradient").run(view, tr.public_info())
    sc = score_sets(inferred, truth, n_candidates=tr.n_items)
    plain = score_sets(get_attack("sttfedrec", "item-gradient").run(
        plain[1], tr.public_info()), truth, n_candidates=tr.n_items)
    assert sc.random_f1 + 0.2 < sc.f1 <= plain.f1


def test_request_intersection_finds_recurring_ids():
    def req(u, rnd, ids):
        return Record(f"client:{u}", RS, rnd, "request", 40, np.array(ids))

    view = [req(0, 0, [1, 2, 3]), req(0, 1, [1, 4, 5]), req(1, 0, [6, 7, 8])]
    public = {"n_items": 10, "n_pos": 1}
    out = get_attack("sttfedrec", "request-intersection").run(view, public, popularity=False)
    assert out[0].tolist() == [1] and out[1].tolist() == []
    with_pop = get_attack("sttfedrec", "request-intersection").run(view, public)
    assert 1 in with_pop[0] and len(with_pop[1]) == 1  # each request's most requested id
    with pytest.raises(ValueError, match="payloads"):
        get_attack("sttfedrec", "request-intersection").run([Record("client:0", RS, 0, "request", 40, None)], public)


def _cli(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_cli_request_intersection_json_and_defense(tmp_path, capsys):
    """The wrapper: a run per defense (kept in --out), attacked from its directory in the common schema."""
    rows = {}
    for defense in ("none", "fixed-pool", "download-all"):
        rows[defense] = _cli(capsys, ["attack", "sttfedrec", "--attack", "request-intersection", "--defense", defense,
                                      "--rounds", "6", "--users", "30", "--items", "300", "--clients", "10",
                                      "--out", str(tmp_path / defense), "--json"])
    for d in ("none", "fixed-pool"):
        a = rows[d]["attack"]
        assert a["attack"] == "request-intersection" and a["metric"] == "precision"
        assert {"value", "random", "public", "advantage", "interval", "status"} <= set(a)
        assert a["value"] > a["random"], (d, a)
    # download-all: RS's view has no item id of any client, so every attack scores the stronger
    # baseline exactly; the price is M embeddings per client
    assert {f["attack"] for f in rows["download-all"]["findings"]} == {"request-intersection", "item-gradient"}
    for f in rows["download-all"]["findings"]:
        assert f["advantage"] == 0.0 and f["value"] == max(f["random"], f["public"]), f
    assert rows["download-all"]["bytes_per_client_per_round"] > rows["none"]["bytes_per_client_per_round"]


@pytest.mark.parametrize("attack", ["request-intersection", "item-gradient"])
def test_cli_dpf_defense_leaves_rs_at_the_stronger_baseline(tmp_path, capsys, attack):
    """``--defense dpf``: PIR requests and DPF gradients; RS's view has no id, so every finding is the
    stronger baseline exactly (advantage 0), while the plaintext run leaks."""
    rows = {}
    for defense in ("none", "dpf"):
        rows[defense] = _cli(capsys, ["attack", "sttfedrec", "--attack", attack, "--defense", defense, "--rounds", "3",
                                      "--users", "30", "--items", "300", "--clients", "10",
                                      "--out", str(tmp_path / defense), "--json"])
    plain = rows["none"]["attack"]
    assert plain["value"] > plain["random"]
    if attack == "item-gradient":  # plaintext per-id rows: the clicks' signs
        assert plain["advantage"] > 0.5
    assert rows["dpf"]["findings"]
    for f in rows["dpf"]["findings"]:
        assert f["advantage"] == 0.0 and f["value"] == max(f["random"], f["public"]), f
    assert rows["dpf"]["bytes_per_client_per_round"] > 0


def test_cli_refuses_a_defense_that_does_not_apply(capsys):
    code = main(["attack", "sttfedrec", "--attack", "item-gradient", "--defense", "fixed-pool", "--rounds", "1"])
    assert code == 2 and "does not apply" in capsys.readouterr().err


# --------------------------------------------------------------------------- chain collusion (SAS's view)


@settings(max_examples=15, deadline=None)
@given(st.integers(3, 9), st.integers(1, 3), st.integers(1, 6), st.data())
def test_chain_collusion_recovers_with_all_2s_neighbours_and_never_with_fewer(n, s, dim, data):
    """The attack function on a real chain run: exact with the victim's 2s ring neighbours, masked
    by a uniform stream as soon as one neighbour is honest (the limit of docs/chain.md)."""
    inputs = {c: np.array(data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=dim, max_size=dim)), dtype=np.uint64)
              for c in range(n)}
    run = simulate(ChainConfig(instance=os.urandom(16), round=1, dim=dim, successors=s), inputs)
    att, ring, s_eff = run.server.attempt, run.server.ring, run.server.successors
    uploads = {c: ChainUpload.from_bytes(d).vector for k, c, a, d in run.server_view if k is Kind.UPLOAD and a == att}
    pads = {c: run.server.revealed[(att, c)] for c in uploads}
    target = ring[data.draw(st.integers(0, n - 1))]
    neighbours = ring_neighbours(ring, target, s_eff)
    assert len(neighbours) == min(2 * s_eff, n - 1)

    def guess(coalition):
        seeds = {}
        for c in set(coalition) | {target}:  # the target's own seeds are in the dict but never used
            seeds.update(run.clients[c].known_seeds())
        view = ChainView(uploads, pads, ring, s_eff, att, seeds)
        return get_attack("sttfedrec", "chain-collusion").run(view, {}, target=target, colluders=coalition)

    assert np.array_equal(guess(neighbours), inputs[target])
    others = [c for c in ring if c != target and c not in neighbours]
    assert np.array_equal(guess(neighbours + others), inputs[target])  # extra colluders do not hurt
    if n > 2 * s_eff + 1:  # otherwise every other client is a neighbour and the sum gives the rest away
        missing = data.draw(st.sampled_from(neighbours))
        assert not np.array_equal(guess([c for c in neighbours + others if c != missing]), inputs[target])


def test_cli_chain_collusion_needs_2s_neighbours(capsys):
    out = {}
    for s in (1, 2):
        code = main(["attack", "sttfedrec", "--attack", "chain-collusion", "--successors", str(s), "--rounds", "1",
                     "--users", "30", "--items", "300", "--clients", "8", "--json"])
        assert code == 0
        out[s] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for s, r in out.items():
        a = r["attack"]
        assert set(a) >= {"exact", "coords_exact", "max_abs_error", "rel_error", "baseline_rel_error", "status"}
        assert r["needed"] == 2 * s and len(r["colluders"]) == 2 * s and r["chain_sum_matches_plaintext"]
        assert a["exact"] and a["max_abs_error"] <= 2.0 ** -r["frac_bits"] and a["baseline_rel_error"] > 0.1
        assert [x["exact"] for x in r["by_colluders"]] == [False] * (2 * s) + [True]
    # the two ring neighbours that suffice against s = 1 recover nothing against s = 2
    assert out[2]["by_colluders"][2]["coords_exact"] < 0.01
    code = main(["attack", "sttfedrec", "--attack", "chain-collusion", "--rounds", "1", "--users", "30", "--items",
                 "300", "--clients", "8", "--colluders", "8"])
    assert code == 2 and "--colluders" in capsys.readouterr().err
