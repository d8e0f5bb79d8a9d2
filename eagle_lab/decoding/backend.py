"""Decoding backends: where a sequence's target state lives and how a round's forward runs.

  EagerBackend    Hugging Face DynamicCache, eager forwards (compile=false). Works for every
                  family and attention kind; the reference the static path is tested against.
  StaticBackend   one preallocated cache per capacity and a fixed-shape step (compiled.py),
                  compiled (compile=true) or eager.

`build_backend` turns compile=auto|true|false into one of them (auto: compile where it
measured faster on this device; the verdict is cached, see compiled.choose).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch

from eagle_lab.decoding.compiled import StepCompiler, can_compile, choose, doubling_lengths
from eagle_lab.decoding.graph_store import GraphStore
from eagle_lab.decoding.scoring import DynamicScorer, Scorer
from eagle_lab.decoding.static_cache import EAGER_BLOCK, StaticKVCache
from eagle_lab.decoding.static_rows import RowScorer, StaticRows
from eagle_lab.errors import EagleLabError
from eagle_lab.models.masks import Mask, causal_mask, contiguous, visibility
from eagle_lab.models.target import Target

log = logging.getLogger(__name__)
COMPILE_CHOICES = ("auto", "true", "false")
SLACK = 128  # tokens a static cache keeps free past the committed length: the largest tree it takes


@dataclass
class DecodingConfig:
    """How the target runs (the top-level `compile=auto|true|false` says whether it is compiled).

    buckets: tokens per static forward; a round's N tokens run in the smallest bucket >= N, padded,
    so a few graphs serve every tree size (a larger tree gets the next power of two, compiled then).
    Every size up to 4 has its own: on a CPU each scored token costs (docs/benchmarks.md), and the small trees
    that pay there would pay less padded to 4.
    cache_block: static caches are sized in multiples of this many tokens.
    min_attended_length: a CUDA graph attends over the first L positions of its cache, L the smallest of
    this length, its doublings and the cache's capacity that holds the step's tokens; each L is a graph
    (compiled when first needed, or all at a shape's first step: StaticBackend's compile_ahead).
    Attention reads every position it is given, masked or not, so a step over a larger cache costs more.
    0: the whole cache. On CPU a package's attended length is dynamic: it reads the positions in use,
    rounded up to 16, and this setting does not apply.
    cache_capacity: a single sequence's static cache holds at least this many positions (more when its
    prompt and max_new_tokens need it), so that sequences of different lengths share graphs: a graph is
    specialised on the strides of the cache it writes, which follow the capacity. The default is a server
    row's (server.context 2048 plus the slack, in blocks of 512), so that a single sequence's steps and the
    server's one-row steps are the same packages.
    frozen_weights: on CPU, compile the target step with its weights frozen and prepacked into each graph
    (graph_store.py): faster where inductor's C++ GEMM template beats MKL at a few rows, at the cost of
    the weights' size on disk per graph and minutes of autotuning per graph.
    compile_min_tokens: compile=auto builds missing graphs only when the run will decode at least this many
    tokens (prompts x max_new_tokens; the bench and the server always qualify); a shorter run uses the graphs
    already built on this machine (`python -m eagle_lab.compile`) and runs the other shapes eagerly."""

    buckets: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 8, 16])
    cache_block: int = 512
    min_attended_length: int = 256
    cache_capacity: int = 2560
    compile_min_tokens: int = 2048
    frozen_weights: bool = False


class Backend(Protocol):
    name: str

    def open(self, prompt_tokens: int, max_new_tokens: int, layer_ids: tuple[int, ...] = ()) -> Scorer: ...

    def reserve(self, prompt_tokens: int, max_new_tokens: int) -> None: ...


class EagerBackend:
    name = "eager"

    def __init__(self, target: Target):
        self.target = target

    def open(self, prompt_tokens: int, max_new_tokens: int, layer_ids: tuple[int, ...] = ()) -> Scorer:
        return DynamicScorer(self.target, layer_ids)

    def reserve(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Nothing to size: a dynamic cache grows."""


