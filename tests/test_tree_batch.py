"""A tree per batch size (eagle_lab/tree_batch.py): priced from batch costs, it shrinks as the
batch grows down to plain decoding, and switching trees between rounds keeps outputs exact."""

from __future__ import annotations

import pytest

from eagle_lab.draft import EagleDrafter, TreeShape
from eagle_lab.generate import Stopper, generate, speculative_decode
from eagle_lab.head import new_head
from eagle_lab.prompts import as_tensor, encode_prompt
from eagle_lab.sampling import SamplingParams
from eagle_lab.serving.batching import BatchScheduler
from eagle_lab.serving.drafters import drafter_factory, fork_eagle
from eagle_lab.serving.engine import Engine
from eagle_lab.serving.sequence import Sequence
from eagle_lab.tree_auto import CostModel
from eagle_lab.tree_batch import BatchCostModel, choose_per_batch, interpolate, measure_batched_forward
from tests.serving_helpers import TINY, serve_config
from tests.test_server_batching import Client, expected_alone, plan

SHAPES = [  # replayed accept lengths, as tree_auto.replay_all reports them
    {"shape": {"depth": 0, "topk": 0, "total_tokens": 0}, "tau": 1.0},
    {"shape": {"depth": 1, "topk": 2, "total_tokens": 2}, "tau": 1.5},
    {"shape": {"depth": 3, "topk": 2, "total_tokens": 6}, "tau": 2.2},
    {"shape": {"depth": 5, "topk": 4, "total_tokens": 20}, "tau": 2.9},
]


def gpu_like_costs() -> CostModel:
    """Batch 1: scoring 21 tokens costs about as much as one (a wide device); drafting is cheap."""
    return CostModel(target_ms={1: 10.0, 4: 10.2, 8: 10.5, 16: 11.0, 32: 12.0}, level_ms={2: 0.3, 4: 0.35},
                     first_level_ms=0.5, overhead_ms=0.5, overhead_per_token_ms=0.01, plain_ms=10.5)


def busy_probe(slope: float) -> dict[int, dict[int, float]]:
    """Batched forwards whose cost grows with the tokens scored in all, B x K (a saturated device)."""
    return {b: {k: 10.0 + slope * max(b * k - 16, 0) for k in (1, 4, 8, 16, 32)} for b in (2, 4, 8)}


def test_interpolate_is_piecewise_linear():
    table = {1: 1.0, 4: 4.0, 8: 12.0}
    assert interpolate(table, 2) == pytest.approx(2.0) and interpolate(table, 6) == pytest.approx(8.0)
    assert interpolate(table, 16) == pytest.approx(28.0)  # extrapolated along the last segment


def test_batch_round_prices_drafting_per_row():
    costs = gpu_like_costs()
    model = BatchCostModel(costs.target_ms, costs.level_ms, costs.first_level_ms, costs.overhead_ms,
                           costs.overhead_per_token_ms, costs.plain_ms, batch=4,
                           batch_target_ms={1: 12.0, 13: 24.0})
    # forward for 6 + 1 tokens per row, then 4 x (first level + 2 levels of k=2 + overhead + 6 x slope)
    assert model.round_ms(TreeShape(3, 2, 6)) == pytest.approx(18.0 + 4 * (0.5 + 2 * 0.3 + 0.5 + 0.06))
    assert model.round_ms(TreeShape(0, 0, 0)) == pytest.approx(12.0 + 4 * 0.5)  # plain: 10.5 - 10 per row


def test_trees_shrink_as_the_batch_grows_down_to_plain_decoding():
    chosen = choose_per_batch(SHAPES, gpu_like_costs(), busy_probe(slope=1.0), 8, TreeShape(0, 0, 0))
    sizes = [chosen[b][0].total_tokens for b in range(2, 9)]
    assert sizes == sorted(sizes, reverse=True)  # never grows with the batch
    assert chosen[2][0].total_tokens > 0 and chosen[8][0].depth == 0  # drafts at 2; plain at 8
    assert len(set(sizes)) >= 3  # a real gradient, not all-or-nothing


