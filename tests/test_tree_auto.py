"""tree=auto: replaying recorded candidates, and the whole calibration on a tiny target."""

import json
import math
from dataclasses import replace

import pytest
import torch

from eagle_lab.decoding.sampling import SamplingParams, target_probs
from eagle_lab.decoding.tree import build_tree
from eagle_lab.decoding.verify import verify
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.eagle.kinds import new_head
from eagle_lab.drafters.growth import Candidates, TreeChoice, TreeShape
from eagle_lab.drafters.ngram import NgramProposer
from eagle_lab.tree_search.auto import auto_tree, choose, row_ms, row_tau
from eagle_lab.tree_search.costs import CostModel
from eagle_lab.tree_search.replay import (
    Recording,
    ReplayTree,
    expected_accept,
    ngram_lengths,
    node_paths,
    record,
    replay_all,
    simulate_accept,
    simulate_hybrid,
)
from eagle_lab.tree_search.space import TreeSearchConfig
from eagle_lab.tree_search.validate import decode_timings
from tests.conftest import small_vocab_target

# root children a(5) > b(6) > c(7); a's children: d(8) > e(9); b's children: f(10) > g(11)
CANDS = Candidates(
    scores=torch.tensor([-0.1, -0.5, -2.0, -0.3, -1.0, -0.9, -3.0]),
    parents=torch.tensor([-1, -1, -1, 0, 0, 1, 1]),
    tokens=torch.tensor([5, 6, 7, 8, 9, 10, 11]),
)


def test_simulate_accept_follows_the_output():
    assert simulate_accept(CANDS, [5, 8, 1], TreeShape(2, 2, 6)) == 2  # a then d
    assert simulate_accept(CANDS, [5, 8, 1], TreeShape(1, 2, 2)) == 1  # depth 1: only a
    assert simulate_accept(CANDS, [6, 10], TreeShape(2, 2, 3)) == 1  # f ranks below the top-3 cut
    assert simulate_accept(CANDS, [6, 10], TreeShape(2, 2, 4)) == 2
    assert simulate_accept(CANDS, [7], TreeShape(1, 2, 2)) == 0  # c is beyond top-2
    assert simulate_accept(CANDS, [7], TreeShape(1, 3, 3)) == 1


def test_choose_trades_acceptance_for_cost():
    shapes = [{"shape": {"depth": 0, "topk": 0, "total_tokens": 0}, "tau": 1.0},
              {"shape": {"depth": 2, "topk": 2, "total_tokens": 4}, "tau": 2.0},
              {"shape": {"depth": 4, "topk": 4, "total_tokens": 16}, "tau": 2.6}]
    flat = CostModel({1: 10.0, 5: 11.0, 17: 12.0}, {2: 0.5, 4: 0.5}, 1.0, 0.0)  # a GPU-like curve
    assert choose(shapes, flat, TreeShape(0, 0, 0))[0] == TreeShape(4, 4, 16)
    steep = CostModel({1: 10.0, 5: 25.0, 17: 60.0}, {2: 2.0, 4: 2.0}, 1.0, 0.0)  # a CPU-like curve
    assert choose(shapes, steep, TreeShape(0, 0, 0))[0] == TreeShape(0, 0, 0)
    assert choose(shapes, steep, TreeShape(2, 0, 0))[0] == TreeShape(2, 2, 4)  # fixed depth is kept


def test_no_draft_is_priced_by_its_measured_round_like_for_like():
    shapes = [{"shape": {"depth": 0, "topk": 0, "total_tokens": 0}, "tau": 1.0},
              {"shape": {"depth": 1, "topk": 4, "total_tokens": 4}, "tau": 1.5}]
    # modelled target costs alone would make the tree win (1.5 / 14 ms > 1 / 10 ms) ...
    costs = CostModel({1: 10.0, 5: 13.0}, {4: 1.0}, 1.0, 2.0, 0.1, plain_ms=9.0)
    assert costs.round_ms(TreeShape(1, 4, 4)) == 13.0 + 1.0 + 2.0 + 0.4
    assert costs.round_ms(TreeShape(0, 0, 0)) == 9.0  # ... priced as the no-draft path measured
    chosen, ranked = choose(shapes, costs, TreeShape(0, 0, 0))
    assert chosen == TreeShape(0, 0, 0) and ranked[0]["tokens_per_s"] == 1000 / 9.0
    cheaper = CostModel({1: 10.0, 5: 11.0}, {4: 0.5}, 0.5, 0.5, 0.0, plain_ms=12.0)
    chosen, ranked = choose(shapes, cheaper, TreeShape(0, 0, 0))
    assert chosen == TreeShape(1, 4, 4) and ranked[0]["tokens_per_s"] > ranked[1]["tokens_per_s"]


