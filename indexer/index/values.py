"""How a table value packs who holds a block key and which namespace it belongs to.

Every value of the shared table (and of the pending table) is
`(stream bits << CODE_BITS) | ns_code(namespace id)`: each stream has a slot (a bit), and the
low bits carry the namespace's code. A query ANDs the values of its blocks in C; the code of id
x is `x | ~x << NS_BITS`, so the AND of two different codes never equals either of them and an
entry of another namespace ends every match right there (isolation is structural, not a
matter of hash odds). Namespace ids therefore have NS_BITS bits.
"""

from __future__ import annotations

__all__ = ["CODE_BITS", "CODE_MASK", "NS_BITS", "NS_MASK", "ns_code"]

NS_BITS = 24
NS_MASK = (1 << NS_BITS) - 1
CODE_BITS = 2 * NS_BITS
CODE_MASK = (1 << CODE_BITS) - 1


def ns_code(ns_id: int) -> int:
    """Namespace id x as `x | ~x << NS_BITS`: ANDing two different codes changes both."""
    return ns_id | ((~ns_id & NS_MASK) << NS_BITS)
