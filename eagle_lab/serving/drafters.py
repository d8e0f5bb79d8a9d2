"""One drafter per active sequence.

An `EagleDrafter` keeps per-sequence state between rounds: the head's KV cache over the
committed tokens (`cache`, `committed`) and the last round's candidates. Two sequences whose
rounds interleave through one drafter would read each other's cache, so every sequence gets
its own drafter. The forks share what is read-only: the head module (weights), the target,
the tree shape, the controller's cost curve (tree=online) and the draft LM-head rows
(`lm_weight`: with a reduced draft vocabulary it is a copy of [Vd, H] rows, not re-made per fork).
At batch >= 2 forks of one head draft together (eagle_lab.serving.batch_draft), in a padded copy
of their caches that is handed back to each fork when the batch changes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from eagle_lab.decoding.tree import Drafter
from eagle_lab.drafters.draft_model.drafter import DraftModelDrafter
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.medusa.drafter import MedusaDrafter
from eagle_lab.drafters.ngram import NgramDrafter


def drafter_factory(prototype: Drafter | None) -> Callable[[], Drafter | None]:
    """What each new sequence calls for its drafter (None: method=vanilla)."""
    if prototype is None:
        return lambda: None
    if isinstance(prototype, EagleDrafter):
        return prototype.fork
    if isinstance(prototype, MedusaDrafter):  # no state between rounds but its last candidates
        return lambda: copy.copy(prototype)
    if isinstance(prototype, DraftModelDrafter):  # the draft LM's weights shared, a cache per sequence
        return lambda: DraftModelDrafter(prototype.model, prototype.shape, prototype.vocab_size, prototype.draft_vocab)
    if isinstance(prototype, NgramDrafter):
        return lambda: NgramDrafter(prototype.proposer)  # stateless today; a fresh one stays safe if that changes
    raise TypeError(f"no per-sequence factory for drafter {type(prototype).__name__}")
