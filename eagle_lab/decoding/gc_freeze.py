"""Keeping Python's cyclic garbage collector away from what a process loaded before it decodes.

A loaded target, its tokenizer, head and compiled packages are ~400,000 objects the collector tracks
(SmolLM2-135M with its packaged head). A full collection walks every one of them, as long as
dozens of plain decoding steps, and one falls wherever the allocation counters say, inside a
timed run or a request. None of those objects is garbage while the process serves, so once set-up is
done they are moved out of the collector's reach (`gc.freeze`, as vLLM and SGLang do after start-up);
what decoding allocates afterwards is still collected as usual.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_loaded_objects() -> int:
    """Collect what is garbage now, then exempt every surviving object from later collections.
    -> how many objects are exempt in all. Safe to call again after loading more."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("%d objects exempt from garbage collection", frozen)
    return frozen
