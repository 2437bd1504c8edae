"""`RecentMarks`: what a stream shadowed lately, within its bounds, and what it says it forgot."""

from __future__ import annotations

from indexer.namespace import Namespace
from indexer.recent_marks import RecentMarks

A = Namespace("m", None, "a")
B = Namespace("m", None, "b")


def _marks(*, keys: int = 100, heads: int = 4, namespaces: int = 4, head: int = 8) -> RecentMarks:
    return RecentMarks(
        most_keys=keys, most_heads=heads, most_namespaces=namespaces, head_tokens=head
    )


def _heads(recent: RecentMarks, horizon: float) -> list[tuple[Namespace, str, list[int], float]]:
    return [
        (ns, key, list(tokens), until) for ns, key, tokens, until in recent.heads_since(horizon)
    ]


def test_a_head_is_its_prompts_first_tokens_kept_once_with_its_longest_time() -> None:
    recent = _marks(head=4)
    recent.remember_head(1.0, A, list(range(10)), "k", 50.0, horizon=0.0)
    recent.remember_head(2.0, A, [0, 1, 2, 3, 99], "k", 40.0, horizon=0.0)  # the same head
    recent.remember_head(3.0, A, [0, 1, 2, 3], "other", 40.0, horizon=0.0)
    assert _heads(recent, 0.0) == [(A, "k", [0, 1, 2, 3], 50.0), (A, "other", [0, 1, 2, 3], 40.0)]
    assert recent.newest == 3.0 and recent.since(3.0) and not recent.since(3.5)
    # only those marked since the horizon count
    assert _heads(recent, 2.5) == [(A, "other", [0, 1, 2, 3], 40.0)]


def test_heads_past_the_bound_leave_their_namespace_and_namespaces_past_theirs_a_time() -> None:
    recent = _marks(heads=1, namespaces=1)
    recent.remember_head(1.0, A, [1, 2], "k", 10.0, horizon=0.0)
    recent.remember_head(2.0, B, [3, 4], "k", 20.0, horizon=0.0)
    # A's head is forgotten while doubtful: its namespace stands for it (tokens: none)
    assert _heads(recent, 0.0) == [(B, "k", [3, 4], 20.0), (A, "k", [], 10.0)]
    assert not recent.forgot_heads_since(0.0)
    recent.remember_head(3.0, A, [5, 6], "j", 30.0, horizon=0.0)
    # B's head goes to the namespaces, which push A's out: only the time is left of it
    assert _heads(recent, 0.0) == [(A, "j", [5, 6], 30.0), (B, "k", [], 20.0)]
    assert recent.forgot_heads_since(1.0) and not recent.forgot_heads_since(1.5)


def test_heads_past_the_horizon_go_without_a_trace() -> None:
    recent = _marks(heads=1, namespaces=1)
    recent.remember_head(1.0, A, [1, 2], "k", 10.0, horizon=0.0)
    recent.remember_head(5.0, B, [3, 4], "k", 20.0, horizon=2.0)  # A's is past doubt
    assert _heads(recent, 0.0) == [(B, "k", [3, 4], 20.0)]
    assert not recent.forgot_heads_since(0.0)


def test_tokens_that_are_not_token_ids_leave_their_namespace() -> None:
    recent = _marks()
    recent.remember_head(1.0, A, [("image", 1), 2], "k", 10.0, horizon=0.0)
    recent.remember_head(1.0, B, [-1], "k", 10.0, horizon=0.0)  # not an unsigned 32-bit id
    assert _heads(recent, 0.0) == [(A, "k", [], 10.0), (B, "k", [], 10.0)]


def test_keys_past_the_bound_say_when_the_newest_forgotten_was_marked() -> None:
    recent = _marks(keys=4)
    recent.remember_keys(1.0, [1, 2], horizon=0.0)
    recent.remember_keys(2.0, [3, 4], horizon=0.0)
    assert recent.keys_since(0.0) == {1, 2, 3, 4} and not recent.forgot_keys_since(0.0)
    recent.remember_keys(3.0, [5], horizon=0.0)
    assert recent.keys_since(0.0) == {3, 4, 5}
    assert recent.forgot_keys_since(1.0) and not recent.forgot_keys_since(1.5)
    recent.remember_keys(9.0, [6], horizon=3.5)  # the rest is past doubt: forgotten quietly
    assert recent.keys_since(0.0) == {6} and recent.keys == 1
    assert not recent.forgot_keys_since(1.5)


def test_records_absorbed_keep_both_in_time_order() -> None:
    one, two = _marks(), _marks()
    one.remember_keys(1.0, [1], horizon=0.0)
    two.remember_keys(2.0, [2], horizon=0.0)
    one.remember_keys(3.0, [3], horizon=0.0)
    one.remember_head(1.0, A, [1], "k", 10.0, horizon=0.0)
    two.remember_head(2.0, A, [1], "k", 30.0, horizon=0.0)  # the same head, later
    two.remember_head(0.5, B, [2], "k", 5.0, horizon=0.0)
    two.forgot_at = 1.5
    merged = _marks()
    merged.absorb(one)
    merged.absorb(two)
    assert [at for at, _ in merged.marks] == [1.0, 2.0, 3.0] and merged.keys == 3
    assert merged.keys_since(1.5) == {2, 3} and merged.forgot_keys_since(1.5)
    assert _heads(merged, 0.0) == [(B, "k", [2], 5.0), (A, "k", [1], 30.0)]
    assert merged.newest == 3.0
    # the bounds hold again at the next mark: the oldest key goes
    merged.remember_keys(4.0, [4], horizon=1.5)
    assert merged.keys_since(0.0) == {2, 3, 4}
