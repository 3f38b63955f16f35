"""SecAgg / SecAgg+ attacked by a colluding server and clients (issue 8, items 2 and 5).

Each attack is written out in full: it succeeds when the defence is switched off (or on the base
commit, where the defence did not exist) and is refused with the defence in place.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from secagg import prg, shamir
from secagg.bonawitz import (
    AdvertiseKeys,
    ClientPolicy,
    KeyBroadcast,
    MaskingClient,
    MaskingConfig,
    MaskingServer,
    SurvivorList,
    UnmaskRequest,
    _advert_digest,
    make_pki,
)
from secagg.errors import AbortError, MessageError
from secagg.graph import complete_graph
from secagg.keys import KEY_BYTES, KeyPair
from secagg.messages import SERVER, decode
from secagg.runner import RunSpec, run

RNG = np.random.default_rng(8)  # CSPRNG-OK: test inputs only


def _inputs(n: int, d: int) -> np.ndarray:
    return np.frombuffer(RNG.bytes(8 * n * d), dtype=np.uint64).reshape(n, d).copy()


# ------------------------------------------------------------------------------------------------
# item 2: a colluding client re-advertises an honest client's mask key
# ------------------------------------------------------------------------------------------------
# Ring 0-1-2-3-0 (SecAgg+ with k = 2). The victim 1 masks with 0 (sign -1, 1 > 0) and with 2
# (sign +1). The colluder 2 advertises client 0's mask key s_0 under its own signature: the
# victim's two pairwise masks become -PRG(s_10) + PRG(s_10) = 0, so its upload is x_1 + PRG(b_1),
# and the normal unmask of a survivor hands the server b_1.
RING4 = ((1, 3), (0, 2), (1, 3), (0, 2))


def _duplicate_key_attack(cfg: MaskingConfig, *, copy_c: bool = False):
    """Drive the attack; returns (recovered victim input, server total, inputs)."""
    n, d = cfg.n, cfg.dim
    x = _inputs(n, d)
    identities, pki = make_pki(n)
    clients = [MaskingClient(cfg, i, identities[i], pki) for i in range(n)]
    server = MaskingServer(cfg, pki)
    adverts = {c.id: c.advertise() for c in clients}
    real2 = adverts[2]
    # the colluder signs (its own c key or the victim's, client 0's s key) with its own identity
    c_pk = adverts[0].c_pk if copy_c else real2.c_pk
    forged = AdvertiseKeys(cfg.instance, cfg.round, 2, SERVER, c_pk=c_pk, s_pk=adverts[0].s_pk,
                           sig=identities[2].sign(_advert_digest(cfg, 2, c_pk, adverts[0].s_pk)))
    for i in (0, 1, 3):
        server.receive(adverts[i].to_bytes())
    server.adverts[2] = forged.c_pk + forged.s_pk + forged.sig  # a colluding server skips its own check
    inbox = server.broadcast_keys()
    # the colluding server shows the colluder its real advert (its client would refuse the forged one)
    own = tuple((v, (real2.c_pk + real2.s_pk + real2.sig) if v == 2 else server.adverts[v]) for v in cfg.holders(2))
    inbox[2] = KeyBroadcast(cfg.instance, cfg.round, SERVER, 2, entries=own).to_bytes()
    for c in clients:
        server.receive(c.share_keys(inbox[c.id]).to_bytes())
    inbox = server.forward_shares()
    uploads = {}
    for c in clients:
        blob = c.mask_input(inbox[c.id], x[c.id]).to_bytes()
        uploads[c.id] = decode(blob).y
        server.receive(blob)
    inbox = server.request_consistency()
    for c in clients:
        server.receive(c.sign_survivors(inbox[c.id]).to_bytes())
    inbox = server.request_unmask()
    for c in clients:
        server.receive(c.unmask(inbox[c.id]).to_bytes())
    total = server.finish()
    y = uploads[1].copy()
    prg.expand_into(server.revealed[1][1], y, label=b"self", negate=True)  # b_1 from the normal unmask
    return y, total, x


def test_duplicate_mask_key_is_refused_by_the_clients_that_would_be_exposed():
    cfg = MaskingConfig(4, 16, 2, RING4, os.urandom(16))
    with pytest.raises(MessageError, match="duplicate"):
        _duplicate_key_attack(cfg)
    with pytest.raises(MessageError, match="duplicate"):
        _duplicate_key_attack(cfg, copy_c=True)


def test_duplicate_key_attack_would_expose_the_victim_and_corrupt_the_sum(monkeypatch):
    """The attack itself, with the clients' distinct-key check switched off: the victim's input
    is recovered exactly and ``finish`` returns a wrong sum without aborting."""
    import secagg.bonawitz as bz

    monkeypatch.setattr(bz, "_check_distinct_keys", lambda *a, **k: None)
    cfg = MaskingConfig(4, 16, 2, RING4, os.urandom(16))
    recovered, total, x = _duplicate_key_attack(cfg)
    assert recovered.tolist() == x[1].tolist()
    assert total.tolist() != x.sum(axis=0).tolist()


def test_honest_server_refuses_a_duplicate_advertised_key():
    n = 4
    cfg = MaskingConfig(n, 4, 2, RING4, os.urandom(16))
    identities, pki = make_pki(n)
    clients = [MaskingClient(cfg, i, identities[i], pki) for i in range(n)]
    adverts = [c.advertise() for c in clients]
    server = MaskingServer(cfg, pki)
    server.receive(adverts[0].to_bytes())
    for c_pk, s_pk in ((adverts[0].s_pk, adverts[2].s_pk), (adverts[2].c_pk, adverts[0].c_pk),
                       (adverts[2].c_pk, adverts[2].c_pk)):
        forged = AdvertiseKeys(cfg.instance, cfg.round, 2, SERVER, c_pk=c_pk, s_pk=s_pk,
                               sig=identities[2].sign(_advert_digest(cfg, 2, c_pk, s_pk)))
        with pytest.raises(MessageError, match="duplicate|equal keys"):
            server.receive(forged.to_bytes())
    server.receive(adverts[2].to_bytes())  # the real one is still accepted
    assert sorted(server.adverts) == [0, 2]


def test_client_refuses_a_broadcast_reusing_its_own_keys():
    n = 4
    cfg = MaskingConfig(n, 4, 2, RING4, os.urandom(16))
    identities, pki = make_pki(n)
    clients = [MaskingClient(cfg, i, identities[i], pki) for i in range(n)]
    adverts = [c.advertise() for c in clients]
    for mine in ("c_pk", "s_pk"):
        # neighbour 0 of client 1 "advertises" client 1's own key
        key = getattr(adverts[1], mine)
        forged = AdvertiseKeys(cfg.instance, cfg.round, 0, SERVER, c_pk=key, s_pk=adverts[0].s_pk,
                               sig=identities[0].sign(_advert_digest(cfg, 0, key, adverts[0].s_pk)))
        entries = []
        for v in cfg.holders(1):
            a = forged if v == 0 else adverts[v]
            entries.append((v, a.c_pk + a.s_pk + a.sig))
        blob = KeyBroadcast(cfg.instance, cfg.round, SERVER, 1, entries=tuple(entries)).to_bytes()
        fresh = MaskingClient(cfg, 1, identities[1], pki)
        fresh._state, fresh.stage = clients[1]._state, clients[1].stage
        with pytest.raises(MessageError, match="duplicate"):
            fresh.share_keys(blob)


def test_a_deviating_client_shifts_the_sum_like_an_input_of_its_choice(start_round):
    """The narrowed promise: the sum is exact when every client in U3 follows the protocol; a
    client that uploads something else shifts the sum by exactly what it added, as if it had
    chosen another input (inputs are not validated)."""
    n, d = 6, 8
    x = _inputs(n, d)
    cfg = MaskingConfig.secagg(n, d)
    identities, clients, server, inbox = start_round(cfg)
    shift = np.arange(d, dtype=np.uint64) + np.uint64(99)
    for c in clients:
        msg = c.mask_input(inbox[c.id], x[c.id])
        if c.id == 3:  # the client itself deviates (and signs what it sends)
            from secagg.bonawitz import _input_digest

            y = msg.y + shift
            msg = type(msg)(msg.instance, msg.round, msg.sender, msg.receiver, y=y,
                            sig=identities[3].sign(_input_digest(cfg, 3, y)))
        server.receive(msg.to_bytes())
    inbox = server.request_consistency()
    for c in clients:
        server.receive(c.sign_survivors(inbox[c.id]).to_bytes())
    inbox = server.request_unmask()
    for c in clients:
        server.receive(c.unmask(inbox[c.id]).to_bytes())
    assert server.finish().tolist() == (x.sum(axis=0) + shift).tolist()


# ------------------------------------------------------------------------------------------------
# item 5: t at or below half of a client's holders voids the consistency check
# ------------------------------------------------------------------------------------------------
def _split_view_attack(cfg: MaskingConfig, victim: int, group_a: list[int], group_b: list[int], start_round):
    """The server shows group A a survivor set containing the victim (they reveal shares of its
    self-mask seed) and the disjoint group B one without it (they reveal shares of its mask key).
    Returns the victim's input as rebuilt by the server, or raises what the clients raise."""
    n, d = cfg.n, cfg.dim
    x = _inputs(n, d)
    identities, clients, server, inbox = start_round(cfg)
    ys = {c.id: decode(c.mask_input(inbox[c.id], x[c.id]).to_bytes()).y for c in clients}
    everyone = tuple(range(n))
    without = tuple(u for u in everyone if u != victim)
    views = {u: everyone for u in group_a} | {u: without for u in group_b}
    sigs = {u: clients[u].sign_survivors(
        SurvivorList(cfg.instance, cfg.round, SERVER, u, survivors=views[u]).to_bytes()).sig for u in views}
    b_shares, s_shares = [], []
    for u in views:
        same = tuple((v, sigs[v]) for v in sorted(views) if views[v] == views[u])
        resp = clients[u].unmask(UnmaskRequest(cfg.instance, cfg.round, SERVER, u, signatures=same).to_bytes())
        for owner, kind, share in resp.shares:
            if owner == victim:
                (b_shares if kind == 0 else s_shares).append((u + 1, share))
    b = shamir.combine(b_shares[: cfg.t], t=cfg.t)
    s_key = KeyPair.from_private_bytes(shamir.combine(s_shares[: cfg.t], t=cfg.t))
    y = ys[victim].copy()
    prg.expand_into(b, y, label=b"self", negate=True)
    for v in cfg.graph[victim]:
        seed = s_key.agree(server.adverts[v][KEY_BYTES: 2 * KEY_BYTES], info=cfg.info(b"secagg/mask"))
        prg.expand_into(seed, y, label=b"pair", negate=victim < v)
    return y, x[victim]


