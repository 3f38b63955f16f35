"""FedMF with every client on its own (simulated) device: the exchanges of protocols/exchange.py.

The server half is built through the registry on a census (one placeholder row per user), each
client's half through ``Exchanges.build_client`` on its own rows; ``run_on_devices`` drives the
same generator as the in-process ``run_round``. Oracles: the in-process run (same seed), and a
plaintext computation (Q + the sum of the updates of the clients that answered).
"""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.exchange import census, run_on_devices
from protocols.fedmf import (
    FedMF,
    FedMFConfig,
    UpdateError,
    _load_he_keys,
    check_devices,
    write_he_keys,
)
from protocols.registry import BuildContext, get_protocol
from protocols.transport import InProcessTransport, Transcript
from recmodels.data import Interactions
from recmodels.mf import MFConfig, local_updates
from recmodels.synthetic import generate_synthetic

DATA = generate_synthetic(n_users=6, n_items=12, dim=3, mean_interactions=4, seed=1)
SPEC = get_protocol("fedmf")


def _cfg(defense="none", variant="full", data=DATA, **kw) -> FedMFConfig:
    kw.setdefault("rating_scale", [float(data.ratings.min()), float(data.ratings.max())])
    return FedMFConfig(mf=MFConfig(dim=3), defense=defense, variant=variant, **kw)


def _own(data: Interactions, u: int) -> Interactions:
    keep = data.users == u
    return Interactions(users=data.users[keep], items=data.items[keep], ratings=data.ratings[keep],
                        timestamps=data.timestamps[keep], user_ids=data.user_ids, item_ids=data.item_ids)


def _ctx(train: Interactions, cfg: FedMFConfig) -> BuildContext:
    return BuildContext(split=SimpleNamespace(train=train), config=cfg, seed=0, source="synthetic",
                        transport=InProcessTransport(Transcript(keep_payloads=True)), data_options={})


def _devices(cfg: FedMFConfig, data: Interactions = DATA):
    """The server half on a census and each client's half on its own rows, through the registry."""
    SPEC.exchanges.check(cfg)
    users = np.flatnonzero(np.bincount(data.users, minlength=data.n_users) > 0)
    server = (SPEC.exchanges.build_server or SPEC.build)(_ctx(census(users, data.n_users, data.n_items), cfg))
    clients = {int(u): SPEC.exchanges.build_client(_ctx(_own(data, int(u)), cfg)) for u in users}
    return server, clients


def _local(cfg: FedMFConfig, data: Interactions = DATA, **kw) -> FedMF:
    """The in-process reference: the scale read from the data (the in-process default)."""
    return FedMF(data, dataclasses.replace(cfg, rating_scale=[], he_keys=""), seed=0, **kw)


def _plain_next_q(q: np.ndarray, p: np.ndarray, m: FedMF, who) -> np.ndarray:
    """Oracle: Q + the plaintext updates of the users ``who``."""
    _, delta = local_updates(p, q, m.lists, m.config.mf)
    total = np.zeros_like(q)
    for u in who:
        k = m.lists.counts[u]
        total[m.lists.items[u, :k]] += delta[u, :k]
    return q + total


@pytest.mark.parametrize("defense,variant", [("none", "full"), ("none", "part"), ("secagg", "full"),
                                             ("secagg", "part")])
