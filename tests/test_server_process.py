"""`python serve.py mode=server` as a process: graceful SIGTERM, config refusals before loading;
the typed server.* keys; and one short check on the embedded SmolLM2 target (slow)."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import OmegaConfBaseException

from tests.serving_helpers import TINY, RunningServer, composed, reference, serve_config

pytestmark = pytest.mark.slow  # every test here starts a server process

ROOT = Path(__file__).resolve().parents[1]


def start_server(tmp_path: Path, *overrides: str) -> subprocess.Popen:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "serve.py", f"hydra.run.dir={tmp_path}/run", "mode=server", *overrides],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)


def wait_for_port(process: subprocess.Popen, lines: queue.Queue, seen: list[str], timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            assert process.poll() is None, "the server exited:\n" + "".join(seen)
            continue
        seen.append(line)
        found = re.search(r"on http://127\.0\.0\.1:(\d+)/v1", line)
        if found:
            return int(found.group(1))
    raise AssertionError("the server never said where it listens:\n" + "".join(seen))


def test_sigterm_finishes_in_flight_requests_and_exits_0(tmp_path):
    """max_batch=1: one stream decoding, one waiting. SIGTERM: no new connections, both finish, exit 0."""
    process = start_server(tmp_path, *TINY, "server.port=0", "server.max_batch=1")
    lines, seen = queue.Queue(), []
    threading.Thread(target=read_lines, args=(process.stderr, lines), daemon=True).start()
    try:
        port = wait_for_port(process, lines, seen)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        outcomes: dict[int, tuple] = {}
        first_chunk = [threading.Event(), threading.Event()]

        def stream(i: int) -> None:
            pieces, finish = [], None
            for chunk in client.completions.create(model="tiny_llama", prompt=f"story {i}", max_tokens=600,
                                                   stream=True, extra_body={"ignore_eos": True}):
                first_chunk[i].set()
                pieces.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
                tokens = (chunk.model_extra or {}).get("eagle_lab", {}).get("token_ids")
                if tokens is not None:
                    outcomes[i] = (len(tokens), finish)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        threads[0].start()
        assert first_chunk[0].wait(60)
        threads[1].start()
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health", timeout=5).json()["waiting"] != 1:
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGTERM)
        refused, deadline = False, time.monotonic() + 10
        while not refused and time.monotonic() < deadline:  # the listening socket closes within ~0.1 s
            try:
                httpx.get(f"{url}/health", timeout=2)
                time.sleep(0.05)
            except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                refused = True  # refused, or accepted into the closing socket's backlog and reset unserved
        assert refused, "still accepting connections after SIGTERM"
        for thread in threads:
            thread.join(120)
        assert outcomes == {0: (600, "length"), 1: (600, "length")}  # both ran to the end
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    stderr = "".join(seen) + "".join(iter_lines(lines))
    assert "server stopped" in stderr and "Traceback" not in stderr


def iter_lines(lines: queue.Queue):
    while True:
        try:
            yield lines.get(timeout=1)
        except queue.Empty:
            return


@pytest.fixture
def busy_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


@pytest.mark.parametrize("override,expected", [
    ("server.port=70000", "server.port must be in 0..65535"),
    ("server.port=-1", "server.port must be in 0..65535"),
    ("server.max_batch=0", "server.max_batch must be >= 1"),
    ("server.max_queue=0", "server.max_queue must be >= 1"),
    ("BUSY", "cannot listen on 127.0.0.1"),
])
def test_bad_server_config_is_one_error_line_before_loading(override, expected, tmp_path, busy_port):
    if override == "BUSY":
        override = f"server.port={busy_port}"
    process = start_server(tmp_path, "target=tiny_llama", override)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode != 0 and stdout == ""
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], stderr
    assert "Traceback" not in stderr
    assert "target tiny_llama:" not in stderr  # refused before the model was loaded


def test_server_keys_are_typed_and_default_sensibly(monkeypatch):
    cfg = serve_config()
    assert (cfg.server.host, cfg.server.port, cfg.server.api_key, cfg.server.max_batch, cfg.server.max_queue) == \
        ("127.0.0.1", 8000, "", 8, 64)
    monkeypatch.setenv("EAGLE_LAB_API_KEY", "from-env")
    assert serve_config().server.api_key == "from-env"
    assert serve_config("server.api_key=given").server.api_key == "given"
    assert serve_config("mode=server", "server.port=0", "server.max_batch=2").server.max_batch == 2
    for bad in (["server.port=eighty"], ["server.max_batc=2"]):
        with pytest.raises((ConfigCompositionException, OmegaConfBaseException)):
            serve_config(*bad)
    for option in sorted(p.stem for p in (ROOT / "conf" / "server").glob("*.yaml")):
        assert composed([f"server={option}"]).server.max_queue >= 1


@pytest.mark.slow
def test_smollm2_chat_over_http_equals_serve_py(tmp_path):
    """The embedded SmolLM2 target with its packaged head: two short chat requests (one streamed)."""
    overrides = ["target=smollm2_135m", "tree=cpu", "compile=false"]  # eager, as the reference run
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = reference([*overrides, "max_new_tokens=16", "temperature=0"], [messages], tmp_path)[0]
    with RunningServer(serve_config(*overrides)) as running:
        client = running.client(timeout=300)
        got = client.chat.completions.create(model="smollm2_135m", messages=messages, max_tokens=16, temperature=0)
        streamed = list(client.chat.completions.create(model="smollm2_135m", messages=messages, max_tokens=16,
                                                       temperature=0, stream=True))
    assert got.model == "smollm2_135m"
    assert got.choices[0].message.content == expected["text"] and expected["text"].strip()
    assert got.eagle_lab["token_ids"] == expected["token_ids"]
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected["text"]
