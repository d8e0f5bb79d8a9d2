"""A tree per batch size (eagle_lab/serving/tree_per_batch.py): priced from batch costs, it shrinks as the
batch grows down to plain decoding, and switching trees between rounds keeps outputs exact."""

from __future__ import annotations

import pytest

from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.growth import BatchTree, TreeShape
from eagle_lab.decoding.generate import Stopper, generate, speculative_decode
from eagle_lab.drafters.eagle.kinds import new_head
from eagle_lab.drafters.ngram import NgramProposer
from eagle_lab.models.prompts import as_tensor, encode_prompt
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.serving.batching import BatchScheduler
from eagle_lab.serving.drafters import drafter_factory, fork_eagle
from eagle_lab.serving.engine import Engine
from eagle_lab.serving.sequence import Sequence
from eagle_lab.serving.timed_batch import timed_batch_decoding
from eagle_lab.tree_search.validate import measured_best
from eagle_lab.tree_search.costs import CostModel
from eagle_lab.serving.tree_per_batch import (BatchCostModel, choose_per_batch, expected_widest, interpolate,
                                             measure_batched_forward, measured_choice, probe_drafting, ranked_per_batch,
                                             validate_per_batch)
from tests.serving_helpers import TINY, serve_config
from tests.scheduler_helpers import expected_alone, plan, run_plans

