"""One key setup reused by a round's instances (secagg/reuse.py): exact sums, the reveal rules, replay
across instances, and the trap a naive reuse falls into (docs/secagg.md "One setup per round")."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from secagg import prg, shamir
from secagg.bonawitz import MaskingConfig, make_pki
from secagg.bonawitz_wire import ConsistencySignature, MaskedInput, UnmaskRequest
from secagg.errors import AbortError, AuthenticationError, MessageError
from secagg.keys import KeyPair
from secagg.reuse import ReuseClient, ReuseServer, instance_id, pair_seed
from secagg.reuse_sim import ReuseSession
from secagg.reuse_wire import ForwardedInstanceShares, InstanceShares, UnmaskReveal
from secagg.runspec import RunSpec

U64 = np.uint64


class Harness:
    """n clients and the server of one setup, driven stage by stage; keeps every message."""

    def __init__(self, n: int = 5, t: int | None = None, dropout: float = 0.4) -> None:
        from secagg.bonawitz import ClientPolicy

        self.cfg = MaskingConfig.secagg(n, 1, t=t)
        ids, pki = make_pki(n)
        policy = ClientPolicy(max_dropout=dropout)
        self.clients = [ReuseClient(self.cfg, i, ids[i], pki, policy) for i in range(n)]
        self.server = ReuseServer(self.cfg, pki)
        self.log: list[tuple[int, str, int, bytes]] = []  # (instance, stage, sender, blob)
        for c in self.clients:
            self.server.receive(c.advertise().to_bytes())
        for i, blob in self.server.broadcast_keys().items():
            self.clients[i].setup(blob)
        self.index = 0

    def run(self, xs: dict[int, np.ndarray], drop_before_input: frozenset[int] = frozenset(),
            silent_at_unmask: frozenset[int] = frozenset()) -> np.ndarray:
        s, i = self.server, self.index
        dim = len(next(iter(xs.values())))
        s.start(dim)
        for u in sorted(s.live):
            blob = self.clients[u].share(i, dim).to_bytes()
            self.log.append((i, "share", u, blob))
            s.receive(blob)
        inbox = s.forward_shares()
        self.forwarded = inbox
        for u in sorted(inbox):
            if u in drop_before_input:
                continue
            blob = self.clients[u].mask_input(inbox[u], xs[u]).to_bytes()
            self.log.append((i, "input", u, blob))
            s.receive(blob)
        inbox = s.request_consistency()
        for u in sorted(inbox):
            blob = self.clients[u].sign_survivors(inbox[u]).to_bytes()
            self.log.append((i, "sign", u, blob))
            s.receive(blob)
        inbox = s.request_unmask()
        for u in sorted(inbox):
            if u in silent_at_unmask:
                continue
            blob = self.clients[u].unmask(inbox[u]).to_bytes()
            self.log.append((i, "unmask", u, blob))
            s.receive(blob)
        self.index += 1
        return s.finish()

    def messages(self, instance: int, stage: str) -> dict[int, bytes]:
        return {u: b for i, s, u, b in self.log if i == instance and s == stage}


def _rand(rng: np.random.Generator, dim: int) -> np.ndarray:
    return rng.integers(0, 2**64, dim, dtype=U64, endpoint=False)


def _sum(rows: list[np.ndarray]) -> np.ndarray:
    return np.sum(np.stack(rows), axis=0, dtype=U64)


# ------------------------------------------------------------------------------------------------
# the trap: a dropout in a later instance must not unmask an earlier one
# ------------------------------------------------------------------------------------------------
def _unmask_first_input(h: Harness, victim: int, pair_seeds: dict[int, bytes]) -> np.ndarray:
    """The server's attempt on the victim's instance-0 upload: its y, minus its self mask (rebuilt
    legitimately in instance 0, where it survived), minus its pairwise masks from ``pair_seeds``."""
    y = MaskedInput.from_bytes(h.messages(0, "input")[victim]).y.copy()
    shares = [(holder + 1, dict(UnmaskReveal.from_bytes(b).b_shares)[victim])
              for holder, b in sorted(h.messages(0, "unmask").items())][: h.cfg.t]
    b0 = shamir.combine(shares, t=h.cfg.t)
    strip = [(b0, b"self", True)] + [(seed, b"pair", victim < v) for v, seed in pair_seeds.items()]
    prg.accumulate(y, strip)
    return y


def test_a_dropout_in_the_second_instance_does_not_unmask_the_first():
    rng = np.random.default_rng(1)
    h = Harness(n=5)  # complete graph, t = 4
    victim = 0
    x0 = {u: _rand(rng, 64) for u in range(5)}
    assert np.array_equal(h.run(x0), _sum(list(x0.values())))
    x1 = {u: _rand(rng, 64) for u in range(5)}
    # the server declares the victim dropped in instance 1 (it shared, its input "never arrived")
    total1 = h.run(x1, drop_before_input=frozenset({victim}))
    assert np.array_equal(total1, _sum([x1[u] for u in range(1, 5)]))
    inst0, inst1 = instance_id(h.cfg, 0), instance_id(h.cfg, 1)
    # everything revealed about the victim in instance 1: each survivor's own per-instance seed
    revealed = {u: dict(UnmaskReveal.from_bytes(b).seeds)[victim] for u, b in h.messages(1, "unmask").items()}
    assert sorted(revealed) == [1, 2, 3, 4]
    for u, seed in revealed.items():
        assert seed == pair_seed(h.clients[u]._master[victim], inst1, 0, u, victim)
        assert seed != pair_seed(h.clients[u]._master[victim], inst0, 0, u, victim)
    # no reveal of either instance holds a share of the victim's long-term key or a master secret
    masters = {h.clients[u]._master[victim] for u in range(1, 5)}
    victim_sk = h.clients[victim]._s.private_bytes()
    for _, _, _, blob in h.log:
        assert victim_sk not in blob and not any(m in blob for m in masters)
    # the attack with every seed the server holds fails ...
    attempt = _unmask_first_input(h, victim, revealed)
    assert not np.array_equal(attempt, x0[victim])
    # ... while the instance-0 seeds (what a rebuilt master would give) would succeed: the arithmetic is right
    true0 = {u: pair_seed(h.clients[u]._master[victim], inst0, 0, u, victim) for u in range(1, 5)}
    assert np.array_equal(_unmask_first_input(h, victim, true0), x0[victim])


def test_the_trap_unmasks_the_first_input_under_a_naive_reuse_that_rebuilds_the_long_term_key():
    """The naive reuse: Shamir-share the long-term mask key s_u once at setup and, when u drops in a
    later instance, rebuild it from t holders (as SecAgg does within one instance). The server then
    derives every master m_uv and unmasks u's earlier input."""
    rng = np.random.default_rng(2)
    h = Harness(n=5)
    victim, t = 0, h.cfg.t
    naive_shares = shamir.split_secret(h.clients[victim]._s.private_bytes(), t=t, n=5)  # given out at setup
    x0 = {u: _rand(rng, 64) for u in range(5)}
    h.run(x0)
    h.run({u: _rand(rng, 64) for u in range(5)}, drop_before_input=frozenset({victim}))
    # instance 1: the naive holders reveal their shares of the dropped victim's long-term key
    sk = KeyPair.from_private_bytes(shamir.combine(naive_shares[1:1 + t], t=t))
    inst0 = instance_id(h.cfg, 0)
    adverts = h.server.adverts
    masters = {v: sk.agree(adverts[v][32:64], info=h.cfg.info(b"secagg/reuse/master"), shared=False)
               for v in range(1, 5)}
    seeds = {v: pair_seed(m, inst0, 0, victim, v) for v, m in masters.items()}
    assert np.array_equal(_unmask_first_input(h, victim, seeds), x0[victim])


