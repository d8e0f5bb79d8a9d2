"""N-gram (prompt lookup) drafting: copy a continuation from the context, merge it into the tree.

Text often repeats what came before (code, summaries, rewrites, answers that quote the
prompt or themselves), and copying it costs no target or head compute:
  propose   find the longest suffix of the committed sequence (between `min_match` and
            `max_match` tokens) that occurred earlier in the prompt or the output, take its
            most recent earlier occurrence, and propose the tokens that followed it as a chain
            of up to `max_tokens` tokens;
  merge     walk the chain down the draft tree from the root while a child holds the chain's
            next token (those tokens are already scored: they are not added twice), then hang
            the rest of the chain under the deepest node it agreed with. The result is still a
            tree (parents before children, sibling tokens distinct), so masks, positions,
            verification and cache compaction work unchanged.
Verification treats an n-gram node like any other candidate: a deterministic proposal (see
verify.py for why that keeps greedy output identical and sampling exact).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from eagle_lab.decoding.tree import DraftTree, build_tree, root_only_tree
from eagle_lab.errors import EagleLabError


@dataclass(frozen=True)
class NgramProposer:
    min_match: int = 2  # shortest suffix that may be matched
    max_match: int = 4  # longest suffix tried first
    max_tokens: int = 8  # chain length

    def __post_init__(self):
        if self.min_match < 1:
            raise EagleLabError(f"ngram.min_match must be >= 1, got {self.min_match}")
        if self.max_match < self.min_match:
            raise EagleLabError(
                f"ngram.max_match ({self.max_match}) must be >= ngram.min_match ({self.min_match})")
        if self.max_tokens < 1:
            raise EagleLabError(f"ngram.max_tokens must be >= 1, got {self.max_tokens}")

    def propose(self, sequence: torch.Tensor) -> list[int]:
        """sequence: [T] committed tokens (prompt + output, the root last) -> the chain after the root."""
        start = match_continuation(sequence, self.min_match, self.max_match)
        if start is None:
            return []
        return copy_forward(sequence[start: start + self.max_tokens].tolist(), self.max_tokens)


def match_continuation(sequence: torch.Tensor, min_match: int, max_match: int) -> int | None:
    """Where the continuation of the longest matched suffix starts, or None.

    For n = max_match .. min_match: the suffix sequence[T-n:] is looked up among the windows
    sequence[i:i+n] with i + n <= T - 1 (an earlier occurrence, followed by at least one
    token); the most recent one wins, and i + n is returned.
    """
    length = sequence.numel()
    for n in range(min(max_match, length - 1), min_match - 1, -1):
        windows = sequence[: length - 1].unfold(0, n, 1)  # [T - n, n]: windows ending before the last token
        hits = (windows == sequence[length - n:]).all(dim=1).nonzero().flatten()  # [hits]
        if hits.numel():
            return int(hits[-1]) + n
    return None


def copy_forward(tail: list[int], count: int) -> list[int]:
    """The `count` tokens that follow a match, `tail` being what the context still holds after it.

    When the match is recent, the context runs out before `count` tokens: the text then
    repeats with period len(tail) (as in an overlapping LZ77 copy), so the copy continues
    from its own start: "a b c a b c" matched at "b c" -> "a b c a b c ...".
    """
    out = list(tail[:count])
    while out and len(out) < count:
        out.append(out[len(out) - len(tail)])
    return out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many first tokens of `a` equal `b`'s (a chain's tokens a round accepted)."""
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def merge_chain(tree: DraftTree, chain: Sequence[int]) -> DraftTree:
    """Merge a chain of proposed tokens (continuing the root) into `tree`.

    The chain follows existing nodes while they hold its tokens, then its remaining tokens
    are appended as new nodes (node indices after the tree's), each the child of the one
    before, the first under the deepest agreeing node. `from_ngram` marks the appended nodes.
    """
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    node, agreed = 0, 0
    while agreed < len(chain):
        child = next((c for c in range(node + 1, len(tokens)) if parents[c] == node and tokens[c] == chain[agreed]),
                     None)
        if child is None:
            break
        node, agreed = child, agreed + 1
    rest = list(chain[agreed:])
    if not rest:
        return tree
    first = len(tokens)
    new_parents = [node] + list(range(first, first + len(rest) - 1))
    device = tree.tokens.device
    merged = build_tree(torch.tensor(tokens + rest, dtype=tree.tokens.dtype, device=device),
                        torch.tensor(parents + new_parents, dtype=tree.parents.dtype, device=device))
    old = tree.from_ngram if tree.from_ngram is not None else torch.zeros(len(tokens), dtype=torch.bool,
                                                                             device=device)
    merged.from_ngram = torch.cat([old, torch.ones(len(rest), dtype=torch.bool, device=device)])  # [N + len(rest)]
    if tree.proposals is not None:  # the chain's nodes are point masses beside sampled ones
        merged.proposals = tree.proposals.extended(len(rest))
    return merged


class NgramDrafter:
    """`method=ngram`: n-gram drafting alone (no head), through the same loop and verifier."""

    feature_layers: tuple[int, ...] = ()

    def __init__(self, proposer: NgramProposer):
        self.proposer = proposer

    def fork(self) -> NgramDrafter:
        return NgramDrafter(self.proposer)  # stateless today; a fresh one stays safe if that changes

    def reset(self) -> None:
        pass

    def draft(self, sequence: torch.Tensor, new_features: torch.Tensor, max_depth: int,
              sampling=None) -> DraftTree:
        """sampling: ignored; a chain copied from the context is a point mass, lossless at any temperature."""
        root = root_only_tree(int(sequence[-1]), sequence.device)
        if max_depth < 1:
            return root
        return merge_chain(root, self.proposer.propose(sequence)[:max_depth])
