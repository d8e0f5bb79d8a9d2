"""What tree=online's cost curve is timed on and depends on: the calibration prompts, the target's forward over
K scored tokens (what an n-gram chain's extra tokens cost), and the fingerprint that keys a cached curve."""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import asdict

import torch

from eagle_lab.decoding.backend import Backend, EagerBackend
from eagle_lab.decoding.compiled import KERNEL_SOURCES
from eagle_lab.decoding.compiled import STEP_SOURCES as TARGET_STEP_SOURCES
from eagle_lab.decoding.graph_store import code_digest
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.eagle.head_step import STEP_SOURCES as HEAD_STEP_SOURCES
from eagle_lab.drafters.ngram import NgramProposer
from eagle_lab.models.device import median_ms
from eagle_lab.models.masks import causal_mask
from eagle_lab.models.native import NATIVE, kernel_march
from eagle_lab.models.prompts import encode_prompt, has_chat_template
from eagle_lab.models.target import Target

K_GRID = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
# what a timed round runs besides the models: the steps (their packages' sources, the code that calls them), the
# loop, the drafter, and what times it
ROUND_CODE = (*TARGET_STEP_SOURCES, *HEAD_STEP_SOURCES, *KERNEL_SOURCES, "decoding/compiled.py",
              "decoding/graph_store.py", "drafters/eagle/head_runner.py", "decoding/static_rows.py",
              "decoding/sequence.py", "decoding/generate.py", "decoding/verify.py", "decoding/backend.py",
              "decoding/scoring.py", "decoding/static_cache.py", "drafters/eagle/drafter.py", "drafters/growth.py",
              "drafters/ngram.py", "tree_search/costs.py")
CALIBRATION_PROMPTS = (
    "Explain how a hash table works, with an example in Python.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main causes of inflation? Answer in a few paragraphs.",
    "Give me a step-by-step plan to learn linear algebra in a month.",
)


def calibration_prompts(target: Target) -> list[list[int]]:
    """The calibration prompts, each cut to half the target's context at most (room to decode after it); through
    the chat template where the tokenizer has one."""
    keep, chat = max(1, target.max_context // 2), has_chat_template(target.tokenizer)
    return [encode_prompt(target.tokenizer, p, chat=chat)[:keep] for p in CALIBRATION_PROMPTS]


def timing_fingerprint(target: Target, drafter: EagleDrafter, ngram: NgramProposer | None = None,
                       backend=None) -> str:
    """A digest of what a round's timings depend on: target, head, device, dtype, threads, backend, and the
    code that runs a round or times it (a change there may move its costs, so it is timed again, not reused)."""
    head = drafter.head
    weights = float(sum(p.detach().float().abs().sum() for p in head.parameters()))
    fields = {"target": target.name, "device": str(target.device), "dtype": str(target.dtype),
              "threads": torch.get_num_threads(),  # every cost scales with them
              "head": asdict(head.arch), "weights": round(weights, 3),
              "head_storage": getattr(head.fc, "storage", str(head.dtype)),
              # how the weights are stored and multiplied: other costs, and (quantized) other acceptance
              "target_weights": [getattr(target, "weights", "fp32"), getattr(target, "linear_kernel", "torch")],
              "code": code_digest(ROUND_CODE)}
    if backend is not None and getattr(backend, "name", "eager") != "eager":  # costs differ per backend
        fields["backend"] = {"name": backend.name, "buckets": list(getattr(backend, "buckets", [])),
                             "min_attended_length": getattr(backend, "min_attended_length", 0),
                             "head_step": "compiled" if drafter.runner.compiled else "eager"}
    if kernel_march() != NATIVE:  # kernels built for another instruction set cost differently
        fields["kernel_march"] = kernel_march()
    if ngram is not None:
        fields["ngram"] = asdict(ngram)
    blob = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def forward_ms(timed: dict[int, float], k: int) -> float:
    """ms of a forward over k scored tokens from those timed at some sizes: linear between them, the smallest's
    below, extended linearly past the largest."""
    keys = sorted(timed)
    if k <= keys[0]:
        return timed[keys[0]]
    for lo, hi in zip(keys, keys[1:]):
        if k <= hi:
            w = (k - lo) / (hi - lo)
            return (1 - w) * timed[lo] + w * timed[hi]
    if len(keys) == 1:
        return timed[keys[0]]
    lo, hi = keys[-2], keys[-1]  # extrapolate linearly past the grid
    return timed[hi] + (k - hi) * (timed[hi] - timed[lo]) / (hi - lo)


@torch.no_grad()
def measure_target_costs(target: Target, context: int, grid=K_GRID, backend: Backend | None = None,
                         reps: int = 5) -> dict[int, float]:
    """ms to score k tokens (a tree's forward and its logits) after `context` cached ones, through the
    backend the decoding loop uses. Eager: timed on `grid` (interpolated between by forward_ms). A static
    backend pads k tokens to its bucket, so every size up to the largest bucket costs what its bucket
    costs (a 5-token tree what the 8-token bucket does, which no interpolation between 4 and 8 gives):
    each bucket is timed, `reps` times in turns with the others so a drift in the machine's speed falls
    on all alike, and its median given to every size it holds (timed size by size, neighbours in one
    bucket came out far apart on a drifting machine). Each timed call follows an untimed one of
    the same bucket, as a decoding loop calls one package round after round."""
    backend = backend or EagerBackend(target)
    buckets = sorted(getattr(backend, "buckets", None) or [])
    sizes = buckets or list(grid)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, target.vocab_size, (context,), generator=g).to(target.device)
    scorer = backend.open(context, 16)
    scorer.prefill(prefix)

    def scoring(k: int):
        tokens = torch.randint(0, target.vocab_size, (k,), generator=g).to(target.device)
        mask = causal_mask(k, target.device)
        depths = torch.arange(k, device=target.device)

        def score():
            scorer.score(tokens, depths, mask)
            scorer.rewind()
        return score

    calls = {k: scoring(k) for k in sizes}
    for call in calls.values():
        call()  # warm-up (and, for a compiled backend, the bucket's compile)
    if not buckets:
        return {k: median_ms(call) for k, call in calls.items()}
    times: dict[int, list[float]] = {k: [] for k in sizes}
    for _ in range(reps):
        for k, call in calls.items():
            call()  # each bucket is its own package: the first call after another one pays for the switch
            times[k].append(median_ms(call, reps=1))
    per_bucket = {k: statistics.median(v) for k, v in times.items()}
    return {k: per_bucket[min(b for b in buckets if b >= k)] for k in range(1, max(buckets) + 1)}
