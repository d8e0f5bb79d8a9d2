"""The compiled server's tree per batch size (eagle_lab/serving/static_trees.py): timed once, then
read back from the cache on the next start, and timed again when the tree it was chosen for changes."""

from __future__ import annotations

import pytest

from eagle_lab.decoding.graph_store import GraphStore
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.growth import TreeShape
from eagle_lab.serving import static_trees
from eagle_lab.serving.static_trees import PLAIN, trees_on_rows
from eagle_lab.drafters.eagle.kinds import new_head
from tests.serving_helpers import TINY, RunningServer, serve_config
from tests.test_static_rows import static_rows


def test_choices_are_cached_and_retimed_when_the_tree_changes(tiny_llama, monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE_LAB_CACHE", str(tmp_path))
    timed = []

    def fake_timing(target, drafter, prompts, tree, new_tokens, rows):
        timed.append((len(prompts), tree))
        # the tree wins at batch 2 and loses at batch 4
        fast = (tree is PLAIN) == (len(prompts) == 4)
        return {"tokens": len(prompts) * new_tokens, "seconds": 1.0 if fast else 2.0, "rounds": new_tokens}

    monkeypatch.setattr(static_trees, "timed_batch_decoding", fake_timing)
    rows = static_rows(tiny_llama, rows=4)
    drafter = EagleDrafter(new_head(tiny_llama, seed=0), tiny_llama, TreeShape(2, 2, 3))
    prompts = [[1, 2, 3]]
    first = trees_on_rows(tiny_llama, drafter, rows, 4, prompts, 8)
    assert timed, "the first start times every batch size"
    assert first[2].shape == drafter.shape and first[3] is PLAIN and first[4] is PLAIN

    timed.clear()
    again = trees_on_rows(tiny_llama, drafter, rows, 4, prompts, 8)
    assert not timed and again == first  # read back, nothing timed

    other = EagleDrafter(new_head(tiny_llama, seed=0), tiny_llama, TreeShape(3, 2, 4))
    trees_on_rows(tiny_llama, other, rows, 4, prompts, 8)
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
