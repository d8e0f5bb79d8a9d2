"""reuse_freed_memory: glibc serves large blocks from the heap (no mmap, no munmap on free) afterwards."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from eagle_lab.training.host_memory import M_MMAP_MAX, M_TRIM_THRESHOLD, reuse_freed_memory


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


@pytest.fixture
def libc():
    lib = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(lib, "mallinfo2"):
        pytest.skip("needs glibc 2.33 or later (mallinfo2)")
    lib.mallinfo2.restype = MallInfo2
    lib.malloc.argtypes, lib.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    lib.free.argtypes = [ctypes.c_void_p]
    lib.mallopt.argtypes, lib.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    yield lib
    lib.mallopt(M_MMAP_MAX, 65536)  # glibc's defaults again, for the tests that follow
    lib.mallopt(M_TRIM_THRESHOLD, 128 * 1024)


def mapped_blocks_while_holding(libc, size: int) -> int:
    block = libc.malloc(size)
    assert block
    try:
        return libc.mallinfo2().hblks
    finally:
        libc.free(block)


def test_a_large_block_is_mapped_by_default_and_comes_from_the_heap_after(libc):
    size = 64 << 20  # above glibc's largest mmap threshold (32 MB)
    base = libc.mallinfo2().hblks
    assert mapped_blocks_while_holding(libc, size) == base + 1  # glibc's default: its own mapping
    assert reuse_freed_memory()
    assert mapped_blocks_while_holding(libc, size) == base  # from the heap, kept there when freed