def test_auto_tree_calibrates_and_caches(tiny_llama, tmp_path):
    drafter = EagleDrafter(new_head(tiny_llama, seed=1), tiny_llama, TreeShape(4, 4, 12))
    search = TreeSearchConfig(depths=[1, 2, 3], topks=[1, 2], totals=[1, 2, 4], record_shape=(3, 2, 6),
                              probe_shape=(1, 2, 2), new_tokens=16, context=32)
    prompts = [list(range(40, 60)), list(range(70, 85))]
    shape = auto_tree(tiny_llama, drafter, TreeShape(0, 0, 0), prompts, search, cache_dir=tmp_path)
    assert drafter.shape == shape
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1
    summary = json.loads(files[0].read_text())
    assert summary["rounds"] > 0 and summary["cost_model"]["target_ms"]
    measured = summary["measured_round_ms"]
    assert measured["no_draft"] > 0 and summary["cost_model"]["plain_ms"] == measured["no_draft"]
    assert measured["record"] > 0 and measured["probe"] > 0  # both shapes the overhead line goes through were timed
    assert all(math.isfinite(summary["cost_model"][k]) for k in ("overhead_ms", "overhead_per_token_ms"))
    again = auto_tree(tiny_llama, drafter, TreeShape(2, 0, 0), prompts, search, cache_dir=tmp_path)
    assert again.depth == 2 and len(list(tmp_path.glob("*.json"))) == 1  # served from the cache
    timed = summary["validated"]["d0-k0-n0"]
    plain_rate = next(r for r in timed if r["shape"]["depth"] == 0)["measured_tokens_per_s"]
    beaten_by = timed[0]["measured_tokens_per_s"] / plain_rate  # the fastest timed row against plain
    strict = auto_tree(tiny_llama, drafter, TreeShape(0, 0, 0), prompts, search, cache_dir=tmp_path,
                       min_gain=beaten_by * 1.01)  # the same timings (cached), a margin no tree meets
    assert strict == TreeShape(0, 0, 0)
    loose = auto_tree(tiny_llama, drafter, TreeShape(0, 0, 0), prompts, search, cache_dir=tmp_path,
                      min_gain=max(beaten_by * 0.99, 1.0))
    assert loose == TreeShape(**timed[0]["shape"])


def test_timing_in_the_loop_overrules_the_model(tiny_llama, monkeypatch):
    """The model ranks a one-token chain above plain decoding; decoding timed in the loop decides."""
    import eagle_lab.tree_search.validate as tree_validate

    costs = CostModel({1: 10.0, 2: 11.0, 5: 12.0}, {1: 1.0}, 1.0, 0.0, 0.0, plain_ms=10.0)
    ranked = [{"shape": {"depth": 1, "topk": 1, "total_tokens": 1}, "tau": 1.4, "tokens_per_s": 116.7}]
    drafter = EagleDrafter(new_head(tiny_llama, seed=1), tiny_llama, TreeShape(4, 4, 12))
    args = (tiny_llama, drafter, ranked, costs, TreeShape(0, 0, 0), [[1, 2, 3]], TreeSearchConfig(), None)
    timed = []

    def fake_timings(tree_seconds):
        def timings(target, drafter, prompts, new_tokens, candidates, backend=None, params=None):
            timed.append([shape.depth for shape, _ in candidates])
            return [{"tokens": 140, "rounds": 100, "seconds": tree_seconds} if shape.depth else
                    {"tokens": 100, "rounds": 100, "seconds": 1.0} for shape, _ in candidates]
        return timings

    monkeypatch.setattr(tree_validate, "decode_timings", fake_timings(2.0))  # a round costs two plain ones
    rows = tree_validate.validate(*args)
    assert timed[-1] == [1, 0]  # plain decoding timed in the same runs
    assert rows[0]["shape"]["depth"] == 0 and rows[1]["measured_tokens_per_s"] == pytest.approx(70.0)
    assert rows[1]["measured_tau"] == pytest.approx(1.4) and rows[1]["measured_round_ms"] == pytest.approx(20.0)
    monkeypatch.setattr(tree_validate, "decode_timings", fake_timings(1.2))  # as cheap as the model said
    assert tree_validate.validate(*args)[0]["shape"]["depth"] == 1
    monkeypatch.setattr(tree_validate, "decode_timings", fake_timings(2.0))
    fixed = tree_validate.validate(tiny_llama, drafter, ranked, costs, TreeShape(1, 0, 0), [[1, 2, 3]],
                               TreeSearchConfig(), None)
    assert [r["shape"]["depth"] for r in fixed] == [1] and timed[-1] == [1]  # a fixed depth never falls back


