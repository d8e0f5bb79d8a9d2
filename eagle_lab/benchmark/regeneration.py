"""What regenerating training replies costs, and whether its forwards could replace the capture pass:
python -m eagle_lab.benchmark.regeneration [rows=1,8,32] [prompts_per_row=2] [tokens=128] [drift=8]

Replies are decoded as `data.regenerate` decodes them: the target in its capture dtype (bf16 where
native), greedy, on the rows of one static cache with continuous batching, for first questions of
ShareGPT's held-out tail (the last conversations of the package).

- Throughput: for each row count R, 2R prompts (prompts_per_row) answered together; reply tokens
  per second of wall time, prefills included.
- Drift (`drift`=N prompts, 0 = skip): the top features the generating forwards computed against a
  capture pass over the same tokens (one forward over prompt + reply, as the corpus captures), both
  in the capture dtype, and each against an fp32 capture: relative error per position and how many
  positions keep the same greedy token. Also how many replies survive the text round trip that
  training data takes (decoded, put back into the chat template, tokenized again) token for token:
  a capture fused into generation needs those ids.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import torch

from eagle_lab.decoding.batch_generate import Reply, generate_on_rows, grouped_query_sdpa
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.models.device import training_dtype
from eagle_lab.models.target import Target, TargetConfig, load_target
from eagle_lab.training.data import DataConfig, load_conversations, tokenize_conversation
from eagle_lab.training.features import compute_features, greedy_tokens
from eagle_lab.training.regenerate import RegenerateConfig, ReplyWriter, reply_rows

CONTEXT = 1024  # the self-distillation recipes' data.max_length


def held_out_prompts(writer: ReplyWriter, count: int) -> list[tuple[list[dict], list[int]]]:
    """-> (opening messages, prompt ids) of the first questions of ShareGPT's last `count` usable conversations."""
    conversations, _ = load_conversations(DataConfig(num_conversations=0))
    out = []
    for conversation in conversations[-count:]:
        first_user = next(i for i, m in enumerate(conversation) if m["role"] == "user")
        opening = conversation[: first_user + 1]
        ids = writer.prompt_ids(opening)
        if len(ids) < CONTEXT // 2:
            out.append((opening, ids))
    return out


def decode(target: Target, rows: int, prompts: list[list[int]], tokens: int, keep_features: bool = False):
    """-> (replies, seconds) for `prompts` greedily answered on `rows` static rows (after a short
    untimed warm-up: the first forwards of a shape pay one-time kernel set-up)."""
    static = reply_rows(target, rows, CONTEXT)
    eos = set(target.eos_token_ids)
    with grouped_query_sdpa():
        generate_on_rows(static, prompts[:rows], SamplingParams(), 4, eos)
        start = time.perf_counter()
        replies = generate_on_rows(static, prompts, SamplingParams(), tokens, eos, keep_features=keep_features)
    return replies, time.perf_counter() - start


def relative_error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[T, H] x [T, H] -> [T] ||a - b|| / ||b|| per position, in float32."""
    a, b = a.float(), b.float()
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp(min=1e-6)


def drift_table(target: Target, reference: Target, writer: ReplyWriter,
                prompts: list[tuple[list[dict], list[int]]], replies: list[Reply]) -> list[str]:
    pairs = {"generation vs capture (same dtype)": [], "capture vs fp32 capture": [],
             "generation vs fp32 capture": []}
    same_greedy = {name: [0, 0] for name in pairs}
    round_trips = 0
    for (opening, prompt), reply in zip(prompts, replies):
        fed = prompt + (reply.token_ids if reply.finished else reply.token_ids[:-1])
        (captured, _), = compute_features(target, [fed])
        (exact, _), = compute_features(reference, [fed])
        generated = reply.features
        for name, (a, b) in zip(pairs, ((generated, captured), (captured, exact), (generated, exact))):
            pairs[name].append(relative_error(a, b))
            agree = greedy_tokens(reference, a.float()) == greedy_tokens(reference, b.float())
            same_greedy[name][0] += int(agree.sum())
            same_greedy[name][1] += agree.numel()
        text = writer.tokenizer.decode(reply.token_ids, skip_special_tokens=True).strip()
        ids, _ = tokenize_conversation(writer.tokenizer, opening + [{"role": "assistant", "content": text}], CONTEXT)
        round_trips += ids[: len(prompt) + len(reply.token_ids)] == prompt + reply.token_ids
    lines = ["| features | mean relative error | 99th percentile | max | same greedy token (fp32 LM head) |",
             "|---|---:|---:|---:|---:|"]
    for name, errors in pairs.items():
        flat = torch.cat(errors)
        agree, total = same_greedy[name]
        lines.append(f"| {name} | {flat.mean():.2e} | {flat.quantile(0.99):.2e} | {flat.max():.2e} | "
                     f"{agree}/{total} ({100 * agree / total:.2f}%) |")
    lines.append(f"\n{round_trips}/{len(replies)} replies keep their token ids through decode -> chat template "
                 "-> tokenize")
    return lines


def main(argv: list[str]) -> None:
    args = dict(a.split("=", 1) for a in argv)
    sizes = [int(r) for r in args.get("rows", "1,8,32").split(",")]
    per_row, tokens = int(args.get("prompts_per_row", 2)), int(args.get("tokens", 128))
    drift = int(args.get("drift", 8))
    base = TargetConfig(device="cpu")
    target = load_target(replace(base, dtype=training_dtype("auto", base)))
    writer = ReplyWriter(target, RegenerateConfig(enabled=True, max_new_tokens=tokens), CONTEXT)
    prompts = held_out_prompts(writer, max(per_row * max(sizes), drift))
    print(f"target {target.name} ({target.dtype}), {torch.get_num_threads()} threads, greedy, up to {tokens} "
          f"reply tokens, ShareGPT held-out first questions")
    print("| rows | prompts | prompt tokens | reply tokens | seconds | reply tok/s |\n|---:|---:|---:|---:|---:|---:|")
    for rows in sizes:
        chosen = [ids for _, ids in prompts[: per_row * rows]]
        replies, seconds = decode(target, rows, chosen, tokens)
        made = sum(len(r.token_ids) for r in replies)
        print(f"| {rows} | {len(chosen)} | {sum(map(len, chosen))} | {made} | {seconds:.1f} | {made / seconds:.1f} |",
              flush=True)
    if drift:
        chosen = prompts[:drift]
        replies, _ = decode(target, min(drift, 8), [ids for _, ids in chosen], tokens, keep_features=True)
        reference = load_target(replace(base, dtype="float32"))
        print("\n" + "\n".join(drift_table(target, reference, writer, chosen, replies)))


if __name__ == "__main__":
    main(sys.argv[1:])
