"""The rate-limit policies (nodemgr.policy.ratelimit) on a clock the test sets."""

from __future__ import annotations

from nodemgr.policy.ratelimit import LogThrottle, TokenBuckets, suppressed_note


def test_a_bucket_starts_full_refills_at_its_rate_and_keeps_keys_apart() -> None:
    b = TokenBuckets(rate=2.0, burst=3)
    assert [b.take("a", 10.0) for _ in range(4)] == [True, True, True, False]
    assert b.take("b", 10.0)  # another key has its own bucket
    assert not b.take("a", 10.4)  # 0.8 of a token
    assert b.take("a", 10.5) and not b.take("a", 10.5)
    # A long pause refills it to the burst, no more.
    assert [b.take("a", 100.0) for _ in range(4)] == [True, True, True, False]
    # A clock that steps back gives nothing.
    assert not b.take("a", 50.0)
    b.forget("a")
    assert b.take("a", 50.0)


def test_a_throttle_says_one_line_per_key_per_interval_with_what_it_held_back() -> None:
    t = LogThrottle(60.0)
    assert t.allow("a", 0.0) == 0
    assert [t.allow("a", s) for s in (1.0, 2.0, 59.0)] == [None, None, None]
    assert t.allow("b", 1.0) == 0  # keys apart
    assert t.allow("a", 60.0) == 3
    assert t.allow("a", 61.0) is None
    assert t.allow("a", 200.0) == 1
    assert suppressed_note(0) == ""
    assert "3 more" in suppressed_note(3)
