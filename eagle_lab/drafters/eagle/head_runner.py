"""The draft head's step (head_step.py) over a preallocated KV cache, run eagerly or compiled per row bucket.

Keys and values go into the head cache at given slots in place: rows are padded to a bucket, and attention
runs under an additive mask over the first W slots of the cache, W the rows' last slot plus one rounded up to
16 (on CUDA: 256, its doublings or the capacity), always short of the capacity. Padding rows write to slot
W - 1, which no row sees before a real row has written it (rows fill slots in order). On CPU each bucket is
an AOTInductor package like the target's step (eagle_lab/decoding/graph_store.py: built once per machine,
loaded in milliseconds, bound to the head's own weights) whose width W is dynamic; one graph replaces the
dozens of small eager kernels a step is made of. On CUDA it is compiled with torch.compile, a graph per W.
Drafts are proposals only: their numerics never touch exactness.
"""

from __future__ import annotations

import functools
import logging
import time

import torch
from torch import nn

from eagle_lab.decoding.compiled import call_known_graph, doubling_lengths, raise_recompile_limits
from eagle_lab.decoding.graph_store import GraphStore
from eagle_lab.drafters.eagle.head import EagleHead, HeadKVCache
from eagle_lab.drafters.eagle.head_step import STEP_SOURCES, BoundHeadStep, HeadStep
from eagle_lab.models.masks import additive_mask
from eagle_lab.models.native import op_schemas

log = logging.getLogger(__name__)
ROW_BUCKETS = (1, 4, 16)  # rows per compiled head step; more rows (a prompt's first commit) run 16 at a time
MIN_WIDTH = 256  # the narrowest cache width a CUDA graph attends over (then doublings, then the capacity)
WIDTH_BLOCK = 16  # a package's width: the slots in use rounded up to this
GRAPH_TOP_K = 8  # a compiled step returns at least this many top-k drafts, sliced to what was asked: one graph
# serves every top-k up to it (the fixed trees use top-k 1..8), where a graph per k would multiply the builds