def test_separate_devices_equal_the_in_process_run(defense, variant):
    cfg = _cfg(defense, variant)
    local = _local(cfg)
    server, clients = _devices(cfg)
    for _ in range(3):
        a, b = local.run_round(), run_on_devices(server, clients)
        assert a.loss == b.loss and a.clients == b.clients == DATA.n_users
        assert a.bytes_per_client == b.bytes_per_client
        np.testing.assert_array_equal(server.q, local.q)
    assert np.isfinite(b.loss) and b.loss < 4
    for u, c in clients.items():  # each client's own p_u, on its device only
        np.testing.assert_array_equal(c.device_state(u)["p"], local.p[u])
    assert server.p.tolist() == FedMF(census(np.arange(6), 6, 12), cfg, seed=0).p.tolist()  # never trained
    # a fresh client half that loads the global model and one user's state scores like the in-process run
    fresh = SPEC.exchanges.build_client(_ctx(_own(DATA, 4), cfg))
    fresh.load_device_model(server.device_model())
    fresh.load_device_state(4, clients[4].device_state(4))
    items = np.arange(DATA.n_items)[None, :]
    np.testing.assert_array_equal(fresh.score(np.array([4]), items), local.score(np.array([4]), items))


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 1000), n_users=st.integers(2, 6), n_items=st.integers(6, 14),
       variant=st.sampled_from(["full", "part"]), mode=st.sampled_from(["sequential", "batch"]))
def test_any_small_plaintext_run_is_the_same_on_devices(seed, n_users, n_items, variant, mode):
    data = generate_synthetic(n_users=n_users, n_items=n_items, dim=3, mean_interactions=3, seed=seed)
    cfg = dataclasses.replace(_cfg("none", variant, data=data), mf=MFConfig(dim=3, user_update=mode))
    local = _local(cfg, data)
    server, clients = _devices(cfg, data)
    for _ in range(2):
        assert local.run_round().loss == run_on_devices(server, clients).loss
    np.testing.assert_array_equal(server.q, local.q)


def test_the_device_loss_is_the_in_process_training_loss():
    cfg = _cfg()
    local = _local(cfg)
    server, clients = _devices(cfg)
    stats = run_on_devices(server, clients)
    local.run_round()
    assert stats.loss == pytest.approx(_mean_of_client_mses(local), rel=1e-12)


def _mean_of_client_mses(m, skip: tuple[int, ...] = ()) -> float:
    """Oracle: the mean over users of each one's own mean squared error (numpy, from the model)."""
    pred = np.clip(np.einsum("nd,nd->n", m.p[m.train.users], m.q[m.train.items]), *m.scale)
    err = (pred - m.train.ratings) ** 2
    users = [u for u in np.unique(m.train.users).tolist() if u not in skip]
    return float(np.mean([err[m.train.users == u].mean() for u in users]))


def test_the_loss_never_carries_a_clients_rating_count():
    """Each client's loss reply is its own mean and a 1: a rating count would be the same in every
    round, so two loss sums over survivor sets that differ in one client would be its count."""
    server, clients = _devices(_cfg())
    run_on_devices(server, clients, tamper=lambda ex, u, r: r)
    for u, c in clients.items():
        reply = c._loss_step(np.array([u]), {"q": server.q})[u]["loss"]
        assert reply[1] == 1.0 and reply[2] == 0.0


def test_the_transcript_holds_the_same_kinds_in_process_and_on_devices():
    cfg = _cfg("none", "part")
    local = _local(cfg)
    server, clients = _devices(cfg)
    local.run_round()
    run_on_devices(server, clients)
    kinds = [(r.sender, r.receiver, r.kind, r.nbytes) for r in local.transport.transcript]
    assert kinds == [(r.sender, r.receiver, r.kind, r.nbytes) for r in server.transport.transcript]
    assert {k for _, _, k, _ in kinds} == {"model", "update", "eval", "loss"}


