"""`WaitingShadows`: other replicas' shadows by the URL of their server, within the doubt and the
bound, and what it says it forgot (until when the forgotten ones were to be kept)."""

from __future__ import annotations

from indexer.namespace import Namespace
from indexer.waiting_shadows import Waiting, WaitingShadows

KEYED = Namespace("m", None, "a", "view-1")


def _shadow(n: int) -> Waiting:
    return Waiting(KEYED, [n, n + 1], None, 100.0 + n)


def test_a_url_takes_its_own_shadows_once_and_the_others_stay() -> None:
    waiting = WaitingShadows(most=8)
    waiting.keep("http://a:1", _shadow(1), 1.0, horizon=0.0)
    waiting.keep("http://b:1", _shadow(2), 2.0, horizon=0.0)
    waiting.keep("http://a:1", _shadow(3), 3.0, horizon=0.0)
    assert waiting.take("http://a:1", 0.0) == ([_shadow(1), _shadow(3)], None)
    assert waiting.take("http://a:1", 0.0) == ([], None)
    assert len(waiting) == 1
    assert waiting.take("http://b:1", 0.0) == ([_shadow(2)], None)


def test_what_came_before_the_horizon_goes() -> None:
    waiting = WaitingShadows(most=8)
    waiting.keep("http://a:1", _shadow(1), 1.0, horizon=0.0)
    waiting.keep("http://a:1", _shadow(2), 5.0, horizon=0.0)
    assert waiting.take("http://a:1", 2.0) == ([_shadow(2)], None)


def test_past_the_bound_the_oldest_go_and_their_url_says_so_within_the_doubt() -> None:
    waiting = WaitingShadows(most=2)
    waiting.keep("http://a:1", _shadow(1), 1.0, horizon=0.0)
    waiting.keep("http://b:1", _shadow(2), 2.0, horizon=0.0)
    waiting.keep("http://b:1", _shadow(3), 3.0, horizon=0.0)  # a:1's goes
    assert len(waiting) == 2
    assert waiting.take("http://b:1", 0.0) == ([_shadow(2), _shadow(3)], None)
    # hidden whole until the forgotten one would have lapsed (kept until 101.0): fail closed
    assert waiting.take("http://a:1", 0.0) == ([], 101.0)
    assert waiting.take("http://a:1", 0.0) == ([], None)  # said once, to the worker added
    waiting.keep("http://a:1", _shadow(4), 4.0, horizon=0.0)
    waiting.keep("http://a:1", _shadow(5), 5.0, horizon=0.0)
    waiting.keep("http://a:1", _shadow(6), 6.0, horizon=0.0)  # 4 goes, forgotten at 4.0
    assert waiting.take("http://a:1", 4.5) == ([_shadow(5), _shadow(6)], None)  # past doubt


def test_past_the_bound_of_urls_every_url_says_it_forgot() -> None:
    waiting = WaitingShadows(most=1)
    waiting.keep("http://a:1", _shadow(1), 1.0, horizon=0.0)
    waiting.keep("http://b:1", _shadow(2), 2.0, horizon=0.0)  # a:1's forgotten, recorded
    waiting.keep("http://c:1", _shadow(3), 3.0, horizon=0.0)  # b:1's: no room to say whose
    assert waiting.take("http://d:1", 0.0) == ([], 102.0)
    assert waiting.take("http://c:1", 2.5) == ([_shadow(3)], None)  # past b:1's time
