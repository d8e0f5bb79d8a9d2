"""The tree a user asks for (`tree=`, TreeConfig) and the space tree=auto searches (TreeSearchConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TreeSearchConfig:
    depths: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6, 7])
    topks: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6, 8])
    totals: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 48, 60])
    record_shape: tuple[int, int, int] = (7, 8, 64)  # the largest shape searched: its candidates contain all others'
    probe_shape: tuple[int, int, int] = (2, 2, 4)  # a small shape, timed to fit the overhead's slope
    new_tokens: int = 48
    # cached tokens behind the timed forwards and draft steps: about where the calibration's own runs decode (a
    # chat prompt and new_tokens), so the model's prices agree with its timed no-draft and probe rounds; timed
    # past 256 tokens (attending over 512 positions) a tree's forward costs more than the runs' own
    context: int = 96
    validate_new_tokens: int = 64  # per prompt when the best shapes are timed against plain decoding
    # sampling temperatures whose expected accept lengths the recording prices (a sampled request
    # drafts the tree chosen for the nearest of them, or for greedy decoding when that is nearer)
    sampled_temperatures: list[float] = field(default_factory=lambda: [0.7, 1.0])


@dataclass
class TreeConfig:
    """auto: measure this device and head, then pick the fastest shape (eagle_lab.tree_search.auto);
    a non-zero depth / topk / total_tokens is kept as given (all three needed when auto=false)."""

    name: str = ""  # the tree/ config it came from (head cards key MT-bench tau by it)
    auto: bool = True
    depth: int = 0
    topk: int = 0
    total_tokens: int = 0
    # tree=auto drafts only where the fastest timed tree beats plain decoding, timed beside it, by
    # this factor; else it decodes without drafts. min_gain: at batch 1 (serve.py, bench, a lone
    # server request); batch_min_gain: at the server's batch sizes >= 2, where timings on the few
    # calibration prompts overrated trees (docs/design-batching.md, "A tree per batch size"); at batch 1
    # a small margin, so that a tie within the timings' noise keeps plain decoding
    min_gain: float = 1.03
    # the margin at batch 1 when sampling (T > 0): the few calibration prompts can rate a tree faster than
    # plain decoding at T=1 where a full benchmark finds it slower (docs/design-tree-search.md)
    sampled_min_gain: float = 1.1
    batch_min_gain: float = 1.2
    # on a device not calibrated yet, a run planned to decode fewer tokens than this (prompts x
    # max_new_tokens) calibrates quickly (its candidates timed on one prompt) instead of in full (on
    # all the calibration prompts, several times longer); 0: always in full
    quick_below_tokens: int = 2048
    # choose each round's chain length online, up to `depth` (3 when 0), from the acceptance this reply shows and
    # the rounds' measured cost (eagle_lab/tree_search/online.py); tree=auto's calibration is not run
    online: bool = False
    # at T > 0, draw the head's tree from its own distribution under the request's sampling parameters and
    # accept with min(1, p/q) (eagle_lab/drafters/sampled.py); false: its top-k tokens, as at T = 0
    sampled_drafts: bool = True
