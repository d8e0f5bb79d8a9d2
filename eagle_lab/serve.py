"""What `python serve.py` runs (the top-level serve.py only composes the Hydra config): generate with a
target and an EAGLE head, streamed or as JSON; mode=bench and mode=server hand over to their modules."""

from __future__ import annotations

import json
import logging
import sys

import hydra
import torch
from omegaconf import DictConfig

from eagle_lab.builders import METHODS, build_decoder, make_drafter, make_generator, ngram_proposer
from eagle_lab.config import ServeConfig, register_configs, to_object
from eagle_lab.decoding.backend import build_backend, compile_choice
from eagle_lab.decoding.gc_freeze import freeze_loaded_objects
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.decoding.sequence import Stopper, check_prompt
from eagle_lab.errors import EagleLabError, run_entry
from eagle_lab.models.prompts import as_tensor, encode_prompt, read_prompts_file
from eagle_lab.models.target import load_target
from eagle_lab.serving.text_stream import NullOut, TextStream

log = logging.getLogger(__name__)
register_configs()


def gather_prompts(cfg: ServeConfig) -> list:
    if cfg.prompts_file:
        return read_prompts_file(cfg.prompts_file)
    if not cfg.prompt.strip():
        raise EagleLabError("nothing to generate: give prompt=TEXT or prompts_file=FILE.jsonl (the prompt is empty)")
    return [cfg.prompt]


def validate(cfg: ServeConfig) -> SamplingParams:
    if cfg.output not in ("text", "json"):
        raise EagleLabError(f"output must be text or json, got '{cfg.output}'")
    if cfg.mode not in ("generate", "bench", "server"):
        raise EagleLabError(f"mode must be generate, bench or server, got '{cfg.mode}'")
    if cfg.method not in METHODS:
        raise EagleLabError(f"method must be one of {', '.join(METHODS)}, got '{cfg.method}'")
    compile_choice(cfg.compile)
    ngram_proposer(cfg.ngram)  # checks ngram.* before any work
    return SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)


def run(raw: DictConfig) -> None:
    cfg: ServeConfig = to_object(raw, ServeConfig)
    params = validate(cfg)
    if cfg.mode == "bench":
        from eagle_lab.benchmark.run import run_bench  # imported per mode: each costs seconds at startup

        run_bench(cfg)
        return
    if cfg.mode == "server":  # OpenAI-compatible HTTP server (eagle_lab/serving/)
        from eagle_lab.serving.server import run_server

        run_server(cfg)
        return
    prompts = gather_prompts(cfg)
    target = load_target(cfg.target)
    encoded = [encode_prompt(target.tokenizer, p, cfg.chat, cfg.system) for p in prompts]
    for ids in encoded:  # before any work (compiling, tree=online's cost curve)
        check_prompt(target, as_tensor(ids, target.device))
    planned = len(encoded) * cfg.max_new_tokens
    backend = build_backend(target, cfg.compile, cfg.decoding, planned_tokens=planned,
                            longest_prompt=max(len(ids) for ids in encoded), max_new_tokens=cfg.max_new_tokens)
    drafter = make_drafter(cfg, target, backend)
    freeze_loaded_objects()
    for index, ids in enumerate(encoded):
        prompt = as_tensor(ids, target.device)
        stream = TextStream(target.tokenizer, cfg.stop, out=sys.stdout if cfg.output == "text" else NullOut())
        stats = _decode(cfg, target, drafter, backend, prompt, params, cfg.method, stream.push)
        text = stream.finish()
        if stats.stop_reason == "context":
            log.warning("prompt %d: stopped at the target's context limit (%d tokens)", index, target.max_context)
        plain = None
        if cfg.compare and cfg.method != "vanilla":
            plain, stats, plain_ids_equal = _compare(cfg, target, drafter, backend, prompt, params, stream.ids)
        if cfg.output == "json":
            record = {
                "index": index, "method": cfg.method, "text": text, "token_ids": stream.ids,
                "new_tokens": stats.new_tokens, "target_forwards": stats.target_forwards,
                "accept_length": round(stats.accept_length, 4), "wall_s": round(stats.wall_s, 4),
                "tokens_per_s": round(_speed(stats), 3),
                "stop_reason": stats.stop_reason, "prompt_tokens": len(ids),
                "accepted_draft_tokens": stats.accepted_draft_tokens,
                "accepted_ngram_tokens": stats.accepted_ngram_tokens,
            }
            if plain is not None:
                record.update({"plain_tokens_per_s": round(_speed(plain), 3),
                               "speedup": round(_speed(stats) / max(_speed(plain), 1e-9), 3),
                               "identical_to_plain": plain_ids_equal, "backend": backend_name(backend)})
            print(json.dumps(record), flush=True)
        elif plain is not None:
            print(f"\n[{cfg.method} {_speed(stats):.1f} tok/s, tau {stats.accept_length:.2f} | plain "
                  f"{_speed(plain):.1f} tok/s | {_speed(stats) / max(_speed(plain), 1e-9):.2f}x | output "
                  f"{'identical to' if plain_ids_equal else 'DIFFERENT from'} plain decoding | "
                  f"{backend_name(backend)}, {torch.get_num_threads()} threads]", flush=True)
        log.info("prompt %d: %d tokens in %.2fs (%.2f tok/s), %d target forwards, tau %.2f, stop=%s%s", index,
                 stats.new_tokens, stats.wall_s, _speed(stats),
                 stats.target_forwards, stats.accept_length, stats.stop_reason,
                 f", n-gram share of accepted drafts {stats.ngram_share:.2f}" if stats.ngram_tree_tokens else "")


COMPARE_RUNS = 4  # timed runs of each method for compare=true


def _compare(cfg: ServeConfig, target, drafter, backend, prompt, params: SamplingParams, shown: list[int]):
    """compare=true: plain decoding and cfg.method timed in turns, COMPARE_RUNS each, after the answer was shown;
    the fastest run of each is kept. In turns, because this machine's speed drifts between runs seconds apart;
    the fastest, because a first run pays one-time costs (graphs loaded, memory first touched) and a slowed one
    says nothing about the method. -> (plain stats, method stats, whether plain decoding's output equals the
    shown answer)."""
    fastest = {}
    identical = True
    for _ in range(COMPARE_RUNS):
        for method in ("vanilla", cfg.method):
            ids: list[int] = []
            stats = _decode(cfg, target, drafter, backend, prompt, params, method, ids.extend)
            if method == "vanilla":
                identical = identical and ids == shown
            if method not in fastest or stats.wall_s < fastest[method].wall_s:
                fastest[method] = stats
    return fastest["vanilla"], fastest[cfg.method], identical


def _speed(stats) -> float:
    return stats.new_tokens / max(stats.wall_s, 1e-9)


def backend_name(backend) -> str:
    return "compiled" if getattr(backend, "compiled", False) else "eager"


def _decode(cfg: ServeConfig, target, drafter, backend, prompt, params: SamplingParams, method: str, push):
    """One prompt through `method`, each step's new tokens handed to `push`; -> the run's stats."""
    eos = set() if cfg.ignore_eos else target.eos_token_ids
    stopper = Stopper(target.tokenizer, cfg.max_new_tokens, eos, cfg.stop)
    decoder = build_decoder(method, target, drafter, prompt, params, stopper, make_generator(cfg.seed, target.device),
                            backend)
    while True:
        try:
            push(next(decoder))
        except StopIteration as done:
            return done.value


@hydra.main(config_path="conf", config_name="serve", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """`python serve.py` / `python -m eagle_lab.serve` (the configs ship inside the package)."""
    run_entry(run, cfg)


if __name__ == "__main__":
    main()