SHAPES = [  # replayed accept lengths, as tree_search.replay.replay_all reports them
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
    clients = run_plans(scheduler, engine, plans)
    assert [c.tokens for c in clients] == [expected_alone(engine, p) for p in plans]
    assert {1, 2, 3} <= set(scheduler.batch_sizes)
    depths = [len(c.decoding.sequence.stats.reached_depth) for c in clients]  # deepest tree each one drafted
    assert clients[0].decoding.sequence.stats.rounds > 0 and depths == [0, 1, 3]  # batch 3 / 2 / alone at the end


# ---- the model ranks, batched rounds timed in the loop decide --------------------------------

def test_timed_batch_decoding_runs_the_batched_round(tiny_llama):
    prototype = EagleDrafter(new_head(tiny_llama, seed=0), tiny_llama, TreeShape(3, 2, 6))
    prompts = [list(range(40, 52)), list(range(60, 70)), list(range(80, 95))]
    plain = timed_batch_decoding(tiny_llama, prototype, prompts, BatchTree(TreeShape(0, 0, 0)), new_tokens=8)
    assert plain["rounds"] == 7 and plain["tokens"] == 3 * 7 and plain["seconds"] > 0  # one token per row a round
    tree = timed_batch_decoding(tiny_llama, prototype, prompts, BatchTree(TreeShape(2, 2, 4)), new_tokens=8)
    assert 1 <= tree["rounds"] <= 7 and tree["tokens"] >= 3 * tree["rounds"]
    # token for token: every row of the timed tree rounds continues the plain rows' greedy output
    for with_tree, without in zip(tree["outputs"], plain["outputs"]):
        common = min(len(with_tree), len(without))
        assert common >= 1 + tree["rounds"] and with_tree[:common] == without[:common]


def test_measured_choice_uses_the_next_timed_size_up():
    tree, plain = {"shape": {"depth": 1, "topk": 1, "total_tokens": 1}}, {"shape": {"depth": 0, "topk": 0,
                                                                               "total_tokens": 0}}
    choice = measured_choice({2: [tree, plain], 4: [plain, tree], 6: [plain]}, 6)
    assert choice == {2: tree, 3: plain, 4: plain, 5: plain, 6: plain}


def test_min_gain_keeps_plain_unless_a_tree_wins_by_that_much():
    plain = {"shape": {"depth": 0, "topk": 0, "total_tokens": 0}, "measured_tokens_per_s": 100.0}
    small = {"shape": {"depth": 1, "topk": 2, "total_tokens": 2}, "measured_tokens_per_s": 108.0}
    big = {"shape": {"depth": 2, "topk": 2, "total_tokens": 4}, "measured_tokens_per_s": 125.0}
    measured = {2: [big, plain], 4: [small, plain], 8: [plain, small]}
    assert measured_choice(measured, 8) == {2: big, 3: small, 4: small, 5: plain, 6: plain, 7: plain, 8: plain}
    assert measured_choice(measured, 8, min_gain=1.1) == {2: big, 3: plain, 4: plain, 5: plain, 6: plain,
                                                          7: plain, 8: plain}
    assert measured_best([big, plain], 1.3) is plain and measured_best([big, plain], 1.25) is big
    assert measured_best([big, small], 2.0) is big  # plain not timed (fixed fields): nothing to keep


def test_validate_per_batch_times_the_best_trees_against_plain(tiny_llama, monkeypatch):
    import eagle_lab.serving.tree_per_batch as timed_batch  # where validate_per_batch looks the timer up

    prototype = EagleDrafter(new_head(tiny_llama, seed=0), tiny_llama, TreeShape(3, 2, 6))
    ranked = ranked_per_batch(SHAPES[1:], gpu_like_costs(), busy_probe(slope=0.0), 5, TreeShape(0, 0, 0))
    calls = []

    def fake(target, drafter, prompts, tree, new_tokens):  # a tree round costs three plain ones
        calls.append((len(prompts), tree.shape.depth))
        rounds = 10
        return {"tokens": int(rounds * len(prompts) * (1.5 if tree.shape.depth else 1.0)), "rounds": rounds,
                "seconds": 3.0 if tree.shape.depth else 1.0}

    monkeypatch.setattr(timed_batch, "timed_batch_decoding", fake)
    measured = validate_per_batch(tiny_llama, prototype, ranked, TreeShape(0, 0, 0), False, [[1, 2, 3]], 8)
    assert sorted(measured) == [2, 4, 5]  # the probed sizes up to max_batch, and max_batch itself
    assert {(b, d) for b, d in calls} >= {(2, 0), (4, 0), (5, 0)}  # plain decoding timed at every size
    assert len(calls) == 3 * 4  # the model's 3 best trees and plain, at each size
    assert all(rows[0]["shape"]["depth"] == 0 for rows in measured.values())  # measured, plain wins
    assert all("measured_tokens_per_s" in r and "measured_tau" in r for rows in measured.values() for r in rows)
    deep = ranked_per_batch(SHAPES, gpu_like_costs(), busy_probe(slope=0.0), 5, TreeShape(3, 0, 0))
    fixed = validate_per_batch(tiny_llama, prototype, deep, TreeShape(3, 0, 0), False, [[1, 2, 3]], 8)
    assert all(r["shape"]["depth"] == 3 for rows in fixed.values() for r in rows)  # a fixed depth never goes plain


def test_trees_per_batch_times_once_and_reads_the_timings_back(tiny_llama, tmp_path, monkeypatch):
    import json

    import eagle_lab.serving.tree_per_batch as timed_batch  # where validate_per_batch looks the timer up
    from eagle_lab.tree_search.auto import auto_tree
    from eagle_lab.tree_search.space import TreeSearchConfig
    from eagle_lab.serving.tree_per_batch import trees_per_batch

    monkeypatch.setenv("EAGLE_LAB_CACHE", str(tmp_path))
    search = TreeSearchConfig(depths=[1, 2], topks=[1, 2], totals=[1, 2, 4], record_shape=(2, 2, 4),
                              probe_shape=(1, 2, 2), new_tokens=8, context=32, validate_new_tokens=8)
    drafter = EagleDrafter(new_head(tiny_llama, seed=0), tiny_llama, TreeShape(3, 2, 6))
    prompts = [list(range(40, 60)), list(range(70, 85))]
    auto_tree(tiny_llama, drafter, TreeShape(0, 0, 0), prompts, search)
    trees = trees_per_batch(tiny_llama, drafter, TreeShape(0, 0, 0), 3, search, prompts=prompts)
    assert sorted(trees) == [2, 3] and all(isinstance(t, BatchTree) for t in trees.values())
    calibration = next(p for p in (tmp_path / "tree_auto").glob("*.json") if "-batch-" not in p.name
                       and "-drafting-" not in p.name)
    timed = next(iter(json.loads(calibration.read_text())["validated_batch"].values()))
    assert sorted(timed) == ["2", "3"] and all(r["measured_tokens_per_s"] > 0 for r in timed["3"])
    assert trees[3] == BatchTree(TreeShape(**timed["3"][0]["shape"]))  # the fastest measured at batch 3

    def not_again(*args):
        raise AssertionError("timed again instead of read from the calibration file")

    monkeypatch.setattr(timed_batch, "timed_batch_decoding", not_again)
    assert trees_per_batch(tiny_llama, drafter, TreeShape(0, 0, 0), 3, search, prompts=prompts) == trees


# ---- batched drafting and hybrid drafting at batch > 1 ----------------------------------------

HYBRID = [  # replayed with chains: "extra" counts rounds by the chain tokens each added to the tree
    {"shape": {"depth": 0, "topk": 0, "total_tokens": 0}, "tau": 1.0},
    {"shape": {"depth": 0, "topk": 0, "total_tokens": 0}, "tau": 1.8, "ngram_tokens": 4, "extra": {"0": 1, "4": 1}},
    {"shape": {"depth": 3, "topk": 2, "total_tokens": 6}, "tau": 2.2},
    {"shape": {"depth": 3, "topk": 2, "total_tokens": 6}, "tau": 2.6, "ngram_tokens": 4,
     "extra": {"0": 1, "2": 1, "4": 2}},
]


def test_expected_widest_row_prices_the_padded_forward():
    table = {1: 10.0, 5: 50.0}  # 10 ms per token scored
    assert expected_widest(table, {0: 1, 4: 1}, 1, 1) == pytest.approx(0.5 * 10.0 + 0.5 * 50.0)
    assert expected_widest(table, {0: 1, 4: 1}, 1, 2) == pytest.approx(0.25 * 10.0 + 0.75 * 50.0)
    assert expected_widest(table, {0: 3}, 1, 8) == pytest.approx(10.0)  # no chain: every row is the root alone


def test_batched_drafting_and_ngram_rows_are_priced_per_batch():
    costs = gpu_like_costs()
    model = BatchCostModel(costs.target_ms, costs.level_ms, costs.first_level_ms, costs.overhead_ms,
                           costs.overhead_per_token_ms, costs.plain_ms, 0.2, 1.0, batch=4,
                           batch_target_ms={1: 12.0, 13: 24.0}, draft_scale=2.0)
    one_draft = 0.5 + 2 * 0.3
    # drafting four rows batched costs two single drafts, not four
    assert model.round_ms(TreeShape(3, 2, 6)) == pytest.approx(18.0 + 2 * one_draft + 4 * (0.5 + 0.06))
    # n-gram only, chains of 4 in half the rounds: forward at the expected widest row (1 - 0.5^4 add 4)
    row = HYBRID[1]
    forward = 0.5 ** 4 * 12.0 + (1 - 0.5 ** 4) * 16.0
    per_row = 0.5 * ((10.5 - 10.0) + 0.2) + 0.5 * 1.0  # empty chain: no-draft row + proposing; else timed
    assert model.row_ms(row) == pytest.approx(forward + 4 * per_row)


def test_hybrid_chains_shrink_with_the_batch():
    costs = gpu_like_costs()
    costs.ngram_ms, costs.ngram_round_ms = 0.1, 0.6
    scales = {2: 1.2, 4: 1.6, 8: 2.5}
    chosen = choose_per_batch(HYBRID[:2], costs, busy_probe(slope=1.0), 8, TreeShape(0, 0, 0), scales)
    chains = {b: row.get("ngram_tokens", 0) for b, (_, row) in chosen.items()}
    assert chosen[2][0] == TreeShape(0, 0, 0) and chains[2] == 4  # a lightly loaded batch still copies
    assert chosen[8][0] == TreeShape(0, 0, 0) and chains[8] == 0  # a saturated one decodes plainly
    chosen = choose_per_batch(HYBRID, costs, busy_probe(slope=1.0), 8, TreeShape(0, 0, 0), scales)
    assert chosen[2][0] == TreeShape(3, 2, 6)  # here the head's tree pays at batch 2 (its chains do not)
    assert chosen[8][0] == TreeShape(0, 0, 0) and not chosen[8][1].get("ngram_tokens")


def test_batched_drafting_probe_is_cached(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_LAB_CACHE", str(tmp_path))
    drafter = EagleDrafter(new_head(tiny_llama, seed=0), tiny_llama, TreeShape(2, 2, 3))
    scales = probe_drafting(tiny_llama, drafter, context=16, max_batch=3, reps=1)
    assert set(scales) == {1, 2, 3} and scales[1] == 1.0 and all(v >= 1.0 for v in scales.values())
    assert len(list((tmp_path / "tree_auto").glob("*-drafting-*.json"))) == 1
    assert probe_drafting(tiny_llama, drafter, context=16, max_batch=3) == scales  # read back, not re-timed


def test_scheduler_switches_chain_lengths_with_the_batch_size(tiny_llama):
    """A hybrid drafter: batch 3 copies no chain and drafts nothing, batch 2 copies chains of 2 with
    no head, alone it keeps its own tree and chains; each request's greedy output is what it is alone."""
    proposer = NgramProposer(min_match=1, max_match=2, max_tokens=6)
    prototype = EagleDrafter(new_head(tiny_llama, seed=0), tiny_llama, TreeShape(2, 2, 3), ngram=proposer)
    engine = Engine(serve_config(*TINY), tiny_llama, drafter_factory(prototype))
    trees = {2: BatchTree(TreeShape(0, 0, 0), 2), 3: BatchTree(TreeShape(0, 0, 0), 0)}
    scheduler = BatchScheduler(max_batch=3, max_queue=4, target=tiny_llama, trees=trees)
    plans = [plan(engine, f"abcabc {i} abcabc {'y' * i}", n) for i, n in enumerate((14, 26, 60))]
    clients = run_plans(scheduler, engine, plans)
    assert [c.tokens for c in clients] == [expected_alone(engine, p) for p in plans]
    assert {1, 2, 3} <= set(scheduler.batch_sizes)
    last = clients[2].decoding.sequence
    assert last.drafter.ngram == proposer  # back to its own chains once alone
    assert len(last.stats.reached_depth) >= 1  # it drafted (chains, then its own tree)