def test_threshold_at_or_below_half_the_holders_is_refused_everywhere():
    graph = complete_graph(5)
    for t in (1, 2):  # 5 holders: t must exceed 2.5
        with pytest.raises(ValueError, match="unsafe_threshold"):
            MaskingConfig(5, 4, t, graph, os.urandom(16))
        with pytest.raises(ValueError, match="unsafe_threshold"):
            MaskingConfig.secagg(5, 4, t=t)
        with pytest.raises(ValueError, match="unsafe_threshold"):
            run("secagg", _inputs(5, 3), RunSpec(t=t))
    with pytest.raises(ValueError, match="unsafe_threshold"):
        MaskingConfig.secagg_plus(20, 4, k=6, t=3)  # 7 holders: t = 4 is the smallest safe value
    assert MaskingConfig.secagg_plus(20, 4, k=6, t=4).t == 4
    assert MaskingConfig.secagg_plus(20, 4, k=6, t=3, unsafe_threshold=True).t == 3


def test_split_view_attack_succeeds_only_in_the_explicitly_unsafe_mode(start_round):
    n, d = 5, 12
    cfg = MaskingConfig(n, d, 2, complete_graph(n), os.urandom(16), unsafe_threshold=True)
    got, want = _split_view_attack(cfg, 0, [1, 2], [3, 4], start_round)
    assert got.tolist() == want.tolist()  # both shares of client 0 collected: its input is out
    # the smallest safe threshold: two disjoint groups cannot both gather t signatures
    safe = MaskingConfig(n, d, 3, complete_graph(n), os.urandom(16))
    with pytest.raises(AbortError, match="valid consistency signatures"):
        _split_view_attack(safe, 0, [1, 2], [3, 4], start_round)


