"""Keeping large freed blocks in the process for reuse, instead of handing them back to the kernel.

glibc's malloc serves every block above its mmap threshold (at most 32 MB) with a fresh mmap and returns it with
munmap on free; the next allocation of that size faults in new pages, which the kernel zeroes first. A CPU
training step allocates and frees dozens of such tensors (EAGLE-3's draft logits and their gradients, [B, T, 8192]
float32: 134 MB each at 4 x 1,024 tokens), so about a fifth of a CPU step went to page faults and page zeroing.
With large blocks taken from the heap and the heap never trimmed, freed blocks are reused as they are (the
measurement: docs/design-training.md, "Speed on CPU"). Elsewhere (musl, macOS, Windows) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4
NEVER_TRIM = 2**31 - 1  # the largest threshold mallopt takes: free memory at the heap's top is kept up to 2 GiB


def reuse_freed_memory() -> bool:
    """Ask glibc to serve large blocks from the heap and keep what is freed; -> whether the C library took it."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, NEVER_TRIM) == 1
    log.debug("large freed blocks %s", "kept for reuse" if done else "returned to the system (no glibc mallopt)")
    return done
