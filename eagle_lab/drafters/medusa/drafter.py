"""`method=medusa`: Medusa heads draft the tree; the target verifies it losslessly.

Each round the heads read the target's feature of the last committed token (the one that chose
the root) and give, for depth d, head d's top-k tokens. The tree grows as EAGLE-2's dynamic tree
(`draft.grow_dynamic_tree`), except that a node's children do not depend on the node: every
frontier node at depth d gets head d+1's top-k. Verification is the exact rejection rule of every
other drafter, not Medusa's typical acceptance, so the output is the target's.
"""

from __future__ import annotations

import copy

import torch

from eagle_lab.decoding.sampling import DraftSampling
from eagle_lab.decoding.tree import DraftTree, root_only_tree
from eagle_lab.drafters.eagle.head import draft_lm_head_weight
from eagle_lab.drafters.growth import Candidates, TreeShape, grow_dynamic_tree
from eagle_lab.drafters.medusa.heads import MedusaHeads
from eagle_lab.drafters.sampled import SUPPORT, grow_sampled_tree
from eagle_lab.models.target import Target


class MedusaDrafter:
    feature_layers: tuple[int, ...] = ()  # reads the top feature
    ngram = None

    def __init__(self, heads: MedusaHeads, target: Target, shape: TreeShape, sampled_drafts: bool = True):
        """sampled_drafts: whether a draft() at T > 0 draws its tokens (else its heads' top-k)."""
        self.heads, self.target, self.sampled_drafts = heads.eval(), target, sampled_drafts
        # no deeper than there are heads
        self.shape = TreeShape(min(shape.depth, self.heads.arch.num_heads), shape.topk, shape.total_tokens)
        self.rows = draft_lm_head_weight(heads, target)  # [Vd, H] the target's LM-head rows
        self.last_candidates: Candidates | None = None

    def fork(self) -> MedusaDrafter:
        """A drafter for another sequence (no state between rounds but its last candidates)."""
        fork = copy.copy(self)
        fork.last_candidates = None
        return fork

    def reset(self) -> None:
        pass  # no state between rounds: the heads read the newest target feature only

    @torch.no_grad()
    def draft(self, sequence: torch.Tensor, new_features: torch.Tensor, max_depth: int,
              sampling: DraftSampling | None = None) -> DraftTree:
        """sampling (T > 0): each depth's tokens drawn from its head's distribution, on a spine
        (drafters/sampled.py)."""
        root = int(sequence[-1])
        depth = min(self.shape.depth, max_depth)
        if depth < 1 or self.shape.topk < 1 or self.shape.total_tokens < 1:
            return root_only_tree(root, sequence.device)
        k = min(self.shape.topk, self.rows.shape[0])
        feature = new_features[-1:].to(self.rows.dtype)  # [1, H] the feature that chose the root
        outputs = self.heads(feature)[:depth]  # per depth [1, H]
        logp = torch.cat([self.heads.draft_logits(h, self.heads.head_rows(i, self.rows))
                          for i, h in enumerate(outputs)]).float().log_softmax(-1)  # [D, Vd]
        if sampling is not None and self.sampled_drafts:  # head d guesses depth d whatever came before: one q
            support_logp, support_ids = logp.topk(min(SUPPORT, logp.shape[-1]), dim=-1)  # [D, S]
            support = self.heads.draft_to_target[support_ids]  # [D, S]
            self.last_candidates = None
            return grow_sampled_tree(root, support_logp[0], support[0], depth, k, self.shape.total_tokens, sampling,
                                     lambda level, token: (support_logp[level], support[level]))
        top_logp, top_ids = logp.topk(k, dim=-1)  # [D, k]
        top_tokens = self.heads.draft_to_target[top_ids]  # [D, k] target token ids

        def expand(level: int, frontier_tokens: torch.Tensor, rows: torch.Tensor | None, visible: torch.Tensor):
            return top_logp[level].expand(k, k), top_tokens[level].expand(k, k)  # the same children for every node

        tree, self.last_candidates = grow_dynamic_tree(root, top_logp[0], top_tokens[0], depth,
                                                       self.shape.total_tokens, expand)
        return tree