# ------------------------------------------------------------------------------------------------
# issue 23: safety settings are the client's own (ClientPolicy), never the server's parameters
# ------------------------------------------------------------------------------------------------
def test_split_view_attack_fails_when_only_the_server_opts_into_the_unsafe_threshold():
    """The server's configuration says ``unsafe_threshold`` (as a Flower setup record could); the
    clients' own policy does not, so they refuse at ADVERTISE and nothing is ever shared. With the
    clients' operators opting in (the demonstration above), the same attack recovers the input."""
    n, d = 5, 12
    cfg = MaskingConfig(n, d, 2, complete_graph(n), os.urandom(16), unsafe_threshold=True)
    identities, pki = make_pki(n)
    for i in range(n):
        with pytest.raises(AbortError, match="unless its own policy sets unsafe_threshold"):
            MaskingClient(cfg, i, identities[i], pki).advertise()
    with pytest.raises(AbortError, match="unless its own policy"):
        MaskingClient(cfg, 0, identities[0], pki, ClientPolicy(min_survivors=3)).advertise()
    assert MaskingClient(cfg, 0, identities[0], pki, ClientPolicy(unsafe_threshold=True)).advertise().sig


def test_a_cohort_below_the_clients_minimum_is_refused_before_any_key_is_shared():
    """A server that announces an aggregation over fewer clients than a client's own
    ``min_survivors`` gets no advertisement from it (the runner then aborts for lack of clients)."""
    identities, pki = make_pki(3)
    cfg = MaskingConfig.secagg(3, 4)
    with pytest.raises(AbortError, match="n = 3 clients is below this client's min_survivors = 4"):
        MaskingClient(cfg, 0, identities[0], pki, ClientPolicy(min_survivors=4)).advertise()
    res = run("secagg", _inputs(3, 4), RunSpec(min_survivors=4))
    assert not res.ok and res.total is None
    assert run("secagg", _inputs(4, 4), RunSpec(min_survivors=4)).ok


