"""Builders: configs -> ready objects (head, drafter, decoder). Shared by serve and bench."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from eagle_lab.config import HeadConfig, MedusaConfig, NgramConfig, ServeConfig, TreeConfig
from eagle_lab.decoding.backend import Backend
from eagle_lab.decoding.generate import Stopper, speculative_decode, vanilla_decode
from eagle_lab.decoding.graph_store import code_digest
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.decoding.tree import Drafter
from eagle_lab.drafters.card import read_card
from eagle_lab.drafters.draft_model.drafter import DraftModelDrafter, check_same_tokenizer
from eagle_lab.drafters.draft_model.store import is_layers_only, load_draft_vocab, load_layers_only
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.eagle.head import EagleHead
from eagle_lab.drafters.eagle.kinds import new_head
from eagle_lab.drafters.eagle.layouts import load_head
from eagle_lab.drafters.growth import TreeShape, untuned_shape
from eagle_lab.drafters.medusa.drafter import MedusaDrafter
from eagle_lab.drafters.medusa.layout import load_any_medusa
from eagle_lab.drafters.ngram import NgramDrafter, NgramProposer
from eagle_lab.errors import EagleLabError
from eagle_lab.models.device import drafting_dtype, integer_dot_products
from eagle_lab.models.embedded import cache_root
from eagle_lab.models.stable_linear import FORMATS, convert_module_linears
from eagle_lab.models.target import Target, TargetConfig, load_target
from eagle_lab.tree_search.costs import calibration_prompts, timing_fingerprint
from eagle_lab.tree_search.online import ChainController, card_prior, cost_curve

log = logging.getLogger(__name__)
PACKAGED_HEADS = Path(__file__).parent / "assets" / "heads"
PACKAGED_DRAFTERS = Path(__file__).parent / "assets" / "drafters"  # <target>/draft_lm, <target>/medusa
METHODS = ("eagle", "vanilla", "ngram", "draft_model", "medusa")
# decoders that run a drafter through speculative_decode
SPECULATIVE = ("eagle", "ngram", "eagle+ngram", "draft_model", "medusa")


def packaged_head_dir(target_name: str, kind: str = "eagle2") -> Path | None:
    """The head of `kind` packaged for a target, if there is one: assets/heads/<target>/ holds the EAGLE-2 head,
    assets/heads/<target>/<kind>/ the others."""
    candidate = PACKAGED_HEADS / target_name
    if kind != "eagle2":
        candidate = candidate / kind
    return candidate if (candidate / "config.json").is_file() else None


def packaged_drafter_dir(target_name: str, kind: str) -> Path | None:
    """The drafter of `kind` (draft_lm, medusa) packaged for a target, if there is one."""
    candidate = PACKAGED_DRAFTERS / target_name / kind
    return candidate if (candidate / "config.json").is_file() else None


def build_head(cfg: HeadConfig, target: Target) -> EagleHead:
    """The head to draft with, in head.draft_dtype. Beside a target on the row-stable CPU kernel the head's linear
    layers use it too, storing head.draft_dtype's weights (bf16 unless float32 is asked for) and computing in
    float32: a draft level then reads half the bytes without bf16 activations."""
    dtype = drafting_dtype(cfg.draft_dtype, target.dtype, target.device)
    head = _load_or_new_head(cfg, target)
    if target.linear_kernel == "stable":
        storage = head_storage(cfg)
        convert_module_linears(head.float(), storage, keep_weight=True)
        log.info("the head drafts with %s weights through the row-stable kernel", storage)
        return head
    if head.dtype != dtype:
        log.info("the head drafts in %s", str(dtype).removeprefix("torch."))
    return head.to(dtype)


HEAD_WEIGHTS = ("fp32", "bf16", "w8a8", "w4a8")  # target.weights names a head may be stored as (decoder formats)


def head_storage(cfg: HeadConfig) -> str:
    """head.draft_weights as a row-stable kernel storage. auto follows head.draft_dtype when it is set (float32:
    fp32 panels, bfloat16: bf16 panels); with both auto: w8a8 on CPUs with integer dot products (AVX512-VNNI or
    AVX2; a draft level reads fewer bytes than from bf16 panels, at the same tau), else bf16 panels."""
    if cfg.draft_weights == "auto":
        if cfg.draft_dtype in ("float32", "fp32"):
            return "f32"
        if cfg.draft_dtype != "auto":
            return "bf16"
        return "q8_0x8" if integer_dot_products() else "bf16"
    if cfg.draft_weights not in HEAD_WEIGHTS:
        raise EagleLabError(f"head.draft_weights must be auto or one of {', '.join(HEAD_WEIGHTS)}, "
                            f"got '{cfg.draft_weights}'")
    return FORMATS[cfg.draft_weights][0]


def _head_path(cfg: HeadConfig, target: Target) -> str:
    """head.path, or the packaged head's directory when it is empty ("random" when there is none)."""
    if cfg.path != "":
        return cfg.path
    packaged = packaged_head_dir(target.name, cfg.kind)
    return str(packaged) if packaged else "random"


