"""reuse_freed_memory: glibc serves large blocks from the heap (no mmap, no munmap on free) afterwards.

The allocator's settings are process-wide and stay set once a trainer has run in the test process, so the
measurement runs in a fresh interpreter.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import subprocess
import sys

import pytest

MEASURE = r"""
import ctypes, ctypes.util, json
from eagle_lab.training.host_memory import reuse_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def mapped_blocks_while_holding(size):
    block = libc.malloc(size)
    assert block
    try:
        return libc.mallinfo2().hblks
    finally:
        libc.free(block)

size = 64 << 20  # above glibc's largest mmap threshold (32 MB)
base = libc.mallinfo2().hblks
before = mapped_blocks_while_holding(size)
taken = reuse_freed_memory()
after = mapped_blocks_while_holding(size)
print(json.dumps({"base": base, "before": before, "taken": taken, "after": after}))
"""


def has_mallinfo2() -> bool:
    name = ctypes.util.find_library("c")
    try:
        return hasattr(ctypes.CDLL(name), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not has_mallinfo2(), reason="needs glibc 2.33 or later (mallinfo2)")
def test_a_large_block_is_mapped_by_default_and_comes_from_the_heap_after():
    env = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}  # glibc's defaults
    done = subprocess.run([sys.executable, "-c", MEASURE], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["before"] == seen["base"] + 1  # glibc's default: the block gets its own mapping
    assert seen["taken"]
    assert seen["after"] == seen["base"]  # from the heap, kept there when freed
