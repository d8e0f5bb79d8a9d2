"""Requests -> checked decoding plans (on the HTTP side) -> Decodings (on the scheduler thread).

`plan_*` run in the event loop's thread before a request is queued, so every refusal (bad
sampling values, too long, unknown model...) is a 400/404 before any model work. `start`
runs on the scheduler thread: a `Decoding` (a Sequence with the same drafter, Stopper and
TextStream as `python serve.py`), so a request's tokens and text are exactly what serve.py
prints for the same prompt and settings.
Omitted request fields take the values of the serve.py keys the server was started with
(temperature, top_p, top_k, max_new_tokens, stop, ignore_eos); an omitted seed is drawn at random.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from jinja2.exceptions import TemplateError

from eagle_lab.builders import make_generator
from eagle_lab.config import ServeConfig
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.decoding.sequence import GenerationStats, Sequence, Stopper
from eagle_lab.decoding.static_rows import StaticRows
from eagle_lab.decoding.tree import Drafter
from eagle_lab.errors import EagleLabError
from eagle_lab.models.prompts import as_tensor, encode_prompt
from eagle_lab.models.target import Target
from eagle_lab.serving.http_errors import APIError
from eagle_lab.serving.protocol import (
    MAX_STOP_STRINGS,
    NEUTRAL,
    ROLES,
    SEED_RANGE,
    ChatRequest,
    CompletionRequest,
    SamplingFields,
)
from eagle_lab.serving.text_stream import TextStream

log = logging.getLogger(__name__)


@dataclass
class Plan:
    """A checked request: everything the scheduler thread needs to decode it."""

    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stop: list[str]
    ignore_eos: bool
    seed: int


@dataclass
class Delta:
    """One round's output: its tokens and the text they release (stop strings may hold some back)."""

    token_ids: list[int]
    text: str


@dataclass
class Finished:
    tail: str  # text not yet released by a Delta
    text: str  # the whole completion, cut before a stop string
    token_ids: list[int]
    stats: GenerationStats


class _Collector:
    """TextStream's `out`: keeps what it writes until taken."""

    def __init__(self):
        self.parts: list[str] = []

    def write(self, text: str) -> None:
        self.parts.append(text)

    def flush(self) -> None:
        pass

    def take(self) -> str:
        text, self.parts = "".join(self.parts), []
        return text


def drafter_factory(prototype: Drafter | None) -> Callable[[], Drafter | None]:
    """What each new sequence calls for its drafter: a fork of the prototype (None: method=vanilla)."""
    return (lambda: None) if prototype is None else prototype.fork