def head_prior(cfg: HeadConfig, target: Target) -> list[float] | None:
    """The acceptance by draft depth the head's card promises (tree=online's starting point); None without one."""
    path = _head_path(cfg, target)
    card = None if path == "random" else read_card(path)
    return card_prior(card.heldout_top1) if card is not None and card.heldout_top1 else None


def _load_or_new_head(cfg: HeadConfig, target: Target) -> EagleHead:
    path = _head_path(cfg, target)
    if path == "random":
        log.warning("!" * 72)
        log.warning("NO TRAINED HEAD for target '%s': drafting with a RANDOM head. Output is still exact,", target.name)
        log.warning("but almost no draft is accepted (tau ~ 1). Train one with train.py; pass head.path=DIR.")
        log.warning("!" * 72)
        return new_head(target, kind=cfg.kind, seed=cfg.seed)
    head = load_head(path, target)
    log.info("head %s (%s, draft vocab %d)", path, head.arch.kind, head.arch.draft_vocab_size)
    card = read_card(path)
    log.info("%s", card.summary() if card is not None else "head card: none (no card.json beside the head)")
    return head


def build_decoder(method: str, target: Target, drafter: Drafter | None, prompt_ids: torch.Tensor,
                  params: SamplingParams, stopper: Stopper, generator: torch.Generator | None,
                  backend: Backend | None = None):
    """backend: how the target runs (eagle_lab.decoding.backend); None: eager over a dynamic cache."""
    if method == "vanilla":
        return vanilla_decode(target, prompt_ids, params, stopper, generator, backend)
    if method in SPECULATIVE:
        return speculative_decode(target, drafter, prompt_ids, params, stopper, generator, backend)
    raise EagleLabError(f"unknown method '{method}' (choose from {', '.join(METHODS)})")


def build_drafter(head: EagleHead, target: Target, tree: TreeConfig, ngram: NgramProposer | None = None,
                  backend: Backend | None = None, prior: list[float] | None = None) -> EagleDrafter:
    """A drafter with a fixed tree, or (tree=online) with a chain length chosen each round, starting from `prior`,
    the acceptance by depth the head promises. ngram: merge n-gram chains into every tree (hybrid drafting;
    under tree=online, as many of a chain's tokens as pay)."""
    tree.validate()
    if tree.online:
        return online_drafter(head, target, tree, ngram, backend, prior)
    drafter = eagle_drafter(head, target, TreeShape(tree.depth, tree.topk, tree.total_tokens), ngram, backend,
                            tree.sampled_drafts)
    if getattr(backend, "buckets", None) and ngram is not None:  # keep hybrid trees within compiled sizes
        drafter.max_tree_tokens = max(max(backend.buckets), tree.total_tokens + 1)
    return drafter


def online_drafter(head: EagleHead, target: Target, tree: TreeConfig, ngram: NgramProposer | None,
                   backend: Backend | None, prior: list[float] | None) -> EagleDrafter:
    """A drafter whose chain length a controller chooses each round, from the cost curve of this machine (timed
    once, cached) and the acceptance its requests show (from the card's prior)."""
    depth = tree.depth
    drafter = eagle_drafter(head, target, TreeShape(depth, 1, depth), ngram, backend, tree.sampled_drafts)
    digest = timing_fingerprint(target, drafter, ngram, backend)
    timing = code_digest(("tree_search/online.py",))[:8]  # the code that times the curve: a change retimes it
    path = cache_root() / "tree_online" / f"{target.name}-{depth}-{digest}-{timing}.json"
    memory = cost_curve(target, drafter, calibration_prompts(target), depth, path, backend)
    log.info("tree=online: each round drafts a chain of 0-%d tokens%s, chosen by the cost curve in %s", depth,
             " (and merges n-gram chain tokens where they pay)" if ngram is not None else "", path)
    drafter.control(ChainController(depth, memory, prior))
    return drafter


