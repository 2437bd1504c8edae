"""The data-parallel rank a request names, and telling the engine the rank the router chose.

SGLang (DP attention) and vLLM (`--data-parallel-size`) serve several DP ranks behind one HTTP
endpoint, each with its own KV cache; unless a request names a rank, the engine's own DP
controller picks one, whatever the router's index says. Both directions follow the engines'
released code (SGLang 0.5.23, vLLM 0.33; the names live in `indexer.engines`):

- reading, as SGLang reads it: on every route the body's `routed_dp_rank`, else its deprecated
  alias `data_parallel_rank` (`managers/io_struct.py`, `openai/protocol.py`); on the OpenAI
  routes the `X-Data-Parallel-Rank` header, which overrides the body
  (`serving_base.extract_routed_dp_rank_from_header`: `int()` of its value, a 400 otherwise).
  vLLM's `X-data-parallel-rank` is the same header (HTTP names are case-insensitive).
  `/generate` reads no header.
- telling: where the engine takes a body field on `/generate` (SGLang's `routed_dp_rank`), the
  field is spliced into the body as the client sent it, every other byte unchanged; elsewhere
  (SGLang's OpenAI routes, every vLLM route) the header is set.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from indexer.engines import SGLANG
from router.errors import RequestError

__all__ = [
    "DP_RANK_FIELDS",
    "DP_RANK_HEADER",
    "requested_rank",
    "with_body_field",
    "with_body_members",
]

DP_RANK_HEADER = SGLANG.dp_rank_header  # vLLM's spelling differs only in case
# the body fields in SGLang's precedence order: the new name wins over its deprecated alias
DP_RANK_FIELDS = ("routed_dp_rank", "data_parallel_rank")

_JSON_SPACE = frozenset(b" \t\r\n")
_encoder = msgspec.json.Encoder()


def _body_rank(body: Mapping[str, Any]) -> int | None:
    ranks = []
    for field in DP_RANK_FIELDS:
        value = body.get(field)
        # both are typed fields of the engine's request model: a bad one is an error even
        # where the other one wins
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise RequestError(f"{field} must be an integer")
        if value is not None and value < 0:
            raise RequestError(f"{field} must not be negative (it names a dp rank)")
        ranks.append(value)
    routed, alias = ranks
    return routed if routed is not None else alias


def requested_rank(body: Mapping[str, Any], header: str | None) -> int | None:
    """The rank the client named: the header's value when given (OpenAI routes pass it;
    `/generate` does not), else the body's; None when it names none."""
    rank = _body_rank(body)
    if header is None:
        return rank
    try:
        value = int(header)
    except ValueError:
        raise RequestError(
            f"invalid {DP_RANK_HEADER} header: must be an integer, got {header!r}"
        ) from None
    if value < 0:
        raise RequestError(f"the {DP_RANK_HEADER} header must not be negative")
    return value


def with_body_field(raw: bytes, field: str, value: int) -> bytes:
    """`raw` (a JSON object) with `"field": value` added as its last member, nothing else moved.

    Re-encoding the body would change what the client sent (number spellings, escapes,
    whitespace, duplicate keys); a splice before the closing brace changes none of it.
    """
    return with_body_members(raw, {field: value})


def with_body_members(raw: bytes, members: Mapping[str, object]) -> bytes:
    """`raw` (a JSON object) with `members` added after its last member, JSON-encoded.

    A name the body already has is then there twice: the engines' JSON parsers (and ours)
    keep the last, so the added value wins, as an update of the decoded body would.
    """
    if not members:
        return raw
    end = len(raw)
    while end and raw[end - 1] in _JSON_SPACE:
        end -= 1
    close = end - 1
    if close < 0 or raw[close] != ord("}"):
        raise ValueError("not a JSON object")
    before = close
    while before and raw[before - 1] in _JSON_SPACE:
        before -= 1
    member = b",".join(
        _encoder.encode(name) + b":" + _encoder.encode(v) for name, v in members.items()
    )
    if raw[before - 1] != ord("{"):  # a member precedes: separate it
        member = b"," + member
    return raw[:close] + member + raw[close:]