def test_ldp_noise_is_added_on_the_device_and_the_server_sums_what_it_received():
    cfg = _cfg("ldp", epsilon=5.0)
    server, clients = _devices(cfg)
    q0, p0 = server.q.copy(), server.p.copy()
    got: dict[int, np.ndarray] = {}

    def keep(ex, u, reply):
        if ex.kind == "train":
            got[u] = reply["delta"].copy()
        return reply

    stats = run_on_devices(server, clients, tamper=keep)
    np.testing.assert_allclose(server.q, q0 + sum(got.values()), rtol=0, atol=1e-12)
    noiseless = _plain_next_q(q0, p0, _local(cfg), range(6)) - q0
    assert np.abs(sum(got.values()) - noiseless).max() > 1e-3  # noised on the devices
    assert all(np.count_nonzero(d) == d.size for d in got.values())  # the fake zeros are noised too
    assert stats.releases[0].who == "clients" and np.isfinite(stats.loss)
    # the loss came through secure aggregation: the server saw no client's squared-error sum
    assert not [r for r in server.transport.transcript if r.kind == "loss" and r.payload is not None
                and np.asarray(r.payload).dtype != np.uint64]


@pytest.mark.parametrize("defense", ["none", "secagg"])
def test_a_silent_client_is_left_out_and_the_sum_is_over_the_others(defense):
    cfg = _cfg(defense)
    server, clients = _devices(cfg)
    q0, p0 = server.q.copy(), server.p.copy()
    stats = run_on_devices(server, clients, silent=lambda ex, u: ex.kind == "train" and u == 2)
    assert stats.clients == 5 and stats.extra["dropped"] == {"2": "silent"}
    expected = _plain_next_q(q0, p0, _local(cfg), [0, 1, 3, 4, 5])
    np.testing.assert_allclose(server.q, expected, rtol=0, atol=0 if defense == "none" else 6 * 2.0**-24)


def _bad_replies():
    return {
        "wrong keys": lambda r: {"delta": r["delta"], "extra": np.zeros(1)},
        "wrong shape": lambda r: {"delta": r["delta"][:-1]},
        "wrong dtype": lambda r: {"delta": r["delta"].astype(np.float32)},
        "nan": lambda r: {"delta": np.full_like(r["delta"], np.nan)},
        "not an array": lambda r: {"delta": r["delta"].tolist()},
    }


@pytest.mark.parametrize("name", sorted(_bad_replies()))
def test_a_malformed_update_drops_only_that_client(name):
    cfg = _cfg()
    server, clients = _devices(cfg)
    q0, p0 = server.q.copy(), server.p.copy()
    bad = _bad_replies()[name]
    stats = run_on_devices(server, clients, tamper=lambda ex, u, r: bad(r) if (ex.kind, u) == ("train", 3) else r)
    assert set(stats.extra["dropped"]) == {"3"} and stats.clients == 5
    np.testing.assert_array_equal(server.q, _plain_next_q(q0, p0, _local(cfg), [0, 1, 2, 4, 5]))


@settings(max_examples=12, deadline=None)
@given(ids=st.lists(st.integers(-3, 20), min_size=1, max_size=6))
def test_part_updates_for_items_not_asked_about_or_unsorted_are_refused(ids):
    cfg = _cfg("none", "part")
    server, clients = _devices(cfg)
    ids_arr = np.array(ids, np.int64)
    valid = ids_arr.min() >= 0 and ids_arr.max() < 12 and np.all(np.diff(ids_arr) > 0)

    def forge(ex, u, r):
        return {"items": ids_arr, "delta": np.zeros((len(ids), 3))} if (ex.kind, u) == ("train", 1) else r

    stats = run_on_devices(server, clients, tamper=forge)
    assert ("1" in stats.extra.get("dropped", {})) != bool(valid)


@pytest.mark.parametrize("loss", [[-1.0, 1.0, 0.0], [1e6, 1.0, 0.0], [1.0, 2.0, 0.0], [1.0, 1.0, 0.5],
                                  [np.nan, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 3.0, 0.0]])
def test_an_impossible_loss_reply_is_dropped(loss):
    server, clients = _devices(_cfg())
    stats = run_on_devices(server, clients, tamper=lambda ex, u, r: {"loss": np.array(loss)}
                           if (ex.kind, u) == ("loss", 0) else r)
    assert set(stats.extra["loss_dropped"]) == {"0"} and "dropped" not in stats.extra and np.isfinite(stats.loss)