def test_survivors_below_the_clients_minimum_are_never_unmasked():
    """The server claims that two of six clients dropped after the masked inputs (``t = 4`` still
    lets it unmask four): with each client's ``min_survivors = 5`` nobody signs U3, so the sum over
    four is never unmasked; with the default minimum (2) the same dropouts give the four-client sum."""
    x = _inputs(6, 3)
    drops = {"masked_input": frozenset({4, 5})}
    res = run("secagg", x, RunSpec(t=4, dropouts=drops, min_survivors=5))
    assert not res.ok and "signed" in res.abort
    res = run("secagg", x, RunSpec(t=4, dropouts=drops))
    assert res.ok and res.survivors == frozenset({0, 1, 2, 3})
    assert res.total.tolist() == x[:4].sum(axis=0).tolist()


def test_client_policy_validates_its_own_settings():
    with pytest.raises(ValueError, match="min_survivors must be an int >= 2"):
        ClientPolicy(min_survivors=1)
    with pytest.raises(ValueError, match="unsafe_threshold must be a bool"):
        ClientPolicy(unsafe_threshold=1)  # type: ignore[arg-type]


def test_an_input_can_raise_its_clients_survivor_floor_but_never_lower_it(start_round):
    """``MaskingClient.require_survivors``: the caller's floor for this aggregation (a distributed-DP
    noise share sized for that many survivors). Five of six survive: a client asked for six refuses
    to sign them, one asked for five signs; a request below the node's own floor keeps the node's;
    above ``n`` it is refused before anything is masked; after signing it is refused."""
    cfg = MaskingConfig.secagg(6, 3)
    x = _inputs(6, 3)
    identities, clients, server, inbox = start_round(cfg)
    for c in clients[:5]:
        server.receive(c.mask_input(inbox[c.id], x[c.id]).to_bytes())
    u3 = server.request_consistency()
    clients[0].require_survivors(6)
    with pytest.raises(AbortError, match="5 survivors, below this client's min_survivors = 6"):
        clients[0].sign_survivors(u3[0])
    clients[1].require_survivors(5)
    assert clients[1].sign_survivors(u3[1]).sig and clients[1].policy.min_survivors == 5
    with pytest.raises(MessageError, match="before the survivor set is signed"):
        clients[1].require_survivors(6)
    pki = make_pki(6)[1]
    node = MaskingClient(cfg, 2, identities[2], pki, ClientPolicy(min_survivors=4))
    node.require_survivors(3)
    assert node.policy.min_survivors == 4  # never lowered
    with pytest.raises(AbortError, match="n = 6 clients is below this input's min_survivors = 7"):
        node.require_survivors(7)
    assert node.policy.min_survivors == 4
    for bad in (1, True, 2.0):
        with pytest.raises(ValueError, match="min_survivors must be an int >= 2"):
            node.require_survivors(bad)  # type: ignore[arg-type]


def test_a_plan_listing_every_client_as_dropping_aborts_cleanly():
    """The simulated clients' max_dropout is the run's plan; a plan that lists every client (the
    fraction 1.0, which ClientPolicy refuses as a setting) aborts cleanly instead of raising."""
    every = frozenset(range(4))
    res = run("secagg", _inputs(4, 3), RunSpec(dropouts={"masked_input": every}))
    assert not res.ok and res.total is None