class HeadStepRunner:
    """Runs `HeadStep` for one drafter: eagerly over the cache's filled part, or compiled with rows padded to a
    bucket (one graph per bucket, k and feature source; on CUDA per width too)."""

    def __init__(self, head: EagleHead, embed_tokens: nn.Module, rotary: nn.Module, lm_weight: torch.Tensor,
                 compiled: bool, buckets: tuple[int, ...] = ROW_BUCKETS, build: bool = True,
                 min_width: int = MIN_WIDTH):
        """build: whether a missing package may be compiled here (else that bucket runs eagerly)."""
        self.module = HeadStep(head, embed_tokens, rotary, lm_weight).eval()
        self.compiled, self.buckets, self.build = compiled, tuple(sorted(buckets)), build
        self.min_width = min_width
        self.packages = compiled and lm_weight.device.type == "cpu"
        self._graphs: dict[tuple, object] = {}  # key -> compiled callable (None: no package, eager)
        self._fn = self.module
        self.store = GraphStore()
        if compiled and not self.packages:
            raise_recompile_limits()
            self._fn = torch.compile(self.module, dynamic=False)

    def bucket(self, rows: int) -> int | None:
        """The compiled row count for `rows`, or None to run eagerly."""
        if not self.compiled:
            return None
        return next((b for b in self.buckets if b >= rows), None)

    def widths(self, capacity: int) -> list[int]:
        """The cache widths a CUDA graph over a cache of `capacity` slots attends over (a graph each)."""
        return doubling_lengths(self.min_width, capacity)

    def width(self, used: int, capacity: int) -> int:
        """The width a compiled step attends over when `used` slots (< capacity) hold its rows and the ones
        before them: past `used`, short of the capacity on CPU (no view of the whole buffer: a package's
        width is dynamic, and only the whole width would be laid out contiguously)."""
        if self.packages:
            return min(-(-(used + 1) // WIDTH_BLOCK) * WIDTH_BLOCK, capacity - 1)
        return next(w for w in self.widths(capacity) if w > used)

    @torch.no_grad()
    def __call__(self, cache: HeadKVCache, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                 visible: torch.Tensor, k: int, from_draft: bool, last_only: bool = False):
        """tokens [T]; features [T, F]; positions [T], or None for length .. length + T - 1; visible
        [T, cache.length + T] bool: which of the filled slots and of these rows each row attends to, or None
        for all the filled ones and causally among these (a commit of new pairs). The rows go to slots
        length .. length + T, and the cache's length moves past them. -> hidden [T, H], top-k log-probs
        [T, k], top-k draft ids [T, k] (last_only: the top-k of at least the last row, which comes last)."""
        rows, start = tokens.shape[0], cache.length
        if self.compiled and rows > self.buckets[-1]:
            return self._in_chunks(cache, tokens, features, positions, visible, k, from_draft, last_only)
        bucket = self.bucket(rows)
        padded = bucket or rows
        cache.reserve(start + rows + 2, like=self.module.head.fc.weight, arch=self.module.head.arch)
        # attention runs over [0, width); padding rows write to its last slot, past every row's own
        width = self.width(start + rows, cache.capacity) if bucket else start + rows
        scratch = width - 1
        device = tokens.device
        slots = torch.tensor([*range(start, start + rows), *[scratch] * (padded - rows)], device=device)
        if visible is None:  # row i sees slots [0, start + i]; a padding row sees more, never a real row's output
            allowed = _columns(width, device)[None, :] <= torch.arange(start, start + padded, device=device)[:, None]
        else:
            allowed = torch.zeros(padded, width, dtype=torch.bool, device=device)
            allowed[:rows, :start + rows] = visible
            if padded > rows:
                allowed[rows:, scratch if bucket else 0] = True  # padding rows attend to something (no empty softmax)
        if positions is None:
            positions = torch.arange(start, start + padded, device=device)  # padding rows' positions are unread
        dtype = self.module.head.dtype  # head.draft_dtype: target features are cast to it
        features = features.to(dtype)
        mask = additive_mask(allowed, dtype)  # [padded, width]
        step_k = max(k, GRAPH_TOP_K) if bucket else k
        args = (cache.key_buffer[:, :, :width], cache.value_buffer[:, :, :width],
                _pad(tokens, padded)[None], _pad(features, padded)[None], _pad(positions, padded)[None], slots,
                mask[None, None], step_k, from_draft, last_only and not bucket)
        # the cache's strides too; a package serves every width
        key = (padded, None if self.packages else width, step_k, from_draft, args[0].stride()) if bucket else None
        hidden, top_logp, top_ids = self._run(args, key, cache)
        cache.length = start + rows
        return hidden[0, :rows], top_logp[:rows, :k], top_ids[:rows, :k]

    def _in_chunks(self, cache, tokens, features, positions, visible, k, from_draft, last_only):
        """More rows than the largest bucket (a prompt's first commit): through the largest compiled step,
        one chunk after another, each chunk seeing the earlier ones in the cache (arguments as __call__'s)."""
        size, start = self.buckets[-1], cache.length
        hidden, top_logp, top_ids = [], [], []
        for first in range(0, tokens.shape[0], size):
            last = min(first + size, tokens.shape[0])
            out = self(cache, tokens[first:last], features[first:last],
                       None if positions is None else positions[first:last],
                       None if visible is None else visible[first:last, :start + last], k, from_draft)
            hidden.append(out[0])
            if not last_only or last == tokens.shape[0]:
                top_logp.append(out[1])
                top_ids.append(out[2])
        return torch.cat(hidden), torch.cat(top_logp), torch.cat(top_ids)

    def _run(self, args, key: tuple | None, cache: HeadKVCache):
        if key is None:
            return self.module(*args)
        if key not in self._graphs:
            if self.packages:
                self._prepare_package(args, key, cache)
            else:
                start = time.perf_counter()
                out = self._fn(*args)
                self._graphs[key] = self._fn
                log.info("compiled the head step for %d rows over a %d-slot cache in %.0f s", key[0], key[1],
                         time.perf_counter() - start)
                return out
        graph = self._graphs[key]
        if graph is None:
            return self.module(*args)
        return graph(args) if self.packages else call_known_graph(self._fn, args, args[2].device)

    def _prepare_package(self, args, key: tuple, cache: HeadKVCache) -> None:
        """Load (or build, when allowed) this step's package, which serves every width of the cache, so that no
        build falls inside a later round when the sequence grows. Export only traces: the cache is not written."""
        padded, _, step_k, from_draft, _ = key
        bound = BoundHeadStep(self.module, step_k, from_draft)
        constants = {"k": step_k, "from_draft": from_draft, "arch": self.module.head.arch, "ops": op_schemas()}
        tensors = args[:7]  # keys, values [1, kvH, W, D]; tokens, features, positions, slots; mask [1, 1, R, W]
        width = torch.export.Dim("width", min=min(WIDTH_BLOCK, cache.capacity - 1), max=cache.capacity - 1)
        dynamic = ({2: width}, {2: width}, None, None, None, None, {3: width})
        store_key = self.store.key("head-step", bound, tensors, constants, STEP_SOURCES, dynamic)
        what = f"the head step for {padded} rows over a {cache.capacity}-slot cache (any width)"
        runner = (self.store.load_or_build(store_key, bound, tensors, what, dynamic=dynamic) if self.build
                  else self.store.load(store_key, bound))
        self._graphs[key] = None if runner is None else (lambda a: tuple(runner(*a[:7])))


@functools.lru_cache(maxsize=16)
def _columns(width: int, device: torch.device) -> torch.Tensor:
    """[width] slot indices 0 .. width - 1 (read only)."""
    return torch.arange(width, device=device)


def _pad(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero rows appended along dim 0 up to `rows`; always contiguous: a graph is specialised on its inputs'
    strides, which its key does not name (the first level's parent features are one row expanded)."""
    missing = rows - tensor.shape[0]
    if missing == 0:
        return tensor.contiguous()
    return torch.cat([tensor, tensor.new_zeros((missing, *tensor.shape[1:]))])