@pytest.mark.parametrize("defense", ["none", "secagg"])
def test_the_loss_of_a_round_is_over_the_clients_that_reported_it(defense):
    cfg = _cfg(defense)
    local = _local(cfg)
    server, clients = _devices(cfg)
    stats = run_on_devices(server, clients, silent=lambda ex, u: ex.kind == "loss" and u == 1)
    local.run_round()
    oracle = _mean_of_client_mses(local, skip=(1,))
    assert stats.extra["loss_dropped"] == {"1": "silent"} and stats.clients == 6
    assert stats.loss == pytest.approx(oracle, rel=1e-12 if defense == "none" else 1e-6)


def test_a_secure_sum_left_with_one_client_aborts_and_the_model_stays():
    server, clients = _devices(_cfg("secagg"))
    q0 = server.q.copy()
    stats = run_on_devices(server, clients, silent=lambda ex, u: ex.kind == "train" and u < 5)
    assert "at least 2 clients" in stats.extra["aborted"] and stats.clients == 0
    np.testing.assert_array_equal(server.q, q0)
    # the round finished; the five that did not train refuse the loss (their vectors would repeat
    # last round's over the unchanged Q), so the loss sum of one client is not released either
    assert server.round == 1 and np.isnan(stats.loss)
    assert sum("only after training" in why for why in stats.extra["loss_dropped"].values()) == 5


def test_a_secure_client_refuses_to_answer_in_plaintext():
    server, _ = _devices(_cfg("none"))  # a server that asks for plaintext updates and losses
    _, clients = _devices(_cfg("secagg"))
    stats = run_on_devices(server, clients)
    assert stats.clients == 0 and all("only through secure aggregation" in why
                                      for why in stats.extra["dropped"].values())
    assert len(stats.extra["loss_dropped"]) == 6 and np.isnan(stats.loss)
    _, ldp = _devices(_cfg("ldp"))
    assert not ldp[0].device_requires_secure("train") and ldp[0].device_requires_secure("loss")


def test_check_refuses_what_cannot_be_separated_in_words():
    with pytest.raises(ValueError, match="rating_scale"):
        check_devices(FedMFConfig())
    with pytest.raises(ValueError, match="never holds"):
        check_devices(FedMFConfig(defense="paillier", rating_scale=[1.0, 5.0]))
    check_devices(FedMFConfig(defense="secagg", rating_scale=[1.0, 5.0]))
    check_devices(FedMFConfig(defense="paillier", rating_scale=[1.0, 5.0], he_keys="/keys"))
    with pytest.raises(ValueError, match="rating_scale"):
        FedMFConfig(rating_scale=[5.0, 1.0])
    with pytest.raises(ValueError, match="outside fedmf.rating_scale"):
        FedMF(_own(DATA, 0), _cfg(rating_scale=[1.0, 1.5]), seed=0, on_device=True)


# -- HE on devices: one shared key the clients hold and the server never has -----------------------
@pytest.fixture(scope="module")
def paillier_keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fedmf-keys")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 1024-bit keys: fast tests, never a deployment
        write_he_keys(folder, _cfg("paillier", key_bits=1024), DATA.n_users)
    return folder


