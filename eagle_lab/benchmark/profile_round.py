"""Where a speculative round's time goes:
python -m eagle_lab.benchmark.profile_round [tokens=96] [depth=4 topk=4 total=12] [compile=true|false] [ops=true]
    [weights=auto|fp32|bf16|int8|int4|w8a8|w4a8] [head_weights=auto|fp32|bf16|w8a8|w4a8]

Decodes one calibration prompt greedily on the embedded target with its packaged head (a
random head if none), plain and speculative, on the same backend, and prints per round: the
drafting, the scoring forward (target and LM head: one graph when compiled), verification,
the commit (cache compaction) and everything else, beside one plain step. The phases come
from the round's observer hook (eagle_lab.decoding.sequence.py); nothing is patched. With ops=true,
torch's profiler then runs the plain and the speculative decode once more and prints each one's
operators by their own CPU time (a compiled graph shows as one entry).
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch

from eagle_lab.builders import build_head, eagle_drafter
from eagle_lab.config import HeadConfig
from eagle_lab.decoding.backend import DecodingConfig, build_backend, compile_choice
from eagle_lab.decoding.generate import Stopper, generate, speculative_decode, vanilla_decode
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.drafters.growth import TreeShape
from eagle_lab.errors import EagleLabError, key_values
from eagle_lab.models.device import timed_call
from eagle_lab.models.prompts import encode_prompt, has_chat_template
from eagle_lab.models.target import TargetConfig, load_target
from eagle_lab.tree_search.costs import CALIBRATION_PROMPTS

PHASES = {"drafted": "drafting", "scored": "scoring forward (target + LM head)", "verified": "verification",
          "committed": "commit (cache compaction)"}


class PhaseTimes:
    """A round observer that sums each phase's seconds."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def phase(self, name: str, seconds: float, result) -> None:
        self.seconds[name] += seconds


def main(argv: list[str]) -> None:
    args = key_values("profile_round", argv, ("tokens", "depth", "topk", "total", "compile", "ops", "weights",
                                                 "head_weights"))
    try:
        shape = TreeShape(int(args.get("depth", 4)), int(args.get("topk", 4)), int(args.get("total", 12)))
        tokens = int(args.get("tokens", 96))
        if tokens < 1:
            raise EagleLabError(f"tokens must be >= 1, got {tokens}")
        compile_choice(args.get("compile", "true"))
        target = load_target(TargetConfig(device="cpu", weights=args.get("weights", "auto")))
        head = build_head(HeadConfig(draft_weights=args.get("head_weights", "auto")), target)
    except (ValueError, EagleLabError) as err:
        raise SystemExit(f"profile_round: {err}") from None
    backend = build_backend(target, args.get("compile", "true"), DecodingConfig())
    drafter = eagle_drafter(head, target, shape, None, backend)  # compiles with the target
    chat = has_chat_template(target.tokenizer)
    prompt = torch.tensor(encode_prompt(target.tokenizer, CALIBRATION_PROMPTS[0], chat=chat))

    def plain():
        return generate(vanilla_decode(target, prompt, SamplingParams(), Stopper(target.tokenizer, tokens, set()),
                                       backend=backend))

    def speculative(observer=None):
        return generate(speculative_decode(target, drafter, prompt, SamplingParams(),
                                           Stopper(target.tokenizer, tokens, set()), backend=backend,
                                           observer=observer))

    plain(), speculative()  # warm-up (and compiles, on a compiled backend)
    base, seconds = timed_call(plain)
    plain_ms = 1000 * seconds / max(base.stats.target_forwards, 1)
    times = PhaseTimes()
    result, total = timed_call(lambda: speculative(times))
    rounds = max(result.stats.rounds, 1)
    round_ms = 1000 * total / rounds
    same = "equal to" if result.token_ids == base.token_ids else "DIFFERENT from"
    print(f"backend {backend.name}, {torch.get_num_threads()} threads, tree {shape}: {rounds} rounds, "
          f"tau {result.stats.accept_length:.2f}, greedy output {same} plain")
    print("| phase | ms per round |\n|---|---:|")
    for key, label in PHASES.items():
        print(f"| {label} | {1000 * times.seconds[key] / rounds:.1f} |")
    rest = round_ms - 1000 * sum(times.seconds.values()) / rounds
    print(f"| everything else (stopping, bookkeeping) | {rest:.1f} |")
    print(f"| **round** | **{round_ms:.1f}** |")
    print(f"| plain step (same backend, prefill included in the mean) | {plain_ms:.1f} |")
    print(f"round = {round_ms / plain_ms:.2f} plain steps; {1000 * result.stats.new_tokens / (1000 * total):.1f} tok/s "
          f"against {1000 / plain_ms:.1f} plain")
    if args.get("ops", "false").lower() == "true":
        for name, run in (("plain", plain), ("speculative", speculative)):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                run()
            print(f"\n{name} decode, operators by self CPU time:")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main(sys.argv[1:])