class StaticBackend:
    """Static caches and the fixed-shape target step (compiled or eager) for one target."""

    def __init__(self, target: Target, buckets: list[int], cache_block: int = 512, compiled: bool = False,
                 per_shape: bool = False, min_attended_length: int = 256, compile_ahead: bool = False,
                 build: bool = True, cache_capacity: int = 0, frozen_weights: bool = False):
        """per_shape: compile=auto's choice, made again for every step shape (compiled.StepCompiler).
        min_attended_length: see DecodingConfig. compile_ahead: a step shape's first step compiles it for
        every attended length of its cache (a bench: no compile may fall inside a timed run); otherwise each
        length compiles when a step first needs it (a sequence that stays short pays for one).
        build: whether missing graphs are compiled here (else those shapes run eagerly). cache_capacity: see
        DecodingConfig."""
        if not buckets or any(b < 1 for b in buckets):
            raise EagleLabError(f"decoding.buckets must be positive token counts, got {list(buckets)}")
        if cache_block < 1:
            raise EagleLabError(f"decoding.cache_block must be >= 1, got {cache_block}")
        if min_attended_length < 0:
            raise EagleLabError(f"decoding.min_attended_length must be >= 0, got {min_attended_length}")
        self.target = target
        self.buckets = sorted(set(int(b) for b in buckets))
        self.slack = max(SLACK, self.buckets[-1])  # cache room kept free past the committed length
        self.cache_block = cache_block
        self.min_attended_length = min_attended_length
        self.compile_ahead = compile_ahead
        self.compiled, self.build = compiled, build
        self.name = "compiled" if compiled else "static"
        self._caches: dict[int, StaticKVCache] = {}
        # every sequence gets at least this much cache (reserve() raises it), so one graph serves all
        self.min_capacity = self._round_capacity(cache_capacity) if cache_capacity else 0
        self._steps = StepCompiler(target, compiled, per_shape, build=build, store=GraphStore(frozen=frozen_weights))
        self.packages = self._steps.packages  # compiled graphs kept on disk (CPU)
        self._every_length_compiled: set[tuple] = set()  # (cache capacity and strides, rows, tokens, layer_ids)

    def stop_building(self) -> None:
        """From now on a step whose graph is missing runs eagerly instead of compiling (a server that is
        listening: no request waits for a compile)."""
        self.build = self._steps.build = False

    def open(self, prompt_tokens: int, max_new_tokens: int, layer_ids: tuple[int, ...] = ()) -> Scorer:
        capacity = max(self._round_capacity(prompt_tokens + max_new_tokens + self.slack), self.min_capacity)
        rows = StaticRows(self, 1, capacity, cache=self.cache_for(capacity))  # one row: the batch path at B = 1
        return RowScorer(rows, layer_ids)

    def _round_capacity(self, need: int) -> int:
        """`need` positions rounded up to a block, at most the target's context plus the slack."""
        limit = self.target.max_context + self.slack
        return -(-min(need, limit) // self.cache_block) * self.cache_block

    def reserve(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Size every later sequence's cache for the longest prompt known in advance (a bench, a prompts file):
        each cache size is a graph of its own, compiled on first use, which must not fall inside a timed run."""
        need = min(prompt_tokens + max_new_tokens, self.target.max_context) + self.slack
        self.min_capacity = max(self.min_capacity, -(-need // self.cache_block) * self.cache_block)

    def cache_for(self, capacity: int) -> StaticKVCache:
        """One cache per capacity, reused by every sequence (batch 1 decodes one sequence at a time)."""
        if capacity not in self._caches:
            self._caches[capacity] = StaticKVCache(self.target.config, capacity, self.target.device,
                                                   self.target.dtype)
        return self._caches[capacity]

    def bucket(self, count: int) -> int:
        """The forward size for `count` tokens; past the configured buckets, the next power of two."""
        for size in self.buckets:
            if size >= count:
                return size
        size = 1 << (count - 1).bit_length()
        if size > self.slack:
            raise EagleLabError(f"a round of {count} tokens is larger than the static cache's slack ({self.slack}); "
                                f"put a bucket >= {count} in decoding.buckets")
        self.buckets.append(size)
        return size

    def runs_eager(self, rows: int, tokens: int, layer_ids: tuple[int, ...] = ()) -> bool:
        """Whether a step of this shape runs eagerly (no graph: it may attend over any length)."""
        return self._steps.runs_eager(rows, tokens, layer_ids)

    def has_graphs(self) -> bool:
        """Whether compiled graphs of this target's plain step were built on this machine (loaded, not built)."""
        return self._steps.has_graphs(self.cache_for(max(self.min_capacity, self.cache_block)))

    def mask(self, allowed: torch.Tensor, past: int, capacity: int, positions: torch.Tensor) -> Mask:
        """allowed: [K, K] bool among K new tokens written at slots past .. past + K - 1 of each of R rows, at
        positions [R, K] -> additive [R, 1, K, capacity] (per layer type where they mix): the prefix [0, past)
        is visible to all, stale entries past past + K are hidden."""
        k, rows = allowed.shape[0], positions.shape[0]
        full = visibility([past] * rows, [allowed] * rows, k, capacity, past)  # [R, K, L]
        return self.target.layout.masks(full, positions, past, self.target.dtype)

    def prefill(self, cache: StaticKVCache, row: int, prompt_ids: torch.Tensor, layer_ids: tuple[int, ...]):
        """prompt_ids: [T] into row `row` of the cache from position 0, eagerly (prompt lengths vary), over a
        view of about the prompt's length, so attention reads the prompt, not the whole capacity.
        -> hidden [1, T, H], layers [1, T, F] or None. The caller sets the cache's length."""
        count = prompt_ids.numel()
        view = cache.eager_prefix(row, 1, count)
        view.set_length(0)
        causal = causal_mask(count, prompt_ids.device)  # [T, T]
        positions = torch.arange(count, device=prompt_ids.device)[None]  # [1, T]
        mask = self.mask(causal, 0, view.capacity, positions)  # [1, 1, T, L]
        return self._steps.backbone(view, prompt_ids[None], positions, mask, layer_ids)

    def attended_lengths(self, capacity: int) -> list[int]:
        """The lengths a compiled step over a cache of `capacity` is built for: on CPU one package serves every
        length (built at the capacity); on CUDA each of these lengths is a graph."""
        return [capacity] if self.packages else doubling_lengths(self.min_attended_length, capacity)

    def attended_length(self, needed: int, capacity: int, rows: int, tokens: int,
                        layer_ids: tuple[int, ...] = ()) -> int:
        """Positions a step of `rows` x `tokens` attends over when the last position it writes is needed - 1:
        little more than `needed` eagerly and from a package (its attended length is dynamic), one of
        `attended_lengths` for a CUDA graph."""
        if self.packages or self.runs_eager(rows, tokens, tuple(layer_ids)):
            return min(capacity, -(-needed // EAGER_BLOCK) * EAGER_BLOCK)
        return next(length for length in self.attended_lengths(capacity) if length >= needed)

    def step(self, cache: StaticKVCache, start: int, length: int, input_ids, positions, mask, layer_ids):
        """input_ids, positions: [R, K] written at positions start .. start + K - 1 of the cache's first R rows,
        attending over its first `length` positions; mask [R, 1, K, length] additive
        -> hidden [R, K, H], layers [R, K, F] or None, logits [R, K, V]."""
        rows, tokens = input_ids.shape
        layer_ids = tuple(layer_ids)
        if self.compile_ahead and self.compiled and not self.runs_eager(rows, tokens, layer_ids):
            self.compile_shape(cache, rows, tokens, layer_ids)
        view = cache.view(0, rows, length)
        view.set_length(start)
        return self._steps.run(view, input_ids, positions, mask, layer_ids)

    def _last_positions_step(self, cache: StaticKVCache, rows: int, tokens: int, length: int):
        """A step of rows x tokens over the first `length` positions of `cache` that writes its last ones
        -> (view, start, input_ids [R, K], positions [R, K], mask [R, 1, K, L])."""
        device = cache.device
        start = length - tokens
        positions = torch.arange(start, length, device=device).repeat(rows, 1)  # [R, K]
        mask = self.mask(causal_mask(tokens, device), start, length, positions)  # [R, 1, K, L]
        input_ids = torch.zeros(rows, tokens, dtype=torch.long, device=device)
        return cache.view(0, rows, length), start, input_ids, positions, mask

    def has_package(self, capacity: int, rows: int, tokens: int, layer_ids: tuple[int, ...] = ()) -> bool:
        """Whether the package of rows x tokens over a cache of `capacity` positions is on disk here (CPU)."""
        if not self.packages:
            return False
        cache = StaticKVCache(self.target.config, capacity, self.target.device, self.target.dtype, rows=rows)
        view, _, input_ids, positions, mask = self._last_positions_step(cache, rows, tokens, capacity)
        return self._steps.has_package(view, input_ids, positions, contiguous(mask), tuple(layer_ids))

    def compile_shape(self, cache: StaticKVCache, rows: int, tokens: int, layer_ids: tuple[int, ...] = ()) -> None:
        """At a step shape's first use on a cache, compile it for every attended length, so that no compile
        falls inside a later round (a timed one, a request's). Each length's graph is called once on the
        cache's own storage; the positions it writes are restored."""
        key = (cache.capacity, cache.layers[0].keys.stride(), rows, tokens, layer_ids)
        if key in self._every_length_compiled:
            return
        self._every_length_compiled.add(key)
        for length in self.attended_lengths(cache.capacity):
            if length < tokens:
                continue
            view, start, input_ids, positions, mask = self._last_positions_step(cache, rows, tokens, length)
            tensors = [tensor for layer in view.layers for tensor in (layer.keys, layer.values)]  # [R, kvH, L, D]
            saved = [tensor[:, :, start:].clone() for tensor in tensors]  # what the dummy step overwrites
            view.set_length(start)
            self._steps.run(view, input_ids, positions, mask, layer_ids)
            for tensor, kept in zip(tensors, saved):
                tensor[:, :, start:] = kept


def compile_choice(value) -> str:
    """compile= as given on the command line (Hydra reads true/false as booleans) -> auto | true | false."""
    choice = str(value).lower()
    if choice not in COMPILE_CHOICES:
        raise EagleLabError(f"compile must be auto, true or false, got '{value}'")
    return choice


def build_backend(target: Target, compile: str, cfg: DecodingConfig, planned_tokens: int | None = None,
                  longest_prompt: int = 0, max_new_tokens: int = 0, compile_ahead: bool = False) -> Backend:
    """planned_tokens: what this run will decode (None: open-ended, e.g. a server or a bench).
    longest_prompt, max_new_tokens: when known up front, every sequence's static cache is sized for them.
    compile_ahead: see StaticBackend."""
    choice = compile_choice(compile)
    if choice == "false":
        return EagerBackend(target)
    short = choice == "auto" and planned_tokens is not None and planned_tokens < cfg.compile_min_tokens
    if choice == "true" or not short:
        ok, why = can_compile(target.device)
        if not ok:
            if choice == "true":
                raise EagleLabError(f"compile=true, but {why}; use compile=false")
            log.info("compile=auto: eager decoding (%s)", why)
            return EagerBackend(target)
    compiled = StaticBackend(target, cfg.buckets, cfg.cache_block, compiled=True, per_shape=choice == "auto",
                             min_attended_length=cfg.min_attended_length, compile_ahead=compile_ahead,
                             build=not short, cache_capacity=cfg.cache_capacity, frozen_weights=cfg.frozen_weights)
    if longest_prompt:
        compiled.reserve(longest_prompt, max_new_tokens)
    if choice == "true":
        return compiled
    if short and not (compiled.packages and compiled.has_graphs()):
        log.info("compile=auto: eager decoding: no compiled graphs for this target on this machine yet (build them "
                 "once with `python -m eagle_lab.compile`; a run of %d tokens or more builds what it lacks)",
                 cfg.compile_min_tokens)
        return EagerBackend(target)
    return choose(target, compiled, EagerBackend(target))
