"""controller/cluster/leadership.py: the lease's local deadline, the leader record and the term,
on a fake clock (numbers)."""

from __future__ import annotations

import math

import pytest

from controller.cluster.leadership import Leadership, LeaseClock, Record, Step, Transition

TTL = 3.0
MARGIN = 0.3
LEASE = 7


# --- the lease ------------------------------------------------------------------------------


def test_the_lease_deadline_counts_from_when_the_keepalive_was_sent() -> None:
    clock = LeaseClock(MARGIN)
    assert not clock.valid(0.0)
    clock.granted(LEASE, TTL, sent_at=100.0)
    assert clock.deadline == 100.0 + TTL - MARGIN
    # A renewal sent at 101 whose answer took 3 s counts from 101, not 104.
    clock.renewed(LEASE, TTL, sent_at=101.0)
    assert clock.valid(103.69)
    assert not clock.valid(103.7)
    clock.renewed(LEASE, TTL, sent_at=100.5)  # overtaken: changes nothing
    clock.renewed(6, TTL, sent_at=102.0)  # another lease: changes nothing
    assert clock.deadline == 101.0 + TTL - MARGIN


def test_a_lease_etcd_no_longer_has_is_lost() -> None:
    clock = LeaseClock(MARGIN)
    clock.granted(LEASE, TTL, sent_at=100.0)
    assert not clock.lost(6)
    clock.renewed(LEASE, 0, sent_at=101.0)
    assert clock.lease == 0
    assert not clock.valid(101.0)


# --- the record ------------------------------------------------------------------------------


def test_a_record_reads_back_and_a_bare_name_is_a_record_without_ttl() -> None:
    record = Record("n1", 42, TTL, LEASE)
    assert Record.decode(record.encode()) == record
    assert record.encode() == Record("n1", 42, TTL, LEASE).encode()  # the fence compares bytes
    assert Record.decode(b"n1") == Record("n1", 0, 0.0)
    assert Record.decode(b"{") == Record("{", 0, 0.0)


# --- the term --------------------------------------------------------------------------------


def follower(name: str = "n2") -> Leadership:
    return Leadership(name, TTL, MARGIN)


def leader(at: float = 100.0, revision: int = 10) -> Leadership:
    """n1, which found the record absent at ``revision`` and won it, sending at ``at``."""
    state = follower("n1")
    assert state.observed(None, revision, at) is None
    step = state.decide(at, LEASE)
    record = Record("n1", revision, TTL, LEASE)
    assert step == Step("campaign", revision=0, record=record)
    state.trying(record)
    won = state.won(record, revision + 1, sent_at=at, now=at + 0.01)
    assert won == Transition(True, at + 0.01, "won the campaign")
    return state


def test_nothing_is_decided_before_the_record_was_read_nor_without_a_lease() -> None:
    state = follower()
    assert state.decide(0.0, LEASE) == Step("wait", at=math.inf)
    state.observed(None, 5, 1.0)
    assert state.decide(1.0, 0) == Step("wait", at=math.inf)
    assert state.decide(1.0, LEASE).kind == "campaign"


@pytest.mark.parametrize(
    ("events", "now", "expected"),
    [
        # (seen at, record's mod revision) ... → the step at ``now``
        ([(100.0, 20)], 103.29, Step("wait", at=103.3)),
        ([(100.0, 20)], 103.3, Step("campaign", revision=20, record=Record("n2", 20, TTL, LEASE))),
        # A renewal seen at 102 restarts the wait: the clock counts from the change.
        ([(100.0, 20), (102.0, 23)], 104.0, Step("wait", at=105.3)),
        # The same revision seen again (the read, then the watch) does not restart it.
        (
            [(100.0, 20), (102.0, 20)],
            103.3,
            Step("campaign", revision=20, record=Record("n2", 20, TTL, LEASE)),
        ),
        # An older revision arriving late changes nothing (rule 6).
        (
            [(100.0, 20), (101.0, 23), (102.0, 21)],
            104.3,
            Step("campaign", revision=23, record=Record("n2", 23, TTL, LEASE)),
        ),
    ],
)
def test_a_follower_takes_over_a_record_silent_for_its_ttl_plus_the_margin(
    events: list[tuple[float, int]], now: float, expected: Step
) -> None:
    state = follower()
    other = Record("n1", 10, TTL, 3)
    for at, revision in events:
        assert state.observed(other, revision, at) is None
    assert state.decide(now, LEASE) == expected
    assert state.leader(now) == (None if expected.kind == "campaign" else "n1")


def test_the_record_s_own_ttl_counts_not_the_follower_s() -> None:
    state = follower()
    state.observed(Record("n1", 10, 10.0, 3), 20, 100.0)
    assert state.decide(105.0, LEASE) == Step("wait", at=110.3)
    # A bare name (an older version's key, bound to its leader's lease) is never taken over
    # by time: that leader renews its lease, not the key, and fences on its create revision.
    state.observed(Record.decode(b"n1"), 21, 111.0)
    assert state.decide(1000.0, LEASE) == Step("wait", at=math.inf)
    assert state.leader(1000.0) == "n1"
    state.observed(None, 22, 1001.0)
    assert state.decide(1001.0, LEASE).kind == "campaign"


