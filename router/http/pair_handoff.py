"""A prefill that says its KV handoff failed (SGLang pairs): whose failure that is.

SGLang's prefill answers only once its decode took the KV (`router.http.pair_hooks`); it gives
up waiting after a timeout of its own and says so in its error. Such a failure, while its decode
has not answered, is not the prefill's alone, and blaming the prefill took the healthy prefills
out one after another while the retry went back to the same wedged decode:
- it says no decode came for the KV (`HandoffFault.DECODE`): SGLang 0.5.23's 500 "Prefill
  bootstrap failed ... timed out after 300.0s in KVPoll.Bootstrapping" (the decode never sent
  its KV indices: `disaggregation/common/conn.py`), the reference worker's 504
  `kv_transfer_timeout` "no decode worker fetched the KV within 2 s". The decode's failure: it
  is hung, or took the request on and never got to it. A decode that could not reach the
  prefill's bootstrap server says so itself, and sooner: its own wait began first
  (`router.http.bootstrap_unreachable`);
- it says the handoff failed in any other words (SGLang's "Prefill transfer failed ...
  KVTransferError", the reference worker's `kv_transfer_*` errors): either side's
  (`HandoffFault.EITHER`), which cannot be told from here. The retry avoids the pair, and
  neither is charged: blaming the wrong one would take a healthy worker out (what the two do
  next may tell: `router.http.pair_faults`);
- anything else (another 5xx, a dropped connection, no answer within the request deadline):
  the prefill's own failure, as before.
"""

from __future__ import annotations

import enum
import re

__all__ = ["HandoffFault", "handoff_fault"]

# a prefill that waited for its decode in vain: the decode never fetched (the reference worker)
# or never sent the KV indices it is to be written to (SGLang: stuck in KVPoll.Bootstrapping)
_NO_DECODE = re.compile(rb"no decode worker fetched the KV|in KVPoll\.Bootstrapping")
# a prefill whose KV handoff failed in other words: the transfer broke, on either side
_HANDOFF = re.compile(rb"kv_transfer_|KVTransferError|Prefill (?:bootstrap|transfer) failed")


class HandoffFault(enum.Enum):
    """Whose failure a prefill's failed KV handoff is, while its decode has not answered."""

    DECODE = "decode"  # no decode came for the KV
    EITHER = "either"  # the handoff failed, on a side not said


def handoff_fault(payload: bytes) -> HandoffFault | None:
    """Whose failure a prefill's 5xx answer `payload` says its KV handoff was (looked for in
    its first 4 KiB); None: not a failed handoff, the prefill's own failure."""
    head = payload[:4096]
    if _NO_DECODE.search(head) is not None:
        return HandoffFault.DECODE
    if _HANDOFF.search(head) is not None:
        return HandoffFault.EITHER
    return None