# ------------------------------------------------------------------------------------------------
# exact sums over random dropouts per instance
# ------------------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_instances_of_one_setup_sum_exactly_over_random_dropouts(data):
    n = data.draw(st.integers(4, 9), label="n")
    plus = data.draw(st.booleans(), label="secagg+")
    if plus:
        k = data.draw(st.sampled_from([k for k in (2, 4, 6, 8) if k < n]), label="k")
        t = (k + 1) // 2 + 1 + data.draw(st.integers(0, 1), label="t extra")
        spec = dict(k=k, t=min(t, k + 1))
    else:
        spec = {}
    session = ReuseSession("secagg+" if plus else "secagg")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    live = list(range(n))
    names = [f"c{i}" for i in range(n)]
    aborted, clean = False, True  # clean: no client has dropped or been left out so far
    for inst in range(data.draw(st.integers(2, 4), label="instances")):
        dim = data.draw(st.integers(1, 40), label="dim")
        # later instances: the live clients but perhaps one not answering, plus perhaps one no longer live
        # (the draws do not depend on the run's outcome: hypothesis replays them)
        skip = data.draw(st.one_of(st.none(), st.integers(0, n - 1)), label="not answering")
        stale = data.draw(st.one_of(st.none(), st.integers(0, n - 1)), label="stale")
        if inst:
            members = [names[u] for u in live if u != skip] + ([names[stale]] if stale is not None else [])
            members = list(dict.fromkeys(members))
            if len(members) < 2:
                break
        else:
            members = names
        m = len(members)
        early = {j for j in data.draw(st.sets(st.integers(0, n - 1), max_size=1), label="drop before input") if j < m}
        late = {j for j in data.draw(st.sets(st.integers(0, n - 1), max_size=1), label="silent at unmask") if j < m}
        stage = data.draw(st.sampled_from(["share_keys", "masked_input"]), label="early stage")
        xs = rng.integers(0, 2**64, (m, dim), dtype=U64, endpoint=False)
        res = session.run(xs, RunSpec(dropouts={stage: frozenset(early), "unmask": frozenset(late)}, dropout=0.99,
                                      **spec), names=members)
        if aborted:  # an aborted instance ends the setup
            assert res.total is None
            continue
        clean = clean and not early and not late and sorted(int(name[1:]) for name in members) == sorted(live)
        if res.total is None:  # only a dropout can abort it, and only for a reason the protocol states
            assert not clean, res.abort
            assert any(why in res.abort for why in ("did not reveal its pair seeds", "lack shares", "fewer than t",
                                                    "more than the")), res.abort
            aborted = True
            event("an instance aborted")
            continue
        event(f"instance {inst} summed" + (" with dropouts" if early or late else ""))
        surv = sorted(res.survivors)
        # the survivors are live members that sent an input (a client left with fewer than t holders by
        # its neighbours' dropouts stops on its own); the sum is exactly theirs
        expected = [j for j, name in enumerate(members) if int(name[1:]) in live and j not in early]
        assert set(surv) <= set(expected)
        if clean:
            assert surv == expected
        assert np.array_equal(res.total, xs[surv].sum(axis=0, dtype=U64))
        # later instances run over the members that completed this one's unmask only
        live = [int(members[j][1:]) for j in surv if j not in late]


