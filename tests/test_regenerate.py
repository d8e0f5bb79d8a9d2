"""Self-distillation data (`data.regenerate`): replies are the target's own, turns stay in
order, work resumes from cached chunks, bad settings are refused."""

from __future__ import annotations

import json
import re

import pytest
import torch

from eagle_lab.decoding.generate import Stopper, generate, vanilla_decode
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.errors import EagleLabError
from eagle_lab.training.regenerate import (
    RegenerateConfig,
    ReplyWriter,
    chunk_order,
    regenerate_conversations,
    regenerated_pool,
    reply_rows,
)

CONVERSATIONS = [
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Red."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}],
    [{"role": "user", "content": "Count to three, please, slowly."}, {"role": "assistant", "content": "1 2 3"}],
]


def writer_for(target, **overrides) -> ReplyWriter:
    cfg = RegenerateConfig(enabled=True, **{"max_new_tokens": 12, **overrides})
    return ReplyWriter(target, cfg, max_length=512, rows=reply_rows(target, cfg.rows, 512))


@pytest.mark.parametrize("rows", [0, 2])  # Hugging Face generate; static rows
def test_greedy_reply_is_the_targets_own_greedy_continuation(tiny_llama, rows):
    writer = writer_for(tiny_llama, batch_size=1, rows=rows)
    opening = CONVERSATIONS[2][:1]
    (rewritten,) = writer.rewrite([CONVERSATIONS[2]], seeds=[0])
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

    def replies(self, prompts, seeds):
        self.calls += 1
        return [self.script.pop(0) for _ in prompts]


def test_turns_follow_the_conversation_and_stop_at_a_cut_reply(tiny_llama):
    # batch of the first two conversations: turn 1 answers both, turn 2 only the first
    writer = ScriptedWriter(tiny_llama, [("A", True), ("B", True), ("C", False)], max_turns=0)
    first, second = writer.rewrite(CONVERSATIONS[:2], seeds=[0, 0])
    assert first == [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "A"},
                     {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "C"}]
    assert second == [*CONVERSATIONS[1][:2], {"role": "assistant", "content": "B"}]

    cut = ScriptedWriter(tiny_llama, [("half a rep", False)], max_turns=0)
    assert cut.rewrite(CONVERSATIONS[:1], seeds=[0]) == [[CONVERSATIONS[0][0], {"role": "assistant",
                                                                             "content": "half a rep"}]]
    one_turn = ScriptedWriter(tiny_llama, [("A", True)], max_turns=1)
    assert one_turn.rewrite(CONVERSATIONS[:1], seeds=[0]) == [[CONVERSATIONS[0][0], {"role": "assistant",
                                                                                 "content": "A"}]]
    empty = ScriptedWriter(tiny_llama, [("", True)])
    assert empty.rewrite(CONVERSATIONS[:1], seeds=[0]) == [None]  # nothing to train on


def test_chunks_are_cached_and_a_killed_run_redoes_only_the_missing_one(tiny_llama, tmp_path):
    conversations = CONVERSATIONS * 3  # 9 conversations, chunks of 4 -> 3 chunks
    writer = ScriptedWriter(tiny_llama, [(f"r{i}", True) for i in range(9)], batch_size=4)
    first = regenerate_conversations(writer, conversations, tmp_path)
    assert all(first) and len(first) == 9 and writer.calls == 3
    assert [c[0] for c in first] == [c[0] for c in conversations]  # original order kept
    assert sorted(c[-1]["content"] for c in first) == sorted(f"r{i}" for i in range(9))

    again = ScriptedWriter(tiny_llama, [], batch_size=4)
    assert regenerate_conversations(again, conversations, tmp_path) == first and again.calls == 0

    lost = tmp_path / "chunk-00001.json"
    indices = json.loads(lost.read_text())["indices"]
    lost.unlink()
    redo = ScriptedWriter(tiny_llama, [("new", True)] * len(indices), batch_size=4)
    redone = regenerate_conversations(redo, conversations, tmp_path)
    assert redo.calls == 1
    assert [i for i, c in enumerate(redone) if c[-1]["content"] == "new"] == sorted(indices)


def test_ranks_split_the_chunks(tiny_llama, tmp_path):
    conversations = CONVERSATIONS * 3
    rank1 = ScriptedWriter(tiny_llama, [("x", True)] * 9, batch_size=4)
    with pytest.raises(EagleLabError, match="chunk-00000"):  # rank 0's chunks were never written
        regenerate_conversations(rank1, conversations, tmp_path, rank=1, world=2)
    assert sorted(p.name for p in tmp_path.glob("chunk-*.json")) == ["chunk-00001.json"]


