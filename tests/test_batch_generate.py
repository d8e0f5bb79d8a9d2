"""Offline batched generation on static rows (eagle_lab/decoding/generate.py): each reply is
what plain decoding gives its prompt alone, while more prompts than rows come and go (continuous
batching), replies end at an eos, at max_new_tokens or at the context, and sampling follows each
prompt's own seed."""

from __future__ import annotations

import pytest
import torch

from eagle_lab.decoding.backend import StaticBackend
from eagle_lab.decoding.generate import Stopper, decode_prompts, generate, vanilla_decode
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.decoding.static_rows import StaticRows
from eagle_lab.errors import EagleLabError
from eagle_lab.models.target import grouped_query_sdpa


def rows_for(target, rows=2, context=64, row_counts=None) -> StaticRows:
    backend = StaticBackend(target, [1], cache_block=32)
    return StaticRows(backend, rows, context, token_buckets=[1], row_counts=row_counts)


def prompts_for(target, lengths=(5, 17, 3, 30, 9)) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, target.vocab_size, (n,), generator=g).tolist() for n in lengths]


def alone(target, prompt, new_tokens, eos, params=SamplingParams(), seed=None):
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    out = generate(vanilla_decode(target, torch.tensor(prompt), params, Stopper(target.tokenizer, new_tokens, eos),
                                  generator))
    return out.token_ids


@pytest.mark.parametrize("row_counts", [None, [2]])
def test_greedy_replies_equal_plain_decoding_alone(tiny_target, row_counts):
    prompts = prompts_for(tiny_target)
    finished = []
    replies = decode_prompts(rows_for(tiny_target, row_counts=row_counts), prompts, SamplingParams(), 12, set(),
                               on_reply=lambda index, reply: finished.append(index))
    assert sorted(finished) == list(range(len(prompts)))
    for prompt, reply in zip(prompts, replies):
        assert reply.token_ids == alone(tiny_target, prompt, 12, set())
        assert not reply.finished  # no eos: every reply ran to max_new_tokens


def test_kept_features_equal_a_capture_pass_over_the_same_tokens(tiny_target):
    from eagle_lab.training.features import compute_features

    prompts = prompts_for(tiny_target)
    free = decode_prompts(rows_for(tiny_target), prompts, SamplingParams(), 12, set())
    eos = {free[2].token_ids[5]}  # some replies end with an eos (every token fed), others at the limit
    replies = decode_prompts(rows_for(tiny_target), prompts, SamplingParams(), 12, eos, keep_features=True)
    assert any(r.finished for r in replies) and not all(r.finished for r in replies)
    for prompt, reply in zip(prompts, replies):
        fed = prompt + (reply.token_ids if reply.finished else reply.token_ids[:-1])
        assert reply.features.shape == (len(fed), tiny_target.hidden_size)
        (captured, _), = compute_features(tiny_target, [fed])
        torch.testing.assert_close(reply.features, captured, rtol=1e-4, atol=1e-4)


def test_an_eos_ends_a_reply_and_is_not_kept(tiny_llama):
    prompts = prompts_for(tiny_llama)
    free = decode_prompts(rows_for(tiny_llama), prompts, SamplingParams(), 12, set())
    eos = free[1].token_ids[4]  # the 5th token of the second reply becomes an end token
    replies = decode_prompts(rows_for(tiny_llama), prompts, SamplingParams(), 12, {eos})
    for reply, whole in zip(replies, free):
        cut = whole.token_ids.index(eos) if eos in whole.token_ids else None
        assert reply.token_ids == (whole.token_ids if cut is None else whole.token_ids[:cut])
        assert reply.finished == (cut is not None)
    assert replies[1].finished and len(replies[1].token_ids) <= 4


def test_the_context_limits_a_reply_and_a_full_prompt_gets_none(tiny_llama):
    prompts = prompts_for(tiny_llama, lengths=(50, 64, 10))
    replies = decode_prompts(rows_for(tiny_llama, context=64), prompts, SamplingParams(), 40, set())
    assert len(replies[0].token_ids) == 14 and replies[0].token_ids == alone(tiny_llama, prompts[0], 14, set())
    assert replies[1].token_ids == [] and not replies[1].finished
    assert len(replies[2].token_ids) == 40


def test_sampled_replies_follow_each_prompts_seed(tiny_llama):
    prompts = prompts_for(tiny_llama)
    params = SamplingParams(temperature=1.0)
    seeds = [11, 12, 13, 14, 15]
    first = decode_prompts(rows_for(tiny_llama), prompts, params, 10, set(), seeds=seeds)
    assert [r.token_ids for r in decode_prompts(rows_for(tiny_llama), prompts, params, 10, set(), seeds=seeds)] \
        == [r.token_ids for r in first]
    # a prompt's reply is the one plain sampling gives it alone with the same seed
    assert first[3].token_ids == alone(tiny_llama, prompts[3], 10, set(), params, seed=14)
    other = decode_prompts(rows_for(tiny_llama), prompts, params, 10, set(), seeds=[s + 100 for s in seeds])
    assert [r.token_ids for r in other] != [r.token_ids for r in first]


def test_grouped_query_attention_gives_the_same_tokens(tiny_target):
    prompts = prompts_for(tiny_target)
    plain = decode_prompts(rows_for(tiny_target), prompts, SamplingParams(), 12, set())
    with grouped_query_sdpa():
        grouped = decode_prompts(rows_for(tiny_target), prompts, SamplingParams(), 12, set())
    assert [r.token_ids for r in grouped] == [r.token_ids for r in plain]


def test_bad_arguments_are_refused(tiny_llama):
    with pytest.raises(EagleLabError, match="seeds"):
        decode_prompts(rows_for(tiny_llama), [[5, 6]], SamplingParams(), 4, set(), seeds=[1, 2])
    with pytest.raises(EagleLabError, match="row counts"):
        rows_for(tiny_llama, rows=2, row_counts=[4])
