"""The pinned mmap threshold: large short-lived blocks keep going to mmap, not the heap."""

from __future__ import annotations

import ctypes
import ctypes.util
import subprocess
import sys

import pytest

from router.commands.allocator import pin_mmap_threshold

_PROBE = """
import ctypes, sys
class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
        "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MI
if sys.argv[1] == "pin":
    from router.commands.allocator import pin_mmap_threshold
    assert pin_mmap_threshold({})
big = bytes(4 << 20)
del big  # unpinned, glibc now raises its threshold to 4 MiB
before = libc.mallinfo2().hblkhd
block = bytes(512 << 10)
print(libc.mallinfo2().hblkhd - before)
"""


def _glibc() -> bool:
    name = ctypes.util.find_library("c")
    return name is not None and hasattr(ctypes.CDLL(name), "mallinfo2")


@pytest.mark.skipif(not _glibc(), reason="glibc's mallopt/mallinfo2 only")
def test_a_pinned_threshold_keeps_large_blocks_off_the_heap() -> None:
    def mmapped(mode: str) -> int:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True
        )
        return int(done.stdout)

    # glibc's own behaviour: after a 4 MiB block is freed, a 512 KiB one comes from the heap
    assert mmapped("default") < 512 << 10
    # pinned: it is mapped (and unmapped when freed), so it cannot fragment the heap
    assert mmapped("pin") >= 512 << 10


def test_the_operator_keeps_the_last_word() -> None:
    assert not pin_mmap_threshold({"KVROUTE_MALLOC_TUNING": "off"})
    assert not pin_mmap_threshold({"MALLOC_MMAP_THRESHOLD_": "65536"})
