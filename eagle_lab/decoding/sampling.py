"""Sampling parameters and the one function that turns target logits into probabilities.

Plain decoding and speculative verification both call `target_probs`, so "the target's
distribution" means the same thing everywhere: softmax(logits / T) restricted to the
top-k tokens, then to the smallest top-p nucleus, renormalised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_lab.errors import EagleLabError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self):
        if not self.temperature >= 0:
            raise EagleLabError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise EagleLabError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise EagleLabError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def temperature_key(temperature: float) -> str:
    """A temperature as a JSON key, "0.0", "0.7", "1.0": the bench's results by temperature (readers take
    float() of it)."""
    return str(float(temperature))


@dataclass(frozen=True)
class DraftSampling:
    """A round's request to draw its draft tokens from the drafter's own distribution under `params`
    (T > 0; eagle_lab/drafters/sampled.py) instead of taking its top-k; `generator` draws them."""

    params: SamplingParams
    generator: torch.Generator | None = None


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities of the (warped) target distribution."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)  # [..., V]
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)  # keep the nucleus
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def greedy_token(logits: torch.Tensor) -> int:
    """The index of the largest of [V] logits, the first on a tie (as argmax). On CPU through NumPy's argmax,
    which reads float32 at memory speed, several times faster than torch's max or argmax on a vocabulary's
    logits; it runs once per plain step and per verified node."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64) and logits.dim() == 1:
        return int(logits.detach().numpy().argmax())
    return int(torch.max(logits, dim=0).indices)


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Choose one token from [V] logits: the greedy token, else a draw from target_probs."""
    if params.greedy:
        return greedy_token(logits)
    return draw(target_probs(logits, params), generator)


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index from [V] non-negative weights (any positive total), with probability weight / total.

    Inverse CDF in float64: the law of torch.multinomial(weights, 1), whose per-call input checks and set-up
    make it several times slower on a CPU over a large vocabulary;
    plain sampling pays it every token and speculative verification once per round. An index
    with zero weight is never drawn: its CDF step is empty, and `right=True` picks the first
    index whose cumulative weight exceeds u * total."""
    cdf = weights.double().cumsum(0)  # [V]
    total = cdf[-1]
    if not total > 0:
        raise EagleLabError("cannot sample from a distribution with no mass")
    u = torch.rand((), generator=generator, dtype=torch.float64, device=weights.device)
    index = int(torch.searchsorted(cdf, u * total, right=True))
    if index >= weights.numel():  # u * total rounded up to the total itself: the last index with weight
        index = int(weights.nonzero()[-1])
    return index
