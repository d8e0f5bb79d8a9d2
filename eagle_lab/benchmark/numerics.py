"""How far a target's logits move with the number of rows a forward carries:
python -m eagle_lab.benchmark.numerics [dtype=float32|bfloat16] [weights=auto|fp32|bf16|int8|int4|gguf] [tokens=32]
    [prompts=4] [extra=3,15] [path=FILE.gguf]

path: a llama.cpp GGUF file as the target (eagle_lab/models/gguf_weights.py) instead of the embedded SmolLM2.

A speculative round scores a position inside a tree of N tokens; plain decoding scores it alone.
Mathematically the logits are the same, but the kernels differ with the row count (blocking,
accumulation order), so the floats differ by the dtype's rounding. Greedy speculative output
equals plain greedy output only where no greedy choice is closer than that difference.

Decodes each calibration prompt greedily for `tokens` steps, eagerly; at every step the next
position is scored alone and again followed by `extra` random tokens (causal: they cannot change
it), and it prints the largest logit difference, how many greedy choices flipped and how many
positions had their top two logits within twice that difference (only those can flip).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from eagle_lab.errors import EagleLabError, key_values
from eagle_lab.models.prompts import encode_prompt, has_chat_template
from eagle_lab.models.target import Target, TargetConfig, load_target
from eagle_lab.tree_search.costs import CALIBRATION_PROMPTS


@dataclass
class ShapeNoise:
    positions: int  # positions scored (prompts x tokens)
    max_abs_dlogit: float  # largest |logit difference| between a position scored alone and inside more rows
    argmax_flips: int  # positions whose greedy token changed with some row count
    near_ties: int  # positions whose top-2 logits (scored alone) lie within 2 x max_abs_dlogit: only these can flip


def _last_logits(target: Target, ids: torch.Tensor, position: int) -> torch.Tensor:
    """ids: [T] -> [V] fp32 logits at `position`, from a forward over all of ids (fresh cache)."""
    out = target.forward(ids[None], target.new_cache())
    return target.logits(out.features[0, position]).float()


@torch.no_grad()
def measure_shape_noise(target: Target, prompts: list[list[int]], tokens: int, extra: tuple[int, ...],
                        seed: int = 0) -> ShapeNoise:
    generator = torch.Generator().manual_seed(seed)
    worst, flips, positions, top2_gaps = 0.0, 0, 0, []  # flips: positions
    for prompt in prompts:
        ids = torch.tensor(prompt, device=target.device)  # [T]
        for _ in range(tokens):
            alone = _last_logits(target, ids, ids.numel() - 1)  # [V]
            flipped = False
            for k in extra:
                tail = torch.randint(0, target.vocab_size, (k,), generator=generator).to(target.device)
                inside = _last_logits(target, torch.cat([ids, tail]), ids.numel() - 1)
                worst = max(worst, (inside - alone).abs().max().item())
                flipped |= bool(inside.argmax() != alone.argmax())
            flips += int(flipped)
            top2 = alone.topk(2).values
            top2_gaps.append((top2[0] - top2[1]).item())
            positions += 1
            ids = torch.cat([ids, alone.argmax().reshape(1)])
    near_ties = sum(gap <= 2 * worst for gap in top2_gaps)
    return ShapeNoise(positions=positions, max_abs_dlogit=worst, argmax_flips=flips, near_ties=near_ties)


def main(argv: list[str]) -> None:
    args = key_values("numerics", argv, ("dtype", "weights", "tokens", "prompts", "extra", "path"))
    try:
        source = {"source": "pretrained", "path": args["path"]} if args.get("path") else {}
        target = load_target(TargetConfig(device="cpu", dtype=args.get("dtype", "float32"),
                                          weights=args.get("weights", "auto"), **source))
        tokens, count = int(args.get("tokens", 32)), int(args.get("prompts", 4))
        extra = tuple(int(k) for k in args.get("extra", "3,15").split(","))
    except (EagleLabError, ValueError) as err:
        raise SystemExit(f"numerics: {err}") from None
    chat = has_chat_template(target.tokenizer)
    prompts = [encode_prompt(target.tokenizer, p, chat=chat) for p in CALIBRATION_PROMPTS[:count]]
    noise = measure_shape_noise(target, prompts, tokens, extra)
    print(f"| dtype | weights | positions | max abs dlogit (alone vs +{'/+'.join(map(str, extra))} rows) "
          "| greedy flips | positions with top-2 within 2x that |")
    print("|---|---|---:|---:|---:|---:|")
    print(f"| {target.dtype} | {target.weights} | {noise.positions} | {noise.max_abs_dlogit:.2e} "
          f"| {noise.argmax_flips} | {noise.near_ties} |")


if __name__ == "__main__":
    main(sys.argv[1:])
