"""`method=draft_model`: a small causal LM that shares the target's tokenizer drafts the tree.

The classic speculative decoding of Leviathan et al. and Chen et al., and what vLLM, SGLang and
Hugging Face's assisted generation call a draft model. It drafts EAGLE-2's dynamic tree from its
own log-probabilities (`tree.topk=1` makes a chain), with its own KV cache over the committed
tokens: each round it reads the tokens committed since the last round in one forward, then one
forward per tree level over the k frontier nodes (tree attention through its own 4-D mask, as the
target scores trees). Frontier entries are dropped at the start of the next round. The target
verifies with the same lossless rule as every other drafter, so the output is the target's,
whatever the draft model proposes.
"""

from __future__ import annotations

import copy

import torch

from eagle_lab.decoding.cache import cache_length, truncate
from eagle_lab.decoding.sampling import DraftSampling
from eagle_lab.decoding.tree import DraftTree, root_only_tree
from eagle_lab.drafters.growth import Candidates, TreeShape, grow_dynamic_tree
from eagle_lab.drafters.sampled import SUPPORT, grow_sampled_tree
from eagle_lab.errors import EagleLabError
from eagle_lab.models.masks import additive_mask, visibility
from eagle_lab.models.target import Target


def check_same_tokenizer(target: Target, draft: Target) -> None:
    """A draft model proposes token ids, so both must mean the same text by them."""
    target_vocab, draft_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        differ = sum(draft_vocab.get(token) != index for token, index in target_vocab.items())
        raise EagleLabError(f"draft model '{draft.name}' has another tokenizer than target '{target.name}' "
                            f"({len(draft_vocab)} vs {len(target_vocab)} tokens, {differ} of the target's differ): "
                            "a draft model must share the target's tokenizer")


class DraftModelDrafter:
    feature_layers: tuple[int, ...] = ()  # reads tokens only
    ngram = None  # no hybrid branches

    def __init__(self, model: Target, shape: TreeShape, vocab_size: int, draft_vocab: torch.Tensor | None = None,
                 sampled_drafts: bool = True):
        """draft_vocab: [Vd] target token ids the model drafts from (the draft vocabulary it was trained on,
        as EAGLE heads draft); None: the whole vocabulary. sampled_drafts: whether a draft() at T > 0 draws
        its tokens (else its top-k)."""
        self.model, self.shape, self.sampled_drafts = model, shape, sampled_drafts
        self.vocab_size = vocab_size  # the target's: padded embedding rows beyond it are never drafted
        self.draft_vocab = None if draft_vocab is None else draft_vocab.to(model.device).long()
        # [Vd, H] the LM-head rows a draft reads (a small draft model's LM head is most of its cost)
        self.rows = None if draft_vocab is None else model.lm_head.weight.index_select(0, self.draft_vocab)
        self.cache = model.new_cache()
        self.committed = 0  # tokens of the committed sequence in the draft model's cache
        self.last_candidates: Candidates | None = None

    def fork(self) -> DraftModelDrafter:
        """A drafter for another sequence: the draft model's weights shared, a cache of its own."""
        fork = copy.copy(self)
        fork.cache, fork.committed, fork.last_candidates = self.model.new_cache(), 0, None
        return fork

    def reset(self) -> None:
        self.cache = self.model.new_cache()
        self.committed = 0

    def feed(self, sequence: torch.Tensor, new_features: torch.Tensor | None = None) -> torch.Tensor:
        """Bring the cache up to the committed sequence -> [1, H] its feature after the last token."""
        truncate(self.cache, self.committed)  # forget last round's frontier entries
        new = sequence[self.committed:]  # [P] committed since the last round, the root last
        out = self.model.forward(new[None], self.cache)
        self.committed = sequence.numel()
        return out.features[0, -1:]

    def _top(self, features: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[R, H] -> the k best ([R, k] log-probabilities, [R, k] target token ids) of each row."""
        if self.rows is None:
            return self.model.logits(features)[:, : self.vocab_size].log_softmax(-1).topk(k)
        scores, ids = torch.nn.functional.linear(features, self.rows).float().log_softmax(-1).topk(k)  # over [Vd]
        return scores, self.draft_vocab[ids]

    @torch.no_grad()
    def draft(self, sequence: torch.Tensor, new_features: torch.Tensor, max_depth: int,
              sampling: DraftSampling | None = None) -> DraftTree:
        """sampling (T > 0): the tokens drawn from the model's distribution, on a spine (drafters/sampled.py)."""
        root = int(sequence[-1])
        depth = min(self.shape.depth, max_depth)
        if depth < 1 or self.shape.topk < 1 or self.shape.total_tokens < 1:
            return root_only_tree(root, sequence.device)
        if sampling is not None and self.sampled_drafts:
            return self._draft_sampled(sequence, depth, sampling)
        k = self.shape.topk
        scores, tokens = (row[0] for row in self._top(self.feed(sequence), k))  # [k] the root's children
        device, dtype = sequence.device, self.model.dtype

        def expand(level: int, frontier_tokens: torch.Tensor, rows: torch.Tensor | None, visible: torch.Tensor):
            past = cache_length(self.cache)  # committed + earlier levels' frontiers
            allowed = visibility([self.committed], [visible], k, past + k, self.committed)[0]  # [k, past + k]
            mask = additive_mask(allowed, dtype)
            positions = torch.full((1, k), self.committed + level - 1, device=device)
            out = self.model.forward(frontier_tokens[None], self.cache, positions,
                                     attention_mask=mask.view(1, 1, k, past + k))
            return self._top(out.features[0], k)  # [k, k] log-probs, target token ids

        tree, self.last_candidates = grow_dynamic_tree(root, scores, tokens, depth, self.shape.total_tokens, expand)
        return tree

    def _draft_sampled(self, sequence: torch.Tensor, depth: int, sampling: DraftSampling) -> DraftTree:
        """The spine: one forward of one row (the spine node) per level, each seeing the spine above it."""
        device = sequence.device
        support = min(SUPPORT, self.vocab_size if self.draft_vocab is None else self.draft_vocab.numel())
        logp, ids = (row[0] for row in self._top(self.feed(sequence), support))  # [S] each

        def expand(level: int, token: int) -> tuple[torch.Tensor, torch.Tensor]:
            positions = torch.full((1, 1), self.committed + level - 1, device=device)  # its ancestors are cached
            out = self.model.forward(torch.tensor([[token]], device=device), self.cache, positions)
            scores, tokens = self._top(out.features[0], support)
            return scores[0], tokens[0]

        self.last_candidates = None
        return grow_sampled_tree(int(sequence[-1]), logp, ids, depth, self.shape.topk, self.shape.total_tokens,
                                 sampling, expand)
