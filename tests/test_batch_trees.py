"""The server's tree policy (eagle_lab/serving/batch_trees.py): at batch >= 2 a row drafts its own tree
(or its controller's chain) or decodes plainly, as timed in the batched round; switching
between rounds keeps outputs exact, the choices are cached, and a compiled server builds every graph
before it listens."""

from __future__ import annotations

import pytest

from eagle_lab.decoding.generate import Stopper, generate, speculative_decode
from eagle_lab.decoding.graph_store import GraphStore
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.decoding.sequence import Sequence, score_rows
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.eagle.kinds import new_head
from eagle_lab.drafters.growth import TreeShape
from eagle_lab.drafters.ngram import NgramProposer
from eagle_lab.models.prompts import as_tensor, encode_prompt
from eagle_lab.serving import batch_trees
from eagle_lab.serving.batch_trees import BatchTrees, choose_batch_trees, timed_batch_decoding
from eagle_lab.serving.batching import BatchScheduler
from eagle_lab.serving.engine import Engine, drafter_factory
from tests.scheduler_helpers import expected_alone, plan, run_plans, static_rows
from tests.serving_helpers import TINY, RunningServer, serve_config


def test_a_row_takes_the_choice_of_its_nearest_timed_temperature():
    trees = BatchTrees({0.0: frozenset({4}), 1.0: frozenset({2, 3, 4})})
    greedy, warm, hot = SamplingParams(), SamplingParams(0.4), SamplingParams(0.8)
    assert not trees.plain(1, hot)  # alone: always the own tree
    assert not trees.plain(2, greedy) and trees.plain(4, greedy)
    assert not trees.plain(2, warm) and trees.plain(2, hot)  # a sampled row: the sampled choice
    assert not BatchTrees.own().plain(8, hot)


def test_plain_rounds_keep_the_head_cache_in_step(tiny_llama):
    """Rounds without drafting (a large batch) skip the head; the next tree feeds it every pair it
    missed, so its cache covers the whole sequence again and the output is unchanged."""
    prototype = EagleDrafter(new_head(tiny_llama, seed=0), tiny_llama, TreeShape(depth=3, topk=2, total_tokens=6))
    prompt = as_tensor(encode_prompt(tiny_llama.tokenizer, "Tell me a story", chat=False), tiny_llama.device)
    expected = generate(speculative_decode(tiny_llama, prototype.fork(), prompt, SamplingParams(),
                                           Stopper(tiny_llama.tokenizer, 30, set()))).token_ids
    drafter, rows = prototype.fork(), static_rows(tiny_llama, rows=1)
    sequence = Sequence(tiny_llama, drafter, prompt, SamplingParams(), Stopper(tiny_llama.tokenizer, 30, set()), None,
                        rows)
    tokens, plan_of_rounds = sequence.prefill(), [True] * 3 + [False, True, True] * 20
    for plain in plan_of_rounds:
        if sequence.done:
            break
        tree = sequence.draft(plain)
        if not plain:
            assert drafter.committed == sequence.past and tree.size > 1  # caught up on the skipped pairs
        else:
            assert tree.size == 1
        tokens += sequence.accept(score_rows(rows, [sequence])[0])
    assert tokens == expected and sequence.done


@pytest.mark.parametrize("hybrid", [False, True], ids=["head", "hybrid"])
def test_scheduler_switches_trees_with_the_batch_size(tiny_llama, hybrid):
    """Batch 3 decodes plainly (no head, no n-gram chain), batch 2 and alone draft the drafter's own tree
    of depth 3: each request's greedy output stays what it is alone."""
    proposer = NgramProposer(min_match=1, max_match=2, max_tokens=6) if hybrid else None
    prototype = EagleDrafter(new_head(tiny_llama, seed=0), tiny_llama, TreeShape(depth=3, topk=1, total_tokens=3),
                             ngram=proposer)
    engine = Engine(serve_config(*TINY), tiny_llama, drafter_factory(prototype), static_rows(tiny_llama, rows=3))
    scheduler = BatchScheduler(3, 4, tiny_llama, engine.rows, BatchTrees({0.0: frozenset({3})}))
    plans = [plan(engine, f"abcabc {i} abcabc {'y' * i}", n) for i, n in enumerate((14, 26, 60))]
    clients = run_plans(scheduler, engine, plans)
    assert [c.tokens for c in clients] == [expected_alone(engine, p) for p in plans]
    assert {1, 2, 3} <= set(scheduler.batch_sizes)
    depths = [len(c.decoding.sequence.stats.reached_depth) for c in clients]  # deepest tree each one drafted
    # batch 3 only: nothing drafted; batch 2 and alone: the head's depth 3 (n-gram chains may reach deeper)
    assert clients[0].decoding.sequence.stats.rounds > 0 and depths[0] == 0 and min(depths[1:]) >= 3
    assert clients[2].decoding.sequence.drafter.ngram == proposer  # its own chains all along