def test_a_resumed_run_deals_the_missing_chunks_to_every_rank(tiny_llama, tmp_path):
    import shutil

    conversations = CONVERSATIONS * 6  # 18 conversations: chunks 0-4 (4, 4, 4, 4, 2)
    regenerate_conversations(ScriptedWriter(tiny_llama, [("x", True)] * 18, batch_size=4), conversations,
                             tmp_path / "run")
    for c in (1, 3, 4):  # left when a run stopped: mostly one parity, the share of one rank of two
        (tmp_path / "run" / f"chunk-{c:05d}.json").unlink()
    rewritten = {}
    for rank in (0, 1):  # each rank on its own copy of the stopped run, to see what it writes
        directory = shutil.copytree(tmp_path / "run", tmp_path / f"rank{rank}")
        writer = ScriptedWriter(tiny_llama, [("y", True)] * 18, batch_size=4)
        with pytest.raises(EagleLabError, match="missing"):  # the other rank's share is not in this copy
            regenerate_conversations(writer, conversations, directory, rank=rank, world=2)
        rewritten[rank] = sorted(int(p.stem.split("-")[1]) for p in directory.glob("chunk-*.json")
                                 if '"y"' in p.read_text())
    assert rewritten == {0: [1, 4], 1: [3]}  # dealt out, not by chunk parity (which gives rank 0 only chunk 4)


def test_chunks_group_similar_prompt_lengths():
    conversations = [[{"role": "user", "content": "x" * n}, {"role": "assistant", "content": "y"}]
                     for n in (50, 1, 40, 2, 30, 3)]
    assert chunk_order(conversations, 2) == [[1, 3], [5, 4], [2, 0]]


@pytest.mark.parametrize("bad", [{"temperature": -0.5}, {"top_p": 0.0}, {"max_new_tokens": 0},
                                 {"batch_size": 0}, {"max_turns": -1}, {"rows": -1}, {"group_chunks": 0}])
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
    chunks = list((tmp_path / "cache" / "regenerated").glob("*/train/chunk-*.json"))
    assert len(chunks) == 2
    replies = [c[-1]["content"] for p in chunks for c in json.loads(p.read_text())["conversations"] if c]
    assert replies
    assert recipe.step == 2


@pytest.mark.parametrize("rows", [0, 2])
def test_sampled_replies_repeat_per_seed_and_leave_the_global_rng_alone(tiny_llama, rows):
    writer = writer_for(tiny_llama, temperature=1.0, rows=rows)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    first = writer.rewrite(CONVERSATIONS, seeds=[1, 2, 3])
    assert torch.equal(torch.rand(3), expected)  # training's random stream is unchanged
    assert writer.rewrite(CONVERSATIONS, seeds=[1, 2, 3]) == first
    assert writer.rewrite(CONVERSATIONS, seeds=[4, 5, 6]) != first


def test_chunks_stay_inside_blocks_so_a_bigger_size_reuses_them():
    conversations = [[{"role": "user", "content": "x" * n}, {"role": "assistant", "content": "y"}]
                     for n in (50, 1, 40, 2, 30, 3)]
    assert chunk_order(conversations, 2, block=4) == [[1, 3], [2, 0], [5, 4]]
    assert chunk_order(conversations[:5], 2, block=4)[:2] == chunk_order(conversations, 2, block=4)[:2]


def test_a_chunk_written_for_other_conversations_is_written_again(tiny_llama, tmp_path):
    short = ScriptedWriter(tiny_llama, [("a", True)] * 3, batch_size=4, block_conversations=4)
    regenerate_conversations(short, CONVERSATIONS, tmp_path)  # the last block ends early: chunk 0 holds 3
    longer = ScriptedWriter(tiny_llama, [("b", True)] * 6, batch_size=4, block_conversations=4)
    rewritten = regenerate_conversations(longer, CONVERSATIONS * 2, tmp_path)
    assert longer.calls == 2 and [c[-1]["content"] for c in rewritten] == ["b"] * 6


