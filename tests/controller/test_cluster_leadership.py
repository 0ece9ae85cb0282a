"""controller/cluster/leadership.py: the lease's local deadline and the term, on a fake clock."""

from __future__ import annotations

import pytest

from controller.cluster.leadership import Leadership, Transition

TTL = 5.0
MARGIN = 0.5


def leader(now: float = 100.0, lease: int = 7, revision: int = 42) -> Leadership:
    """A node that was granted ``lease`` at ``now`` and won a campaign at once."""
    state = Leadership(MARGIN)
    assert state.granted(lease, TTL, sent_at=now, now=now + 0.01) is None
    won = state.won(lease, revision, now + 0.02)
    assert won == Transition(True, now + 0.02, "won the campaign")
    return state


def test_no_lease_no_leadership() -> None:
    state = Leadership(MARGIN)
    assert not state.leading(0.0)
    assert not state.lease_valid(0.0)
    assert state.won(0, 5, 0.0) is None
    assert state.term == 0


def test_the_deadline_counts_from_when_the_keepalive_was_sent() -> None:
    state = leader(now=100.0)
    assert state.deadline == 100.0 + TTL - MARGIN
    # A renewal sent at 101 whose answer took 3 s counts from 101, not 104.
    assert state.renewed(7, TTL, sent_at=101.0, now=104.0) is None
    assert state.deadline == 101.0 + TTL - MARGIN
    assert state.leading(105.49)
    assert not state.leading(105.5)


def test_past_the_deadline_it_does_not_lead_whatever_etcd_says_later() -> None:
    state = leader(now=100.0)
    assert state.leading(104.49)
    assert not state.leading(104.5)  # read at once, before any timer or answer
    assert state.expire(104.5) == Transition(False, 104.5, "the lease was not renewed in time")
    assert state.expire(104.6) is None
    # A paused process wakes up; etcd still has the lease: the lease is valid, the term is not.
    assert state.renewed(7, TTL, sent_at=110.0, now=110.01) is None
    assert state.lease_valid(110.02)
    assert not state.leading(110.02)
    assert state.term == 0
    # It leads again only by winning a campaign.
    assert state.won(7, 42, 110.03) == Transition(True, 110.03, "won the campaign")


def test_a_late_renewal_ends_the_term_even_before_the_timer() -> None:
    state = leader(now=100.0)
    ended = state.renewed(7, TTL, sent_at=104.0, now=105.0)
    assert ended == Transition(False, 105.0, "the lease lapsed before it was renewed")
    assert state.lease_valid(105.0)
    assert not state.leading(105.0)
    assert state.expire(200.0) is None


def test_renewals_only_move_the_deadline_forward_for_the_current_lease() -> None:
    state = leader(now=100.0)
    state.renewed(7, TTL, sent_at=102.0, now=102.1)
    assert state.renewed(7, TTL, sent_at=101.0, now=102.2) is None  # overtaken
    assert state.deadline == 102.0 + TTL - MARGIN
    assert state.renewed(6, TTL, sent_at=103.0, now=103.1) is None  # an older lease
    assert state.deadline == 102.0 + TTL - MARGIN


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (lambda s: s.renewed(7, 0, 101.0, 101.1), "etcd no longer has the lease"),
        (lambda s: s.lost(7, 101.1), "etcd no longer has the lease"),
        (lambda s: s.granted(8, TTL, 101.0, 101.1), "a new lease replaced the old one"),
        (lambda s: s.deposed(101.1, "resigned"), "resigned"),
    ],
)
def test_the_term_ends_at_once(event, reason) -> None:
    state = leader(now=100.0)
    assert event(state) == Transition(False, 101.1, reason)
    assert not state.leading(101.1)
    assert state.term == 0
    assert state.reason == reason


def test_lost_of_another_lease_changes_nothing() -> None:
    state = leader(now=100.0)
    assert state.lost(6, 101.0) is None
    assert state.leading(101.0)


def test_a_campaign_with_an_old_or_lapsed_lease_does_not_win() -> None:
    state = Leadership(MARGIN)
    state.granted(7, TTL, 100.0, 100.0)
    state.granted(8, TTL, 100.5, 100.5)
    assert state.won(7, 42, 101.0) is None  # rule 2: not the current lease
    assert state.won(8, 42, 105.0) is None  # rule 2: lapsed (deadline 105.0)
    assert state.term == 0


def test_each_term_ends_once() -> None:
    state = leader(now=100.0)
    transitions = [
        state.expire(104.5),
        state.lost(7, 104.6),
        state.deposed(104.7, "again"),
    ]
    assert [t.leading for t in transitions if t] == [False]


def test_winning_again_while_leading_is_no_transition() -> None:
    state = leader(now=100.0)
    assert state.won(7, 42, 101.0) is None
    assert state.leading(101.0)
    assert "term=42" in repr(state)
