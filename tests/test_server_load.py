"""Load: 8 concurrent clients x 3 requests (completions and chat, greedy and seeded sampling,
whole and streamed) while another client sends malformed requests and abandons a stream.
Every request must succeed and equal what serve.py prints for it alone."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from tests.serving_helpers import TINY, HeldRounds, RunningServer, reference, serve_config

MODEL = "tiny_llama"
CLIENTS, MAX_TOKENS, SEED = 8, 24, 11
PROMPTS = [f"Client {i} asks: what comes after {i * 7}?" for i in range(CLIENTS)]


def request(client: openai.OpenAI, kind: str, prompt: str) -> list[int]:
    """One request of the given kind; the generated token ids (streamed ones from the last chunk)."""
    extra = {"ignore_eos": True}
    if kind == "raw-greedy":
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body=extra)
        return got.eagle_lab["token_ids"]
    messages = [{"role": "user", "content": prompt}]
    if kind == "chat-greedy-stream":
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True, extra_body=extra))
        final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(final) == 1
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return final[0].eagle_lab["token_ids"], text
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0.8,
                                         seed=SEED, extra_body=extra)
    return got.eagle_lab["token_ids"]


@pytest.mark.slow
def test_concurrent_clients_with_bad_ones_in_the_middle(tmp_path):
    common = [*TINY, f"max_new_tokens={MAX_TOKENS}", "ignore_eos=true"]
    expected = {
        "raw-greedy": [r["token_ids"] for r in reference([*common, "chat=false"], PROMPTS, tmp_path)],
        "chat-greedy-stream": [(r["token_ids"], r["text"]) for r in reference(common, [
            [{"role": "user", "content": p}] for p in PROMPTS], tmp_path)],
        "chat-sampled": [r["token_ids"] for r in reference([*common, "temperature=0.8", f"seed={SEED}"], [
            [{"role": "user", "content": p}] for p in PROMPTS], tmp_path)],
    }
    kinds = list(expected)
    with RunningServer(serve_config(*TINY, "server.max_batch=8", "server.max_queue=64")) as running:
        results, errors, active_then = {}, [], []
        busy = threading.Event()

        def client_thread(i: int):
            client = running.client()
            for j in range(3):
                kind = kinds[(i + j) % 3]  # every client sends every kind, in a different order
                try:
                    results[(i, kind)] = request(client, kind, PROMPTS[i])
                except Exception as exc:  # noqa: BLE001 - collected and reported below
                    errors.append(f"client {i} {kind}: {exc!r}")
                busy.set()

        def troublemaker():
            busy.wait(30)  # the load is under way
            active_then.append(running.scheduler.active + running.scheduler.waiting)
            client = running.client()
            bad = httpx.post(f"{running.url}/v1/chat/completions", content=b'{"model": "tiny_llama", "messages": [',
                             headers={"content-type": "application/json"}, timeout=30)
            refusals = [bad.status_code]
            for call, kwargs in ((client.chat.completions.create, {"messages": []}),
                                 (client.completions.create, {"prompt": "x", "temperature": -1})):
                try:
                    call(model=MODEL, max_tokens=4, **kwargs)
                except openai.BadRequestError as exc:
                    refusals.append(exc.status_code)
            if refusals != [400, 400, 400]:
                errors.append(f"bad requests were answered {refusals}")
            stream = client.completions.create(model=MODEL, prompt="abandon me", max_tokens=500, stream=True,
                                               extra_body={"ignore_eos": True})
            next(iter(stream))
            stream.close()  # mid-stream disconnect among the others

        threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(CLIENTS)]
        threads += [threading.Thread(target=troublemaker)]
        with HeldRounds(running.scheduler, arrivals=CLIENTS) as held:  # the first requests meet in one batch
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
        unfinished = [t.name for t in threads if t.is_alive()]
        running.wait_until(lambda: running.scheduler.active == 0)
        counts = dict(running.scheduler.counts)

    assert not errors, errors
    assert not unfinished, f"clients still waiting after 120 s: {unfinished}"
    for i in range(CLIENTS):
        for kind in kinds:
            assert results[(i, kind)] == expected[kind][i], (i, kind)
    assert held.peak >= 4  # requests really ran together
    assert active_then and active_then[0] > 0  # the bad requests came while others were decoding
    assert counts["completed"] == 3 * CLIENTS and counts["cancelled"] == 1 and counts["failed"] == 0


@pytest.mark.slow
def test_eight_concurrent_greedy_requests_on_smollm2_equal_batch_one(tmp_path):
    """The embedded SmolLM2 target with its packaged head (tree=cpu): 8 concurrent chat requests,
    scored together in padded batched forwards, each equal to serve.py's batch-1 output."""
    overrides = ["target=smollm2_135m", "tree=cpu", "compile=false"]  # eager, as the reference run
    questions = ["What is the capital of France?", "Name three primary colors.", "What is 12 times 12?",
                 "Write a haiku about rain.", "Who wrote Hamlet?", "Explain gravity in one sentence.",
                 "List two fruits that are red.", "What does a compiler do?"]
    chats = [[{"role": "user", "content": q}] for q in questions]
    expected = reference([*overrides, "max_new_tokens=20", "temperature=0", "ignore_eos=true"], chats, tmp_path)
    results: dict[int, list[int]] = {}
    errors: list[str] = []
    with RunningServer(serve_config(*overrides, "server.max_batch=8")) as running:
        client = running.client(timeout=600)

        def ask(i: int) -> None:
            try:
                got = client.chat.completions.create(model="smollm2_135m", messages=chats[i], max_tokens=20,
                                                     temperature=0, extra_body={"ignore_eos": True})
                results[i] = got.eagle_lab["token_ids"]
            except Exception as exc:  # noqa: BLE001 - collected and reported below
                errors.append(f"request {i}: {exc!r}")

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(chats))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)
        sizes = dict(running.scheduler.batch_sizes)
    assert not errors, errors
    mismatched = [i for i in range(len(chats)) if results.get(i) != expected[i]["token_ids"]]
    assert not mismatched, f"requests {mismatched} differ from batch 1"
    assert max(sizes) >= 4, sizes  # they really shared forwards
