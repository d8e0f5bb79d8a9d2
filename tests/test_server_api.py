"""The HTTP server in process (uvicorn on 127.0.0.1, tiny target, random head, fixed tree),
driven with the openai client: outputs equal serve.py's, streaming, errors, keys, limits."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from tests.serving_helpers import TINY, HeldRounds, RunningServer, reference, serve_config

MODEL = "tiny_llama"
COMPLETION_PROMPTS = ["Hello there", "The quick brown fox", "def add(a, b):"]
CHATS = [
    [{"role": "user", "content": "Tell me a story."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}],
]


@pytest.fixture(scope="module")
def server():
    with RunningServer(serve_config(*TINY, "server.max_batch=4", "server.max_queue=8")) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_greedy_equals_serve_py(server, client, tmp_path, ignore_eos):
    """/v1/completions = serve.py chat=false; /v1/chat/completions = serve.py (chat template)."""
    common = [*TINY, "temperature=0", "max_new_tokens=30", f"ignore_eos={str(ignore_eos).lower()}"]
    raw = reference([*common, "chat=false"], COMPLETION_PROMPTS, tmp_path)
    chat = reference(common, CHATS, tmp_path)
    extra = {"ignore_eos": True} if ignore_eos else None
    for prompt, expected in zip(COMPLETION_PROMPTS, raw):
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, extra_body=extra)
        check_against(got, got.choices[0].text, expected)
    for messages, expected in zip(CHATS, chat):
        got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                             extra_body=extra)
        assert got.choices[0].message.role == "assistant"
        check_against(got, got.choices[0].message.content, expected)


def check_against(got, text: str, expected: dict) -> None:
    assert text == expected["text"]
    assert got.eagle_lab["token_ids"] == expected["token_ids"]
    assert got.eagle_lab["target_forwards"] == expected["target_forwards"]
    assert got.eagle_lab["accept_length"] == pytest.approx(expected["accept_length"], abs=1e-3)
    assert got.usage.prompt_tokens == expected["prompt_tokens"]
    assert got.usage.completion_tokens == expected["new_tokens"] == len(expected["token_ids"])
    assert got.usage.total_tokens == expected["prompt_tokens"] + expected["new_tokens"]
    assert got.choices[0].finish_reason == {"eos": "stop", "stop": "stop", "length": "length"}[expected["stop_reason"]]


def test_seeded_sampling_and_stop_strings_equal_serve_py(client, tmp_path):
    expected = reference([*TINY, "temperature=0.9", "top_k=50", "top_p=0.95", "seed=123", "max_new_tokens=30",
                          "ignore_eos=true"], CHATS[:1], tmp_path)[0]
    got = client.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=30, temperature=0.9, top_p=0.95,
                                         seed=123, extra_body={"top_k": 50, "ignore_eos": True})
    check_against(got, got.choices[0].message.content, expected)
    text = expected["text"]
    # an ASCII letter or digit first seen mid-text (the reference passes it through a Hydra override)
    stop = next(text[i] for i in range(3, len(text) - 1) if text[i].isascii() and text[i].isalnum()
                and text[i] not in text[:i])
    cut = reference([*TINY, "temperature=0.9", "top_k=50", "top_p=0.95", "seed=123", "max_new_tokens=30",
                     "ignore_eos=true", f"stop=[{json.dumps(stop)}]"], CHATS[:1], tmp_path)[0]
    got = client.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=30, temperature=0.9, top_p=0.95,
                                         seed=123, stop=stop, extra_body={"top_k": 50, "ignore_eos": True})
    assert cut["stop_reason"] == "stop" and cut["text"] == text[: text.index(stop)]
    check_against(got, got.choices[0].message.content, cut)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_stream_sends_the_same_text_in_chunks(client, kind):
    args = dict(model=MODEL, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    if kind == "chat":
        whole = client.chat.completions.create(messages=CHATS[1], **args)
        chunks = list(client.chat.completions.create(messages=CHATS[1], stream=True,
                                                     stream_options={"include_usage": True}, **args))
        text = whole.choices[0].message.content
        pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert all(c.object == "chat.completion.chunk" for c in chunks)
    else:
        whole = client.completions.create(prompt=COMPLETION_PROMPTS[0], **args)
        chunks = list(client.completions.create(prompt=COMPLETION_PROMPTS[0], stream=True,
                                                stream_options={"include_usage": True}, **args))
        text = whole.choices[0].text
        pieces = [c.choices[0].text for c in chunks if c.choices]
    assert len([p for p in pieces if p]) > 5  # really streamed, not one block
    assert "".join(pieces) == text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert finals[0].eagle_lab["token_ids"] == whole.eagle_lab["token_ids"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40 == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_raw_sse_framing(server):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 5, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["model"] == MODEL


LONG = "x" * 2100  # 2100 byte tokens > the tiny target's context of 2048
ERRORS = {  # name: (endpoint, fields, status, param)
    "unknown model": ("completions", {"model": "gpt-4"}, 404, "model"),
    "negative temperature": ("completions", {"temperature": -0.5}, 400, "temperature"),
    "top_p zero": ("completions", {"temperature": 1, "top_p": 0}, 400, "top_p"),
    "top_p above one": ("completions", {"temperature": 1, "top_p": 1.5}, 400, "top_p"),
    "negative top_k": ("completions", {"top_k": -1}, 400, "top_k"),
    "max_tokens zero": ("completions", {"max_tokens": 0}, 400, "max_tokens"),
    "max_tokens beyond the context": ("completions", {"max_tokens": 5000}, 400, "max_tokens"),
    "max_tokens not a number": ("completions", {"max_tokens": "many"}, 400, "max_tokens"),
    "prompt longer than the context": ("completions", {"prompt": LONG}, 400, "prompt"),
    "empty prompt": ("completions", {"prompt": "  "}, 400, "prompt"),
    "list of prompts": ("completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    "n of two": ("completions", {"n": 2}, 400, "n"),
    "logprobs": ("completions", {"logprobs": 3}, 400, "logprobs"),
    "too many stop strings": ("completions", {"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    "seed out of range": ("completions", {"seed": 1 << 70}, 400, "seed"),
    "empty messages": ("chat", {"messages": []}, 400, "messages"),
    "unknown role": ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    "message without content": ("chat", {"messages": [{"role": "user"}]}, 400, "messages.0.content"),
    "chat longer than the context": ("chat", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    "chat n of three": ("chat", {"n": 3}, 400, "n"),
    "penalty": ("chat", {"presence_penalty": 0.5}, 400, "presence_penalty"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_requests_get_openai_errors(server, client, case):
    endpoint, fields, status, param = ERRORS[case]
    if endpoint == "chat":
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
        call = client.chat.completions.create
    else:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, **fields}
        call = client.completions.create
    known = {k: v for k, v in body.items() if k not in ("top_k",)}
    extra = {k: v for k, v in body.items() if k == "top_k"}
    with pytest.raises(openai.APIStatusError) as caught:
        call(**known, extra_body=extra or None)
    assert caught.value.status_code == status
    error = caught.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    assert server.scheduler.alive
    ok = client.completions.create(model=MODEL, prompt="still serving?", max_tokens=3)
    assert ok.usage.completion_tokens >= 1


@pytest.mark.parametrize("payload,param", [
    (b'{"model": "tiny_llama", "prompt": ', None),  # malformed JSON
    (b"[1, 2]", None),  # JSON, not an object
    (b'{"prompt": "hi"}', "model"),  # no model
    (b'\xff\xfe', None),  # not UTF-8
    (b'{"model": "tiny_llama", "prompt": "hi", "temperature": NaN}', "temperature"),  # Python's json reads NaN
    (b'{"model": "tiny_llama", "prompt": "hi", "top_p": Infinity}', "top_p"),
])
def test_malformed_bodies_get_400(server, client, payload, param):
    response = httpx.post(f"{server.url}/v1/completions", content=payload,
                          headers={"content-type": "application/json"}, timeout=10)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param and response.json()["error"]["type"] == "invalid_request_error"
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).usage.completion_tokens >= 1


def test_oversized_body_gets_413(server, client, monkeypatch):
    monkeypatch.setattr("eagle_lab.serving.app.MAX_BODY_BYTES", 64 << 10)
    response = httpx.post(f"{server.url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "x" * (200 << 10), "max_tokens": 2})
    assert response.status_code == 413 and response.json()["error"]["message"]
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).usage.completion_tokens >= 1


def test_unknown_route_and_method_get_openai_errors(server):
    assert httpx.get(f"{server.url}/v1/nothing", timeout=10).json()["error"]["message"]
    response = httpx.get(f"{server.url}/v1/completions", timeout=10)
    assert response.status_code == 405 and "error" in response.json()


def test_api_key_is_required_when_set():
    with RunningServer(serve_config(*TINY, "server.api_key=sekrit")) as running:
        for key in ("none", "sekrit2", "sekri"):
            with pytest.raises(openai.AuthenticationError) as caught:
                running.client(api_key=key).completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert caught.value.response.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            running.client(api_key="wrong").models.list()
        missing = httpx.post(f"{running.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=10)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        bad_json = httpx.post(f"{running.url}/v1/completions", content=b"{", timeout=10)
        assert bad_json.status_code == 401  # the key is checked before the body is read
        assert httpx.get(f"{running.url}/health", timeout=10).status_code == 200  # open for probes
        assert running.client(api_key="sekrit").completions.create(model=MODEL, prompt="hi", max_tokens=2).usage


def test_full_queue_answers_429_and_disconnects_free_slots(tmp_path):
    """max_batch=1, max_queue=1: one active, one waiting, the next is refused. Closing streams
    (the client goes away) cancels them: the slot frees at once and the server goes on."""
    with RunningServer(serve_config(*TINY, "server.max_batch=1", "server.max_queue=1")) as running:
        client, scheduler = running.client(), running.scheduler
        long = dict(model=MODEL, prompt="Once upon a time", max_tokens=1500, extra_body={"ignore_eos": True})
        first = client.completions.create(stream=True, **long)
        next(iter(first))  # it is running
        running.wait_until(lambda: scheduler.active == 1)
        second = client.completions.create(stream=True, **long)  # queued: its response starts when it runs
        running.wait_until(lambda: scheduler.waiting == 1)
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model=MODEL, prompt="one more", max_tokens=2)
        assert caught.value.response.json()["error"]["type"] == "rate_limit_error"
        first.close()  # mid-stream disconnect
        running.wait_until(lambda: scheduler.counts["cancelled"] == 1)
        chunks = iter(second)
        next(chunks)  # the waiting request got the slot
        second.close()
        running.wait_until(lambda: scheduler.counts["cancelled"] == 2 and scheduler.active == 0)
        # a non-streaming client that gives up (read timeout) is cancelled too; its request is held until then
        impatient = running.client(timeout=1.0)
        with HeldRounds(scheduler) as held:
            held.gate.clear()
            with pytest.raises(openai.APITimeoutError):
                impatient.completions.create(**long)
        running.wait_until(lambda: scheduler.counts["cancelled"] == 3 and scheduler.active == 0)
        assert scheduler.counts["completed"] == 0
        expected = reference([*TINY, "chat=false", "max_new_tokens=12", "ignore_eos=true"], ["after"], tmp_path)[0]
        after = client.completions.create(model=MODEL, prompt="after", max_tokens=12, extra_body={"ignore_eos": True})
        assert after.eagle_lab["token_ids"] == expected["token_ids"]
        running.wait_until(lambda: scheduler.active == 0)  # it leaves its slot on the round after its last event
        assert scheduler.counts["completed"] == 1 and scheduler.counts["cancelled"] == 3


def test_concurrent_requests_each_equal_batch_one(server, client, tmp_path):
    """8 concurrent greedy requests (more than max_batch=4: some wait) equal their serve.py output."""
    prompts = [f"Request number {i}: count" for i in range(8)]
    expected = reference([*TINY, "chat=false", "max_new_tokens=20", "ignore_eos=true"], prompts, tmp_path)
    results: dict[int, list[int]] = {}
    errors: dict[int, BaseException] = {}

    def ask(i: int):
        try:
            got = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=20, temperature=0,
                                            extra_body={"ignore_eos": True})
            results[i] = got.eagle_lab["token_ids"]
        except Exception as error:  # reported below, with the request it belongs to
            errors[i] = error

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    with HeldRounds(server.scheduler, arrivals=8) as held:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not errors, f"requests failed: {errors}"
    assert not any(t.is_alive() for t in threads), "requests still running after 120 s"
    assert [results.get(i) for i in range(8)] == [row["token_ids"] for row in expected]
    assert held.peak == 4  # sequences were active together, never more than max_batch


@pytest.mark.parametrize("method", ["vanilla", "ngram"])
def test_other_methods_serve_the_same_output(method, tmp_path):
    overrides = [*TINY, f"method={method}", "ngram.min_match=1"]
    prompt = "one two three one two three one two"
    expected = reference([*overrides, "chat=false", "max_new_tokens=20", "ignore_eos=true"], [prompt], tmp_path)[0]
    with RunningServer(serve_config(*overrides)) as running:
        got = running.client().completions.create(model=MODEL, prompt=prompt, max_tokens=20,
                                                  extra_body={"ignore_eos": True})
    check_against(got, got.choices[0].text, expected)
