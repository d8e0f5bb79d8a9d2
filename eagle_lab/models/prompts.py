"""Prompts from the command line or a JSONL file, rendered with the target's chat template."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle_lab.errors import EagleLabError


def read_prompts_file(path: str) -> list[list[dict] | str]:
    """Lines of {"prompt": str} or {"messages": [{"role", "content"}, ...]}; all checked up front."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise EagleLabError(f"prompts file '{path}' does not exist or is not a file")
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise EagleLabError(f"cannot read prompts file '{path}': {exc}") from exc
    prompts: list[list[dict] | str] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EagleLabError(f"{where}: not valid JSON ({exc.msg})") from exc
        prompts.append(_parse_row(row, where))
    if not prompts:
        raise EagleLabError(f"prompts file '{path}' has no prompts")
    return prompts


def _parse_row(row, where: str) -> list[dict] | str:
    if isinstance(row, dict) and isinstance(row.get("prompt"), str):
        if not row["prompt"].strip():
            raise EagleLabError(f"{where}: the prompt is empty")
        return row["prompt"]
    if isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]:
        for message in row["messages"]:
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise EagleLabError(f"{where}: each message needs string 'role' and 'content'")
        return row["messages"]
    raise EagleLabError(f"{where}: expected {{\"prompt\": str}} or {{\"messages\": [...]}}")


def has_chat_template(tokenizer) -> bool:
    """Whether prompts can go through the tokenizer's chat template (a base model's GGUF carries none)."""
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer, prompt: list[dict] | str, chat: bool, system: str = "") -> list[int]:
    """Token ids [T] of the prompt, through the chat template unless chat=False."""
    if isinstance(prompt, str) and not prompt.strip():
        raise EagleLabError("the prompt is empty")
    if not chat:
        text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
        return tokenizer(text, add_special_tokens=True)["input_ids"]
    if not has_chat_template(tokenizer):
        raise EagleLabError("the target's tokenizer has no chat template; pass chat=false for raw text")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}] + messages
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def as_tensor(ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long, device=device)
