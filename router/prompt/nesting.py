"""How deep a JSON document nests, found without walking (or recursing into) its objects.

A request body is bounded in depth (`limits.max_json_depth`) because everything downstream that
walks it recursively (msgspec, a chat template's `tojson`, the engine's own parser) fails with a
RecursionError at about a thousand levels, which 2 KB of brackets reach. Measuring the decoded
object would cost a pass over every list element (4 M token ids in a large `input_ids`); the
bytes are cheaper: with strings removed, every bracket left is structure.
"""

from __future__ import annotations

import re

__all__ = ["nests_deeper"]

# a JSON string, escapes included (unrolled: a long string is one tight scan, not a backtrack)
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_ONLY_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def nests_deeper(raw: bytes, limit: int) -> bool:
    """Whether valid JSON `raw` nests arrays/objects more than `limit` levels deep."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False  # the usual body: too few brackets to nest that deep
    structure = _JSON_STRING.sub(b"", raw).translate(_ONLY_BRACKETS, _NOT_BRACKETS)
    # each pass strips every innermost pair, so `limit` passes empty anything within the limit
    for _ in range(limit):
        structure = structure.replace(b"[]", b"")
        if not structure:
            return False
    return True
