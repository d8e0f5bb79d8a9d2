"""Request schemas (pydantic) and response bodies in the shapes of OpenAI's API.

Unknown fields are ignored, as OpenAI clients send some we have no use for (`user`, ...);
fields for features this server does not have are accepted only at their neutral value, so
a request that asks for them is refused instead of silently answered without them.
Extensions: `top_k` and `ignore_eos` in requests; an `eagle_lab` object in responses
(`target_forwards`, `accept_length` = tau, `token_ids`, `stop_reason`).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from eagle_lab.decoding.sequence import GenerationStats

Finite = Annotated[float, Field(allow_inf_nan=False)]
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes
MAX_STOP_STRINGS = 4
ROLES = ("system", "user", "assistant")
# field -> the values that mean "not used"; anything else is refused with 400
NEUTRAL = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "suffix": (None, ""),
    "best_of": (None, 1), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "response_format": (None, {"type": "text"}), "min_tokens": (None, 0),
}
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What both endpoints take. None = the server's default (the serve.py keys it was started with)."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: Finite | None = None
    top_p: Finite | None = None
    top_k: int | None = None  # extension
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool | None = False  # null = false
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None  # extension


class CompletionRequest(SamplingFields):
    prompt: str | list | None = None  # a list is refused with a clear message (one string only)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content


class ChatRequest(SamplingFields):
    messages: list[Message]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def extension(stats: GenerationStats, token_ids: list[int]) -> dict:
    return {"target_forwards": stats.target_forwards, "accept_length": round(stats.accept_length, 4),
            "stop_reason": stats.stop_reason, "token_ids": token_ids}


class Shapes:
    """Builds the bodies of one response: a completion or a chat completion, whole or in chunks."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def whole(self, text: str, stats: GenerationStats, token_ids: list[int], prompt_tokens: int) -> dict:
        choice = {"index": 0, "logprobs": None, "finish_reason": FINISH_REASONS.get(stats.stop_reason, "stop")}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        body = self._envelope([choice], chunk=False)
        body["usage"] = usage(prompt_tokens, stats.new_tokens)
        body["eagle_lab"] = extension(stats, token_ids)
        return body

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False) -> dict:
        choice: dict = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.chat:
            choice["delta"] = ({"role": "assistant", "content": text} if first else
                               {"content": text} if text or finish_reason is None else {})
        else:
            choice["text"] = text
        return self._envelope([choice], chunk=True)

    def last_chunk(self, stats: GenerationStats, token_ids: list[int]) -> dict:
        body = self.chunk("", FINISH_REASONS.get(stats.stop_reason, "stop"))
        body["eagle_lab"] = extension(stats, token_ids)
        return body

    def usage_chunk(self, prompt_tokens: int, stats: GenerationStats) -> dict:
        body = self._envelope([], chunk=True)
        body["usage"] = usage(prompt_tokens, stats.new_tokens)
        return body
