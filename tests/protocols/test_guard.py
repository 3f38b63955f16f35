"""The client-side guard (protocols/guard.py): each rule against an oracle of what a client answered."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.guard import DevicePolicy, RefusedStep, StepGuard

SECURE = {"s1", "s2"}
ONCE = frozenset({"o"})
KINDS = ["s1", "s2", "p", "o"]


def _guard(policy: DevicePolicy | None = None) -> StepGuard:
    return StepGuard(policy or DevicePolicy(), secure_kind=lambda k: k in SECURE, once=ONCE)


def _expect(history: list[tuple[int, str, int, bool]], user: int, kind: str, t: int, secure: bool,
            require_secure: bool) -> str | None:
    """The oracle: why the guard must refuse, from the steps the user had answered (``history``)."""
    mine = [(k, r, s) for u, k, r, s in history if u == user]
    last = max((r for _, r, _ in mine), default=-1)
    if t < last:
        return "rolled-back"
    if not secure and (require_secure or kind in SECURE):
        return "plaintext"
    if kind in ONCE and any(k == kind for k, _, _ in mine):
        return "once"
    if secure and any(k == kind and r == t and s for k, r, s in mine):
        return "already answered"
    return None


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from(KINDS), st.integers(0, 4), st.booleans()),
                max_size=40),
       st.booleans())
def test_the_guard_refuses_exactly_what_the_rules_say(requests, require_secure):
    """Random request sequences (repeats, rollbacks, plaintext for secure steps, once-steps again) over
    three users: the guard admits exactly what the oracle admits, and its record survives a round
    trip through arrays at every step (as a device's state does)."""
    guard = _guard(DevicePolicy(require_secure=require_secure))
    answered: list[tuple[int, str, int, bool]] = []
    for user, kind, t, secure in requests:
        want = _expect(answered, user, kind, t, secure, require_secure)
        if want is None:
            guard.admit(user, kind, t, secure=secure)
            answered.append((user, kind, t, secure))
        else:
            with pytest.raises(RefusedStep):
                guard.admit(user, kind, t, secure=secure)
        restored = _guard(DevicePolicy(require_secure=require_secure))
        for u in range(3):
            restored.load_state(u, guard.state(u))
        guard = restored


def test_each_refusal_says_which_rule_in_words():
    g = _guard()
    g.admit(0, "s1", 3, secure=True)
    with pytest.raises(RefusedStep, match="already answered; a second sum"):
        g.admit(0, "s1", 3, secure=True)
    with pytest.raises(RefusedStep, match="rolled-back round is refused"):
        g.admit(0, "s2", 2, secure=True)
    with pytest.raises(RefusedStep, match="asked in plaintext"):
        g.admit(0, "s2", 3, secure=False)
    g.admit(0, "o", 3, secure=True)
    with pytest.raises(RefusedStep, match="once per protocol instance"):
        g.admit(0, "o", 9, secure=True)
    g.admit(0, "s1", 4, secure=True)  # a new round: the step again
    with pytest.raises(RefusedStep, match="not a round number"):
        g.admit(0, "s1", -1, secure=True)
    g.admit(1, "s1", 3, secure=True)  # each user has its own record


def test_a_refused_check_records_nothing():
    g = _guard()
    g.admit(0, "s1", 5, secure=True)
    before = g.state(0)
    with pytest.raises(RefusedStep):
        g.admit(0, "s1", 4, secure=True)
    assert all(np.array_equal(before[k], g.state(0)[k]) for k in before)


def test_the_local_dp_budget_is_counted_on_the_device():
    g = _guard(DevicePolicy(ldp_epsilon_budget=2.5))
    for _ in range(2):
        g.spend_ldp(0, 1.0)
    with pytest.raises(RefusedStep, match="over its operator's budget 2.5"):
        g.spend_ldp(0, 1.0)
    g.spend_ldp(0, 0.5)  # exactly up to the budget
    assert g.ldp_spent(0) == pytest.approx(2.5) and g.ldp_spent(1) == 0.0
    with pytest.raises(RefusedStep, match="finite epsilon"):
        g.spend_ldp(1, math.inf)
    restored = _guard(DevicePolicy(ldp_epsilon_budget=2.5))
    restored.load_state(0, g.state(0))
    with pytest.raises(RefusedStep):
        restored.spend_ldp(0, 0.1)


@pytest.mark.parametrize("bad", [
    {"last_round": np.array(1.5), "this_round": np.zeros(0, np.uint8), "once": np.zeros(0, np.uint8),
     "ldp_spent": np.array(0.0)},
    {"last_round": np.array(1), "this_round": np.zeros(2, np.int64), "once": np.zeros(0, np.uint8),
     "ldp_spent": np.array(0.0)},
    {"last_round": np.array(1), "this_round": np.zeros(0, np.uint8), "once": np.zeros(0, np.uint8),
     "ldp_spent": np.array(-1.0)},
    {"last_round": np.array(1)},
])
def test_a_malformed_record_is_refused(bad):
    with pytest.raises(ValueError, match="step guard"):
        _guard().load_state(0, bad)


def test_node_config_gives_the_policy_and_refuses_malformed_values():
    p = DevicePolicy.from_node_config({"min-survivors": "4", "unsafe-threshold": "false", "require-secagg": "yes",
                                       "ldp-epsilon-budget": "8", "max-dropout": 0.2, "partition-id": 3})
    assert p == DevicePolicy(min_survivors=4, require_secure=True, ldp_epsilon_budget=8.0, max_dropout=0.2)
    assert p.secagg().max_dropout == 0.2 and DevicePolicy.from_node_config({"ldp-epsilon-budget": "inf"}) == DevicePolicy()
    assert DevicePolicy.from_node_config({}, require_secure=True).require_secure
    assert not DevicePolicy.from_node_config({"require-secagg": "false"}).require_secure
    for key, value in (("min-survivors", "two"), ("min-survivors", 1), ("min-survivors", 2.5),
                       ("unsafe-threshold", "maybe"), ("ldp-epsilon-budget", "-1"), ("ldp-epsilon-budget", "nan"),
                       ("max-dropout", "1.5"), ("unsafe-threshold", "yes")):
        with pytest.raises(ValueError, match="node config"):
            DevicePolicy.from_node_config({key: value})


def test_a_local_dp_step_is_charged_when_it_is_admitted_and_never_by_a_check():
    """Rule 6 through the step itself: a step whose ``ldp_cost`` is positive is charged on admission
    (before it runs), with its round; a refused one changes nothing."""
    g = StepGuard(DevicePolicy(ldp_epsilon_budget=4.0), secure_kind=lambda k: k in SECURE,
                  ldp_cost=lambda k: 1.5 if k == "up" else 0.0)
    g.check(0, "up", 0, secure=False)
    assert g.ldp_spent(0) == 0.0 and g.ldp_round(0) == -1
    g.admit(0, "up", 0, secure=False)
    g.admit(0, "p", 1, secure=False)  # not an upload: free
    g.admit(0, "up", 2, secure=False)
    assert g.ldp_spent(0) == 3.0 and g.ldp_round(0) == 2
    before = g.state(0)
    with pytest.raises(RefusedStep, match="operator's budget 4"):
        g.admit(0, "up", 3, secure=False)
    assert all(np.array_equal(before[k], g.state(0)[k]) for k in before)
    bad = StepGuard(DevicePolicy(), secure_kind=lambda k: False, ldp_cost=lambda k: math.nan)
    with pytest.raises(RefusedStep, match="finite number"):
        bad.admit(0, "up", 0, secure=False)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.sampled_from(KINDS + ["up"]), st.integers(0, 4), st.booleans()),
                max_size=40))
