"""A preallocated KV cache for the target, written in place (Hugging Face's `StaticCache`).

Every layer holds [B, kvH, capacity, D] tensors at fixed addresses, which is what lets a
compiled forward (and a captured CUDA graph) reuse one graph round after round. The cache
writes each forward's K/V at its own counter (`cumulative_length`); this module owns that
counter: `set_length` rewinds it, and `keep_accepted` moves a verified tree path in place
right after the committed prefix. Entries past the committed length are stale and stay
hidden by the attention mask (eagle_lab/decoding/scoring.py) until they are overwritten.
"""

from __future__ import annotations

import torch
from transformers import StaticCache

from eagle_lab.errors import EagleLabError


class StaticKVCache:
    def __init__(self, config, capacity: int, device: torch.device, dtype: torch.dtype):
        self.capacity = capacity
        self.hf_cache = StaticCache(config=config, max_cache_len=capacity)
        for layer in self.hf_cache.layers:
            if getattr(layer, "is_sliding", False):
                raise EagleLabError("sliding-window attention layers are not supported by the static cache; "
                                    "use compile=false (the dynamic cache)")
        self.device, self.dtype = device, dtype

    @property
    def layers(self):
        return self.hf_cache.layers

    @property
    def initialised(self) -> bool:
        return all(getattr(layer, "is_initialized", False) for layer in self.layers)

    def set_length(self, length: int) -> None:
        """The next forward writes its K/V from position `length` on."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"cache length {length} outside [0, {self.capacity}]")
        for layer in self.layers:
            layer.cumulative_length.fill_(length)

    def keep_accepted(self, past: int, accepted: torch.Tensor) -> None:
        """Keep positions [0, past) plus past + accepted (node indices in path order), in place.

        accepted: [L] int64, accepted[0] = 0 (the root). The accepted entries move to
        past .. past + L - 1; the counter is set to past + L."""
        count = accepted.numel()
        contiguous = bool((accepted == torch.arange(count, device=accepted.device)).all())
        if not contiguous:
            source = accepted.to(self.device) + past  # [L]
            for layer in self.layers:
                if not layer.is_initialized:
                    continue
                # keys/values: [B, kvH, capacity, D]; index_select copies, so source and target may overlap
                layer.keys[:, :, past:past + count] = layer.keys.index_select(2, source)
                layer.values[:, :, past:past + count] = layer.values.index_select(2, source)
        self.set_length(past + count)
