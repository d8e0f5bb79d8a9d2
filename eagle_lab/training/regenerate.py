"""Self-distillation data: the conversations' assistant replies rewritten by the target itself.

A head learns to predict the target, so the best training text is what the target writes:
ShareGPT's replies come from another model, and the features of text the target would never
produce teach the head patterns it will not meet when serving. `data.regenerate.enabled=true`
keeps each conversation's system and user turns and asks the target for every assistant reply
(up to `max_turns`), feeding its own earlier replies back as history, as Medusa-2, EAGLE-3 and
HASS do for their training sets.

Layout: the conversations are cut, in source order, into blocks of `block_conversations`; inside
a block they are sorted by prompt length and cut into chunks of `batch_size`. A chunk's contents
depend only on its block, so asking for more conversations later reuses every chunk already
written. Each finished chunk is its own JSON file, written atomically: a killed run resumes at the
first missing chunk, and ranks deal out the missing chunks between them.

Decoding: by default on the `rows` rows of one static cache with continuous batching
(eagle_lab.decoding.generate.decode_prompts), several chunks at a time, so no row computes past the end
of its reply; a target the static cache cannot hold, or `rows=0`, uses a batched Hugging Face
`generate` per chunk. Each conversation samples from its own seed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from eagle_lab.decoding.backend import StaticBackend
from eagle_lab.decoding.generate import decode_prompts
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.decoding.static_rows import StaticRows
from eagle_lab.errors import EagleLabError
from eagle_lab.models.embedded import cache_root
from eagle_lab.models.gguf_weights import FILE_WEIGHTS
from eagle_lab.models.stable_linear import WEIGHTS
from eagle_lab.models.target import Target, grouped_query_sdpa

log = logging.getLogger(__name__)
Messages = list[dict[str, str]]


@dataclass
class RegenerateConfig:
    enabled: bool = False
    max_new_tokens: int = 256  # per reply; a reply cut here ends its conversation
    temperature: float = 0.0  # 0 = greedy, the text temperature-0 serving will see
    top_p: float = 1.0
    max_turns: int = 1  # assistant replies regenerated per conversation; 0 = all of them
    batch_size: int = 32  # conversations per chunk file (and per generate call when rows=0)
    block_conversations: int = 512  # conversations sorted by length together (see the module docstring)
    seed: int = 0  # sampling seed (temperature > 0); each conversation's is derived from it and its place
    rows: int = 32  # sequences decoded together on a static cache; 0: Hugging Face generate per chunk
    group_chunks: int = 8  # chunks decoded together on the rows (written as each group ends)
    samples: int = 1  # replies per training conversation, each with its own seed (> 1 needs temperature > 0)
    # "" = the replies come from the training target as loaded; a target.weights name (auto, w4a8, ...) = from the
    # target loaded again on CPU with its linear layers stored that way: how it decodes when served, and on 32 rows
    # a faster reply rate than the bf16 target with w4a8 (docs/design-training.md, "At the served precision")
    weights: str = ""

    def validate(self) -> None:
        if self.max_new_tokens < 1 or self.batch_size < 1 or self.max_turns < 0 or self.block_conversations < 1 \
                or self.rows < 0 or self.group_chunks < 1:
            raise EagleLabError("data.regenerate needs max_new_tokens >= 1, batch_size >= 1, max_turns >= 0, "
                                "block_conversations >= 1, rows >= 0 and group_chunks >= 1")
        if self.samples < 1 or (self.samples > 1 and self.temperature == 0):
            raise EagleLabError(f"data.regenerate.samples must be >= 1, and > 1 only with temperature > 0 (greedy "
                                f"replies repeat), got samples={self.samples}, temperature={self.temperature}")
        if self.weights and self.weights not in ("auto", *WEIGHTS, *FILE_WEIGHTS):
            raise EagleLabError(f"data.regenerate.weights must be empty (the training target) or one of auto, "
                                f"{', '.join(WEIGHTS + FILE_WEIGHTS)}, got '{self.weights}'")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise EagleLabError(f"data.regenerate needs temperature >= 0 and 0 < top_p <= 1, got "
                                f"temperature={self.temperature}, top_p={self.top_p}")


def regenerate_key(target_name: str, source: dict, cfg: RegenerateConfig) -> str:
    """Cache key: the target (and its dtype, in `source`), where the conversations came from and
    how they are rewritten; not how many, so every size shares one directory."""
    # how, not what; the writing target's weights are in `source`
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("enabled", "rows", "group_chunks", "weights")}
    if settings["samples"] == 1:
        del settings["samples"]  # one reply per conversation: the layout keys written before samples existed
    blob = json.dumps({"target": target_name, "source": source, "regenerate": settings, "layout": 2}, sort_keys=True)
    return f"{target_name}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


Rewrite = Callable[[list[Messages], str], list[Messages | None]]  # (conversations, split name) -> rewritten


def regenerated_pool(rewrite: Rewrite, conversations: list[Messages], held: int, count: int,
                     block: int) -> tuple[list[Messages], int, int, int]:
    """A feature corpus's pool for self-distillation: the held-out tail (the source's last `held`
    conversations) and the first `count` (0 = all) training conversations, rewritten by the target.
    The training part is rounded up to whole blocks, so a later, larger `count` reuses every chunk.

    -> (training conversations kept + tail kept, tail kept, training kept of the first `count`, dropped);
    a rewrite that answers each training conversation several times (`data.regenerate.samples`)
    counts every reply.
    """
    train, tail = conversations[:-held], conversations[-held:]
    count = count or len(train)
    wanted = min(len(train), math.ceil(count / block) * block)
    new_train = rewrite(train[:wanted], "train")
    samples = len(new_train) // max(wanted, 1)  # replies per conversation (data.regenerate.samples)
    new_tail = [c for c in rewrite(tail, "eval") if c]
    kept_of_count = sum(1 for c in new_train[:count * samples] if c)
    kept = [c for c in new_train if c]
    dropped = sum(1 for c in new_train[:count * samples] if not c) + held - len(new_tail)
    return kept + new_tail, len(new_tail), kept_of_count, dropped


def chunk_order(conversations: list[Messages], batch_size: int, block: int = 1 << 30) -> list[list[int]]:
    """Conversation indices grouped into chunks of `batch_size` by first-prompt length, within
    consecutive blocks of `block` conversations (a chunk never spans two blocks)."""
    first_prompt = [sum(len(m["content"]) for m in _opening(c)) for c in conversations]
    chunks = []
    for first in range(0, len(conversations), block):
        order = sorted(range(first, min(first + block, len(conversations))), key=lambda i: (first_prompt[i], i))
        chunks += [order[start: start + batch_size] for start in range(0, len(order), batch_size)]
    return chunks


def _opening(messages: Messages) -> Messages:
    """The system message (if any) and the first user turn."""
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    return messages[: first_user + 1]


def _user_turns(messages: Messages) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "user"]


class ReplyWriter:
    """Batched replies from the target (its Hugging Face model and chat template); rows: the static
    cache to decode on (None: Hugging Face generate)."""

    def __init__(self, target: Target, cfg: RegenerateConfig, max_length: int, autocast=contextlib.nullcontext,
                 rows: StaticRows | None = None):
        tokenizer = target.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise EagleLabError("data.regenerate needs a target tokenizer with a chat template")
        self.model, self.tokenizer, self.cfg = target.model, tokenizer, cfg
        self.max_length, self.autocast, self.rows = max_length, autocast, rows
        self.eos_ids = target.eos_token_ids
        self.generated_tokens = 0  # reply tokens written so far (progress lines)
        self.on_reply: Callable[[int], None] | None = None  # told each reply's token count as it ends (progress)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def prompt_ids(self, history: Messages) -> list[int]:
        text = self.tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def replies(self, prompts: list[list[int]], seeds: list[int]) -> list[tuple[str, bool]]:
        """Token-id prompts, one seed each -> [(reply text, finished)], finished = it ended with an eos
        token rather than at max_new_tokens or at `max_length` tokens of prompt plus reply."""
        if self.rows is not None:
            params = SamplingParams(self.cfg.temperature, 0, self.cfg.top_p)
            told = None if self.on_reply is None else (lambda index, reply: self.on_reply(len(reply.token_ids)))
            with grouped_query_sdpa():
                out = decode_prompts(self.rows, prompts, params, self.cfg.max_new_tokens, self.eos_ids, seeds,
                                       on_reply=told)
            replies = [(reply.token_ids, reply.finished) for reply in out]
        else:
            replies = self._generated(prompts, seeds[0])
            if self.on_reply is not None:
                for reply, _ in replies:
                    self.on_reply(len(reply))
        results = []
        for reply, finished in replies:
            self.generated_tokens += len(reply)
            results.append((self.tokenizer.decode(reply, skip_special_tokens=True).strip(), finished))
        return results

    @torch.no_grad()
    def _generated(self, prompts: list[list[int]], seed: int) -> list[tuple[list[int], bool]]:
        """The prompts as one batch through Hugging Face generate (one seed for the batch)."""
        width = max(len(p) for p in prompts)
        device = self.model.device
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # [B, W], left padded
        attention_mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(prompts):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention_mask[row, width - len(ids):] = 1
        sampling = {"do_sample": True, "temperature": self.cfg.temperature, "top_p": self.cfg.top_p, "top_k": 0} \
            if self.cfg.temperature > 0 else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), self.autocast():  # training's RNG stream stays untouched
            torch.manual_seed(seed)
            out = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                      max_new_tokens=self.cfg.max_new_tokens, pad_token_id=self.pad_id, **sampling)
        results = []
        for prompt, row in zip(prompts, out[:, width:].tolist()):  # [B, new] generated ids, padded after the eos
            row = row[: self.max_length - len(prompt)]
            end = next((i for i, token in enumerate(row) if token in self.eos_ids), None)
            results.append((row if end is None else row[:end], end is not None))
        return results

    def rewrite(self, conversations: list[Messages], seeds: list[int]) -> list[Messages | None]:
        """The conversations (one seed each) with their assistant replies written by the model, turn
        by turn for the whole batch; None where not even the first reply could be written."""
        histories = [_opening(c) for c in conversations]
        users = [_user_turns(c) for c in conversations]
        active = list(range(len(conversations)))
        turns = self.cfg.max_turns or max(len(u) for u in users)
        for turn in range(turns):
            prompts = {i: self.prompt_ids(histories[i]) for i in active}
            active = [i for i in active if len(prompts[i]) < self.max_length]  # room for >= 1 new token
            if not active:
                break
            replies = self.replies([prompts[i] for i in active], [seeds[i] * 64 + turn for i in active])
            still = []
            for i, (text, finished) in zip(active, replies):
                if not text:
                    continue
                histories[i].append({"role": "assistant", "content": text})
                if finished and turn + 1 < len(users[i]):  # a cut reply would not fit the next question
                    histories[i].append({"role": "user", "content": users[i][turn + 1]})
                    still.append(i)
            active = still
        for history in histories:
            while history and history[-1]["role"] == "user":
                history.pop()
        return [h if any(m["role"] == "assistant" for m in h) else None for h in histories]


class TargetRewrite:
    """(conversations, split name) -> the conversations with the target's replies (None: dropped),
    cached under `directory`/<split>."""

    def __init__(self, writer: ReplyWriter, directory: Path, rank: int, world: int, barrier: Callable[[], None]):
        self.writer, self.directory, self.rank, self.world, self.barrier = writer, directory, rank, world, barrier

    def __call__(self, conversations: list[Messages], split: str) -> list[Messages | None]:
        """Training conversations are answered `samples` times each (consecutive in the result); a
        held-out split once."""
        if split == "train" and self.writer.cfg.samples > 1:
            conversations = [c for c in conversations for _ in range(self.writer.cfg.samples)]
        return regenerate_conversations(self.writer, conversations, self.directory / split, self.rank, self.world,
                                        self.barrier)


def target_rewrite(target: Target, data, rank: int = 0, world: int = 1, barrier: Callable[[], None] = lambda: None,
                   autocast=contextlib.nullcontext) -> TargetRewrite:
    """The rewrite for `data` (a DataConfig with regenerate enabled) by `target` (the training target, or the one
    data.regenerate.weights loads), cached under <cache>/regenerated/<key>: the key holds the target, its dtype and
    weights, the source and the settings."""
    data.regenerate.validate()
    source = {"source": data.source, "path": data.path, "max_length": data.max_length, "dtype": str(target.dtype)}
    if data.regenerate.weights:
        source["weights"] = target.weights
    directory = cache_root() / "regenerated" / regenerate_key(target.name, source, data.regenerate)
    how = f" ({target.weights} weights)" if data.regenerate.weights else ""
    log.info("regenerate: replies by the target%s, cached in %s", how, directory)
    rows = reply_rows(target, data.regenerate.rows, data.max_length)
    writer = ReplyWriter(target, data.regenerate, data.max_length, autocast=autocast, rows=rows)
    return TargetRewrite(writer, directory, rank, world, barrier)


def reply_rows(target: Target, rows: int, max_length: int) -> StaticRows | None:
    """The static cache replies are decoded on (None: Hugging Face generate). Eager: a compiled 32-row bf16
    step was slower than the eager one on CPU."""
    if rows == 0:
        return None
    backend = StaticBackend(target, buckets=[1], compiled=False)
    try:
        return StaticRows(backend, rows, max_length, token_buckets=[1], row_counts=[rows])
    except EagleLabError as err:
        log.info("regenerate: Hugging Face generate instead of the static cache (%s)", err)
        return None


def _write_json(path: Path, payload: dict) -> None:
    fd, staging = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, ensure_ascii=False)
    os.replace(staging, path)  # atomic: a killed run never leaves half a chunk


def regenerate_conversations(
    writer: ReplyWriter,
    conversations: list[Messages],
    directory: Path,
    rank: int = 0,
    world: int = 1,
    barrier: Callable[[], None] = lambda: None,
) -> list[Messages | None]:
    """-> the rewritten conversations in their original order (None: dropped, its first prompt
    leaves no room under max_length or its reply was empty).

    Chunks already under `directory` are reused; the missing ones are dealt out between the ranks
    (every `world`-th from `rank`), then all ranks wait at `barrier` and read every chunk. A chunk file
    that holds other conversations than its slot expects (written for a shorter, partial last block) is
    written again.
    """
    directory.mkdir(parents=True, exist_ok=True)
    cfg = writer.cfg
    chunks = chunk_order(conversations, cfg.batch_size, cfg.block_conversations)
    barrier()  # every rank lists what is missing before any rank writes
    missing = [c for c in range(len(chunks)) if _read_chunk(directory, c, chunks[c]) is None]
    barrier()
    todo = missing[rank::world]  # the missing chunks dealt out, so a resumed run keeps every rank busy
    if len(missing) < len(chunks) and rank == 0:
        log.info("regenerate: reusing %d of %d chunks already in %s", len(chunks) - len(missing), len(chunks),
                 directory)
    progress = RegenerateProgress(sum(len(chunks[c]) for c in todo), len(todo))
    with tqdm(total=progress.conversations, desc="regenerate", unit="conv",
              disable=rank != 0 or not todo) as bar:
        def replied(tokens: int) -> None:  # a group of chunks takes minutes: show each reply as it ends
            progress.reply(tokens)
            bar.set_postfix_str(progress.live(), refresh=True)

        writer.on_reply = replied
        group = cfg.group_chunks if writer.rows is not None else 1
        for first in range(0, len(todo), group):
            ids = todo[first:first + group]
            before = writer.generated_tokens
            indices = [i for c in ids for i in chunks[c]]
            seeds = [(cfg.seed + c) * 1000 + j for c in ids for j in range(len(chunks[c]))]
            rewritten = writer.rewrite([conversations[i] for i in indices], seeds)
            for c in ids:
                part, rewritten = rewritten[:len(chunks[c])], rewritten[len(chunks[c]):]
                _write_json(directory / f"chunk-{c:05d}.json", {"indices": chunks[c], "conversations": part})
            bar.update(len(indices))
            progress.add(len(indices), writer.generated_tokens - before, len(ids))
            if rank == 0:
                log.info("regenerate: %s", progress.line())
    barrier()
    rewritten_by_index: dict[int, Messages | None] = {}
    for c, indices in enumerate(chunks):
        payload = _read_chunk(directory, c, indices)
        if payload is None:
            raise EagleLabError(f"regenerated chunk {directory / f'chunk-{c:05d}.json'} is missing or unreadable; "
                                "run again to write it")
        rewritten_by_index.update(zip(indices, payload))
    return [rewritten_by_index.get(i) or None for i in range(len(conversations))]


def _read_chunk(directory: Path, c: int, indices: list[int]) -> list[Messages | None] | None:
    """The conversations of chunk `c`, or None when it is not on disk (or holds other indices)."""
    path = directory / f"chunk-{c:05d}.json"
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as err:
        log.warning("regenerate: %s is unreadable (%s); writing it again", path, err)
        return None
    if payload.get("indices") != indices:
        return None
    return payload["conversations"]


class RegenerateProgress:
    """One line per chunk group: conversations done, reply tokens per second, time left."""

    def __init__(self, conversations: int, chunks: int):
        self.conversations, self.chunks = conversations, chunks
        self.done_conversations = self.done_chunks = self.tokens = 0
        self.live_replies = self.live_tokens = 0
        self.start = time.perf_counter()

    def add(self, conversations: int, tokens: int, chunks: int = 1) -> None:
        self.done_conversations += conversations
        self.done_chunks += chunks
        self.tokens += tokens
        self.live_replies = self.live_tokens = 0  # now counted in the totals

    def reply(self, tokens: int) -> None:
        """One reply of the group in progress ended, with `tokens` tokens."""
        self.live_replies += 1
        self.live_tokens += tokens

    def live(self) -> str:
        """The group in progress: replies ended so far, and reply tok/s since the start."""
        elapsed = time.perf_counter() - self.start
        return (f"{self.live_replies} replies in this group, "
                f"{(self.tokens + self.live_tokens) / max(elapsed, 1e-9):.1f} reply tok/s")

    def line(self) -> str:
        elapsed = time.perf_counter() - self.start
        left = elapsed * (self.conversations - self.done_conversations) / max(self.done_conversations, 1)
        return (f"chunk {self.done_chunks}/{self.chunks}, {self.done_conversations}/{self.conversations} "
                f"conversations, {self.tokens / max(elapsed, 1e-9):.1f} reply tok/s, "
                f"elapsed {elapsed / 60:.1f} min, ETA {left / 60:.1f} min")
