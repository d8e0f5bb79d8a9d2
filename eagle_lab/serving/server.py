"""`python serve.py mode=server`: check the config, bind, load, then serve until SIGTERM/SIGINT.

Order matters for users: a bad `server.*` value or a taken port ends in one `error:` line
before the model loads (which can take long); the socket is bound first but only listened
on once the model is ready, so a client never reaches a half-loaded server.
"""

from __future__ import annotations

import logging
import signal
import socket

from eagle_lab.builders import make_drafter
from eagle_lab.config import ServeConfig, ServerConfig
from eagle_lab.decoding.backend import DecodingConfig, StaticBackend, build_backend
from eagle_lab.decoding.gc_freeze import freeze_loaded_objects
from eagle_lab.decoding.static_rows import StaticRows
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.errors import EagleLabError
from eagle_lab.models.target import load_target
from eagle_lab.serving.batch_trees import BatchTrees, build_row_graphs, choose_batch_trees
from eagle_lab.serving.batching import BatchScheduler
from eagle_lab.serving.engine import Engine, drafter_factory
from eagle_lab.serving.scheduler import ModelThread
from eagle_lab.tree_search.costs import calibration_prompts

log = logging.getLogger(__name__)
SERVER_TEMPERATURES = (0.0, 0.7, 1.0)  # the temperatures the tree per batch size is timed at (a request: the nearest)
BATCH_TIMING_TOKENS = 48  # tokens each calibration prompt decodes when drafting is timed against plain decoding


def check_server_config(cfg: ServerConfig) -> None:
    if not 0 <= cfg.port <= 65535:
        raise EagleLabError(f"server.port must be in 0..65535 (0 = any free port), got {cfg.port}")
    if cfg.max_batch < 1:
        raise EagleLabError(f"server.max_batch must be >= 1, got {cfg.max_batch}")
    if cfg.context < 2:
        raise EagleLabError(f"server.context must be >= 2 tokens (prompt + completion), got {cfg.context}")
    if cfg.max_queue < 1:
        raise EagleLabError(f"server.max_queue must be >= 1, got {cfg.max_queue}")
    if not cfg.host.strip():
        raise EagleLabError("server.host is empty (127.0.0.1 serves this machine only)")


def bind(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) TCP socket; EagleLabError when the address is unusable."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise EagleLabError(f"cannot listen on {host}:{port}: {exc}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise EagleLabError(f"cannot listen on {host}:{port}: {exc}") from exc
    return sock


def build_app(cfg: ServeConfig, model_thread: ModelThread | None = None):
    """Load the target (and head), then the engine, scheduler and FastAPI app. Also used by tests.
    model_thread: the thread this runs on, where the scheduler's loop is to run too (None: a thread of its own)."""
    from eagle_lab.serving.app import create_app  # fastapi is an optional extra: imported only to serve

    target = load_target(cfg.target)
    backend, rows, prototype, trees = prepare_decoding(cfg, target)
    engine = Engine(cfg, target, drafter_factory(prototype), rows)
    scheduler = BatchScheduler(cfg.server.max_batch, cfg.server.max_queue, target, rows, trees,
                               model_thread=model_thread)
    return create_app(engine, scheduler, cfg.server.api_key), engine, scheduler


def prepare_decoding(cfg: ServeConfig, target):
    """Everything the server decodes with, ready before it listens: the backend, the static rows, the
    prototype drafter and the tree per batch size. Compiled, every graph a request may need is built (or
    loaded) here, then building stops: a missing one later runs eagerly, and no request waits for a compile.
    `python -m eagle_lab.compile` calls it too, so that a server's start only loads."""
    backend = build_backend(target, cfg.compile, cfg.decoding, compile_ahead=True)
    rows = serving_rows(backend, cfg.server.max_batch, cfg.server.context, cfg.decoding)
    prototype = make_drafter(cfg, target, backend)
    eagle = prototype if isinstance(prototype, EagleDrafter) else None
    if rows.backend.compiled and (eagle is not None or prototype is None):
        build_row_graphs(target, eagle, rows, calibration_prompts(target)[0], SERVER_TEMPERATURES)
    if isinstance(backend, StaticBackend):
        backend.stop_building()
        if eagle is not None:
            eagle.stop_building()
    # timed as the server will run: a shape whose graph was not built above runs eagerly, there as here
    trees = batch_trees(cfg, target, prototype, rows)
    return backend, rows, prototype, trees


def serving_rows(backend, max_batch: int, context: int, decoding: DecodingConfig) -> StaticRows:
    """One static cache of max_batch rows of `context` tokens that every sequence decodes in
    (eagle_lab/decoding/static_rows.py): the backend's compiled step, or an eager static step (sized by
    `decoding`, as a compiled one is) when the backend is eager."""
    if not isinstance(backend, StaticBackend):
        backend = StaticBackend(backend.target, decoding.buckets, decoding.cache_block, compiled=False)
    log.info("%s decoding: %d rows of %d tokens in one static cache", backend.name, max_batch, context)
    try:
        return StaticRows(backend, max_batch, context, token_buckets=[1, *backend.buckets])
    except EagleLabError as exc:
        raise EagleLabError(f"the server decodes in one static cache: {exc.args[0].split(';')[0]}; "
                            "serve.py with a prompt (compile=false) decodes this target") from exc


def batch_trees(cfg: ServeConfig, target, prototype, rows: StaticRows) -> BatchTrees:
    """tree=online with server.tree_per_batch: the tree policy at batch >= 2 (eagle_lab/serving/batch_trees.py);
    otherwise every sequence drafts its own tree at every batch size."""
    if not (cfg.tree.online and cfg.server.tree_per_batch and isinstance(prototype, EagleDrafter)):
        return BatchTrees.own()
    log.info("timing drafting against plain decoding at each batch size up to %d (%s)", cfg.server.max_batch,
             rows.backend.name)
    return choose_batch_trees(target, prototype, rows, cfg.server.max_batch, calibration_prompts(target),
                              BATCH_TIMING_TOKENS, cfg.tree.batch_min_gain, SERVER_TEMPERATURES)


def run_server(cfg: ServeConfig) -> None:
    check_server_config(cfg.server)
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise EagleLabError(f"mode=server needs the server extras ({exc.name} is missing): "
                            "pip install -e '.[server]'") from exc
    sock = bind(cfg.server.host, cfg.server.port)

    model_thread = ModelThread()  # loads the model, then runs the scheduler's loop: one thread runs the model
    app, engine, _ = model_thread.run(build_app, cfg, model_thread)
    freeze_loaded_objects()
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    log.info("serving %s (method=%s) on http://%s:%d/v1 (max_batch %d, max_queue %d%s)", engine.model_name,
             cfg.method, shown, port, cfg.server.max_batch, cfg.server.max_queue,
             ", API key required" if cfg.server.api_key else "")
    # uvicorn handles SIGTERM/SIGINT: it stops accepting, waits for in-flight requests (streams
    # included), runs the app's shutdown, then re-raises the signal with the handler that was
    # installed before it started. For SIGTERM that handler is ours and does nothing, so a
    # graceful stop exits 0; SIGINT keeps Python's KeyboardInterrupt (exit 130, as elsewhere).
    previous = signal.signal(signal.SIGTERM, _stopped_by_sigterm)
    try:
        server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=True, timeout_graceful_shutdown=None))
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
    log.info("server stopped")


def _stopped_by_sigterm(_signum, _frame) -> None:
    log.info("SIGTERM: in-flight requests finished")