def test_pool_is_the_rewritten_prefix_in_whole_blocks_plus_the_heldout_tail():
    conversations = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}] for i in range(20)]
    asked = []

    def rewrite(convs, split):
        asked.append((split, [c[0]["content"] for c in convs]))
        return [None if c[0]["content"] in ("q1", "q18") else [*c[:1], {"role": "assistant", "content": "t"}]
                for c in convs]

    pool, held, count, dropped = regenerated_pool(rewrite, conversations, held=4, count=5, block=4)
    assert asked == [("train", [f"q{i}" for i in range(8)]), ("eval", ["q16", "q17", "q18", "q19"])]
    assert [c[0]["content"] for c in pool] == [f"q{i}" for i in (0, 2, 3, 4, 5, 6, 7, 16, 17, 19)]
    assert (held, count, dropped) == (3, 4, 2)  # q1 of the first 5 and q18 of the tail dropped


def corpus_settings(tmp_path, monkeypatch) -> tuple[str, ...]:
    """Overrides for a tiny feature-corpus run over 30 conversations whose replies say "from elsewhere"
    (6 held out), regenerating 8-token replies in chunks of 4 and blocks of 8."""
    monkeypatch.setenv("EAGLE_LAB_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "convs.jsonl"
    convs = [[{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "from elsewhere"}]
             for i in range(30)]
    data.write_text("\n".join(json.dumps({"messages": c}) for c in convs))
    return ("data=file", f"data.path={data}", "data.eval_conversations=6", "data.shard_conversations=8",
            "trainer.epochs=1", "trainer.max_steps=1000", "data.regenerate.max_new_tokens=8",
            "data.regenerate.batch_size=4", "data.regenerate.block_conversations=8",
            f"trainer.features_dir={tmp_path / 'features'}")


def test_self_distilled_corpus_holds_out_the_targets_replies_to_the_tail(tmp_path, monkeypatch):
    from test_train import smoke_cfg

    from eagle_lab.training.trainer import Recipe

    common = (*corpus_settings(tmp_path, monkeypatch), "data.regenerate.enabled=true")
    recipe = Recipe(smoke_cfg(tmp_path / "run", *common, "data.num_conversations=10"))
    recipe.setup()
    assert len(recipe.train_source) == 10 and len(recipe.eval_source) == 6
    regenerated = next((tmp_path / "cache" / "regenerated").iterdir())
    assert len(list((regenerated / "train").glob("chunk-*.json"))) == 4  # 16 conversations: 2 whole blocks
    tail = [c for p in sorted((regenerated / "eval").glob("chunk-*.json"))
            for c in json.loads(p.read_text())["conversations"]]
    assert sorted(c[0]["content"] for c in tail) == [f"question {i}" for i in range(24, 30)]
    assert all(c[-1]["content"] != "from elsewhere" for c in tail)
    text = recipe.target.tokenizer.decode(recipe.eval_source.store[0].input_ids.tolist())
    assert "question 24" in text and "from elsewhere" not in text


def test_add_regenerated_mixes_the_targets_replies_into_the_source_corpus(tmp_path, monkeypatch):
    from test_train import smoke_cfg

    from eagle_lab.training.trainer import Recipe

    common = corpus_settings(tmp_path, monkeypatch)
    recipe = Recipe(smoke_cfg(tmp_path / "run", *common, "data.num_conversations=10", "data.add_regenerated=8"))
    recipe.setup()
    decode = recipe.target.tokenizer.decode
    texts = [decode(recipe.train_source.store[i].input_ids.tolist()) for i in range(len(recipe.train_source))]
    source, regenerated = texts[:10], texts[10:]
    assert all("from elsewhere" in t for t in source) and len(regenerated) == recipe.train_parts[1]["examples"] > 0
    assert not any("from elsewhere" in t for t in regenerated)
    assert [re.search(r"question (\d+)", t).group(1) for t in regenerated] == [str(i) for i in range(len(regenerated))]
    assert recipe.train_source.tokens == sum(part["tokens"] for part in recipe.train_parts)
    assert [part["replies"] for part in recipe.train_parts] == ["source", "target"]
    heldout = [decode(recipe.eval_source.store[i].input_ids.tolist()) for i in range(len(recipe.eval_source))]
    assert len(heldout) == 6 and all("from elsewhere" in t for t in heldout)  # the primary corpus's tail
    assert recipe.card().data["parts"] == recipe.train_parts

    with pytest.raises(EagleLabError, match="data.add_regenerated=N mixes"):
        Recipe(smoke_cfg(tmp_path / "bad", *common, "data.add_regenerated=8", "data.regenerate.enabled=true")).setup()


def test_samples_answer_each_training_conversation_several_times(tiny_llama, tmp_path, monkeypatch):
    from eagle_lab.training.data import DataConfig
    from eagle_lab.training.regenerate import regenerate_key, target_rewrite

    monkeypatch.setenv("EAGLE_LAB_CACHE", str(tmp_path))
    settings = {"enabled": True, "max_new_tokens": 8, "temperature": 1.0, "batch_size": 4, "block_conversations": 4}
    data = DataConfig(source="file", path="convs.jsonl", max_length=64,
                      regenerate=RegenerateConfig(**settings, samples=2))
    convs = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "theirs"}] for i in range(10)]
    pool, held, count, dropped = regenerated_pool(target_rewrite(tiny_llama, data), convs, 2, 3, 4)
    train, tail = pool[:-held], pool[-held:]
    assert [c[0]["content"] for c in tail] == ["q8", "q9"]  # the held-out tail: one reply each
    assert [c[0]["content"] for c in train] == [f"q{i}" for i in range(4) for _ in range(2)]  # a whole block
    assert all(train[i][1]["content"] != train[i + 1][1]["content"] for i in range(0, 8, 2))  # own seeds
    assert (count, dropped) == (6, 0)  # 3 conversations x 2 replies
    source = {"source": "file", "path": "convs.jsonl", "max_length": 64, "dtype": str(tiny_llama.dtype)}
    once, twice = (regenerate_key("t", source, RegenerateConfig(**settings, samples=n)) for n in (1, 2))
    assert once != twice
    with pytest.raises(EagleLabError, match="samples must be >= 1, and > 1 only with temperature > 0"):
        RegenerateConfig(**{**settings, "temperature": 0.0}, samples=2).validate()


