"""The server's static path (eagle_lab/decoding/static_rows.py): several sequences as rows of one
preallocated cache, scored by one fixed-shape forward, decode exactly as each does alone.

Row scoring is compared with a dynamic cache through trees, ragged pasts and non-contiguous
compaction on every family; whole decodes (greedy, seeded sampling) are compared token for
token with generate.py alone while sequences of different lengths finish and leave, so rows are
packed (moved) under the others; the scheduler and the compiled step are run end to end.
"""

from __future__ import annotations

import pytest
import torch

from eagle_lab.decoding.backend import EagerBackend, StaticBackend
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.decoding.static_rows import StaticRows, row_buckets
from eagle_lab.decoding.tree import build_tree
from eagle_lab.errors import EagleLabError
from eagle_lab.serving.batching import BatchScheduler
from eagle_lab.serving.engine import Engine
from tests.scheduler_helpers import expected_alone, plan, run_plans, static_rows
from tests.serving_helpers import serve_config
from tests.test_server_batching import LENGTHS, PROMPTS, encoded, make_drafters, together


def test_row_buckets():
    assert row_buckets(1) == [1] and row_buckets(8) == [1, 2, 4, 8] and row_buckets(6) == [1, 2, 4, 6]


def test_rows_score_like_dynamic_caches(tiny_target):
    """Two rows of different pasts, a tree and a chain in one forward, a non-contiguous path kept,
    then a second forward: every node's logits as each sequence's own dynamic cache gives them."""
    rows = static_rows(tiny_target)
    prompts = encoded(tiny_target, PROMPTS[1:3])
    dynamic = [EagerBackend(tiny_target).open(p.numel(), 32) for p in prompts]
    handles = [rows.attach() for _ in prompts]
    for scorer, handle, prompt in zip(dynamic, handles, prompts):
        features, _ = rows.prefill(handle, prompt)
        torch.testing.assert_close(features, scorer.prefill(prompt).features, atol=1e-4, rtol=1e-4)
    tree = build_tree(torch.tensor([5, 9, 11, 13, 17]), torch.tensor([-1, 0, 0, 1, 3]))
    chain = build_tree(torch.tensor([7, 8]), torch.tensor([-1, 0]))
    for trees, kept in (([tree, chain], [torch.tensor([0, 1, 3]), torch.tensor([0, 1])]),
                        ([chain, tree], [torch.tensor([0]), torch.tensor([0, 2])])):
        scores = rows.score(handles, trees)
        for scorer, handle, score, t, accepted in zip(dynamic, handles, scores, trees, kept):
            expected = scorer.score(t.tokens, t.depths, t.mask)
            torch.testing.assert_close(score.logits, expected.logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(score.features, expected.features, atol=1e-4, rtol=1e-4)
            rows.keep(handle, score, accepted)
            scorer.commit(accepted)
            assert handle.past == scorer.past


def test_rows_refuse_what_they_cannot_hold(tiny_llama):
    rows = static_rows(tiny_llama, rows=2, context=64)
    first, _ = rows.attach(), rows.attach()
    with pytest.raises(EagleLabError, match="rows of the static batch are in use"):
        rows.attach()
    with pytest.raises(EagleLabError, match="more than a sequence may hold here"):
        rows.prefill(first, torch.arange(3, 70))


def test_scheduler_on_rows_serves_like_alone(tiny_llama):
    """The server's scheduler on the static path: six requests through three rows, joining and
    leaving between rounds; each gets generate.py's tokens alone."""
    rows = static_rows(tiny_llama, rows=3)
    prototype = make_drafters(tiny_llama, ["eagle"])[0]
    engine = Engine(serve_config("method=eagle"), tiny_llama, lambda: prototype.fork(), rows=rows)
    scheduler = BatchScheduler(3, 8, tiny_llama, rows=rows)
    plans = [plan(engine, text, n) for text, n in zip(PROMPTS + PROMPTS[:2], LENGTHS + LENGTHS[:2])]
    clients = run_plans(scheduler, engine, plans)
    assert [c.tokens for c in clients] == [expected_alone(engine, p) for p in plans]
    assert max(scheduler.batch_sizes) == 3
    assert all(row is None for row in rows.rows)


@pytest.mark.slow
def test_compiled_rows_decode_like_eager_rows(tiny_llama):
    """The compiled step over 1, 2 and 4 rows gives the eager step's tokens (greedy)."""
    kinds = ("eagle", "oracle", "vanilla", "eagle-small")
    prompts, lengths = encoded(tiny_llama, PROMPTS), LENGTHS
    runs = {}
    for compiled in (False, True):
        runs[compiled] = together(tiny_llama, make_drafters(tiny_llama, kinds), prompts, SamplingParams(),
                                           lengths, [0] * 4, static_rows(tiny_llama, compiled=compiled))
    assert runs[True] == runs[False]


def test_compile_auto_keeps_the_faster_step_per_shape(tiny_llama, monkeypatch, tmp_path):
    """compile=auto times each newly compiled shape against eager and keeps the faster: here the
    "compiled" step is made slow, so eager serves the shape, over exact lengths, with the same tokens;
    a later process reads the verdict and does not compile that shape at all."""
    import time

    monkeypatch.setenv("EAGLE_LAB_CACHE", str(tmp_path))
    calls = []

    def slow_backend():
        backend = StaticBackend(tiny_llama, [4, 8, 16], cache_block=64, compiled=True, per_shape=True)
        eager = backend._steps.module

        def slow(cache, *args):
            calls.append(args[0].shape)
            time.sleep(0.02)
            return eager(cache.hf_cache, *args)

        # stands in for a compiled graph that is slower than eager on this shape
        backend._steps._graph_for = lambda *args: slow
        return backend

    backend = slow_backend()
    steps = backend._steps
    kinds = ("eagle", "vanilla")
    prompts, lengths = encoded(tiny_llama, PROMPTS[:2]), LENGTHS[:2]
    drafters = make_drafters(tiny_llama, kinds)
    got = together(tiny_llama, drafters, prompts, SamplingParams(), lengths, [0, 0],
                            StaticRows(backend, 2, 256))
    expected = together(tiny_llama, make_drafters(tiny_llama, kinds), prompts, SamplingParams(), lengths,
                                 [0, 0], static_rows(tiny_llama, rows=2))
    assert got == expected
    assert steps._eager_shapes and all(steps.runs_eager(*shape) for shape in steps._eager_shapes)
    assert not StaticBackend(tiny_llama, [4], compiled=True).runs_eager(2, 4)  # compile=true: always compiled

    calls.clear()
    again = together(tiny_llama, make_drafters(tiny_llama, kinds), prompts, SamplingParams(), lengths,
                              [0, 0], StaticRows(slow_backend(), 2, 256))
    assert again == expected and not calls  # every shape ran eagerly from the cached verdicts