def test_a_survivor_silent_at_the_unmask_with_a_dropped_neighbour_aborts_cleanly():
    rng = np.random.default_rng(3)
    h = Harness(n=6, t=4)
    with pytest.raises(AbortError, match="did not reveal its pair seeds"):
        h.run({u: _rand(rng, 8) for u in range(6)}, drop_before_input=frozenset({0}),
              silent_at_unmask=frozenset({1}))
    with pytest.raises(AbortError, match="no live clients"):
        h.server.start(8)


# ------------------------------------------------------------------------------------------------
# the per-instance reveal rules
# ------------------------------------------------------------------------------------------------
def test_a_client_reveals_exactly_one_thing_per_neighbour_and_never_a_long_term_secret():
    rng = np.random.default_rng(4)
    h = Harness(n=6, t=4)
    h.run({u: _rand(rng, 8) for u in range(6)}, drop_before_input=frozenset({2}))
    for u, blob in h.messages(0, "unmask").items():
        msg = UnmaskReveal.from_bytes(blob)
        owners, peers = {o for o, _ in msg.b_shares}, {v for v, _ in msg.seeds}
        assert not owners & peers
        assert peers == {2} and owners == set(range(6)) - {2}


def test_a_client_dropped_in_an_instance_takes_no_part_in_later_ones():
    rng = np.random.default_rng(5)
    h = Harness(n=6, t=4)
    h.run({u: _rand(rng, 8) for u in range(6)}, drop_before_input=frozenset({2}))
    assert 2 not in h.server.live and all(2 in h.clients[u].gone for u in range(6) if u != 2)
    with pytest.raises(MessageError, match="not allowed in stage"):  # it never completed instance 0
        h.clients[2].share(1, 8)
    # a survivor asked for an instance out of order refuses
    with pytest.raises(MessageError, match="next instance of this setup is 1"):
        h.clients[0].share(2, 8)
    # a survivor no longer shares with the dropped client, and refuses shares from it
    blob = h.clients[0].share(1, 8).to_bytes()
    assert 2 not in {v for v, _ in InstanceShares.from_bytes(blob).shares}
    h.server.start(8)
    h.server.receive(blob)
    forged = ForwardedInstanceShares(instance=instance_id(h.cfg, 1), round=0, sender=0xFFFFFFFF, receiver=0,
                                     shares=((2, bytes(len(InstanceShares.from_bytes(blob).shares[0][1]))),))
    with pytest.raises(MessageError, match="not a live neighbour"):
        h.clients[0].mask_input(forged.to_bytes(), np.zeros(8, U64))