@pytest.mark.parametrize("rows", [0, 2])  # Hugging Face generate; static rows
def test_each_reply_is_reported_as_it_ends(tiny_llama, rows, tmp_path):
    """Progress inside a group of chunks: on_reply hears every reply's token count, and they add up
    to what the writer counts."""
    writer = writer_for(tiny_llama, batch_size=3, rows=rows)
    heard = []
    writer.on_reply = heard.append
    prompts = [writer.prompt_ids(c[:1]) for c in CONVERSATIONS]
    writer.replies(prompts, seeds=[0, 1, 2])
    assert len(heard) == 3 and sum(heard) == writer.generated_tokens > 0
    rewritten = regenerate_conversations(writer_for(tiny_llama, batch_size=2, rows=rows), CONVERSATIONS, tmp_path)
    assert len(rewritten) == 3 and all(c is not None for c in rewritten)  # with the live progress line on


def test_replies_can_come_from_the_target_at_its_serving_precision(tmp_path, monkeypatch):
    """data.regenerate.weights=w8a8: each reply is the greedy continuation of the target loaded with w8a8
    weights, and the replies are cached apart from the training target's (whose cache key stays as it was)."""
    from eagle_lab.config import TrainConfig, to_object
    from eagle_lab.models.target import TargetConfig, load_target
    from eagle_lab.training.trainer import Recipe
    from tests.test_train import composed

    monkeypatch.setenv("EAGLE_LAB_CACHE", str(tmp_path / "cache"))
    base = ["experiment=smoke", "data.num_conversations=6", "trainer.max_steps=1", "trainer.eval_every=100",
            "data.regenerate.enabled=true", "data.regenerate.max_new_tokens=12", "data.regenerate.batch_size=8"]
    written = tmp_path / "cache" / "regenerated"

    def regenerate(name: str, *extra: str) -> set:
        before = set(written.iterdir()) if written.is_dir() else set()
        Recipe(to_object(composed("train", [*base, f"run_dir={tmp_path / name}", *extra]), TrainConfig)).setup()
        return set(written.iterdir()) - before

    (quantized,) = regenerate("w8a8", "data.regenerate.weights=w8a8")
    (plain,) = regenerate("plain")
    assert plain != quantized

    target = load_target(TargetConfig(name="tiny_llama", source="tiny", device="cpu", weights="w8a8"))
    writer = writer_for(target)
    conversations = [c for p in sorted((quantized / "train").glob("chunk-*.json"))
                     for c in json.loads(p.read_text())["conversations"] if c]
    assert conversations
    for conversation in conversations:
        prompt = torch.tensor(writer.prompt_ids(conversation[:-1]))
        greedy = generate(vanilla_decode(target, prompt, SamplingParams(), Stopper(target.tokenizer, 12,
                                                                                     writer.eos_ids)))
        reply = [t for t in greedy.token_ids if t not in writer.eos_ids]
        assert conversation[-1]["content"] == target.tokenizer.decode(reply, skip_special_tokens=True).strip()

    with pytest.raises(EagleLabError, match="data.regenerate.weights must be"):
        RegenerateConfig(enabled=True, weights="int3").validate()
