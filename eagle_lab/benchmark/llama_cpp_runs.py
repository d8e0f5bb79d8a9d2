"""llama.cpp beside eagle_lab in the bench, on the same prompts, token budget, temperature and threads.

  llamacpp         plain decoding (`llama-completion`)
  llamacpp_eagle3  EAGLE-3 drafting with eagle_lab's head (`llama-speculative-simple --spec-type draft-eagle3`,
                   chains of `bench.llama_cpp_draft` tokens)
  llamacpp_ngram   n-gram drafting (`--spec-type ngram-simple`: lookup `ngram.min_match` tokens, drafts up to
                   `ngram.max_tokens`)

They need llama.cpp's tools built (`bench.llama_cpp=DIR` or $EAGLE_LAB_LLAMA_CPP, tools under DIR/build/bin) and
the GGUF pair that `python -m eagle_lab.export format=gguf` writes (`bench.gguf_dir`). Without them the methods
are skipped with one line. Each prompt is handed over as the text of eagle_lab's own prompt tokens (chat template
included); the reply comes back as text (blank lines around it dropped) and is tokenized with the target's
tokenizer. Time is llama.cpp's own
prompt processing plus decoding (model loading excluded, as eagle_lab's wall time excludes it too); tau is new
tokens per target forward, as for eagle_lab (a forward yields one token plus the drafts it accepts).
"""

from __future__ import annotations

import logging
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle_lab.benchmark.context import BenchContext, Run
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.errors import EagleLabError
from eagle_lab.models.llama_cpp import ENV, source_dir, tool

log = logging.getLogger(__name__)
LLAMA_CPP_METHODS = ("llamacpp", "llamacpp_eagle3", "llamacpp_ngram")
PLAIN_TOOL, SPECULATIVE_TOOL = "llama-completion", "llama-speculative-simple"
CONTEXT_MARGIN = 64  # context positions beyond prompt + budget (a last round's drafts)


@dataclass
class LlamaCppSetup:
    tools: Path  # llama.cpp's build/bin
    target: Path  # the target's GGUF
    head: Path | None  # the EAGLE-3 head's GGUF


def find_setup(source: str, gguf_dir: str, gguf_target: str, methods: list[str]) -> tuple[LlamaCppSetup | None, str]:
    """(what the requested llama.cpp methods need, "") or (None, why they are skipped: said in one line)."""
    wanted = [m for m in methods if m in LLAMA_CPP_METHODS]
    if not wanted:
        return None, ""
    source_path = source_dir(source)
    if source_path is None:
        return _skipped(wanted, f"no llama.cpp (bench.llama_cpp=DIR or ${ENV})")
    tools = source_path / "build" / "bin"
    needed = {PLAIN_TOOL} if "llamacpp" in wanted else set()
    needed |= {SPECULATIVE_TOOL} if set(wanted) - {"llamacpp"} else set()
    missing = [name for name in sorted(needed) if tool(source_path, name) is None]
    if missing:
        return _skipped(wanted, f"llama.cpp's {', '.join(missing)} not built under {tools} "
                                f"(cmake --build build --target {' '.join(missing)})")
    if not gguf_dir:
        return _skipped(wanted, "no GGUF files (bench.gguf_dir=DIR, from `python -m eagle_lab.export format=gguf "
                                "out=DIR`)")
    directory = Path(gguf_dir).expanduser()
    target = directory / gguf_target if gguf_target else _default_target(directory)
    if target is None or not target.is_file():
        raise EagleLabError(f"bench.gguf_dir={gguf_dir}: no target GGUF "
                            f"({gguf_target or 'target-*.gguf'}); export one with format=gguf")
    head = directory / "head.gguf"
    if "llamacpp_eagle3" in wanted and not head.is_file():
        raise EagleLabError(f"bench.gguf_dir={gguf_dir}: no head.gguf for llamacpp_eagle3")
    return LlamaCppSetup(tools, target, head if head.is_file() else None), ""


def _skipped(methods: list[str], why: str) -> tuple[None, str]:
    log.warning("bench: %s skipped: %s", ", ".join(methods), why)
    return None, f"skipped: {why}"


def _default_target(directory: Path) -> Path | None:
    found = sorted(directory.glob("target-*.gguf"))
    preferred = [p for p in found if p.name == "target-f32.gguf"]
    return (preferred or found or [None])[0]


def command_for(setup: LlamaCppSetup, method: str, prompt_file: Path, budget: int, context: int, threads: int,
                params: SamplingParams, seed: int, ignore_eos: bool, draft: int, ngram_lookup: int,
                ngram_tokens: int, extra: list[str] = ()) -> list[str]:
    """The llama.cpp command line that runs `method` on one prompt; `extra` (bench.llama_cpp_args) goes last."""
    binary = PLAIN_TOOL if method == "llamacpp" else SPECULATIVE_TOOL
    command = [str(setup.tools / binary), "-m", str(setup.target), "-f", str(prompt_file), "-n", str(budget),
               "-c", str(context), "-t", str(threads), "-tb", str(threads), "--seed", str(seed)]
    if params.greedy:
        command += ["--temp", "0"]
    else:
        command += ["--temp", str(params.temperature), "--top-k", str(params.top_k), "--top-p", str(params.top_p),
                    "--min-p", "0"]
    if ignore_eos:
        command.append("--ignore-eos")
    if method == "llamacpp":
        command += ["-no-cnv", "--no-display-prompt", "--no-warmup"]
    elif method == "llamacpp_eagle3":
        command += ["-md", str(setup.head), "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(draft)]
    else:
        command += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(ngram_lookup),
                    "--spec-ngram-simple-size-m", str(ngram_tokens)]
    return command + [str(arg) for arg in extra]