def test_timed_batch_decoding_runs_the_batched_round(tiny_llama):
    prototype = EagleDrafter(new_head(tiny_llama, seed=0), tiny_llama, TreeShape(3, 2, 6))
    prompts = [list(range(40, 52)), list(range(60, 70)), list(range(80, 95))]
    rows = static_rows(tiny_llama, rows=3)
    plain = timed_batch_decoding(tiny_llama, prototype, prompts, True, 8, rows)
    assert plain["rounds"] == 7 and plain["tokens"] == 3 * 7 and plain["seconds"] > 0  # one token per row a round
    smaller = EagleDrafter(prototype.head, tiny_llama, TreeShape(2, 2, 4))
    tree = timed_batch_decoding(tiny_llama, smaller, prompts, False, 8, rows)
    assert 1 <= tree["rounds"] <= 7 and tree["tokens"] >= 3 * tree["rounds"]
    # token for token: every row of the timed tree rounds continues the plain rows' greedy output
    for with_tree, without in zip(tree["outputs"], plain["outputs"]):
        common = min(len(with_tree), len(without))
        assert common >= 1 + tree["rounds"] and with_tree[:common] == without[:common]
    sampled = [timed_batch_decoding(tiny_llama, prototype, prompts, False, 8, rows, SamplingParams(1.0), seed=5)
               for _ in range(2)]
    assert sampled[0]["outputs"] == sampled[1]["outputs"]  # seeded: the same draws
    assert all(row is None for row in rows.rows)  # every sequence gave its row back


def test_choices_are_timed_per_temperature_cached_and_retimed_when_a_tree_changes(tiny_llama, monkeypatch,
                                                                                   tmp_path):
    monkeypatch.setenv("EAGLE_LAB_CACHE", str(tmp_path))
    timed = []

    def fake_timing(target, drafter, prompts, plain, new_tokens, rows, params=SamplingParams(), seed=0):
        timed.append((len(prompts), plain, params.temperature))
        # greedy: the tree wins at batch 2 and loses at batch 4; sampled (T=0.7): it loses at every size
        fast = plain == (len(prompts) == 4 or params.temperature > 0)
        return {"tokens": len(prompts) * new_tokens, "seconds": 1.0 if fast else 2.0, "rounds": new_tokens}

    monkeypatch.setattr(batch_trees, "timed_batch_decoding", fake_timing)
    rows = static_rows(tiny_llama, rows=4)
    drafter = EagleDrafter(new_head(tiny_llama, seed=0), tiny_llama, TreeShape(2, 2, 3))
    prompts = [[1, 2, 3]]
    first = choose_batch_trees(tiny_llama, drafter, rows, 4, prompts, 8, temperatures=(0.7, 0.0))
    assert {t for _, _, t in timed} == {0.0, 0.7} and {b for b, _, _ in timed} == {2, 4}
    assert not first.plain(2, SamplingParams()) and first.plain(3, SamplingParams())
    assert first.plain(4, SamplingParams()) and first.plain(2, SamplingParams(0.7))

    timed.clear()
    again = choose_batch_trees(tiny_llama, drafter, rows, 4, prompts, 8, temperatures=(0.7, 0.0))
    assert not timed and again == first  # read back, nothing timed

    drafter = EagleDrafter(drafter.head, tiny_llama, TreeShape(3, 2, 4))
    choose_batch_trees(tiny_llama, drafter, rows, 4, prompts, 8, temperatures=(0.7, 0.0))
    assert timed  # another tree: timed again


@pytest.mark.slow
def test_a_compiled_server_builds_its_graphs_before_listening_and_never_in_a_request(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE_LAB_CACHE", str(tmp_path))
    cfg = serve_config(*[o for o in TINY if not o.startswith("compile=")], "compile=true", "server.max_batch=2",
                       "server.context=96", "decoding.min_attended_length=32", "decoding.cache_block=32",
                       "decoding.buckets=[4,8]")
    with RunningServer(cfg) as running:
        built_in_requests = []
        monkeypatch.setattr(GraphStore, "load_or_build",
                            lambda self, key, module, args, what, build=True: built_in_requests.append(what))
        client = running.client()
        replies = [client.completions.create(model="tiny_llama", prompt=prompt, max_tokens=24, temperature=0)
                   for prompt in ("Hello there", "The quick brown fox jumps")]
        assert all(r.usage.completion_tokens > 0 for r in replies)
    assert not built_in_requests
