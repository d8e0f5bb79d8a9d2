"""Where a speculative round's time goes:
python -m eagle_lab.benchmark.profile_round [tokens=48] [depth=4 topk=4 total=12].

Times the target forward over the tree, the LM-head rows read by verification, drafting,
verification bookkeeping and cache compaction, per round, on the embedded default target
with its packaged head (random head if none), greedy, on one calibration prompt.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

import torch

from eagle_lab import generate as gen
from eagle_lab.builders import build_head
from eagle_lab.config import HeadConfig
from eagle_lab.draft import EagleDrafter, TreeShape
from eagle_lab.prompts import encode_prompt
from eagle_lab.sampling import SamplingParams
from eagle_lab.target import TargetConfig, load_target
from eagle_lab.tree_search.auto import CALIBRATION_PROMPTS


def _timed(totals: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        totals[name] += time.perf_counter() - start
        return result

    return wrapper


def main(argv: list[str]) -> None:
    args = dict(a.split("=", 1) for a in argv)
    target = load_target(TargetConfig(device="cpu"))
    shape = TreeShape(int(args.get("depth", 4)), int(args.get("topk", 4)), int(args.get("total", 12)))
    drafter = EagleDrafter(build_head(HeadConfig(), target), target, shape)
    totals: dict[str, float] = defaultdict(float)
    target.forward = _timed(totals, "target forward (tree)", target.forward)
    target.logits = _timed(totals, "target LM-head rows", target.logits)
    drafter.draft = _timed(totals, "drafting", drafter.draft)
    gen.verify = _timed(totals, "verify (incl. LM-head rows)", gen.verify)
    gen.keep_accepted = _timed(totals, "cache compaction", gen.keep_accepted)
    prompt = torch.tensor(encode_prompt(target.tokenizer, CALIBRATION_PROMPTS[0], chat=True))
    start = time.perf_counter()
    result = gen.generate(gen.speculative_decode(target, drafter, prompt, SamplingParams(),
                                                 gen.Stopper(target.tokenizer, int(args.get("tokens", 48)), set())))
    total, rounds = time.perf_counter() - start, max(result.stats.rounds, 1)
    print(f"{rounds} rounds, tau {result.stats.accept_length:.2f}, {1000 * total / rounds:.1f} ms per round "
          f"({torch.get_num_threads()} threads), tree {shape}")
    for name, seconds in totals.items():
        print(f"  {name:30s} {1000 * seconds / rounds:7.1f} ms")
    outside = total - sum(v for k, v in totals.items() if k != "target LM-head rows")
    print(f"  {'everything else':30s} {1000 * outside / rounds:7.1f} ms")


if __name__ == "__main__":
    main(sys.argv[1:])
