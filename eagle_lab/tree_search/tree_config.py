"""The tree a user asks for (`tree=`, TreeConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from eagle_lab.errors import EagleLabError


@dataclass
class TreeConfig:
    """online: each round drafts the chain length, up to `depth`, expected to give the most tokens per ms
    (eagle_lab.tree_search.online); else the fixed shape depth / topk / total_tokens (all three > 0)."""

    name: str = "online"  # the tree/ config it came from (head cards key MT-bench tau by it)
    online: bool = True
    depth: int = 3
    topk: int = 1
    total_tokens: int = 3
    # the server at batch sizes >= 2: rows draft only where drafting, timed beside plain decoding in the batched
    # round, beats it by this factor (docs/design-batching.md, "A tree per batch size")
    batch_min_gain: float = 1.2
    # at T > 0, draw the head's tree from its own distribution under the request's sampling parameters and
    # accept with min(1, p/q) (eagle_lab/drafters/sampled.py); false: its top-k tokens, as at T = 0
    sampled_drafts: bool = True

    def validate(self) -> None:
        if self.online and self.depth < 1:
            raise EagleLabError(f"tree=online needs tree.depth >= 1 (the longest chain), got {self.depth}")
        if not self.online and min(self.depth, self.topk, self.total_tokens) < 1:
            raise EagleLabError("a fixed tree (tree.online=false) needs tree.depth, tree.topk and tree.total_tokens "
                                f"> 0; got {self.depth} / {self.topk} / {self.total_tokens}")
        if self.batch_min_gain < 1.0:
            raise EagleLabError(f"tree.batch_min_gain must be >= 1 (how much faster than plain decoding drafting "
                                f"must time at a server batch to be used); got {self.batch_min_gain}")