def test_decode_timings_visit_every_prompt_with_every_candidate_twice_in_rotating_order(tiny_llama, monkeypatch):
    import eagle_lab.tree_search.validate as tree_validate

    drafter = EagleDrafter(new_head(tiny_llama, seed=1), tiny_llama, TreeShape(4, 4, 12))
    order = []
    decode = tree_validate.speculative_decode

    def spy(target, drafter, prompt, *args, **kwargs):
        order.append((int(prompt[0]), drafter.shape.depth))
        return decode(target, drafter, prompt, *args, **kwargs)

    monkeypatch.setattr(tree_validate, "speculative_decode", spy)
    candidates = [(TreeShape(2, 2, 4), None), (TreeShape(1, 1, 1), None)]
    timings = decode_timings(tiny_llama, drafter, [list(range(40, 50)), list(range(60, 70))], 6, candidates)
    # each prompt twice (the faster run counts), the order rotated from run to run and prompt to prompt
    assert order == [(40, 2), (40, 1), (40, 1), (40, 2), (60, 1), (60, 2), (60, 2), (60, 1)]
    assert timings[0]["tokens"] == timings[1]["tokens"] > 0  # the same greedy output, prefills not counted
    assert all(t["rounds"] >= 1 and t["seconds"] > 0 for t in timings)
    assert drafter.shape == TreeShape(4, 4, 12)  # restored


# ---- hybrid drafting: n-gram chains replayed and priced with the trees -------------------------

def test_simulate_hybrid_accepts_the_longer_agreement_and_counts_added_tokens():
    tree = ReplayTree(CANDS, TreeShape(2, 2, 4))  # keeps a(5), b(6), d(8), f(10)
    assert simulate_hybrid(tree, [5, 8, 1], [5, 8, 1, 2]) == (3, 2)  # chain beats the tree; 5, 8 already held
    assert simulate_hybrid(tree, [5, 8, 1], [5, 9]) == (2, 1)  # the tree's path wins; 9 is new
    assert simulate_hybrid(tree, [7, 2], [7, 2, 4]) == (2, 3)  # 7 is not kept: a whole new branch
    assert simulate_hybrid(tree, [6, 10], []) == (2, 0)


def test_ngram_lengths_searched_up_to_max_tokens():
    assert ngram_lengths(None) == []
    assert ngram_lengths(NgramProposer(2, 4, 5)) == [1, 2, 3, 4, 5]
    assert ngram_lengths(NgramProposer(2, 4, 20)) == [1, 2, 3, 4, 6, 8, 12, 16, 20]


RECORDING = Recording(rounds=[(CANDS, [5, 8, 1]), (CANDS, [7, 2]), (CANDS, [3, 3])],
                      chains=[[5, 8, 1, 2], [], [3, 3, 3]], ngram_ms=0.2)
TINY_SEARCH = TreeSearchConfig(depths=[1], topks=[2], totals=[2])


def test_replay_merges_chains_of_each_length():
    rows = {(r["shape"]["depth"], r.get("ngram_tokens", 0)): r for r in replay_all(RECORDING, TINY_SEARCH, [1, 2])}
    assert set(rows) == {(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)}
    assert rows[(0, 0)]["tau"] == 1.0 and "extra" not in rows[(0, 0)]
    # n-gram alone: round 1 accepts 5 (8), round 2 has no chain, round 3 accepts 3 (3)
    assert rows[(0, 1)]["tau"] == pytest.approx(1 + 2 / 3) and rows[(0, 1)]["extra"] == {"1": 2, "0": 1}
    assert rows[(0, 2)]["tau"] == pytest.approx(1 + 4 / 3) and rows[(0, 2)]["extra"] == {"2": 2, "0": 1}
    # depth 1, top-2, 2 tokens keeps a(5), b(6): alone it accepts only round 1's 5
    assert rows[(1, 0)]["tau"] == pytest.approx(1 + 1 / 3)
    assert rows[(1, 1)]["tau"] == pytest.approx(1 + 2 / 3) and rows[(1, 1)]["extra"] == {"0": 2, "1": 1}
    assert rows[(1, 2)]["tau"] == pytest.approx(1 + 4 / 3) and rows[(1, 2)]["extra"] == {"1": 1, "0": 1, "2": 1}


def test_rounds_pay_for_every_chain_token_and_ngram_alone_can_win():
    costs = CostModel({1: 10.0, 2: 14.0, 3: 18.0, 5: 26.0}, {2: 1.0}, 2.0, 1.0, 0.5, plain_ms=9.0, ngram_ms=0.2)
    assert costs.round_ms(TreeShape(0, 0, 0), 2, ngram=True) == 18.0 + 1.0 + 0.5 * 2 + 0.2  # no draft cost
    assert costs.round_ms(TreeShape(0, 0, 0), 0, ngram=True) == 9.0 + 0.2  # no chain: the no-draft round
    assert costs.round_ms(TreeShape(1, 2, 2), 1, ngram=True) == 22.0 + 2.0 + 1.0 + 0.5 * 3 + 0.2  # target(4): 3 <-> 5
    rows = replay_all(RECORDING, TINY_SEARCH, [1, 2])
    chosen, ranked = choose(rows, costs, TreeShape(0, 0, 0))
    assert chosen == TreeShape(0, 0, 0) and ranked[0]["ngram_tokens"] == 2  # n-gram alone, chains of 2
    assert ranked[0]["round_ms"] == pytest.approx((2 * (18.0 + 1.0 + 1.0 + 0.2) + 9.2) / 3)
    assert ranked[0]["tokens_per_s"] == pytest.approx(1000 * (1 + 4 / 3) / ranked[0]["round_ms"])
    chosen, ranked = choose(rows, costs, TreeShape(1, 0, 0))  # a fixed depth keeps the head's tree
    assert chosen == TreeShape(1, 2, 2) and ranked[0]["ngram_tokens"] == 2