_NUMBER = r"([0-9]+(?:\.[0-9]+)?)"


@dataclass
class Timing:
    """What llama.cpp's log says about one run."""

    prompt_s: float  # prompt processing
    decode_s: float  # decoding (speculative: drafting and verifying)
    decode_runs: int | None = None  # plain: one-token forwards after the prompt
    generated: int | None = None  # speculative: tokens generated
    accepted: int | None = None  # speculative: drafted tokens accepted


def parse_timing(method: str, log_text: str) -> Timing:
    if method == "llamacpp":
        prompt = re.search(r"prompt eval time =\s*" + _NUMBER + r" ms", log_text)
        decode = re.search(r"\beval time =\s*" + _NUMBER + r" ms /\s*(\d+) runs", log_text)
        if not (prompt and decode):
            raise EagleLabError("llama.cpp's log has no prompt eval / eval times")
        return Timing(float(prompt.group(1)) / 1000, float(decode.group(1)) / 1000, decode_runs=int(decode.group(2)))
    encoded = re.search(r"encoded\s+\d+ tokens in\s+" + _NUMBER + " seconds", log_text)
    decoded = re.search(r"decoded\s+\d+ tokens in\s+" + _NUMBER + " seconds", log_text)
    generated = re.search(r"n_predict\s*=\s*(\d+)", log_text)
    accepted = re.search(r"n_accept\s*=\s*(\d+)", log_text)
    if not (encoded and decoded and generated and accepted):
        raise EagleLabError("llama.cpp's log has no encoded / decoded times, n_predict or n_accept")
    return Timing(float(encoded.group(1)), float(decoded.group(1)), generated=int(generated.group(1)),
                  accepted=int(accepted.group(1)))


END_OF_TEXT = " [end of text]"  # what llama-completion prints after the reply when it stops at end of text


def reply_text(stdout: str, prompt_text: str) -> str:
    """The generated text from a llama.cpp tool's standard output: blank lines around it dropped, the prompt
    that `llama-speculative-simple` echoes and the end-of-text marker that `llama-completion` prints."""
    text = stdout.strip("\n")
    if text.startswith(prompt_text.strip("\n")):
        text = text[len(prompt_text.strip("\n")):]
    text = text.strip("\n")
    return text[: -len(END_OF_TEXT)] if text.endswith(END_OF_TEXT) else text


def run_llama_cpp(ctx: BenchContext, setup: LlamaCppSetup, method: str, prompt_ids: list[int],
                  params: SamplingParams) -> Run:
    """One prompt through llama.cpp; the reply's tokens, llama.cpp's time and its target forwards."""
    cfg, tokenizer = ctx.cfg, ctx.target.tokenizer
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=False)
    with tempfile.TemporaryDirectory() as scratch:
        prompt_file = Path(scratch) / "prompt.txt"
        prompt_file.write_text(prompt_text)
        # llama-completion prints one token fewer than -n: it stops before showing the last one it sampled
        budget = cfg.max_new_tokens + (method == "llamacpp")
        command = command_for(setup, method, prompt_file, budget,
                              len(prompt_ids) + cfg.max_new_tokens + CONTEXT_MARGIN, torch.get_num_threads(),
                              params, cfg.seed, not ctx.eos, cfg.bench.llama_cpp_draft, cfg.ngram.min_match,
                              cfg.ngram.max_tokens, list(cfg.bench.llama_cpp_args))
        # a sampled reply can end inside a multi-byte character (the budget cuts it): read it as far as it goes
        done = subprocess.run(command, capture_output=True, text=True, errors="replace")
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise EagleLabError(f"llama.cpp ({method}) failed with exit code {done.returncode}: {tail}")
    timing = parse_timing(method, done.stderr + done.stdout)
    token_ids = tokenizer(reply_text(done.stdout, prompt_text), add_special_tokens=False)["input_ids"]
    token_ids = token_ids[: cfg.max_new_tokens]
    stop = "length" if len(token_ids) >= cfg.max_new_tokens else "eos"
    if stop == "eos" and ctx.eos:
        token_ids = token_ids + [min(ctx.eos)]  # llama.cpp prints no end-of-turn text; eagle_lab counts it
    if method == "llamacpp":  # at the budget, the last forward sampled a token past it: not counted
        runs = timing.decode_runs or 1
        decode_s = timing.decode_s * (runs - 1) / runs if stop == "length" else timing.decode_s
        return Run(token_ids, timing.prompt_s + decode_s, len(token_ids), stop)
    # a last round may run past the budget: time and forwards scaled to the tokens kept
    kept = len(token_ids) / max(timing.generated, 1)
    forwards = round((timing.generated - timing.accepted) * kept)
    return Run(token_ids, (timing.prompt_s + timing.decode_s) * kept, max(forwards, 1), stop)