def eagle_drafter(head: EagleHead, target: Target, shape: TreeShape, ngram: NgramProposer | None,
                  backend: Backend | None, sampled_drafts: bool = True,
                  controller: ChainController | None = None) -> EagleDrafter:
    """The head compiles when the target does; its cache is sized like the backend's static caches."""
    return EagleDrafter(head, target, shape, ngram, compiled=getattr(backend, "compiled", False),
                        cache_capacity=getattr(backend, "min_capacity", 0), build=getattr(backend, "build", True),
                        sampled_drafts=sampled_drafts, controller=controller)


def ngram_proposer(cfg: NgramConfig) -> NgramProposer:
    """The n-gram settings as a proposer; bad values raise EagleLabError."""
    return NgramProposer(cfg.min_match, cfg.max_match, cfg.max_tokens)


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def make_drafter(cfg: ServeConfig, target: Target, backend: Backend | None = None) -> Drafter | None:
    """method=eagle: the head's tree (plus n-gram branches when ngram.enabled); method=ngram: n-gram
    drafting alone, no head; method=draft_model: a small LM's tree; method=vanilla: none."""
    if cfg.method == "eagle":
        proposer = ngram_proposer(cfg.ngram) if cfg.ngram.enabled else None
        return build_drafter(build_head(cfg.head, target), target, cfg.tree, proposer, backend,
                             head_prior(cfg.head, target))
    if cfg.method == "ngram":
        return NgramDrafter(ngram_proposer(cfg.ngram))
    if cfg.method == "draft_model":
        return build_draft_model_drafter(cfg.draft_model, cfg.tree, target)
    if cfg.method == "medusa":
        return build_medusa_drafter(cfg.medusa, cfg.tree, target)
    return None


def build_draft_model_drafter(cfg: TargetConfig, tree: TreeConfig, target: Target) -> DraftModelDrafter:
    """method=draft_model: the draft LM on the target's device, checked to share its tokenizer; with no
    draft_model.path, the one packaged for the target (eagle_lab/assets/drafters/<target>/draft_lm)."""
    path = cfg.path
    if cfg.source == "pretrained" and not path:
        packaged = packaged_drafter_dir(target.name, "draft_lm")
        if packaged is None:
            raise EagleLabError(f"method=draft_model needs draft_model.path=DIR for target '{target.name}' (no draft "
                                "model is packaged for it): a Hugging Face causal LM that shares the target's "
                                "tokenizer, or one trained with python train.py head=draft_lm")
        path = str(packaged)
    if cfg.source == "pretrained" and is_layers_only(path):
        draft = load_layers_only(path, target)  # the target's tokenizer, embeddings and LM head
    else:
        draft = load_target(replace(cfg, path=path, device=str(target.device)))
        check_same_tokenizer(target, draft)
    return DraftModelDrafter(draft, untuned_shape("draft_model", tree.online, tree.depth, tree.topk, tree.total_tokens),
                             target.vocab_size, load_draft_vocab(path) if cfg.source == "pretrained" else None,
                             sampled_drafts=tree.sampled_drafts)


def build_medusa_drafter(cfg: MedusaConfig, tree: TreeConfig, target: Target) -> MedusaDrafter:
    """method=medusa: heads trained with head=medusa (medusa.path=DIR; none: those packaged for the target)."""
    path = cfg.path
    if not path:
        packaged = packaged_drafter_dir(target.name, "medusa")
        if packaged is None:
            raise EagleLabError(f"method=medusa needs medusa.path=DIR for target '{target.name}' (no Medusa heads are "
                                "packaged for it): heads trained with python train.py head=medusa")
        path = str(packaged)
    heads = load_any_medusa(path, target)  # eagle_lab's layout or the Medusa project's
    return MedusaDrafter(heads, target, untuned_shape("medusa", tree.online, tree.depth, tree.topk, tree.total_tokens),
                         sampled_drafts=tree.sampled_drafts)