def test_an_absent_record_is_campaigned_for_at_once_with_the_revision_as_its_term() -> None:
    state = follower()
    state.observed(Record("n1", 10, TTL, 3), 20, 100.0)
    state.observed(None, 25, 100.5)  # deleted (resigned) at 25
    assert state.decide(100.5, LEASE) == Step("campaign", record=Record("n2", 25, TTL, LEASE))
    assert state.leader(100.5) is None


def test_the_leader_renews_every_third_of_the_ttl_by_compare_and_swap() -> None:
    state = leader(at=100.0)
    assert state.leading(100.01)
    assert state.decide(100.5, LEASE) == Step("wait", at=101.0)
    ours = Record("n1", 10, TTL, LEASE)
    assert state.decide(101.0, LEASE) == Step("renew", revision=11, record=ours, within=1.0)
    # Its own write comes back through the watch: still ours.
    assert state.observed(ours, 11, 101.05) is None
    assert state.renewed(15, sent_at=101.0, now=101.2) is None
    assert state.deadline == 101.0 + TTL - MARGIN
    assert state.decide(101.5, LEASE) == Step("wait", at=102.0)
    assert state.decide(102.0, LEASE) == Step("renew", revision=15, record=ours, within=1.0)
    assert state.leader(102.0) == "n1"
    assert state.term == 10


def test_a_renewal_waits_a_third_of_the_ttl_at_most_and_never_past_the_term() -> None:
    """Rule 7: a renewal lost in etcd is given up in time for another within the term."""
    state = leader(at=100.0)  # deadline 102.7
    assert state.decide(101.0, LEASE).within == TTL / 3
    # The renewal sent at 101 was never answered: one sent at 102 waits until the deadline.
    assert state.decide(102.0, LEASE).within == pytest.approx(0.7)
    assert state.decide(102.6, LEASE).within == pytest.approx(0.1)


def test_past_its_deadline_the_leader_does_not_lead_whatever_etcd_says_later() -> None:
    state = leader(at=100.0)
    assert state.leading(102.69)
    assert not state.leading(102.7)  # read at once, before any timer or answer
    assert state.expire(102.7) == Transition(
        False, 102.7, "the leader record was not renewed in time"
    )
    assert state.expire(102.8) is None
    assert state.term == 0
    assert state.leader(102.8) is None
    # Nobody took over: the record it wrote is taken back at once, as a new term (rule 2).
    step = state.decide(110.0, LEASE)
    assert step == Step("campaign", revision=11, record=Record("n1", 11, TTL, LEASE))


def test_a_renewal_answered_past_the_deadline_ends_the_term() -> None:
    state = leader(at=100.0)
    ended = state.renewed(12, sent_at=102.6, now=102.75)
    assert ended == Transition(False, 102.75, "the record was renewed past the term's deadline")
    assert not state.leading(102.75)


def test_another_s_record_or_its_deletion_ends_the_term_at_once() -> None:
    state = leader(at=100.0)
    taken = state.observed(Record("n2", 11, TTL, 4), 12, 101.0)
    assert taken == Transition(False, 101.0, "n2 took over (term 11)")
    assert state.leader(101.0) == "n2"
    assert state.decide(101.0, LEASE) == Step("wait", at=101.0 + TTL + MARGIN)

    state = leader(at=100.0)
    gone = state.observed(None, 13, 101.0)
    assert gone == Transition(False, 101.0, "the leader record was deleted")


def test_a_campaign_answered_too_late_starts_no_term_and_is_retried() -> None:
    state = follower()
    state.observed(None, 10, 100.0)
    record = Record("n2", 10, TTL, LEASE)
    state.trying(record)
    assert state.won(record, 11, sent_at=100.0, now=102.7) is None
    assert not state.leading(102.7)
    assert state.decide(102.7, LEASE) == Step(
        "campaign", revision=11, record=Record("n2", 11, TTL, LEASE)
    )


def test_a_campaign_whose_answer_was_lost_is_taken_back_when_seen() -> None:
    state = follower()
    state.observed(None, 10, 100.0)
    record = Record("n2", 10, TTL, LEASE)
    state.trying(record)  # ... EtcdUnavailable; the write was applied all the same
    assert state.observed(record, 11, 100.5) is None
    assert not state.leading(100.5)
    step = state.decide(100.5, LEASE)
    assert step == Step("campaign", revision=11, record=Record("n2", 11, TTL, LEASE))


def test_each_term_ends_once() -> None:
    state = leader(at=100.0)
    ends = [
        state.expire(102.7),
        state.observed(Record("n2", 11, TTL, 4), 12, 102.8),
        state.resigned(102.9),
    ]
    assert [t.leading for t in ends if t] == [False]
    assert state.resigned(103.0) is None


@pytest.mark.parametrize("late", [0.0, 0.2, 1.0, 1.6])
def test_a_follower_never_takes_over_before_the_leader_s_deadline(late: float) -> None:
    """Rule 4: whatever the delay between a renewal's send, its commit and a follower seeing
    it, the follower's earliest takeover falls after the leader's deadline."""
    old = leader(at=100.0)
    other = follower()
    assert old.renewed(12, sent_at=100.9, now=101.0 + late) is None
    other.observed(old.ours, 12, 100.9 + late)
    takeover = other.decide(100.9 + late, LEASE).at
    assert takeover - old.deadline == pytest.approx(late + 2 * MARGIN)
