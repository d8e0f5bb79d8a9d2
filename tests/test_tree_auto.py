"""tree=auto: replaying recorded candidates, and the whole calibration on a tiny target."""

import json

import torch

from eagle_lab.draft import Candidates, EagleDrafter, TreeShape
from eagle_lab.head import new_head
from eagle_lab.tree_auto import CostModel, TreeSearchConfig, auto_tree, choose, simulate_accept

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
    assert summary["cost_model"]["overhead_ms"] >= 0 and summary["cost_model"]["overhead_per_token_ms"] >= 0
    again = auto_tree(tiny_llama, drafter, TreeShape(2, 0, 0), prompts, search, cache_dir=tmp_path)
    assert again.depth == 2 and len(list(tmp_path.glob("*.json"))) == 1  # served from the cache
