"""Self-distillation data (`data.regenerate`): replies are the target's own, turns stay in
order, work resumes from cached chunks, bad settings are refused."""

from __future__ import annotations

import json

import pytest
import torch

from eagle_lab.errors import EagleLabError
from eagle_lab.generate import Stopper, generate, vanilla_decode
from eagle_lab.sampling import SamplingParams
from eagle_lab.training.regenerate import RegenerateConfig, ReplyWriter, chunk_order, regenerate_conversations

CONVERSATIONS = [
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Red."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}],
    [{"role": "user", "content": "Count to three, please, slowly."}, {"role": "assistant", "content": "1 2 3"}],
]


def writer_for(target, **overrides) -> ReplyWriter:
    cfg = RegenerateConfig(enabled=True, **{"max_new_tokens": 12, **overrides})
    return ReplyWriter(target, cfg, max_length=512)


def test_greedy_reply_is_the_targets_own_greedy_continuation(tiny_llama):
    writer = writer_for(tiny_llama, batch_size=1)
    opening = CONVERSATIONS[2][:1]
    (rewritten,) = writer.rewrite([CONVERSATIONS[2]], seed=0)
    assert rewritten[0] == opening[0] and rewritten[1]["role"] == "assistant" and len(rewritten) == 2

    prompt = torch.tensor(writer.prompt_ids(opening))
    plain = generate(vanilla_decode(tiny_llama, prompt, SamplingParams(),
                                    Stopper(tiny_llama.tokenizer, 12, writer.eos_ids)))
    reply = [t for t in plain.token_ids if t not in writer.eos_ids]
    assert rewritten[1]["content"] == tiny_llama.tokenizer.decode(reply, skip_special_tokens=True).strip()


class ScriptedWriter(ReplyWriter):
    """A writer whose replies are scripted: (text, finished) per call, in order."""

    def __init__(self, target, script, **overrides):
        super().__init__(target, RegenerateConfig(enabled=True, **overrides), 512)
        self.script, self.calls = list(script), 0

    def replies(self, prompts, seed):
        self.calls += 1
        return [self.script.pop(0) for _ in prompts]


def test_turns_follow_the_conversation_and_stop_at_a_cut_reply(tiny_llama):
    # batch of the first two conversations: turn 1 answers both, turn 2 only the first
    writer = ScriptedWriter(tiny_llama, [("A", True), ("B", True), ("C", False)], max_turns=0)
    first, second = writer.rewrite(CONVERSATIONS[:2], seed=0)
    assert first == [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "A"},
                     {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "C"}]
    assert second == [*CONVERSATIONS[1][:2], {"role": "assistant", "content": "B"}]

    cut = ScriptedWriter(tiny_llama, [("half a rep", False)], max_turns=0)
    assert cut.rewrite(CONVERSATIONS[:1], seed=0) == [[CONVERSATIONS[0][0], {"role": "assistant",
                                                                             "content": "half a rep"}]]
    one_turn = ScriptedWriter(tiny_llama, [("A", True)], max_turns=1)
    assert one_turn.rewrite(CONVERSATIONS[:1], seed=0) == [[CONVERSATIONS[0][0], {"role": "assistant",
                                                                                 "content": "A"}]]
    empty = ScriptedWriter(tiny_llama, [("", True)])
    assert empty.rewrite(CONVERSATIONS[:1], seed=0) == [None]  # nothing to train on


def test_chunks_are_cached_and_a_killed_run_redoes_only_the_missing_one(tiny_llama, tmp_path):
    conversations = CONVERSATIONS * 3  # 9 conversations, chunks of 4 -> 3 chunks
    writer = ScriptedWriter(tiny_llama, [(f"r{i}", True) for i in range(9)], batch_size=4)
    first, dropped = regenerate_conversations(writer, conversations, tmp_path)
    assert dropped == 0 and len(first) == 9 and writer.calls == 3
    assert [c[0] for c in first] == [c[0] for c in conversations]  # original order kept
    assert sorted(c[-1]["content"] for c in first) == sorted(f"r{i}" for i in range(9))

    again = ScriptedWriter(tiny_llama, [], batch_size=4)
    assert regenerate_conversations(again, conversations, tmp_path)[0] == first and again.calls == 0

    lost = tmp_path / "chunk-00001.json"
    indices = json.loads(lost.read_text())["indices"]
    lost.unlink()
    redo = ScriptedWriter(tiny_llama, [("new", True)] * len(indices), batch_size=4)
    redone, _ = regenerate_conversations(redo, conversations, tmp_path)
    assert redo.calls == 1
    assert [i for i, c in enumerate(redone) if c[-1]["content"] == "new"] == sorted(indices)


def test_ranks_split_the_chunks(tiny_llama, tmp_path):
    conversations = CONVERSATIONS * 3
    rank1 = ScriptedWriter(tiny_llama, [("x", True)] * 9, batch_size=4)
    with pytest.raises(EagleLabError, match="chunk-00000"):  # rank 0's chunks were never written
        regenerate_conversations(rank1, conversations, tmp_path, rank=1, world=2)
    assert sorted(p.name for p in tmp_path.glob("chunk-*.json")) == ["chunk-00001.json"]


def test_chunks_group_similar_prompt_lengths():
    conversations = [[{"role": "user", "content": "x" * n}, {"role": "assistant", "content": "y"}]
                     for n in (50, 1, 40, 2, 30, 3)]
    assert chunk_order(conversations, 2) == [[1, 3], [5, 4], [2, 0]]


@pytest.mark.parametrize("bad", [{"temperature": -0.5}, {"top_p": 0.0}, {"max_new_tokens": 0},
                                 {"batch_size": 0}, {"max_turns": -1}])
def test_bad_settings_are_refused(bad):
    with pytest.raises(EagleLabError, match="data.regenerate"):
        RegenerateConfig(enabled=True, **bad).validate()


def test_training_on_regenerated_replies_runs_end_to_end(tmp_path, monkeypatch):
    from eagle_lab.config import TrainConfig, to_object
    from eagle_lab.training.trainer import Recipe
    from tests.test_train import composed

    monkeypatch.setenv("EAGLE_LAB_CACHE", str(tmp_path / "cache"))
    overrides = ["experiment=smoke", f"run_dir={tmp_path / 'run'}", "data.num_conversations=12",
                 "trainer.max_steps=2", "trainer.eval_every=100", "data.regenerate.enabled=true",
                 "data.regenerate.max_new_tokens=16", "data.regenerate.batch_size=8"]
    recipe = Recipe(to_object(composed("train", overrides), TrainConfig))
    recipe.setup()
    recipe.train()
    chunks = list((tmp_path / "cache" / "regenerated").glob("*/chunk-*.json"))
    assert len(chunks) == 2
    replies = [c[-1]["content"] for p in chunks for c in json.loads(p.read_text())["conversations"] if c]
    assert replies
    assert recipe.step == 2


def test_sampled_replies_repeat_per_seed_and_leave_the_global_rng_alone(tiny_llama):
    writer = writer_for(tiny_llama, temperature=1.0)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    first = writer.rewrite(CONVERSATIONS, seed=1)
    assert torch.equal(torch.rand(3), expected)  # training's random stream is unchanged
    assert writer.rewrite(CONVERSATIONS, seed=1) == first
    assert writer.rewrite(CONVERSATIONS, seed=2) != first