def test_a_free_batch_keeps_the_big_tree():
    """Where batching is free (the forward costs the same for any B x K), the best tree stays the largest."""
    chosen = choose_per_batch(SHAPES, gpu_like_costs(), busy_probe(slope=0.0), 4, TreeShape(0, 0, 0))
    assert all(shape.total_tokens == 20 for shape, _ in chosen.values())


def test_fixed_fields_are_kept_per_batch():
    chosen = choose_per_batch(SHAPES, gpu_like_costs(), busy_probe(slope=1.0), 8, TreeShape(3, 0, 0))
    assert {shape.depth for shape, _ in chosen.values()} == {3}  # fixed depth: never plain, never another depth


def test_batched_forward_probe_times_every_point(tiny_llama):
    costs = measure_batched_forward(tiny_llama, context=16, batches=(2, 3), tokens=(1, 4), reps=1)
    assert set(costs) == {2, 3} and all(set(row) == {1, 4} and min(row.values()) > 0 for row in costs.values())


def test_plain_rounds_keep_the_head_cache_in_step(tiny_llama):
    """Rounds without drafting (a large batch) skip the head; the next tree feeds it every pair it
    missed, so its cache covers the whole sequence again and the output is unchanged."""
    prototype = EagleDrafter(new_head(tiny_llama, seed=0), tiny_llama, TreeShape(depth=3, topk=2, total_tokens=6))
    prompt = as_tensor(encode_prompt(tiny_llama.tokenizer, "Tell me a story", chat=False), tiny_llama.device)
    expected = generate(speculative_decode(tiny_llama, fork_eagle(prototype), prompt, SamplingParams(),
                                           Stopper(tiny_llama.tokenizer, 30, set()))).token_ids
    drafter = fork_eagle(prototype)
    sequence = Sequence(tiny_llama, drafter, prompt, SamplingParams(), Stopper(tiny_llama.tokenizer, 30, set()), None)
    tokens, plan_of_rounds = sequence.prefill(), [TreeShape(0, 0, 0)] * 3 + [None, TreeShape(1, 2, 2)] * 20
    for shape in plan_of_rounds:
        if sequence.done:
            break
        tree = sequence.draft(shape)
        if shape is None or shape.depth:
            assert drafter.committed == sequence.past and tree.size > 1  # caught up on the skipped pairs
        else:
            assert tree.size == 1
        tokens += sequence.accept(sequence.score_alone())
    assert tokens == expected and sequence.done


def test_scheduler_switches_trees_with_the_batch_size(tiny_llama):
    """Batch 3 decodes plainly, batch 2 with a depth-1 tree, batch 1 with the drafter's own chain of
    depth 3: each request's greedy output stays what it is alone."""
    prototype = EagleDrafter(new_head(tiny_llama, seed=0), tiny_llama, TreeShape(depth=3, topk=1, total_tokens=3))
    engine = Engine(serve_config(*TINY), tiny_llama, drafter_factory(prototype))
    trees = {2: TreeShape(1, 2, 2), 3: TreeShape(0, 0, 0)}
    scheduler = BatchScheduler(max_batch=3, max_queue=4, target=tiny_llama, trees=trees)
    plans = [plan(engine, f"prompt {i} {'y' * i}", n) for i, n in enumerate((14, 26, 60))]
    clients = [Client(engine, p, f"r{i}") for i, p in enumerate(plans)]
    for client in clients:
        scheduler.submit(client.job)
    scheduler.start()
    scheduler.stop(timeout=120)
    assert [c.tokens for c in clients] == [expected_alone(engine, p) for p in plans]
    assert {1, 2, 3} <= set(scheduler.batch_sizes)
    depths = [len(c.decoding.sequence.stats.reached_depth) for c in clients]  # deepest tree each one drafted
    assert clients[0].decoding.sequence.stats.rounds > 0 and depths == [0, 1, 3]  # batch 3 / 2 / alone at the end
