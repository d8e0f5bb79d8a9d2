"""The target's fixed-shape step, compiled, and compile=auto's choice.

On CPU each step shape is an AOTInductor package (graph_store.py): built once on a machine (a
slow step: `make compile` builds them ahead), loaded by every later process in milliseconds, and bound to the
target's own weights. On CUDA the step is compiled with `torch.compile(mode="reduce-overhead")`
(captured CUDA graphs) in each process. On CPU each (rows, tokens, cache layout) is one package whose
attended length is dynamic (exported as a dimension of the mask and the cache's views: any length up to
the cache's capacity, with the speed of a package built for that one length); on CUDA each attended length is
a graph too.

`build=False` (compile=auto in a short run) never compiles: a shape whose package is missing runs
eagerly over the same static cache, and the run says once how to build the packages.

With `per_shape` (compile=auto), each newly compiled (rows, tokens) shape is then timed against
the eager step on the same inputs, and the faster one serves that shape from then on: on some
CPUs the compiled step is faster at one row and slower than eager MKL at several.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time

import torch

from eagle_lab.decoding.graph_store import GraphStore
from eagle_lab.decoding.step_graph import FlatStep, Step, cache_inputs
from eagle_lab.models.device import cpu_features, median_ms
from eagle_lab.models.embedded import cache_root
from eagle_lab.models.masks import contiguous
from eagle_lab.models.native import op_schemas
from eagle_lab.models.target import Target

log = logging.getLogger(__name__)
CHOICE_FILE = "compile_choice.json"
EAGER_MARGIN = 0.9  # compile=auto keeps a shape eager only when eager timed at least 10% faster
# what the target step's packages are built from; the C++ kernels they call are not, only their ops' schemas
# (native.op_schemas, in every package's key): a faster kernel keeps the packages
STEP_SOURCES = ("decoding/step_graph.py", "models/stable_linear.py", "models/attention.py")
KERNEL_SOURCES = ("models/kernels/stable_linear.cpp", "models/kernels/stable_attention.cpp", "models/kernels/simd.h")


def doubling_lengths(first: int, capacity: int) -> list[int]:
    """`first`, its doublings below `capacity`, then `capacity`: the lengths a compiled step attends over, one graph
    each (the target's attended lengths, the head's cache widths); first <= 0: the capacity alone."""
    lengths, length = [], first
    while 0 < length < capacity:
        lengths.append(length)
        length *= 2
    return lengths + [capacity]


class _GuardSkipping:
    """Whether known-shape calls still skip guard evaluation in this process (see call_known_graph)."""

    enabled = True


def call_known_graph(fn, args: tuple, device: torch.device):
    """fn(*args) for a compiled fn that has already compiled a graph for these inputs' shapes. On CPU,
    dynamo then evaluates only the guards that have told its graphs apart, not every guard of the chosen
    one (the target step's guards, checked in full on every call, cost a visible share of a CPU step). The callers
    key their graphs by every shape and stride a graph depends on and pass contiguous inputs. Should a
    guard that has told graphs apart fail anyway, dynamo refuses to recompile under this stance: the call
    is then made again with every guard (it recompiles), and so is every later one in this process. On
    CUDA every guard runs (captured graphs read fixed input addresses, which the guards protect)."""
    if device.type != "cpu" or not _GuardSkipping.enabled:
        return fn(*args)
    try:
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return fn(*args)
    except RuntimeError as err:
        if "skip_guard_eval_unsafe" not in str(err):
            raise
        _GuardSkipping.enabled = False
        log.warning("a compiled step needed a graph its key did not tell apart; every guard is evaluated "
                    "from now on in this process (1-2 ms per step): %s", err)
        return fn(*args)


def raise_recompile_limits(graphs: int = 64) -> None:
    """Let dynamo keep one graph per bucket and capacity instead of falling back to eager after 8."""
    import torch._dynamo.config as dynamo
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo, limit):
            setattr(dynamo, limit, max(getattr(dynamo, limit), graphs))


def can_compile(device: torch.device) -> tuple[bool, str]:
    """Whether torch.compile can build kernels here, and why not."""
    if device.type == "cuda":
        return True, ""
    if device.type != "cpu":
        return False, f"no compiled path for device type '{device.type}'"
    if not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        return False, "no C++ compiler on PATH (inductor's CPU kernels are C++)"
    return True, ""


class StepCompiler:
    """Runs the step eagerly or compiled (packages on CPU, torch.compile on CUDA).
    build: whether a missing package may be compiled in this process (else that shape runs eagerly).
    per_shape: after compiling a shape, keep whichever of compiled and eager timed faster for it."""

    def __init__(self, target: Target, compiled: bool, per_shape: bool = False, build: bool = True,
                 store: GraphStore | None = None):
        self.target, self.compiled, self.per_shape, self.build = target, compiled, per_shape, build
        self.module = Step(target).eval()
        self._graphs: dict[tuple, object] = {}  # key -> the compiled callable serving it
        self._missing: set[tuple] = set()  # keys with no package, run eagerly (build=False)
        self._eager_shapes: set[tuple] = set()  # (rows, tokens, layer_ids) that eager serves faster
        self._cached: dict[tuple, dict | None] = {}  # shape -> verdict an earlier process saved (None: none)
        self.packages = compiled and target.device.type == "cpu"
        self.store = store or GraphStore()
        self._fn = None
        if compiled and not self.packages:
            raise_recompile_limits()
            self._fn = torch.compile(self.module, dynamic=False, mode="reduce-overhead")

    @torch.no_grad()
    def backbone(self, cache, input_ids, positions, mask, layer_ids):
        return self.module.hidden(cache.hf_cache, input_ids, positions, mask, tuple(layer_ids))

    def runs_eager(self, rows: int, tokens: int, layer_ids: tuple[int, ...] = ()) -> bool:
        """Whether a step of this shape runs eagerly (then it may attend over any length). With per_shape,
        a shape an earlier process found faster eagerly (the cached verdict) runs eagerly without compiling."""
        if not self.compiled:
            return True
        shape = (rows, tokens, tuple(layer_ids))
        if self.per_shape and shape not in self._cached:
            verdict = self._cached[shape] = _read_verdicts().get(self._shape_key(shape))
            if verdict is not None and verdict["choice"] == "eager":
                self._eager_shapes.add(shape)
                log.info("compile=auto: the %s step runs eagerly (cached: %.1f ms compiled, %.1f ms eager)",
                         _shape_name(rows, tokens), verdict["compiled_ms"], verdict["eager_ms"])
        return shape in self._eager_shapes

    def _shape_key(self, shape: tuple) -> str:
        rows, tokens, layer_ids = shape
        return f"{_choice_key(self.target)}:{rows}x{tokens}:{','.join(map(str, layer_ids))}"

    def _constants(self, layer_ids: tuple[int, ...]) -> dict:
        return {"layers": layer_ids, "model": self.target.config.to_json_string(use_diff=False),
                "weights": self.target.weights, "linear_kernel": self.target.linear_kernel, "ops": op_schemas()}

    def _package_key(self, flat: FlatStep, args: tuple, dynamic: tuple) -> str:
        """The store's key of the package that runs `flat` on `args` (the step's tensors, the cache's included)."""
        return self.store.key("target-step", flat, args, self._constants(flat.layer_ids), STEP_SOURCES, dynamic)

    def has_package(self, cache, input_ids, positions, mask, layer_ids: tuple[int, ...]) -> bool:
        """Whether the package a step on these inputs runs is on disk (nothing is loaded or built)."""
        args = (input_ids, positions, mask, cache_inputs(cache.hf_cache))
        flat = FlatStep(self.module, cache, layer_ids)
        return self.store.has(self._package_key(flat, args, attended_length_dims(args, cache.storage_capacity)))

    def has_graphs(self, cache) -> bool:
        """Whether any plain-step package for this target (over caches like `cache`) was built on this machine."""
        if not self.packages:
            return self.compiled
        return self.store.has_family(self.store.family("target-step", FlatStep(self.module, cache, ()),
                                                       self._constants(()), STEP_SOURCES))

    @torch.no_grad()
    def run(self, cache, input_ids, positions, mask, layer_ids: tuple[int, ...]):
        # a graph is specialised on strides too: inputs are made contiguous
        input_ids, positions, mask = input_ids.contiguous(), positions.contiguous(), contiguous(mask)
        # the cache's strides too: two views of one length over caches of different capacities are one shape; a
        # package serves every attended length of a cache (its strides tell the cache apart)
        length = None if self.packages else cache.capacity
        key = (length, input_ids.shape[0], input_ids.shape[1], layer_ids, cache.layers[0].keys.stride())
        if self.runs_eager(input_ids.shape[0], input_ids.shape[1], layer_ids) or key in self._missing:
            return self.module(cache.hf_cache, input_ids, positions, mask, layer_ids)
        graph = self._graphs.get(key)
        if graph is not None:
            return graph(cache, input_ids, positions, mask, layer_ids)
        return self._first_call(key, cache, input_ids, positions, mask, layer_ids)

    def _graph_for(self, key, cache, input_ids, positions, mask, layer_ids):
        """The compiled callable for `key` (loaded, built or, on CUDA, compiled on its first call), or None
        when its package is missing and may not be built."""
        if not self.packages:
            fn, known = self._fn, self._graphs

            def compiled(c, *args):
                if key in known:  # its graph exists: dynamo's full guard evaluation is skipped
                    return call_known_graph(fn, (c.hf_cache, *args), c.device)
                return fn(c.hf_cache, *args)
            return compiled
        flat = FlatStep(self.module, cache, layer_ids)
        # each counter a tensor of its own: on CPU they are elements of one tensor (static_cache.py), and export
        # is given no aliased inputs that it writes to (a package reads and adds to each input apart either way)
        kv = [(keys, values, written.clone()) for keys, values, written in cache_inputs(cache.hf_cache)]
        args = (input_ids, positions, mask, kv)
        dynamic = attended_length_dims(args, cache.storage_capacity)
        store_key = self._package_key(flat, args, dynamic)
        what = (f"the target step for {_shape_name(key[1], key[2])} over a {cache.storage_capacity}-position cache "
                "(any attended length)")
        # export traces on fake tensors: building writes nothing into the cache
        if self.build:
            runner = self.store.load_or_build(store_key, flat, args, what, dynamic=dynamic)
        else:
            runner = self.store.load(store_key, flat)
        if runner is None:
            return None

        def call(c, ids, pos, msk, _layer_ids):  # the layers are part of the package
            out = runner(ids, pos, msk, cache_inputs(c.hf_cache))
            return (out[0], None, out[1]) if len(out) == 2 else tuple(out)
        return call

    def _first_call(self, key, cache, input_ids, positions, mask, layer_ids):
        rows, tokens = key[1:3]
        shape = _shape_name(rows, tokens)
        start, written_from = time.perf_counter(), int(cache.layers[0].cumulative_length)
        graph = self._graph_for(key, cache, input_ids, positions, mask, layer_ids)
        if graph is None:
            self._missing.add(key)
            _hint_once()
            return self.module(cache.hf_cache, input_ids, positions, mask, layer_ids)
        cache.set_length(written_from)
        out = graph(cache, input_ids, positions, mask, layer_ids)
        self._graphs[key] = graph
        if not self.packages:
            log.info("compiled the %s step in %.0f s", shape, time.perf_counter() - start)
        if not self.per_shape:
            return out
        if self._cached.get((rows, tokens, layer_ids)) is not None:
            return out  # timed by an earlier process
        args = (cache, input_ids, positions, mask, layer_ids)
        compiled_ms = _timed_ms(graph, cache, args, written_from)
        eager_ms = _timed_ms(lambda c, *rest: self.module(c.hf_cache, *rest), cache, args, written_from)
        verdict = _save_verdict(self._shape_key((rows, tokens, layer_ids)), compiled_ms, eager_ms)
        self._cached[(rows, tokens, layer_ids)] = verdict
        eager = verdict["choice"] == "eager"
        if eager:
            self._eager_shapes.add((rows, tokens, layer_ids))
        log.info("compile=auto: the %s step runs %s (%.1f ms compiled, %.1f ms eager)", shape,
                 "eagerly" if eager else "compiled", compiled_ms, eager_ms)
        cache.set_length(written_from)
        return (self.module(cache.hf_cache, input_ids, positions, mask, layer_ids) if eager
                else graph(*args))  # the cache as the kept path writes it


def attended_length_dims(args: tuple, capacity: int) -> tuple:
    """torch.export's dynamic_shapes for FlatStep's (input_ids, positions, mask, kv): the attended length, the
    mask's last dimension (per layer type where they mix) and the cache views' third, is one dynamic size from
    16 (or the capacity, if less) up to the capacity of the cache they view."""
    length = torch.export.Dim("attended_length", min=min(16, capacity), max=capacity)
    _, _, mask, kv = args
    masks = {name: {3: length} for name in mask} if isinstance(mask, dict) else {3: length}
    return None, None, masks, [({2: length}, {2: length}, None) for _ in kv]


class _Hint:
    shown = False


def _hint_once() -> None:
    if not _Hint.shown:
        _Hint.shown = True
        log.info("compile=auto: some steps have no compiled graph on this machine yet and run eagerly; build them "
                 "once with `python -m eagle_lab.compile` (about 40 s a graph on 2 cores)")


def _shape_name(rows: int, tokens: int) -> str:
    return f"{rows} x {tokens} tokens" if rows > 1 else f"{tokens} tokens"


def _timed_ms(fn, cache, args, length: int, reps: int = 3) -> float:
    """Median ms of fn(*args), each call writing from cache position `length` (the counter is rewound)."""
    ms = median_ms(lambda: fn(*args), reps, before=lambda: cache.set_length(length), device=cache.device)
    cache.set_length(length)
    return ms


def _read_verdicts() -> dict:
    """compile=auto's cached verdicts: {key: {"compiled_ms", "eager_ms", "choice"}} ({} when unreadable)."""
    path = cache_root() / CHOICE_FILE
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}


