"""`python -m eagle_lab.compile [serve.py overrides]`: build, once per machine, every compiled graph that
`python serve.py` with the same overrides decodes with, and time the tree policy on them.

Graphs are AOTInductor packages under `<cache>/compiled/` (eagle_lab/decoding/graph_store.py); a later
process loads them in milliseconds, so `compile=auto` decodes compiled from the first token of any run.
First the target steps known ahead build side by side, a worker process per core; then the steps: plain
decoding's step (one package serves every attended length), the tree policy's timings on the
compiled backend (tree=online's cost curve), one speculative generation
(the head's steps), and what `mode=server` decodes with (every row count of its static cache, its tree per
batch size). Graphs already built are loaded, not rebuilt: running it again is quick.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

import hydra
import torch
from omegaconf import DictConfig

from eagle_lab.builders import build_decoder, make_drafter, make_generator
from eagle_lab.config import ServeConfig, register_configs, to_object
from eagle_lab.decoding.backend import StaticBackend, build_backend
from eagle_lab.decoding.generate import Stopper, generate
from eagle_lab.decoding.graph_store import GraphStore
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.decoding.static_cache import StaticKVCache
from eagle_lab.decoding.static_rows import row_buckets, rows_capacity
from eagle_lab.errors import EagleLabError, run_entry
from eagle_lab.models.prompts import as_tensor, encode_prompt
from eagle_lab.models.target import load_target
from eagle_lab.serving.server import check_server_config, prepare_decoding

log = logging.getLogger(__name__)
register_configs()
DEMO_PROMPT = "Explain speculative decoding in two sentences."


def build_graphs(cfg: ServeConfig) -> None:
    store = GraphStore()
    before, _ = store.summary()
    start = time.perf_counter()
    target = load_target(cfg.target)
    backend = build_backend(target, "true", cfg.decoding, compile_ahead=True)
    if not isinstance(backend, StaticBackend):
        raise EagleLabError("this target cannot be compiled here")
    prompt = as_tensor(encode_prompt(target.tokenizer, cfg.prompt or DEMO_PROMPT, cfg.chat, cfg.system), target.device)
    _build_known_shapes(cfg, backend)
    log.info("compile [1/4]: plain decoding's step")
    _decode(cfg, target, None, backend, prompt, "vanilla")
    log.info("compile [2/4]: the drafter, and tree=online's cost curve on the compiled target")
    drafter = make_drafter(cfg, target, backend)
    if drafter is not None:
        log.info("compile [3/4]: one speculative generation (the drafter's steps)")
        _decode(cfg, target, drafter, backend, prompt, cfg.method)
    log.info("compile [4/4]: the server's steps (mode=server: %d rows of %d tokens)", cfg.server.max_batch,
             cfg.server.context)
    check_server_config(cfg.server)
    prepare_decoding(cfg, target)
    after, size = store.summary()
    log.info("compile: done in %.0f s; %d graphs built now, %d in %s (%.0f MB)", time.perf_counter() - start,
             after - before, after, store.root, size / 1e6)


def _build_known_shapes(cfg: ServeConfig, backend: StaticBackend) -> None:
    """Build, a worker process per core, the target steps every later step will ask for whatever the controller
    chooses: one sequence's step at each token bucket (the cost curve times them all) and the server's plain step at
    each row count. A package's build is mostly one core's work (export, lowering, one C++ compile), so
    builds side by side take about the time of one each; the steps below then load them. Skipped on one core,
    for a target eager here, and where a copy of the target per worker would not fit in half the memory."""
    workers = min(os.cpu_count() or 1, 4)
    target = backend.target
    weight_bytes = sum(t.numel() * t.element_size() for t in target.backbone.parameters())
    if workers < 2 or not backend.packages or weight_bytes * workers > _memory_bytes() // 2:
        return
    single = backend.min_capacity or backend.cache_block
    shapes = [(single, 1, tokens) for tokens in backend.buckets]
    server = rows_capacity(backend, cfg.server.context)
    shapes += [(server, rows, 1) for rows in row_buckets(cfg.server.max_batch) if (server, rows, 1) not in shapes]
    missing = [shape for shape in shapes if not backend.has_package(*shape)]
    if not missing:
        return
    log.info("compile: building %d target steps in %d worker processes", len(missing), min(workers, len(missing)))
    start = time.perf_counter()
    with ProcessPoolExecutor(min(workers, len(missing)), mp_context=multiprocessing.get_context("spawn")) as pool:
        for done in as_completed([pool.submit(_build_shape, cfg.target, cfg.decoding, *shape) for shape in missing]):
            done.result()
    log.info("compile: %d target steps built in %.0f s", len(missing), time.perf_counter() - start)


def _build_shape(target_cfg, decoding, capacity: int, rows: int, tokens: int) -> None:
    """In a worker process: build (or load) the target step for rows x tokens over a cache of `capacity`."""
    torch.set_num_threads(1)
    target = load_target(target_cfg)
    backend = build_backend(target, "true", decoding, compile_ahead=True)
    backend.compile_shape(StaticKVCache(target.config, capacity, target.device, target.dtype, rows=rows), rows, tokens)


def _memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _decode(cfg: ServeConfig, target, drafter, backend, prompt, method: str) -> None:
    stopper = Stopper(target.tokenizer, cfg.max_new_tokens, target.eos_token_ids)
    decoder = build_decoder(method, target, drafter, prompt, SamplingParams(), stopper,
                            make_generator(cfg.seed, target.device), backend)
    generate(decoder)


def run(raw: DictConfig) -> None:
    build_graphs(to_object(raw, ServeConfig))


@hydra.main(config_path="conf", config_name="serve", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_entry(run, cfg)


if __name__ == "__main__":
    main()
