"""A preallocated KV cache for the target, written in place (Hugging Face's `StaticCache`).

Every layer holds [R, kvH, capacity, D] tensors at fixed addresses, which is what lets a
compiled forward (and a captured CUDA graph) reuse one graph round after round. R is 1 for
one sequence; the server keeps one row per sequence it decodes (static_rows.py). The cache
writes each forward's K/V at its own counter (`cumulative_length`), the same positions in
every row; this module owns that counter: `set_length` sets it before each forward, and
`keep_accepted` moves a verified tree path in place right after a row's committed prefix. Entries past a
row's committed length are stale and stay hidden by the attention mask until overwritten.

`view(rows, length)` is a cache over the first `rows` rows (or one row) and the first
`length` positions that shares this one's storage: a forward over fewer rows, or over a
shorter prefix (attention reads every position it is given), writes straight into it.
"""

from __future__ import annotations

import torch
from transformers import StaticCache

from eagle_lab.decoding.cache import move_row_entries
from eagle_lab.models.masks import cache_config

EAGER_BLOCK = 16  # positions an eager forward's attended length is rounded to (views of that length are kept)


def _kv_shape(config) -> tuple[int, int]:
    """(key/value heads, head dim) of a decoder config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv_heads, head_dim


def _as_graph_inputs(hf_cache: StaticCache) -> None:
    """Hugging Face marks a static cache's tensors (keys, values, write counter) as static addresses, for
    CUDA graphs. On CPU, inductor's freezing then builds such tensors into a graph like weights, and dynamo
    does not guard their identity: another cache of the same shape would run that graph on the first cache's
    tensors. On CPU they stay ordinary graph inputs (a graph per shape serves every cache); CUDA keeps the
    marks."""
    for layer in hf_cache.layers:
        for name in ("keys", "values", "cumulative_length"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                tensor.__dict__.pop("_dynamo_static_input_type", None)


def _shared_counters(hf_cache: StaticCache) -> torch.Tensor | None:
    """On CPU, every layer's write counter becomes one element of a single tensor [layers], so that setting
    them all is one kernel, not one per layer (a decoding step sets them once, and a fill per layer costs a
    small model's step more than one fill). Each layer still adds to its own element in place, so nothing
    is shared but the storage. CUDA keeps Hugging Face's own counters (marked static for CUDA graphs).
    -> the shared tensor, or None where the counters stay apart."""
    layers = hf_cache.layers
    if not layers or any(layer.cumulative_length.device.type != "cpu" for layer in layers):
        return None
    counters = torch.zeros(len(layers), dtype=layers[0].cumulative_length.dtype)
    for index, layer in enumerate(layers):
        counters[index] = layer.cumulative_length
        layer.cumulative_length = counters[index]  # a 0-d view, like the tensor it replaces
    return counters


def _stacked_storage(hf_cache: StaticCache) -> tuple[torch.Tensor, torch.Tensor] | None:
    """On CPU, every layer's keys (and values) become one slice of a single tensor [layers, R, kvH, capacity + 1, D],
    so that moving a round's accepted entries, or a row, is one copy for all layers, not one per layer tensor (60
    on SmolLM2, each a small kernel launch on a CPU). Each layer's tensor keeps its shape [R, kvH, capacity, D].
    The one spare position, never read or written, keeps every view of a layer (any rows, any attended length,
    the whole capacity included) laid out alike: a compiled step exported over a dynamic attended length
    (compiled.py) would otherwise tell the whole capacity apart, the one length whose view is contiguous. CUDA
    keeps Hugging Face's own tensors (marked static for CUDA graphs). -> (keys, values) stacked, or None where
    the layers differ in shape or stay apart."""
    layers = hf_cache.layers
    if not layers or any(layer.keys.device.type != "cpu" for layer in layers):
        return None
    first = layers[0]
    if any(layer.keys.shape != first.keys.shape or layer.values.shape != first.values.shape
           or layer.keys.dtype != first.keys.dtype for layer in layers):
        return None
    rows, kv_heads, capacity, head_dim = first.keys.shape
    spare = (len(layers), rows, kv_heads, capacity + 1)
    keys = torch.zeros((*spare, head_dim), dtype=first.keys.dtype)
    values = torch.zeros((*spare, first.values.shape[-1]), dtype=first.values.dtype)
    for index, layer in enumerate(layers):
        layer.keys, layer.values = keys[index, :, :, :capacity], values[index, :, :, :capacity]
    return keys[..., :capacity, :], values[..., :capacity, :]


class StaticKVCache:
    def __init__(self, config, capacity: int, device: torch.device, dtype: torch.dtype, rows: int = 1,
                 hf_cache: StaticCache | None = None,
                 stacked: tuple[torch.Tensor, torch.Tensor] | None = None, storage_capacity: int | None = None):
        """hf_cache: the layers of a view (view()), with `stacked` its slice of the owner's stacked storage and
        storage_capacity the owner's capacity (the longest view of that storage)."""
        self.capacity, self.rows = capacity, rows
        self.storage_capacity = capacity if storage_capacity is None else storage_capacity
        config = cache_config(config)  # every layer keeps every position; a sliding window is the masks' work
        self.config, self.device, self.dtype = config, device, dtype
        self.hf_cache = hf_cache if hf_cache is not None else StaticCache(config=config, max_cache_len=capacity)
        if hf_cache is None:  # allocated up front, so that views can be taken before the first forward
            kv_heads, head_dim = _kv_shape(config)
            self.hf_cache.early_initialization(rows, kv_heads, head_dim, dtype, device)
            stacked = _stacked_storage(self.hf_cache)
        self._stacked = stacked  # [layers, R, kvH, capacity, D] keys and values, or None: per layer
        _as_graph_inputs(self.hf_cache)
        self._counters = _shared_counters(self.hf_cache)
        self._views: dict[tuple[int, int, int], StaticKVCache] = {}

    @property
    def layers(self):
        return self.hf_cache.layers

    @property
    def initialised(self) -> bool:
        return all(getattr(layer, "is_initialized", False) for layer in self.layers)

    def set_length(self, length: int) -> None:
        """The next forward writes its K/V from position `length` on (in every row)."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"cache length {length} outside [0, {self.capacity}]")
        if self._counters is not None:
            self._counters.fill_(length)
            return
        for layer in self.layers:
            layer.cumulative_length.fill_(length)

    def eager_prefix(self, start: int, rows: int, needed: int) -> StaticKVCache:
        """A view over little more than `needed` positions, for an eager forward (a prefill): attention then
        reads the prompt, not the whole capacity (over the whole cache a short prefill is markedly slower)."""
        return self.view(start, rows, min(self.capacity, -(-needed // EAGER_BLOCK) * EAGER_BLOCK))

    def view(self, start: int, rows: int, length: int) -> StaticKVCache:
        """Rows [start, start + rows) and positions [0, length) of this cache, sharing its storage (the cache
        itself when that is all of it)."""
        if (start, rows, length) == (0, self.rows, self.capacity):
            return self
        if not self.initialised:
            raise ValueError("a view of a cache that no forward has allocated")
        key = (start, rows, length)
        if key not in self._views:
            hf_view = StaticCache(config=self.config, max_cache_len=length)
            for own, layer in zip(self.layers, hf_view.layers):
                layer.lazy_initialization(own.keys[:1, :, :1], own.values[:1, :, :1])  # sets dtype, device, heads
                layer.keys = own.keys[start:start + rows, :, :length]  # [rows, kvH, length, D], a view
                layer.values = own.values[start:start + rows, :, :length]
                layer.batch_size = rows
                if self.device.type == "cuda":
                    torch._dynamo.mark_static_address(layer.keys)
                    torch._dynamo.mark_static_address(layer.values)
            stacked = None if self._stacked is None else tuple(t[:, start:start + rows, :, :length]
                                                               for t in self._stacked)
            self._views[key] = StaticKVCache(self.config, length, self.device, self.dtype, rows, hf_cache=hf_view,
                                             stacked=stacked, storage_capacity=self.storage_capacity)
        return self._views[key]

    def keep_accepted(self, past: int, accepted: torch.Tensor, row: int = 0, scored_at: int | None = None) -> None:
        """Keep row `row`'s positions [0, past) plus its scored entries at scored_at + accepted (node
        indices in path order; scored_at defaults to past), in place.

        accepted: [L] int64, accepted[0] = 0 (the root). The accepted entries move to
        past .. past + L - 1. The write counter is left alone: every forward sets it first (set_length), and
        30-odd counters cost a fill each."""
        scored_at = past if scored_at is None else scored_at
        count = accepted.numel()
        contiguous = scored_at == past and accepted.tolist() == list(range(count))  # a chain: nothing moves
        if not contiguous:
            source = accepted.to(self.device) + scored_at  # [L]
            if self._stacked is not None:
                for tensor in self._stacked:  # [layers, R, kvH, capacity, D]: every layer in one copy
                    tensor[:, row, :, past:past + count] = tensor[:, row].index_select(2, source)
                return
            for layer in self.layers:
                if layer.is_initialized:
                    move_row_entries((layer.keys, layer.values), row, source, past)  # [R, kvH, capacity, D]

    def move_entries(self, rows: torch.Tensor, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """rows, sources, targets: [n] int64: entry sources[i] of row rows[i] is copied to targets[i] (one copy
        per layer tensor for every row, where keep_accepted takes one per row)."""
        if self._stacked is not None:
            for tensor in self._stacked:  # [layers, R, kvH, capacity, D]
                tensor[:, rows, :, targets] = tensor[:, rows, :, sources]  # [n, layers, kvH, D]
            return
        for layer in self.layers:
            for tensor in (layer.keys, layer.values):  # [R, kvH, capacity, D]
                tensor[rows, :, targets] = tensor[rows, :, sources]  # [n, kvH, D]

    def move_row(self, source: int, target: int, length: int) -> None:
        """Copy row `source`'s first `length` positions into row `target` (packing the rows in use)."""
        if self._stacked is not None:
            for tensor in self._stacked:
                tensor[:, target, :, :length] = tensor[:, source, :, :length]
            return
        for layer in self.layers:
            for tensor in (layer.keys, layer.values):
                tensor[target, :, :length] = tensor[source, :, :length]