def test_unmask_needs_t_valid_signatures_on_the_same_survivor_set():
    rng = np.random.default_rng(6)
    h = Harness(n=5)
    s, dim = h.server, 4
    s.start(dim)
    for u in range(5):
        s.receive(h.clients[u].share(0, dim).to_bytes())
    inbox = s.forward_shares()
    for u in range(5):
        s.receive(h.clients[u].mask_input(inbox[u], _rand(rng, dim)).to_bytes())
    inbox = s.request_consistency()
    for u in range(5):
        s.receive(h.clients[u].sign_survivors(inbox[u]).to_bytes())
    reqs = s.request_unmask()
    req = UnmaskRequest.from_bytes(reqs[0])
    short = UnmaskRequest(instance=req.instance, round=0, sender=req.sender, receiver=0,
                          signatures=req.signatures[: h.cfg.t - 1])
    with pytest.raises(AbortError, match="valid consistency signatures"):
        h.clients[0].unmask(short.to_bytes())
    # the server refuses a reveal that gives a seed for a survivor (the wrong kind for that neighbour)
    good = UnmaskReveal.from_bytes(h.clients[1].unmask(reqs[1]).to_bytes())
    bad = UnmaskReveal(instance=good.instance, round=0, sender=1, receiver=0xFFFFFFFF, b_shares=good.b_shares[1:],
                       seeds=((good.b_shares[0][0], bytes(32)),))
    with pytest.raises(MessageError, match="unexpected owners"):
        s.receive(bad.to_bytes())


