"""The Hugging Face baseline: `model.generate`, plain and with prompt lookup, under the bench's settings."""

from __future__ import annotations

from typing import Any

import torch

from eagle_lab.benchmark.context import BenchContext, Run
from eagle_lab.benchmark.methods import PROMPT_LOOKUP_TOKENS
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.models.device import timed_call
from eagle_lab.models.prompts import as_tensor


def run_hf(ctx: BenchContext, method: str, prompt_ids: list[int], params: SamplingParams) -> Run:
    """`model.generate` with the same eos, length and sampling settings as eagle_lab's loops.

    ignore_eos passes eos_token_id=None rather than min_new_tokens: the latter masks eos out
    of the logits, which would change greedy outputs. Target forwards are counted with a hook.
    """
    target, cfg = ctx.target, ctx.cfg
    input_ids = as_tensor(prompt_ids, target.device)[None]  # [1, T]
    kwargs: dict[str, Any] = {
        "attention_mask": torch.ones_like(input_ids),
        "max_new_tokens": cfg.max_new_tokens,
        "eos_token_id": sorted(ctx.eos) if ctx.eos else None,
        "pad_token_id": ctx.pad_token_id,
        ctx.cache_kwarg: target.new_cache(),
    }
    if params.greedy:
        kwargs["do_sample"] = False
    else:
        kwargs.update(do_sample=True, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
    if method == "hf_prompt_lookup":
        kwargs["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
    forwards = [0]

    def count(_module, _args) -> None:
        forwards[0] += 1

    hook = target.model.register_forward_pre_hook(count)
    try:
        if not params.greedy:
            torch.manual_seed(cfg.seed)
        output, wall = timed_call(lambda: target.model.generate(input_ids, **kwargs), target.device)
    finally:
        hook.remove()
    tokens, reason = cut_hf_output(output[0, input_ids.shape[1]:].tolist(), ctx.eos, cfg.max_new_tokens)
    return Run(tokens, wall, forwards[0] or None, reason)

def cut_hf_output(tokens: list[int], eos: set[int], max_new_tokens: int) -> tuple[list[int], str]:
    """HF's new tokens up to and including the first eos (any padding after it dropped)."""
    for index, token in enumerate(tokens):
        if token in eos:
            return tokens[: index + 1], "eos"
    return tokens, "length" if len(tokens) >= max_new_tokens else "other"