def _save_verdict(key: str, compiled_ms: float, eager_ms: float) -> dict:
    # eager must win clearly: a timing taken while another process holds a core is noisy, and it is kept
    verdict = {"compiled_ms": round(compiled_ms, 2), "eager_ms": round(eager_ms, 2),
               "choice": "eager" if eager_ms < EAGER_MARGIN * compiled_ms else "compiled"}
    verdicts = _read_verdicts()
    verdicts[key] = verdict
    path = cache_root() / CHOICE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(verdicts, indent=1))
    return verdict


def _choice_key(target: Target) -> str:
    device = target.device
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_features()
    parts = [target.name, str(target.config.model_type), str(target.config.num_hidden_layers),
             str(target.config.hidden_size), str(target.dtype), device.type, hardware, torch.__version__,
             str(torch.get_num_threads()), getattr(target, "weights", "fp32")]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


def _timed_step_ms(backend, context: int, reps: int = 5) -> float:
    """Median ms of one plain decoding step after `context` cached tokens (first call excluded)."""
    scorer = backend.open(context, 16)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, backend.target.vocab_size, (context,), generator=generator).to(backend.target.device)
    scorer.prefill(prompt)
    token = prompt[-1:]
    return median_ms(lambda: scorer.score(token), reps, warmup=1, device=backend.target.device)


def choose(target: Target, compiled, eager):
    """compile=auto: the compiled static path where it measured faster than eager here, else eager.
    The verdict is cached per target, device, dtype, threads and torch version."""
    ok, why = can_compile(target.device)
    if not ok:
        log.info("compile=auto: eager decoding (%s)", why)
        return eager
    key = _choice_key(target)
    verdict = _read_verdicts().get(key)
    if verdict is None:
        log.info("compile=auto: timing a compiled plain step against an eager one (once for this target and device)")
        context = min(256, target.max_context // 2)
        verdict = _save_verdict(key, _timed_step_ms(compiled, context), _timed_step_ms(eager, context))
    log.info("compile=auto: %s decoding (a plain step timed %.1f ms compiled, %.1f ms eager)", verdict["choice"],
             verdict["compiled_ms"], verdict["eager_ms"])
    return compiled if verdict["choice"] == "compiled" else eager
