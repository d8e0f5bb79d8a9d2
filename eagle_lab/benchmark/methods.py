"""The bench's methods: their names, the drafter each runs, and the checks made before any work."""

from __future__ import annotations

import logging
from dataclasses import replace

from eagle_lab.benchmark.llama_cpp_runs import LLAMA_CPP_METHODS
from eagle_lab.builders import (
    build_draft_model_drafter,
    build_drafter,
    build_head,
    build_medusa_drafter,
    head_prior,
    ngram_proposer,
)
from eagle_lab.config import HeadConfig, ServeConfig, TreeConfig
from eagle_lab.decoding.backend import Backend
from eagle_lab.decoding.sampling import SamplingParams, temperature_key
from eagle_lab.decoding.tree import Drafter
from eagle_lab.drafters.ngram import NgramDrafter
from eagle_lab.errors import EagleLabError
from eagle_lab.models.target import Target
from eagle_lab.tree_search.presets import tree_preset

log = logging.getLogger(__name__)
METHODS = ("vanilla", "vanilla_eager", "eagle", "eagle+ngram", "ngram", "draft_model", "medusa", "hf_greedy",
           "hf_prompt_lookup", *LLAMA_CPP_METHODS)
HEAD_METHODS = ("eagle", "eagle+ngram")  # methods that run the head
HF_METHODS = ("hf_greedy", "hf_prompt_lookup")
GREEDY_ONLY = ("hf_prompt_lookup",)
PROMPT_LOOKUP_TOKENS = 10


PACKAGED_HEADS = ("eagle2", "eagle3")  # head names a method may give without bench.heads: the target's packaged ones


def split_method(method: str) -> tuple[str, str]:
    """'eagle/eagle3@auto' -> ('eagle', 'auto'); 'eagle' -> ('eagle', '') (the configured tree=)."""
    base, _, tree = method.partition("@")
    return base.partition("/")[0], tree


def method_head(method: str) -> str:
    """'eagle/eagle3@cpu' -> 'eagle3'; '' = the configured head (head=, head.path=)."""
    return method.partition("@")[0].partition("/")[2]


def head_config(cfg: ServeConfig, name: str) -> HeadConfig:
    """The head a method names: '' the configured one, eagle2 / eagle3 the target's packaged head of that
    kind, any other name the directory bench.heads gives it."""
    if not name:
        return cfg.head
    if name in cfg.bench.heads:
        return replace(cfg.head, path=cfg.bench.heads[name])
    if name in PACKAGED_HEADS:
        return replace(cfg.head, kind=name, path="")
    raise EagleLabError(f"bench: no head named '{name}' (the packaged {' / '.join(PACKAGED_HEADS)}, or "
                        f"+bench.heads.{name}=DIR)")

def build_drafters(cfg: ServeConfig, target: Target, backend: Backend | None = None) -> dict[str, Drafter]:
    """One drafter per speculative method requested; head methods naming the same head share it
    (under tree=online each times its cost curve, cached, on its own)."""
    methods = cfg.bench.methods
    heads = {name: build_head(head_config(cfg, name), target)
             for name in dict.fromkeys(method_head(m) for m in methods if split_method(m)[0] in HEAD_METHODS)}
    drafters: dict[str, Drafter] = {}
    for method in methods:
        base, preset = split_method(method)
        tree = tree_preset(preset) if preset else cfg.tree
        head = heads.get(method_head(method))
        if base in ("eagle", "eagle+ngram"):
            proposer = ngram_proposer(cfg.ngram) if base == "eagle+ngram" else None
            drafters[method] = build_drafter(head, target, tree, proposer, backend,
                                             prior=head_prior(head_config(cfg, method_head(method)), target))
        elif base == "ngram":
            drafters[method] = NgramDrafter(ngram_proposer(cfg.ngram))
        elif base == "draft_model":
            drafters[method] = build_draft_model_drafter(cfg.draft_model, tree, target)
        elif base == "medusa":
            drafters[method] = build_medusa_drafter(cfg.medusa, tree, target)
    return drafters

def tree_label(tree: TreeConfig) -> str:
    """How head cards key MT-bench tau: the preset's name, or the shape."""
    return tree.name or ("online" if tree.online else f"d{tree.depth}-k{tree.topk}-n{tree.total_tokens}")

def validate_bench(cfg: ServeConfig) -> None:
    """Refuse unknown or repeated methods, bad temperatures and a negative warm-up up front."""
    bench = cfg.bench
    if not bench.methods:
        raise EagleLabError(f"bench.methods is empty (choose from {', '.join(METHODS)})")
    unknown = [m for m in bench.methods if split_method(m)[0] not in METHODS]
    if unknown:
        raise EagleLabError(f"unknown bench method(s) {', '.join(unknown)} (choose from {', '.join(METHODS)})")
    for method in bench.methods:
        base, preset = split_method(method)
        if "@" in method and base not in HEAD_METHODS:
            raise EagleLabError(f"bench method '{method}': only {', '.join(HEAD_METHODS)} take a tree after '@'")
        if "/" in method.partition("@")[0]:
            if base not in HEAD_METHODS:
                raise EagleLabError(f"bench method '{method}': only {', '.join(HEAD_METHODS)} take a head after '/'")
            head_config(cfg, method_head(method))  # raises EagleLabError on an unknown name
        if preset:
            tree_preset(preset)  # raises EagleLabError naming the presets
    if len(set(bench.methods)) != len(bench.methods):
        raise EagleLabError(f"bench.methods repeats a method: {list(bench.methods)}")
    if not bench.temperatures:
        raise EagleLabError("bench.temperatures is empty (e.g. bench.temperatures=[0.0,1.0])")
    for temperature in bench.temperatures:
        SamplingParams(temperature, cfg.top_k, cfg.top_p)  # raises EagleLabError on bad values
    if len({temperature_key(t) for t in bench.temperatures}) != len(bench.temperatures):
        raise EagleLabError(f"bench.temperatures repeats a value: {list(bench.temperatures)}")
    if any(m in ("eagle+ngram", "ngram") for m in bench.methods):
        ngram_proposer(cfg.ngram)  # raises EagleLabError on bad ngram.* values
    if bench.llama_cpp_draft < 1:
        raise EagleLabError(f"bench.llama_cpp_draft must be >= 1, got {bench.llama_cpp_draft}")
    if bench.warmup < 0:
        raise EagleLabError(f"bench.warmup must be >= 0, got {bench.warmup}")
    if cfg.stop:
        log.warning("bench ignores stop strings (stop=%s): every method stops at eos or max_new_tokens", cfg.stop)
    if cfg.temperature != 0:
        log.warning("bench ignores temperature=%g: it runs bench.temperatures=%s", cfg.temperature,
                    list(bench.temperatures))