class Engine:
    def __init__(self, cfg: ServeConfig, target: Target, new_drafter: Callable[[], Drafter | None],
                 rows: StaticRows):
        """rows: the static cache every sequence takes a row of (eagle_lab.decoding.static_rows)."""
        self.cfg, self.target, self.new_drafter, self.rows = cfg, target, new_drafter, rows
        self.model_name = target.name
        self.context = rows.context

    # ---- HTTP side: checks, tokenization ----

    def plan_completion(self, request: CompletionRequest) -> Plan:
        self._check_common(request)
        if not isinstance(request.prompt, str):
            raise APIError(400, "prompt must be one string (lists of prompts or token ids are not supported)",
                           "prompt")
        ids = self._encode(request.prompt, chat=False, param="prompt")
        return self._plan(request, ids, request.max_tokens, "prompt")

    def plan_chat(self, request: ChatRequest) -> Plan:
        self._check_common(request)
        if not request.messages:
            raise APIError(400, "messages must not be empty", "messages")
        messages = []
        for index, message in enumerate(request.messages):
            if message.role not in ROLES:
                raise APIError(400, f"messages[{index}].role must be one of {', '.join(ROLES)}, got "
                                    f"'{message.role}'", f"messages.{index}.role")
            text = message.text()
            if text is None:
                raise APIError(400, f"messages[{index}].content must be text", f"messages.{index}.content")
            messages.append({"role": message.role, "content": text})
        if request.max_tokens is not None and request.max_completion_tokens is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both", "max_tokens")
        max_tokens = request.max_tokens if request.max_tokens is not None else request.max_completion_tokens
        ids = self._encode(messages, chat=True, param="messages")
        return self._plan(request, ids, max_tokens, "messages")

    def _check_common(self, request: SamplingFields) -> None:
        if request.model != self.model_name:
            raise APIError(404, f"the model '{request.model}' does not exist; this server serves "
                                f"'{self.model_name}'", "model", "model_not_found")
        if request.n not in (None, 1):
            raise APIError(400, f"n must be 1 (one choice per request), got {request.n}", "n")
        for name, value in (request.model_extra or {}).items():
            if name in NEUTRAL and value not in NEUTRAL[name]:
                raise APIError(400, f"{name} is not supported by this server", name)

    def _encode(self, prompt, chat: bool, param: str) -> list[int]:
        try:
            return encode_prompt(self.target.tokenizer, prompt, chat, self.cfg.system if chat else "")
        except EagleLabError as exc:
            raise APIError(400, str(exc), param) from exc
        except TemplateError as exc:  # e.g. a template that wants alternating user/assistant turns
            raise APIError(400, f"the target's chat template refused these messages: {exc}", param) from exc

    def _plan(self, request: SamplingFields, ids: list[int], max_tokens: int | None, prompt_param: str) -> Plan:
        context = self.context
        if not ids:
            raise APIError(400, "the prompt is empty", prompt_param)
        if len(ids) >= context:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this server's context of {context} tokens "
                                "leaves no room to generate", prompt_param, "context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(self.cfg.max_new_tokens, context - len(ids))
        elif max_tokens < 1:
            raise APIError(400, f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
        elif len(ids) + max_tokens > context:
            raise APIError(400, f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds the target's "
                                f"context of {context} tokens", "max_tokens", "context_length_exceeded")
        cfg = self.cfg
        try:
            params = SamplingParams(
                cfg.temperature if request.temperature is None else request.temperature,
                cfg.top_k if request.top_k is None else request.top_k,
                cfg.top_p if request.top_p is None else request.top_p)
        except EagleLabError as exc:
            raise APIError(400, str(exc), str(exc).split()[0]) from exc  # the message starts with the field
        stop = [request.stop] if isinstance(request.stop, str) else list(cfg.stop if request.stop is None
                                                                          else request.stop)
        if len(stop) > MAX_STOP_STRINGS and request.stop is not None:
            raise APIError(400, f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
            raise APIError(400, f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {seed}", "seed")
        ignore_eos = cfg.ignore_eos if request.ignore_eos is None else request.ignore_eos
        return Plan(ids, params, max_tokens, [s for s in stop if s], ignore_eos, seed)

    # ---- scheduler thread: decoding ----

    def start(self, plan: Plan, name: str = "") -> Decoding:
        """A request's decoding state (made on the scheduler thread; the prefill runs in its first round)."""
        target = self.target
        eos = set() if plan.ignore_eos else target.eos_token_ids
        stopper = Stopper(target.tokenizer, plan.max_tokens, eos, plan.stop)
        plain = self.cfg.method == "vanilla"
        drafter = None if plain else self.new_drafter()
        sequence = Sequence(target, drafter, as_tensor(plan.prompt_ids, target.device),
                            plan.params, stopper, make_generator(plan.seed, target.device), plain=plain,
                            rows=self.rows)
        return Decoding(sequence, target.tokenizer, plan, name)


class Decoding:
    """A Sequence plus its text stream: each step returns the events the client gets this round
    (a Delta, then Finished once the sequence is done), exactly as serve.py would print them."""

    def __init__(self, sequence: Sequence, tokenizer, plan: Plan, name: str = ""):
        self.sequence, self.plan, self.name = sequence, plan, name
        self.out = _Collector()
        self.stream = TextStream(tokenizer, plan.stop, out=self.out)

    def prefill(self) -> list[Delta | Finished]:
        return self._events(self.sequence.prefill())

    def emitted(self, tokens: list[int]) -> list[Delta | Finished]:
        """The events of the tokens this round emitted (Sequence.accept's)."""
        return self._events(tokens)

    def close(self) -> None:
        """Cancelled or failed: free the caches now."""
        if not self.sequence.done:
            self.sequence.finish("cancelled")

    def _events(self, tokens: list[int]) -> list[Delta | Finished]:
        self.stream.push(tokens)
        events: list[Delta | Finished] = [Delta(tokens, self.out.take())]
        if self.sequence.done:
            stats, text = self.sequence.stats, self.stream.text()
            log.info("request %s: %d prompt + %d new tokens in %.2fs, %d target forwards, tau %.2f, stop=%s",
                     self.name, len(self.plan.prompt_ids), stats.new_tokens, stats.wall_s, stats.target_forwards,
                     stats.accept_length, stats.stop_reason)
            events.append(Finished(text[self.stream.printed:], text, list(self.stream.ids), stats))
        return events
