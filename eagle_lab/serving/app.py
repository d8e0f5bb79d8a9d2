"""FastAPI routes. Handlers run on the event loop; the model runs on the scheduler thread.

A request: check the key -> parse JSON -> validate fields (pydantic) -> plan (engine, 400/404)
-> submit to the scheduler (429 when the waiting list is full) -> await its events on an
asyncio.Queue fed from the scheduler thread -> one JSON body, or SSE chunks then
`data: [DONE]`. A client that goes away cancels its job, which frees its slot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from eagle_lab.serving.engine import Delta, Engine, Finished, Plan
from eagle_lab.serving.http_errors import APIError, error_body
from eagle_lab.serving.protocol import ChatRequest, CompletionRequest, Shapes
from eagle_lab.serving.scheduler import Failed, Job, QueueFull, Scheduler, SchedulerStopped

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.5  # a non-streaming request checks this often whether its client is still there
MAX_BODY_BYTES = 32 << 20  # far above any prompt a target's context holds; larger bodies get 413


@dataclass(eq=False)
class Ticket:
    """A handler's hold on its job: the queue its events arrive on, and whether the last one came."""

    job: Job
    queue: asyncio.Queue
    ended: bool = False


class TicketStream(StreamingResponse):
    """A StreamingResponse that releases its job however the response ends, even when the client
    left before the body generator ever started (then the generator's own `finally` never runs)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def create_app(engine: Engine, scheduler: Scheduler, api_key: str = "") -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        scheduler.start()
        yield
        scheduler.stop()  # uvicorn has already waited for the in-flight requests

    app = FastAPI(title="eagle_lab", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    def authorize(request: Request) -> None:
        if not api_key:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key (send Authorization: Bearer <key>)", None,
                           "invalid_api_key")

    @app.get("/health")
    async def health() -> JSONResponse:
        status = 200 if scheduler.alive else 503
        return JSONResponse({"status": "ok" if status == 200 else "scheduler stopped", "model": engine.model_name,
                             "active": scheduler.active, "waiting": scheduler.waiting, **scheduler.counts},
                            status_code=status)

    def model_card() -> dict:
        return {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "eagle_lab"}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request) -> dict:
        authorize(request)
        if model != engine.model_name:
            raise APIError(404, f"the model '{model}' does not exist", "model", "model_not_found")
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        body = await parse(request, CompletionRequest)
        return await respond(request, body, engine.plan_completion(body), Shapes(chat=False, model=engine.model_name))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        body = await parse(request, ChatRequest)
        return await respond(request, body, engine.plan_chat(body), Shapes(chat=True, model=engine.model_name))

    async def respond(request: Request, body, plan: Plan, shapes: Shapes):
        ticket = submit(plan, shapes.id)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return TicketStream(sse(ticket, shapes, len(plan.prompt_ids), include_usage), lambda: release(ticket),
                                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await whole(request, ticket, shapes, len(plan.prompt_ids))

    def submit(plan: Plan, name: str) -> Ticket:
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()  # holds at most max_tokens + 2 events

        def deliver(event: object) -> None:  # called on the scheduler thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                job.cancelled.set()

        job = Job(start=lambda: engine.start(plan, name), deliver=deliver, name=name)
        try:
            scheduler.submit(job)
        except QueueFull as exc:
            raise APIError(429, f"the server is busy: {exc}; retry later", None, "queue_full") from exc
        except SchedulerStopped as exc:
            raise APIError(503, str(exc)) from exc
        return Ticket(job, queue)

    def release(ticket: Ticket) -> None:
        """The handler is done with its job: cancel it unless its last event arrived (idempotent)."""
        if not ticket.ended and not ticket.job.cancelled.is_set():
            log.info("request %s: the client went away; cancelled", ticket.job.name)
            scheduler.cancel(ticket.job)

    async def whole(request: Request, ticket: Ticket, shapes: Shapes, prompt_tokens: int):
        next_check = loop_time() + DISCONNECT_POLL_S
        try:
            while True:
                try:  # events arrive every round, so the client is checked on a clock, not on a quiet queue
                    event = await asyncio.wait_for(ticket.queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    event = None
                if isinstance(event, (Finished, Failed)):
                    ticket.ended = True
                    if isinstance(event, Failed):
                        raise APIError(event.status, event.message)
                    return shapes.whole(event.text, event.stats, event.token_ids, prompt_tokens)
                if loop_time() >= next_check:
                    next_check = loop_time() + DISCONNECT_POLL_S
                    if await request.is_disconnected():  # nobody reads the answer: released below
                        return JSONResponse(error_body(400, "client disconnected"), status_code=400)
        finally:
            release(ticket)  # also when the handler itself is cancelled

    async def sse(ticket: Ticket, shapes: Shapes, prompt_tokens: int, include_usage: bool) -> AsyncIterator[str]:
        # On a disconnect Starlette cancels this generator (or never starts it): TicketStream releases the job.
        try:
            if shapes.chat:
                yield data(shapes.chunk("", first=True))
            while True:
                event = await ticket.queue.get()
                if isinstance(event, Delta) and event.text:
                    yield data(shapes.chunk(event.text))
                elif isinstance(event, Finished):
                    ticket.ended = True
                    if event.tail:
                        yield data(shapes.chunk(event.tail))
                    yield data(shapes.last_chunk(event.stats, event.token_ids))
                    if include_usage:
                        yield data(shapes.usage_chunk(prompt_tokens, event.stats))
                    break
                elif isinstance(event, Failed):  # the status line is sent already: report in the stream
                    ticket.ended = True
                    yield data(error_body(event.status, event.message))
                    break
            yield "data: [DONE]\n\n"
        finally:
            release(ticket)

    return app


async def read_body(request: Request) -> bytes:
    """The body, refused with 413 past MAX_BODY_BYTES (declared or actually sent): memory stays bounded."""
    declared = request.headers.get("content-length", "")
    too_big = APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def parse(request: Request, schema: type[BaseModel]) -> BaseModel:
    """The body as `schema`, or a 400 naming the offending field."""
    raw = await read_body(request)
    try:
        payload = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(payload, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return schema.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise APIError(400, f"{where}: {first['msg']}" if where else first["msg"], where or None) from exc


def loop_time() -> float:
    return asyncio.get_running_loop().time()


def data(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