def test_every_clients_record_round_trips_through_a_checkpoint(requests):
    """:meth:`StepGuard.state_dict` (what a trainer that plays every client checkpoints) restores every
    record exactly, through the checkpoint format (tensors plus JSON)."""
    from protocols.state import state_from_bytes, state_to_bytes

    def guard() -> StepGuard:
        return StepGuard(DevicePolicy(), secure_kind=lambda k: k in SECURE, once=ONCE,
                         ldp_cost=lambda k: 0.25 if k == "up" else 0.0)

    g = guard()
    for user, kind, t, secure in requests:
        try:
            g.admit(user, kind, t, secure=secure)
        except RefusedStep:
            pass
    back = guard()
    back.load_state_dict(state_from_bytes(state_to_bytes({"g": g.state_dict()}))["g"])
    assert back.users() == g.users()
    for u in g.users():
        assert all(np.array_equal(v, back.state(u)[k]) for k, v in g.state(u).items())


def _records(**change):
    g = StepGuard(DevicePolicy(), secure_kind=lambda k: k in SECURE)
    g.admit(3, "s1", 2, secure=True), g.admit(5, "o", 1, secure=True)
    return {**g.state_dict(), **change}


@pytest.mark.parametrize("bad", [
    _records(users=np.array([3, 3])),
    _records(users=np.array([-1, 5])),
    _records(ldp_spent=np.array([0.0])),
    _records(this_round_at=np.array([0, 3, 1])),
    _records(once_at=np.array([0, 0, 99])),
    _records(ldp_spent=np.array([0.0, np.inf])),
    {"users": np.zeros(0, np.int64)},
])
def test_malformed_checkpoint_records_are_refused_and_change_nothing(bad):
    g = StepGuard(DevicePolicy(), secure_kind=lambda k: k in SECURE)
    g.admit(9, "s1", 1, secure=True)
    with pytest.raises(ValueError, match="step guard"):
        g.load_state_dict(bad)
    assert g.users() == [9]


def test_a_device_record_written_before_the_upload_round_was_kept_still_loads():
    g = _guard()
    g.load_state(0, {"last_round": np.array(4), "this_round": np.zeros(0, np.uint8), "once": np.zeros(0, np.uint8),
                     "ldp_spent": np.array(2.0)})
    assert g.ldp_spent(0) == 2.0 and g.ldp_round(0) == -1 and set(g.state(0)) == StepGuard._KEYS
