"""Where a stream holds a block: its residency per storage tier, and the best tier held.

Engines report offload as events: vLLM and SGLang (HiCache) store a block on the GPU, store it
again on the host (`BlockStored` with medium CPU / CPU_PINNED) when it is offloaded, then
remove it from the GPU (`BlockRemoved` with medium GPU) while the host copy stays. So a stream
holds each block in a set of media, each with its own count, and a removal names the medium
it leaves (none named: every medium). What a request can reuse is the best tier held: a block
on GPU and CPU is a GPU hit; once it has left the GPU it is a CPU hit.

Tier order, best first, covers both engines' spellings (vLLM: GPU, CPU, STORAGE; SGLang:
GPU, CPU_PINNED, DISK, EXTERNAL); a medium neither uses sorts after them, by name.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["MEDIUM_ORDER", "best_medium"]

MEDIUM_ORDER = ("GPU", "CPU", "CPU_PINNED", "DISK", "STORAGE", "EXTERNAL")
_RANK = {medium: i for i, medium in enumerate(MEDIUM_ORDER)}


def best_medium(held: Mapping[str, int]) -> str:
    """The best tier among the media `held` (counts > 0); `held` must not be empty."""
    return min(held, key=lambda medium: (_RANK.get(medium, len(_RANK)), medium))
