"""Helpers for the HTTP server tests: composed configs, an in-process server on a free
127.0.0.1 port, the openai client, and reference outputs from serve.py's own `run`."""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time
from pathlib import Path

import openai
import uvicorn
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from eagle_lab.config import ServeConfig, register_configs, to_object
from eagle_lab.serve import run as serve_run
from eagle_lab.serving.server import bind, build_app

CONF = Path(__file__).resolve().parents[1] / "conf"
# tiny random target, random head, a fixed tree that drafts several tokens per round; eager (the
# compiled server path, static rows, is tested in tests/test_static_rows.py)
TINY = ["target=tiny_llama", "head.path=random", "tree=cpu", "tree.depth=3", "tree.topk=2",
        "tree.total_tokens=6", "compile=false"]
register_configs()


def composed(overrides: list[str]):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="serve", overrides=overrides, return_hydra_config=False)


def serve_config(*overrides: str) -> ServeConfig:
    return to_object(composed(list(overrides)), ServeConfig)


class RunningServer:
    """uvicorn in a thread, on a socket bound to 127.0.0.1:0; stops (gracefully) on exit."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.app, self.engine, self.scheduler = build_app(cfg)
        self.sock = bind("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_config=None, access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> RunningServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def client(self, api_key: str = "none", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0,
                             timeout=kwargs.pop("timeout", 60), **kwargs)

    def wait_until(self, condition, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError("timed out waiting for the scheduler")
            time.sleep(0.01)


def reference(overrides: list[str], prompts: list, tmp_path: Path) -> list[dict]:
    """What `python serve.py prompts_file=... output=json <overrides>` prints, one row per prompt
    ({"prompt": str} or {"messages": [...]}), run in this process through serve.py's `run`."""
    file = tmp_path / f"prompts-{time.monotonic_ns()}.jsonl"
    file.write_text("".join(json.dumps({"messages": p} if isinstance(p, list) else {"prompt": p}) + "\n"
                            for p in prompts))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        serve_run(OmegaConf.create(OmegaConf.to_container(
            composed([*overrides, f"prompts_file={file}", "output=json"]), resolve=True)))
    return [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]


class HeldRounds:
    """Wraps a running scheduler's rounds (as a context manager): the first round waits until `arrivals`
    requests have reached the scheduler, so requests meet in one batch on any machine, however fast; every
    round's batch size is recorded. `gate`: while it is cleared, no round runs at all."""

    def __init__(self, scheduler, arrivals: int = 1, timeout: float = 60.0):
        self.scheduler, self.arrivals, self.timeout = scheduler, arrivals, timeout
        self.sizes: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self._original = None
        self._first = True

    def _round(self, jobs) -> None:
        if not self.gate.wait(self.timeout):
            raise TimeoutError("a held round was never released")
        deadline = time.monotonic() + self.timeout
        while self._first and self.scheduler.waiting + len(jobs) < self.arrivals and time.monotonic() < deadline:
            time.sleep(0.001)  # the requests are on their way: the scheduler thread waits for them
        self._first = False
        self.sizes.append(len(jobs))
        self._original(jobs)

    @property
    def peak(self) -> int:
        return max(self.sizes, default=0)

    def __enter__(self) -> HeldRounds:
        self._original = self.scheduler._round
        self.scheduler._round = self._round
        return self

    def __exit__(self, *exc) -> None:
        self.gate.set()
        self.scheduler._round = self._original