# ------------------------------------------------------------------------------------------------
# replay across instances
# ------------------------------------------------------------------------------------------------
def test_messages_of_one_instance_are_refused_in_another():
    rng = np.random.default_rng(7)
    h = Harness(n=5)
    h.run({u: _rand(rng, 4) for u in range(5)})
    s = h.server
    s.start(4)
    for u, blob in h.messages(0, "share").items():  # instance 0's shares replayed into instance 1
        with pytest.raises(MessageError, match="another protocol instance"):
            s.receive(blob)
    fresh = {u: h.clients[u].share(1, 4).to_bytes() for u in range(5)}
    for blob in fresh.values():
        s.receive(blob)
    with pytest.raises(MessageError, match="replayed"):
        s.receive(fresh[0])
    inbox = s.forward_shares()
    # instance 0's forwarded shares given to a client in instance 1: refused by the header ...
    old = ForwardedInstanceShares.from_bytes(next(iter(h.forwarded.values())))
    with pytest.raises(MessageError, match="another protocol instance"):
        h.clients[old.receiver].mask_input(old.to_bytes(), np.zeros(4, U64))
    # ... and re-headered as instance 1, refused by the AEAD (its AAD binds the instance)
    moved = ForwardedInstanceShares(instance=instance_id(h.cfg, 1), round=0, sender=old.sender,
                                    receiver=old.receiver, shares=old.shares)
    with pytest.raises(AuthenticationError):
        h.clients[old.receiver].mask_input(moved.to_bytes(), np.zeros(4, U64))
    # an instance-0 masked input: refused by the header, and re-headered, by its signature (bound to instance 0)
    old_y = h.messages(0, "input")[1]
    with pytest.raises(MessageError, match="another protocol instance"):
        s.receive(old_y)
    y0 = MaskedInput.from_bytes(old_y)
    replay = MaskedInput(instance=instance_id(h.cfg, 1), round=0, sender=1, receiver=0xFFFFFFFF, y=y0.y, sig=y0.sig)
    with pytest.raises(AuthenticationError):
        s.receive(replay.to_bytes())
    for v in range(5):
        s.receive(h.clients[v].mask_input(inbox[v], _rand(rng, 4)).to_bytes())
    inbox = s.request_consistency()
    old_sig = ConsistencySignature.from_bytes(h.messages(0, "sign")[1])
    moved_sig = ConsistencySignature(instance=instance_id(h.cfg, 1), round=0, sender=1, receiver=0xFFFFFFFF,
                                     sig=old_sig.sig)
    with pytest.raises(AuthenticationError):  # the same survivor set, but signed for instance 0
        s.receive(moved_sig.to_bytes())
    for v in range(5):
        s.receive(h.clients[v].sign_survivors(inbox[v]).to_bytes())
    s.request_unmask()
    with pytest.raises(MessageError, match="another protocol instance"):
        s.receive(h.messages(0, "unmask")[1])


def test_instance_ids_are_distinct_and_bound_to_setup_and_round():
    a = MaskingConfig.secagg(4, 1)
    b = MaskingConfig.secagg(4, 1)
    ids = {instance_id(a, i) for i in range(50)} | {instance_id(b, i) for i in range(50)}
    assert len(ids) == 100
    with pytest.raises(ValueError):
        instance_id(a, -1)


def test_every_client_and_server_method_is_refused_outside_its_stage():
    from secagg.reuse_wire import REUSE_CLIENT_TRANSITIONS, REUSE_SERVER_TRANSITIONS, ReuseClientStage, ReuseStage

    h = Harness(n=4, t=3)
    args = {"advertise": (), "setup": (b"",), "share": (0, 4), "mask_input": (b"", np.zeros(4, U64)),
            "sign_survivors": (b"",), "unmask": (b"",)}
    for method, (need, _) in REUSE_CLIENT_TRANSITIONS.items():
        for stage in ReuseClientStage:
            if stage == need:
                continue
            c = h.clients[0]
            saved, c.stage = c.stage, stage
            with pytest.raises(MessageError, match="not allowed in stage"):
                getattr(c, method)(*args[method])
            c.stage = saved
    s = h.server
    for method, (need, _) in REUSE_SERVER_TRANSITIONS.items():
        for stage in ReuseStage:
            if stage == need:
                continue
            saved, s.stage = s.stage, stage
            with pytest.raises(MessageError, match="not allowed in stage"):
                getattr(s, method)(*((4,) if method == "start" else ()))
            s.stage = saved