def test_ngram_only_rounds_are_priced_by_their_own_timing():
    """Timed n-gram-only rounds replace the head rounds' overhead line for rounds that skip the head."""
    costs = CostModel({1: 10.0, 2: 14.0, 3: 18.0, 5: 26.0}, {2: 1.0}, 2.0, 8.0, 0.5, plain_ms=9.0, ngram_ms=0.2,
                      ngram_round_ms=1.5)
    assert costs.round_ms(TreeShape(0, 0, 0), 2, ngram=True) == 18.0 + 1.5  # not 18 + 8 + 0.5 * 2 + 0.2
    assert costs.round_ms(TreeShape(0, 0, 0), 0, ngram=True) == 9.0 + 0.2  # no chain: the no-draft round
    # head rounds as before
    assert costs.round_ms(TreeShape(1, 2, 2), 1, ngram=True) == 22.0 + 2.0 + 8.0 + 0.5 * 3 + 0.2
    rows = replay_all(RECORDING, TINY_SEARCH, [1, 2])
    unmeasured = replace(costs, ngram_round_ms=None)
    ngram_only = [r for r in rows if r["shape"]["depth"] == 0 and r.get("ngram_tokens")]
    assert all(row_ms(r, costs) < row_ms(r, unmeasured) for r in ngram_only)


