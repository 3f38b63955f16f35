"""The attack on FedCL's LDP embeddings: exact with no noise, near random when the noise dominates,
climbing with the number of averaged uploads (why they must be composed), and its CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from attacks.fedcl import embedding_topk_attack, score, topk_items
from attacks.registry import get_attack
from dp.ldp import ldp_laplace
from dp.rng import DeterministicTestSource
from experiments.cli import main
from protocols.transport import SERVER, Record

N_USERS, N_ITEMS, DIM, TRUE = 80, 200, 16, 20


def world(seed: int = 0):
    rng = np.random.default_rng(seed)
    users, items = rng.normal(size=(N_USERS, DIM)), rng.normal(size=(N_ITEMS, DIM))
    truth = {u: topk_items(users[u : u + 1], items, TRUE)[0] for u in range(N_USERS)}
    return users, items, truth


def uploads(users: np.ndarray, epsilon: float, count: int, seed: int = 1) -> list[Record]:
    src = DeterministicTestSource(seed)
    return [Record(f"client:{u}", SERVER, r, "embedding", 4 * DIM,
                   ldp_laplace(users[u], clip_bound=1.0, epsilon=epsilon, _test_source=src).values)
            for r in range(count) for u in range(len(users))]


def precision(epsilon: float, count: int, k: int = 10, use: int | None = None) -> tuple[float, float]:
    users, items, truth = world()
    res = embedding_topk_attack(uploads(users, epsilon, count), {"n_items": N_ITEMS}, item_table=items, k=k, uploads=use)
    sc = score(res, truth, N_ITEMS)
    return sc.precision, sc.random_precision


def test_registered_against_fedcl():
    assert get_attack("fedcl", "fedcl-embedding-topk").run is embedding_topk_attack


def test_without_noise_the_server_reads_the_users_top_items():
    p, rand = precision(1e9, 1)
    assert p == pytest.approx(1.0) and rand == pytest.approx(TRUE / N_ITEMS)


def test_strong_noise_leaves_the_attack_near_random_and_uploads_compose():
    one, rand = precision(0.05, 1)
    assert one < 2.5 * rand  # eps 0.05: the promise holds, the guess is barely better than random
    few, _ = precision(4.0, 1)
    many, _ = precision(4.0, 64)
    assert many > few + 0.2 and many > 3 * rand  # averaging 64 uploads at the paper's eps 4 defeats its protection
    last, _ = precision(4.0, 64, use=1)
    assert last < many  # only the last upload: back to the one-upload level


def test_attack_rejects_an_empty_view_and_a_wrong_item_table():
    _, items, _ = world()
    with pytest.raises(ValueError, match="no embedding payloads"):
        embedding_topk_attack([], {"n_items": N_ITEMS}, item_table=items)
    with pytest.raises(ValueError, match="item_table has"):
        embedding_topk_attack([], {"n_items": N_ITEMS + 1}, item_table=items)


def test_cli_json_shape_and_composed_epsilon(tmp_path, capsys):
    """The wrapper runs FedCL into --out (2 rounds: 2 uploads per user), attacks the directory and
    composes the epsilon of the uploads the attack averaged; --uploads without --sweep is deprecated."""
    code = main(["attack", "fedcl", "--epsilon", "8", "--uploads", "2", "--rounds", "2", "--users", "30", "--items", "60",
                 "--dim", "8", "--out", str(tmp_path / "r"), "--json"])
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert code == 0 and "--uploads is deprecated" in captured.err
    a = out["attack"]
    assert a["attack"] == "fedcl-embedding-topk" and a["metric"] == "precision" and 0 <= a["value"] <= 1
    assert a["random"] > 0 and a["advantage"] is not None and a["extra"]["uploads_per_user"] == 2
    assert out["privacy"]["attacked_uploads"]["epsilon_basic"] == 16
    assert out["privacy"]["attacked_uploads"]["epsilon"] <= 16 + 1e-9
    assert (tmp_path / "r" / "attacks.json").is_file()


def test_cli_refuses_more_uploads_than_rounds(tmp_path, capsys):
    code = main(["attack", "fedcl", "--uploads", "5", "--rounds", "2", "--sweep", str(tmp_path / "s")])
    err = capsys.readouterr().err
    assert code == 2 and "--rounds" in err and len(err.strip().splitlines()) == 1


def test_one_upload_gains_at_most_e_to_the_epsilon_over_a_data_independent_upload():
    """The LDP promise, attacked: the same attack on uploads of a fixed zero embedding (no data) is
    the reference; over 20 noise draws the real uploads' precision stays within e^eps of it."""
    users, items, truth = world()
    eps = 0.5
    real, ref = [], []
    for seed in range(20):
        for emb, out in ((users, real), (np.zeros_like(users), ref)):
            res = embedding_topk_attack(uploads(emb, eps, 1, seed=seed + 10), {"n_items": N_ITEMS}, item_table=items, k=10)
            out.append(score(res, truth, N_ITEMS).precision)
    assert np.mean(real) <= np.exp(eps) * np.mean(ref) * 1.05  # 5% sampling slack over 1600 user draws
    assert np.mean(real) > np.mean(ref)  # and the upload does leak within that bound
