"""The target's step as it is exported and compiled: what a target-step package is built from.

Only this module (with the layers' kernels and attention) goes into a package's key, so changes to the code
that calls the packages (eagle_lab/decoding/compiled.py) leave the packages built on a machine valid.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import StaticCache

from eagle_lab.models.target import Target


class Step(nn.Module):
    """backbone + LM head over R rows of K tokens after the cached prefix; the unit that is compiled."""

    def __init__(self, target: Target):
        super().__init__()
        self.backbone, self.lm_head = target.backbone, target.lm_head
        self.cache_kwarg = target._cache_kwarg

    def hidden(self, cache, input_ids, positions, mask, layer_ids: tuple[int, ...]):
        out = self.backbone(input_ids=input_ids, position_ids=positions, attention_mask=mask, use_cache=True,
                            output_hidden_states=bool(layer_ids), **{self.cache_kwarg: cache})
        layers = None
        if layer_ids:
            layers = torch.cat([out.hidden_states[i] for i in layer_ids], dim=-1)  # [R, K, n*H]
        return out.last_hidden_state, layers  # [R, K, H]

    def forward(self, cache, input_ids, positions, mask, layer_ids: tuple[int, ...]):
        hidden, layers = self.hidden(cache, input_ids, positions, mask, layer_ids)
        return hidden, layers, self.lm_head(hidden).float()  # logits [R, K, V]


class FlatStep(nn.Module):
    """`Step` over a static cache's tensors passed as plain inputs (what torch.export takes): per layer
    (keys [R, kvH, L, D], values, write counter []), all written in place. A private Hugging Face cache
    object carries them into the model's code."""

    def __init__(self, step: Step, cache, layer_ids: tuple[int, ...]):
        super().__init__()
        self.step, self.layer_ids = step, layer_ids
        self.carrier = StaticCache(config=cache.config, max_cache_len=cache.capacity)
        for own, layer in zip(cache.layers, self.carrier.layers):
            layer.lazy_initialization(own.keys[:1, :, :1], own.values[:1, :, :1])  # dtype, device, heads
            layer.batch_size = cache.rows

    def forward(self, input_ids, positions, mask, kv):
        for layer, (keys, values, written) in zip(self.carrier.layers, kv):
            layer.keys, layer.values, layer.cumulative_length = keys, values, written
        hidden, layers, logits = self.step(self.carrier, input_ids, positions, mask, self.layer_ids)
        return (hidden, logits) if layers is None else (hidden, layers, logits)


def cache_inputs(cache) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A static cache's tensors as FlatStep takes them: per layer (keys, values, write counter)."""
    return [(layer.keys, layer.values, layer.cumulative_length) for layer in cache.layers]