@pytest.mark.parametrize("variant", ["full", "part"])
def test_paillier_on_devices_equals_the_in_process_run_and_the_server_cannot_decrypt(paillier_keys, variant):
    cfg = _cfg("paillier", variant, key_bits=1024, he_keys=str(paillier_keys))
    server, clients = _devices(cfg)
    local = _local(cfg, he_client=_load_he_keys(cfg, DATA.n_users, secret=True))
    for _ in range(2):
        a, b = local.run_round(), run_on_devices(server, clients)
        assert a.loss == b.loss and b.clients == 6
    for c in clients.values():  # every client decrypted the same, exact (on the 2^-24 grid) model
        np.testing.assert_array_equal(c.item_matrix, local.item_matrix)
    # the server half has the public key only: no secret in its state, and it cannot decrypt
    secret = (paillier_keys / "fedmf-paillier.secret").read_bytes()
    assert server.he is None and not any(isinstance(v, bytes) and secret in v for v in vars(server).values())
    assert secret not in server.he_server.public_bytes
    with pytest.raises(UpdateError, match="cannot decrypt"):
        server._decrypt_model(server._enc_q)
    with pytest.raises(UpdateError, match="Enc"):
        _ = server.item_matrix
    fresh = SPEC.exchanges.build_client(_ctx(_own(DATA, 2), cfg))
    fresh.load_device_model(server.device_model())
    np.testing.assert_array_equal(fresh.item_matrix, local.item_matrix)


def test_paillier_refresh_falls_to_the_next_client_and_bad_ciphertexts_are_dropped(paillier_keys):
    cfg = _cfg("paillier", key_bits=1024, he_keys=str(paillier_keys))
    server, clients = _devices(cfg)
    local = _local(cfg, he_client=_load_he_keys(cfg, DATA.n_users, secret=True))
    q0, p0 = local.item_matrix.copy(), local.p.copy()

    def tamper(ex, u, r):
        if (ex.kind, u) == ("train", 5):
            return {"ct": r["ct"][:-7]}  # truncated
        if (ex.kind, u) == ("train", 4):
            return {"ct": r["ct"].astype(np.int64)}  # not bytes
        return r

    stats = run_on_devices(server, clients, silent=lambda ex, u: ex.kind == "refresh" and u == 0, tamper=tamper)
    assert set(stats.extra["dropped"]) == {"4", "5"} and stats.clients == 4
    refreshes = [r.sender for r in server.transport.transcript if r.kind == "refresh"]
    assert refreshes == ["client:1"]
    expected = _plain_next_q(q0, p0, local, [0, 1, 2, 3])
    np.testing.assert_allclose(clients[1].item_matrix, expected, rtol=0, atol=8 * 2.0**-24)


def test_he_key_files_that_do_not_fit_the_run_are_refused(paillier_keys, tmp_path):
    with pytest.raises(ValueError, match="frac_bits"):
        _load_he_keys(_cfg("paillier", frac_bits=20, he_keys=str(paillier_keys)), DATA.n_users, secret=False)
    with pytest.raises(ValueError, match="public key file"):
        _load_he_keys(_cfg("paillier", he_keys=str(tmp_path)), DATA.n_users, secret=False)
    (tmp_path / "fedmf-paillier.public").write_bytes((paillier_keys / "fedmf-paillier.public").read_bytes())
    with pytest.raises(ValueError, match="secret key file"):
        _load_he_keys(_cfg("paillier", he_keys=str(tmp_path)), DATA.n_users, secret=True)
    assert oct((paillier_keys / "fedmf-paillier.secret").stat().st_mode & 0o777) == "0o600"


@pytest.mark.slow  # ~10-20 s: every CKKS context is first parsed in a child process (secagg.he.isolate)
def test_ckks_on_devices_matches_the_in_process_run_within_its_error(tmp_path):
    cfg = _cfg("ckks", he_keys=str(write_he_keys(tmp_path, _cfg("ckks"), DATA.n_users)))
    server, clients = _devices(cfg)
    local = _local(cfg, he_client=_load_he_keys(cfg, DATA.n_users, secret=True))
    a, b = local.run_round(), run_on_devices(server, clients)
    assert b.clients == 6 and b.loss == pytest.approx(a.loss, rel=1e-5)
    np.testing.assert_allclose(clients[3].item_matrix, local.item_matrix, rtol=0, atol=1e-5)  # CKKS is approximate
    assert server.he is None and not any(isinstance(v, bytes) and (tmp_path / "fedmf-ckks.secret").read_bytes() == v
                                         for v in vars(server.he_server).values())