def test_auto_tree_with_ngram_calibrates_separately(tmp_path):
    target = small_vocab_target(vocab_size=8, seed=0)
    search = TreeSearchConfig(depths=[1, 2], topks=[1, 2], totals=[1, 2, 4], record_shape=(2, 2, 4),
                              probe_shape=(1, 2, 2), new_tokens=24, context=32)
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], [6, 0, 7, 6, 0, 7, 6, 0]]
    proposer = NgramProposer(min_match=2, max_match=3, max_tokens=4)
    drafter = EagleDrafter(new_head(target, seed=1), target, TreeShape(4, 4, 12), ngram=proposer)
    shape = auto_tree(target, drafter, TreeShape(0, 0, 0), prompts, search, cache_dir=tmp_path)
    assert drafter.shape == shape
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1
    summary = json.loads(files[0].read_text())
    assert summary["cost_model"]["ngram_ms"] > 0
    rows = summary["shapes"]
    lengths = {r.get("ngram_tokens", 0) for r in rows}
    assert lengths == {0, 1, 2, 3, 4}
    base = {json.dumps(r["shape"]): r["tau"] for r in rows if not r.get("ngram_tokens")}
    assert all(r["tau"] >= base[json.dumps(r["shape"])] - 1e-9 for r in rows)  # a chain never loses a token
    assert any(r["tau"] > base[json.dumps(r["shape"])] for r in rows if r.get("ngram_tokens"))  # and it helps here
    cm = summary["cost_model"]
    costs = CostModel({int(k): v for k, v in cm["target_ms"].items()}, {int(k): v for k, v in cm["level_ms"].items()},
                      cm["first_level_ms"], cm["overhead_ms"], cm["overhead_per_token_ms"], cm["plain_ms"],
                      cm["ngram_ms"], cm["ngram_round_ms"])
    assert cm["ngram_round_ms"] is not None  # the prompts repeat: n-gram-only rounds were found and timed
    timed = summary["validated"]["d0-k0-n0"]  # the model's best few, timed in the loop
    best = choose(rows, costs, TreeShape(0, 0, 0))[1][0]
    assert {json.dumps(r["shape"]) for r in timed} >= {json.dumps(best["shape"])}
    expected = timed[0].get("ngram_tokens", 0)
    assert (drafter.ngram.max_tokens if drafter.ngram else 0) == expected  # the chosen chain length, or off
    if drafter.ngram:
        assert (drafter.ngram.min_match, drafter.ngram.max_match) == (2, 3)
    plain = EagleDrafter(new_head(target, seed=1), target, TreeShape(4, 4, 12))
    auto_tree(target, plain, TreeShape(0, 0, 0), prompts, search, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 2 and plain.ngram is None  # cached apart from the hybrid's


def test_a_bucketed_backend_prices_every_size_at_its_bucket(tiny_llama):
    """A static backend pads N tokens to a bucket, so N=5 costs what 8 costs: no size may be
    interpolated from its neighbours, and sizes in one bucket cost the same."""
    from eagle_lab.decoding.backend import StaticBackend
    from eagle_lab.tree_search.costs import measure_target_costs

    costs = measure_target_costs(tiny_llama, 16, backend=StaticBackend(tiny_llama, [4, 8], 64))
    assert sorted(costs) == list(range(1, 9))
    assert all(ms > 0 for ms in costs.values())
    assert len({costs[k] for k in (1, 2, 3, 4)}) == 1 and len({costs[k] for k in (5, 6, 7, 8)}) == 1


def test_no_loop_timing_when_the_model_ranks_plain_first_by_a_wide_margin(tiny_llama, tmp_path, monkeypatch):
    """When plain decoding tops the model's ranking and no tree comes within CLOSE_CALL of it, nothing
    is decoded and plain decoding is kept, marked as not timed; a tree that comes close, or one on top,
    is timed in the loop (the model's fitted overhead can overprice trees)."""
    import eagle_lab.tree_search.validate as tree_validate
    from eagle_lab.tree_search.auto import validated

    def no_timings(*args, **kwargs):
        raise AssertionError("decoded in the loop although the model ranks plain decoding first")

    monkeypatch.setattr(tree_validate, "decode_timings", no_timings)
    costs = CostModel({1: 10.0, 2: 20.0}, {1: 1.0}, 1.0, 0.0, 0.0, plain_ms=10.0)
    ranked = [
        {"shape": {"depth": 0, "topk": 0, "total_tokens": 0}, "tau": 1.0, "tokens_per_s": 100.0, "round_ms": 10.0},
        {"shape": {"depth": 1, "topk": 1, "total_tokens": 1}, "tau": 1.4, "tokens_per_s": 50.0, "round_ms": 28.0}]
    drafter = EagleDrafter(new_head(tiny_llama, seed=1), tiny_llama, TreeShape(4, 4, 12))
    summary, path = {}, tmp_path / "calibration.json"
    rows = validated(tiny_llama, drafter, summary, path, ranked, costs, TreeShape(0, 0, 0), [[1, 2, 3]],
                     TreeSearchConfig(), None)
    assert [r["shape"]["depth"] for r in rows] == [0] and rows[0]["timed"] is False
    assert json.loads(path.read_text())["validated"]["d0-k0-n0"] == rows  # cached like a timed ranking
    assert tree_validate.measured_best(rows, 1.2) is rows[0]
    close = [ranked[0], {**ranked[1], "tokens_per_s": 70.0}]  # priced at 0.7 x plain: timed
    with pytest.raises(AssertionError, match="decoded in the loop"):
        validated(tiny_llama, drafter, {}, path, close, costs, TreeShape(0, 0, 0), [[1, 2, 3]], TreeSearchConfig(),
                  None)
    ranked[0], ranked[1] = ranked[1], ranked[0]  # a tree on top: it must be timed
    with pytest.raises(AssertionError, match="decoded in the loop"):
        validated(tiny_llama, drafter, {}, path, ranked, costs, TreeShape(0, 0, 0), [[1, 2, 3]], TreeSearchConfig(),
                  None)


def test_a_quick_calibration_is_replaced_by_a_full_one(tiny_llama, tmp_path, monkeypatch):
    """A short run calibrates quickly (no n-gram-only timing; its shapes and candidates timed on one
    prompt); a later full run measures again on every prompt and its calibration then serves short
    runs too."""
    import eagle_lab.tree_search.auto as tree_auto
    import eagle_lab.tree_search.validate as tree_validate

    proposer = NgramProposer(max_tokens=2, min_match=2, max_match=3)
    drafter = EagleDrafter(new_head(tiny_llama, seed=1), tiny_llama, TreeShape(4, 4, 12))
    search = TreeSearchConfig(depths=[1, 2], topks=[1, 2], totals=[1, 2, 4], record_shape=(2, 2, 4),
                              probe_shape=(1, 2, 2), new_tokens=12, context=32)
    prompts = [[5, 6, 7, 8] * 5, list(range(70, 85))]
    calls = {"calibrate": 0, "timings": 0, "timed_prompts": [], "validated_prompts": []}
    real_calibrate, real_timings = tree_auto.calibrate, tree_validate.decode_timings
    real_rounds = tree_auto.timed_rounds

    def counted_calibrate(*args, **kwargs):
        calls["calibrate"] += 1
        return real_calibrate(*args, **kwargs)

    def counted_timings(target, drafter, prompts, *args, **kwargs):
        calls["timings"] += 1
        calls["validated_prompts"].append(len(prompts))
        return real_timings(target, drafter, prompts, *args, **kwargs)

    def counted_rounds(target, drafter, prompts, *args, **kwargs):
        calls["timed_prompts"].append(len(prompts))
        return real_rounds(target, drafter, prompts, *args, **kwargs)

    monkeypatch.setattr(tree_auto, "calibrate", counted_calibrate)
    monkeypatch.setattr(tree_validate, "decode_timings", counted_timings)
    monkeypatch.setattr(tree_auto, "timed_rounds", counted_rounds)
    drafter.ngram = proposer  # auto_tree replaces it with the chosen chain (or none)
    auto_tree(tiny_llama, drafter, TreeShape(0, 0, 0), prompts, search, cache_dir=tmp_path, quick=True)
    [path] = tmp_path.glob("*.json")
    summary = json.loads(path.read_text())
    assert summary["quick"] and summary["cost_model"]["ngram_round_ms"] is None
    assert calls["calibrate"] == 1 and calls["timed_prompts"] == [1, 1]  # one prompt per timed shape
    quick_rows = summary["validated"]["d0-k0-n0"]
    quick_timed = all(r.get("timed", True) for r in quick_rows)  # untimed only where plain won by a wide margin
    assert calls["validated_prompts"] == ([1] if quick_timed else []) and (quick_timed or len(quick_rows) == 1)
    drafter.ngram = proposer  # auto_tree replaces it with the chosen chain (or none)
    auto_tree(tiny_llama, drafter, TreeShape(0, 0, 0), prompts, search, cache_dir=tmp_path, quick=True)
    assert calls["calibrate"] == 1  # the quick one serves short runs
    drafter.ngram = proposer  # auto_tree replaces it with the chosen chain (or none)
    auto_tree(tiny_llama, drafter, TreeShape(0, 0, 0), prompts, search, cache_dir=tmp_path)
    summary = json.loads(path.read_text())
    assert calls["calibrate"] == 2 and not summary["quick"] and calls["timed_prompts"][2:] == [2, 2]
    rows = summary["validated"]["d0-k0-n0"]
    timed_in_loop = all(r.get("timed", True) for r in rows)  # untimed only where the model ranked plain first
    assert calls["validated_prompts"][int(quick_timed):] == ([2] if timed_in_loop else [])
    assert timed_in_loop or len(rows) == 1
    drafter.ngram = proposer  # auto_tree replaces it with the chosen chain (or none)
    auto_tree(tiny_llama, drafter, TreeShape(0, 0, 0), prompts, search, cache_dir=tmp_path, quick=True)
    assert calls["calibrate"] == 2  # the full one serves short runs too


def test_expected_accept_is_what_sampling_verification_accepts_on_average():
    """The sum over nodes of the product of p along the path, against verify.py's sampling rule run
    many times on one tree (a chain merged after it too): a wrong formula lands many sigmas away."""
    g = torch.Generator().manual_seed(0)
    # root -> 5, 6; 5 -> 8, 9; 6 -> 10; 8 -> 12   (a chain 6, 10, 13 merges a new node 13 under 10)
    tree = build_tree(torch.tensor([1, 5, 6, 8, 9, 10, 12, 13]), torch.tensor([-1, 0, 0, 1, 1, 2, 3, 5]))
    logits = torch.randn(tree.size, 16, generator=g) * 1.5  # [N, V] the target at each node
    for node, token in ((0, 5), (0, 6), (1, 8), (3, 12), (5, 13)):
        logits[node, token] += 2.0  # make the drafted tokens likely, so deep nodes are reached
    params = SamplingParams(temperature=1.0)
    probs = target_probs(logits, params)  # [N, V]
    paths = node_paths(tree)
    row = {path: i for i, path in enumerate(paths)}
    path_probs = {path: float(probs[row[path[:-1]], path[-1]]) for path in paths[1:]}
    expected = expected_accept(paths[1:7], path_probs, chain=[6, 10, 13])
    draws = 6000
    accepted = [verify(tree, lambda node: logits[node], params, g)[0].numel() - 1 for _ in range(draws)]
    mean = sum(accepted) / draws
    spread = (sum((a - mean) ** 2 for a in accepted) / draws) ** 0.5
    assert abs(mean - expected) < 4 * spread / draws ** 0.5, (mean, expected)
    assert expected_accept(paths[1:3], path_probs) == pytest.approx(float(probs[0, 5] + probs[0, 6]))
    assert expected_accept([(5,), (5, 8)], {(5, 8): 0.9}) == 0.0  # a probability not recorded counts as 0


def test_sampled_replay_matches_greedy_replay_as_the_temperature_goes_to_zero(tiny_llama):
    """At a tiny temperature the target's distribution is its argmax, so the expected accept length is
    the greedy one wherever the recording scored a tree's nodes: equal for the recorded shape, never above."""
    drafter = EagleDrafter(new_head(tiny_llama, seed=1), tiny_llama, TreeShape(3, 2, 6))
    search = TreeSearchConfig(depths=[1, 2, 3], topks=[1, 2], totals=[1, 2, 4, 6], record_shape=(3, 2, 6),
                              sampled_temperatures=[1e-4, 1.0])
    recording, _ = record(tiny_llama, drafter, [list(range(40, 60)), list(range(70, 85))], 16,
                          temperatures=search.sampled_temperatures)
    assert recording.rounds and len(recording.path_probs) == len(recording.rounds)
    rows = replay_all(recording, search)
    for row in rows:
        assert row["sampled_tau"]["0.0001"] <= row["tau"] + 1e-6
        assert row["sampled_tau"]["1.0"] >= 1.0
    recorded = next(r for r in rows if r["shape"] == {"depth": 3, "topk": 2, "total_tokens": 6})
    assert recorded["sampled_tau"]["0.0001"] == pytest.approx(recorded["tau"], abs=1e-4)
    assert row_tau(recorded, 0.9) == recorded["sampled_tau"]["1.0"] and row_tau(recorded, 0.0) == recorded["tau"]


def test_choose_ranks_sampled_requests_by_their_expected_accept_length():
    shapes = [{"shape": {"depth": 0, "topk": 0, "total_tokens": 0}, "tau": 1.0, "sampled_tau": {"1": 1.0}},
              {"shape": {"depth": 1, "topk": 3, "total_tokens": 3}, "tau": 1.6, "sampled_tau": {"1": 1.45}},
              {"shape": {"depth": 3, "topk": 1, "total_tokens": 3}, "tau": 2.1, "sampled_tau": {"1": 1.40}}]
    costs = CostModel({1: 10.0, 4: 10.5}, {1: 1.5, 3: 1.5}, 1.5, 0.5, 0.0, plain_ms=10.0)
    assert choose(shapes, costs, TreeShape(0, 0, 0))[0] == TreeShape(3, 1, 3)  # greedy: the deep chain
    chosen, ranked = choose(shapes, costs, TreeShape(0, 0, 0), temperature=1.0)
    assert chosen == TreeShape(1, 3, 3) and ranked[0]["tau"] == 1.45  # sampling: one head step, three guesses


def test_auto_tree_chooses_a_tree_per_temperature_and_requests_select_theirs(tiny_llama, tmp_path, monkeypatch):
    import eagle_lab.tree_search.auto as auto

    drafter = EagleDrafter(new_head(tiny_llama, seed=1), tiny_llama, TreeShape(4, 4, 12))
    search = TreeSearchConfig(depths=[1, 2], topks=[1, 2], totals=[1, 2, 4], record_shape=(2, 2, 4),
                              probe_shape=(1, 2, 2), new_tokens=12, context=32, validate_new_tokens=8,
                              sampled_temperatures=[1.0])
    timed_at = []
    validate = auto.validate

    def spy(*args):
        timed_at.append(args[-1].temperature)
        return validate(*args)

    monkeypatch.setattr(auto, "validate", spy)
    monkeypatch.setattr(auto, "choose", lambda shapes, costs, fixed, temperature=0.0: (None, [  # never plain first
        {"shape": {"depth": 2 if temperature else 1, "topk": 1, "total_tokens": 2 if temperature else 1},
         "tau": 1.5, "round_ms": 1.0, "tokens_per_s": 1500.0}]))
    prompts = [list(range(40, 60))]
    auto_tree(tiny_llama, drafter, TreeShape(0, 0, 0), prompts, search, cache_dir=tmp_path, temperatures=(0.0, 1.0))
    assert timed_at == [0.0, 1.0]  # each temperature timed in the loop, sampling at its own
    summary = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert set(summary["validated"]) == {"d0-k0-n0", "d0-k0-n0-T1"}
    assert [c.temperature for c in drafter.choices] == [0.0, 1.0] and drafter.shape == drafter.choices[0].shape
    auto_tree(tiny_llama, drafter, TreeShape(0, 0, 0), prompts, search, cache_dir=tmp_path, temperatures=(1.0,))
    assert timed_at == [0.0, 1.0] and [c.temperature for c in drafter.choices] == [1.0]  # cached, not timed again


def test_select_takes_the_tree_of_the_nearest_temperature(tiny_llama):
    drafter = EagleDrafter(new_head(tiny_llama, seed=1), tiny_llama, TreeShape(2, 2, 3))
    drafter.select(SamplingParams(temperature=1.0))
    assert drafter.shape == TreeShape(2, 2, 3) and drafter.choices == ()  # a fixed tree stays
    chain = NgramProposer(max_tokens=4)
    drafter.choices = (TreeChoice(0.0, TreeShape(2, 1, 2), chain), TreeChoice(1.0, TreeShape(1, 3, 3)))
    for temperature, shape, ngram in ((1.0, TreeShape(1, 3, 3), None), (0.7, TreeShape(1, 3, 3), None),
                                      (0.0, TreeShape(2, 1, 2), chain), (0.3, TreeShape(2, 1, 2), chain)):
        drafter.select(SamplingParams(temperature=temperature))
        assert (drafter.shape, drafter.ngram) == (shape, ngram), temperature


def test_a_target_with_a_short_context_calibrates(tmp_path):
    """A context shorter than the calibration's prefix and prompts: they are cut to fit, and tree=auto
    chooses a tree instead of failing on its own prompts."""
    from eagle_lab.models.target import TargetConfig, load_target

    target = load_target(TargetConfig(name="tiny_llama", source="tiny", device="cpu", max_context=64))
    drafter = EagleDrafter(new_head(target, seed=1), target, TreeShape(4, 4, 12))
    search = TreeSearchConfig(depths=[1, 2], topks=[1, 2], totals=[1, 2, 4], record_shape=(2, 2, 4),
                              probe_shape=(1, 2, 2), new_tokens=12)
    shape = auto_tree(target, drafter, TreeShape(0, 0, 0), search=search, cache_dir=tmp_path, quick=True)
    assert shape.depth in (0, 1, 2)
    [path] = tmp_path.glob("*.json")
    assert json.loads(path.read_text())["rounds"] > 0


def test_the_best_head_tree_is_timed_even_when_the_model_ranks_it_low():
    """Three n-gram rows and plain decoding top the model's ranking: the best row that runs the head is
    timed beside them (and plain decoding is among the candidates once)."""
    from eagle_lab.tree_search.validate import VALIDATE_TOP, candidates_to_time

    def row(depth, chain, speed):
        return {"shape": {"depth": depth, "topk": depth, "total_tokens": depth}, "ngram_tokens": chain,
                "tau": 1.0, "tokens_per_s": speed}

    ranked = [row(0, 0, 200), row(0, 2, 199), row(0, 3, 198), row(0, 4, 197), row(2, 0, 160), row(1, 0, 150)]
    rows = candidates_to_time(ranked, TreeShape(0, 0, 0))
    # the best head row, then the one-token chain (the smallest head tree)
    assert [(r["shape"]["depth"], r["ngram_tokens"]) for r in rows] == [(0, 0), (0, 2), (0, 3), (2, 0), (1, 0)]
    head_first = [row(1, 0, 210), *ranked[1:]]  # a head tree on top, plain decoding not among the best three
    rows = candidates_to_time(head_first, TreeShape(0, 0, 0))
    assert len(rows) == VALIDATE_TOP + 1 and rows[-1]["shape"]["depth"] == 0 and not rows[-1].get("ngram_tokens")


def test_the_best_small_head_tree_is_timed_beside_larger_ones():
    """The model's best rows are all larger head trees (an overhead fitted on a slow minute favours them):
    its best tree of at most SMALL_TREE_TOKENS draft tokens is timed too, and only that one."""
    from eagle_lab.tree_search.validate import SMALL_TREE_TOKENS, candidates_to_time

    def row(depth, total, speed):
        return {"shape": {"depth": depth, "topk": 4, "total_tokens": total}, "tau": 1.0, "tokens_per_s": speed}

    ranked = [row(3, 8, 200), row(3, 6, 199), row(2, 4, 198), row(2, 2, 150), row(1, 1, 149), row(0, 0, 140)]
    rows = candidates_to_time(ranked, TreeShape(0, 0, 0))
    totals = [r["shape"]["total_tokens"] for r in rows]
    assert totals == [8, 6, 4, 1, 0] and SMALL_TREE_TOKENS == 1
    assert [r["shape"]["total_tokens"] for r in candidates_to_time(ranked[2:], TreeShape(0, 0, 0))] == [4, 2, 1, 0]
    assert [r["shape"]["total_tokens"] for r in candidates_to_time(ranked[:4], TreeShape(0, 0, 0))] == [8, 6, 4, 0]


def test_no_drafting_row_is_credited_with_more_than_its_tau_over_plain_decoding():
    """Timed in a faster minute, an n-gram chain at tau 1.04 came out 9% above plain decoding and 2% above a head
    chain at tau 1.47: it is capped at 1.04 x plain decoding's speed and the head chain ranks first; rows under
    their bound, and plain decoding itself, keep what they measured."""
    from eagle_lab.tree_search.validate import cap_at_tau

    def row(depth, chain, tau, speed):
        return {"shape": {"depth": depth, "topk": depth, "total_tokens": depth}, "ngram_tokens": chain,
                "measured_tau": tau, "measured_tokens_per_s": speed}

    rows = [row(0, 1, 1.04, 181.2), row(1, 0, 1.47, 177.4), row(0, 0, 1.0, 166.0)]
    cap_at_tau(rows)
    assert rows[0]["measured_tokens_per_s"] == pytest.approx(1.04 * 166.0) and rows[0]["capped"]
    assert rows[1]["measured_tokens_per_s"] == 177.4 and "capped" not in rows[1]
    assert rows[2]["measured_tokens_per_s"] == 166.0 and "capped" not in rows[2]
    assert max(rows, key=lambda r: r["measured_tokens_per_s"]) is rows[1]
    unplain = [row(0, 1, 1.04, 181.2)]  # plain decoding not timed (fixed fields): nothing to bound by
    cap_at_tau(unplain)
    assert unplain[0]["measured_tokens_per_s"] == 181.2


def test_calibrations_key_on_code_not_on_its_prose():
    """tree=auto's cached timings name the round's code through python_code: a docstring, a comment or a
    blank line changes nothing, a changed statement does."""
    from eagle_lab.decoding.graph_store import python_code

    base = 'def f(x):\n    """Add one."""\n    return x + 1\n'
    prose = 'def f(x):\n    """Add one to x (a new docstring)."""\n\n    # a comment\n    return x + 1\n'
    code = 'def f(x):\n    """Add one."""\n    return x + 2\n'
    assert python_code(base) == python_code(prose)
    assert python_code(base) != python_code(code)
