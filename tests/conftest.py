"""Shared fixtures: tiny targets and reference drafters whose quality we control."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from eagle_lab.decoding.tree import DraftTree, build_tree, root_only_tree
from eagle_lab.models.target import Target, TargetConfig, load_target
from eagle_lab.models.tiny import TinyModelConfig, build_tiny_model, byte_tokenizer

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
FAMILIES = ("llama", "qwen2", "mistral")


@pytest.fixture(autouse=True)
def collectable_heap():
    """Serving code exempts what it loaded from garbage collection (decoding/gc_freeze.py); in one test process
    that would keep every earlier test's objects out of the collector's reach, so each test ends with the
    exemption lifted."""
    yield
    gc.unfreeze()


@pytest.fixture(scope="session", params=FAMILIES)
def tiny_target(request) -> Target:
    return load_target(TargetConfig(name=f"tiny_{request.param}", source="tiny",
                                    tiny=TinyModelConfig(family=request.param), device="cpu"))


@pytest.fixture(scope="session")
def tiny_llama() -> Target:
    return load_target(TargetConfig(name="tiny_llama", source="tiny", device="cpu"))


def small_vocab_target(vocab_size: int = 5, seed: int = 3, init_std: float = 0.35, family: str = "llama",
                       sliding_window: int = 0) -> Target:
    """A tiny target over a handful of tokens, so exact sequence probabilities can be enumerated
    (and its greedy output repeats itself, so n-gram drafts get accepted)."""
    model = build_tiny_model(TinyModelConfig(family=family, hidden_size=32, intermediate_size=64, init_std=init_std,
                                             seed=seed, sliding_window=sliding_window), vocab_size=vocab_size)
    return Target(model, byte_tokenizer(), name="small_vocab")


class OracleDrafter:
    """Drafts the target's own greedy continuation (plus one wrong sibling per level).

    Almost every draft is accepted under greedy verification, so multi-token acceptance and
    cache compaction are exercised; the siblings make the tree branch.
    """

    def __init__(self, target: Target, depth: int = 4, wrong_siblings: bool = True):
        self.target, self.depth, self.wrong_siblings = target, depth, wrong_siblings

    def reset(self) -> None:
        pass

    @torch.no_grad()
    def draft(self, sequence: torch.Tensor, new_features: torch.Tensor, max_depth: int,
              sampling=None) -> DraftTree:
        depth = min(self.depth, max_depth)
        if depth < 1:
            return root_only_tree(int(sequence[-1]), sequence.device)
        context = sequence.clone()
        tokens, parents = [int(sequence[-1])], [-1]
        chain_parent = 0
        for _ in range(depth):
            logits = self.target.logits(self.target.forward(context[None]).features[0, -1])  # [V]
            best = int(logits.argmax())
            tokens.append(best)
            parents.append(chain_parent)
            chain_parent = len(tokens) - 1
            if self.wrong_siblings:
                tokens.append(int(logits.argsort(descending=True)[1]))
                parents.append(parents[-1])
            context = torch.cat([context, torch.tensor([best], device=context.device)])
        return build_tree(torch.tensor(tokens, device=sequence.device), torch.tensor(parents, device=sequence.device))


class NoisyDrafter:
    """Top-k children from a perturbed copy of the target's distribution, to a fixed depth.

    The draft agrees with the target often but not always, and every node has several
    siblings: the regime where a wrong acceptance rule would show.
    """

    def __init__(self, target: Target, depth: int = 2, topk: int = 2, noise: float = 1.0, seed: int = 0):
        self.target, self.depth, self.topk, self.noise = target, depth, topk, noise
        self.generator = torch.Generator().manual_seed(seed)
        self._logits: dict[tuple, torch.Tensor] = {}  # the target is deterministic: memoise it

    def _target_logits(self, context: torch.Tensor) -> torch.Tensor:
        key = tuple(context.tolist())
        if key not in self._logits:
            self._logits[key] = self.target.logits(self.target.forward(context[None]).features[0, -1])  # [V]
        return self._logits[key]

    def reset(self) -> None:
        pass

    @torch.no_grad()
    def draft(self, sequence: torch.Tensor, new_features: torch.Tensor, max_depth: int,
              sampling=None) -> DraftTree:
        depth = min(self.depth, max_depth)
        tokens, parents, paths = [int(sequence[-1])], [-1], [[]]
        frontier = [0]
        for _ in range(depth):
            next_frontier = []
            for node in frontier:
                context = torch.cat([sequence, torch.tensor(paths[node], dtype=torch.long)])
                logits = self._target_logits(context)
                noisy = logits + self.noise * torch.randn(logits.shape, generator=self.generator)
                for token in noisy.topk(self.topk).indices.tolist():
                    tokens.append(token)
                    parents.append(node)
                    paths.append(paths[node] + [token])
                    next_frontier.append(len(tokens) - 1)
            frontier = next_frontier
        return build_tree(torch.tensor(tokens), torch.tensor(parents))


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` run only where a CUDA device exists."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
