"""`python serve.py mode=server`: check the config, bind, load, then serve until SIGTERM/SIGINT.

Order matters for users: a bad `server.*` value or a taken port ends in one `error:` line
before the model loads (which can take long); the socket is bound first but only listened
on once the model is ready, so a client never reaches a half-loaded server.
"""

from __future__ import annotations

import logging
import signal
import socket

from eagle_lab.builders import make_drafter, ngram_proposer
from eagle_lab.config import ServeConfig, ServerConfig
from eagle_lab.decoding.backend import StaticBackend, build_backend
from eagle_lab.decoding.static_rows import StaticRows
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.growth import TreeShape
from eagle_lab.errors import EagleLabError
from eagle_lab.serving.batching import BatchScheduler
from eagle_lab.serving.drafters import drafter_factory
from eagle_lab.serving.engine import Engine
from eagle_lab.models.target import load_target
from eagle_lab.serving.static_trees import build_row_graphs, trees_on_rows
from eagle_lab.serving.tree_per_batch import trees_per_batch
from eagle_lab.tree_search.auto import calibration_prompts
from eagle_lab.tree_search.space import TreeSearchConfig

log = logging.getLogger(__name__)
SERVER_TEMPERATURES = (0.0, *TreeSearchConfig().sampled_temperatures)  # what requests may ask: a tree for each


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


def build_app(cfg: ServeConfig):
    """Load the target (and head), then the engine, scheduler and FastAPI app. Also used by tests."""
    from eagle_lab.serving.app import create_app  # fastapi is an optional extra: imported only to serve

    target = load_target(cfg.target)
    backend, rows, prototype, trees = prepare_decoding(cfg, target)
    engine = Engine(cfg, target, drafter_factory(prototype), rows)
    scheduler = BatchScheduler(cfg.server.max_batch, cfg.server.max_queue, target, trees, rows=rows)
    return create_app(engine, scheduler, cfg.server.api_key), engine, scheduler


def prepare_decoding(cfg: ServeConfig, target):
    """Everything the server decodes with, ready before it listens: the backend, the static rows (compiled),
    the prototype drafter and the tree per batch size. Compiled, every graph a request may need is built (or
    loaded) here, then building stops: a missing one later runs eagerly, and no request waits for a compile.
    `python -m eagle_lab.compile` calls it too, so that a server's start only loads."""
    backend = build_backend(target, cfg.compile, cfg.decoding, compile_ahead=True)
    rows = serving_rows(backend, cfg.server.max_batch, cfg.server.context)
    # requests choose their temperature: a tree for greedy decoding and for each temperature tree=auto prices
    prototype = make_drafter(cfg, target, backend, temperatures=SERVER_TEMPERATURES)
    eagle = prototype if isinstance(prototype, EagleDrafter) else None
    if rows is not None and (eagle is not None or prototype is None):
        build_row_graphs(target, eagle, rows, calibration_prompts(target)[0])
    trees = batch_trees(cfg, target, prototype, rows)
    if isinstance(backend, StaticBackend):
        backend.stop_building()
        if eagle is not None:
            eagle.stop_building()
    return backend, rows, prototype, trees


def serving_rows(backend, max_batch: int, context: int) -> StaticRows | None:
    """Compiled decoding: one static cache of max_batch rows of `context` tokens that every sequence
    decodes in (eagle_lab/decoding/static_rows.py); eager: None (each sequence its own dynamic cache)."""
    if not isinstance(backend, StaticBackend):
        return None
    log.info("compiled decoding: %d rows of %d tokens in one static cache", max_batch, context)
    return StaticRows(backend, max_batch, context, token_buckets=[1, *backend.buckets])


def batch_trees(cfg: ServeConfig, target, prototype, rows: StaticRows | None = None) -> dict:
    """tree=auto with server.tree_per_batch: the tree for each batch size (eagle_lab/serving/tree_per_batch.py;
    compiled, eagle_lab/serving/static_trees.py); else {} (every sequence drafts the drafter's own tree)."""
    if not (cfg.tree.auto and cfg.server.tree_per_batch and isinstance(prototype, EagleDrafter)):
        return {}
    if rows is not None:
        log.info("tree=auto: timing the batch-1 tree against plain decoding at each batch size up to %d, compiled",
                 cfg.server.max_batch)
        return trees_on_rows(target, prototype, rows, cfg.server.max_batch, calibration_prompts(target),
                             TreeSearchConfig().new_tokens, cfg.tree.batch_min_gain)
    fixed = TreeShape(cfg.tree.depth, cfg.tree.topk, cfg.tree.total_tokens)
    log.info("tree=auto: choosing a tree for each batch size up to %d before listening (timed once per target, "
             "head and device, then cached; a few minutes on a 2-core CPU the first time)", cfg.server.max_batch)
    calibrated = ngram_proposer(cfg.ngram) if cfg.ngram.enabled and cfg.method == "eagle" else None
    return trees_per_batch(target, prototype, fixed, cfg.server.max_batch, ngram=calibrated,
                           min_gain=cfg.tree.batch_min_gain)


def run_server(cfg: ServeConfig) -> None:
    check_server_config(cfg.server)
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise EagleLabError(f"mode=server needs the server extras ({exc.name} is missing): "
                            "pip install -e '.[server]'") from exc
    sock = bind(cfg.server.host, cfg.server.port)

    app, engine, _ = build_app(cfg)
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
