"""Batched speculative decoding (eagle_lab/decoding/sequence.py, batching.py): one forward of the
static rows scores the trees of several sequences, and every sequence decodes exactly as it does alone.

Greedy and seeded sampling are compared token for token with generate.py run alone (same
drafter, same seed): rows of different prompt lengths and different tree sizes share a
forward, sequences join and leave between rounds (rows are packed under the others), a
cancelled one frees its row. Sampling at batch > 1 is also checked against the target's exact
distribution (chi-square).
"""

from __future__ import annotations

import pytest
import torch

from eagle_lab.decoding.generate import Stopper, generate, speculative_decode, vanilla_decode
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.decoding.sequence import Sequence, score_rows
from eagle_lab.drafters.draft_model.drafter import DraftModelDrafter
from eagle_lab.drafters.eagle.batch import BatchDrafter
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.eagle.kinds import new_head
from eagle_lab.drafters.growth import TreeShape
from eagle_lab.drafters.medusa.drafter import MedusaDrafter
from eagle_lab.drafters.ngram import NgramDrafter, NgramProposer
from eagle_lab.models.prompts import as_tensor, encode_prompt
from eagle_lab.serving.batching import BatchScheduler
from eagle_lab.serving.engine import Engine, drafter_factory
from tests.conftest import OracleDrafter, small_vocab_target
from tests.scheduler_helpers import Client, expected_alone, plan, run_all, static_rows
from tests.serving_helpers import TINY, serve_config
from tests.test_draft_model import small_lm
from tests.test_medusa import random_heads
from tests.test_sampling_lossless import ALPHA, chi_square_pvalue, exact_sequence_probs

PROMPTS = ["Hi", "Tell me a story about a dragon and a knight.", "1 2 3 1 2 3 1 2", "def add(a, b):\n    return"]
LENGTHS = (30, 22, 27, 18)


# ---------------------------------------------------------------- sequences, no scheduler

def make_drafters(target, kinds):
    prototype = EagleDrafter(new_head(target, seed=0), target, TreeShape(depth=3, topk=2, total_tokens=6))
    small = EagleDrafter(new_head(target, seed=1), target, TreeShape(depth=2, topk=2, total_tokens=3))
    made = {"eagle": lambda: prototype.fork(), "eagle-small": lambda: small.fork(),
            "oracle": lambda: OracleDrafter(target, depth=4), "ngram": lambda: NgramDrafter(NgramProposer(1, 3, 4)),
            "draft_model": drafter_factory(DraftModelDrafter(small_lm(target),
                                                             TreeShape(depth=3, topk=2, total_tokens=5),
                                                             target.vocab_size)),
            "medusa": drafter_factory(MedusaDrafter(random_heads(target), target, TreeShape(depth=3, topk=2,
                                                                                          total_tokens=5))),
            "vanilla": lambda: None}
    return [made[kind]() for kind in kinds]


def alone(target, drafter, prompt, params, length, seed) -> tuple[list[int], int]:
    """generate.py at batch 1: (tokens, target forwards)."""
    stopper, generator = Stopper(target.tokenizer, length, set()), torch.Generator().manual_seed(seed)
    decoder = (vanilla_decode(target, prompt, params, stopper, generator) if drafter is None
               else speculative_decode(target, drafter, prompt, params, stopper, generator))
    result = generate(decoder)
    return result.token_ids, result.stats.target_forwards


def together(target, drafters, prompts, params, lengths, seeds, rows=None, record=None):
    """The same sequences, every round of all live ones scored in one forward of the static rows;
    -> (tokens, target forwards) each. record: gets (tree sizes, pasts) per round and then how many
    rows were moved (packed) under the others."""
    rows = rows or static_rows(target)
    sequences = [Sequence(target, d, p, params, Stopper(target.tokenizer, n, set()), torch.Generator().manual_seed(s),
                          rows, plain=d is None) for d, p, n, s in zip(drafters, prompts, lengths, seeds)]
    tokens = [s.prefill() for s in sequences]
    live, moved = [s for s in sequences if not s.done], 0
    while live:
        for sequence in live:
            sequence.draft()
        if record is not None:
            record.append(([s.tree.size for s in live], [s.past for s in live]))
        before = [s.row.index for s in live]
        scored = score_rows(rows, live)
        moved += sum(a != s.row.index for a, s in zip(before, live))
        for sequence, row in zip(live, scored):
            tokens[sequences.index(sequence)] += sequence.accept(row)
        live = [s for s in live if not s.done]
    assert all(row is None for row in rows.rows)  # every finished sequence gave its row back
    if record is not None:
        record.append(moved)
    return [(t, s.stats.target_forwards) for t, s in zip(tokens, sequences)]


def encoded(target, prompts):
    return [as_tensor(encode_prompt(target.tokenizer, p, chat=False), target.device) for p in prompts]


@pytest.mark.parametrize("kinds", [("eagle", "eagle", "eagle"), ("eagle", "oracle", "ngram", "eagle-small"),
                                   ("draft_model", "medusa", "draft_model", "medusa"),
                                   ("vanilla", "vanilla", "vanilla", "vanilla")],
                         ids=["eagle3", "mixed4", "draft-model-medusa4", "vanilla4"])
def test_greedy_batched_equals_alone(tiny_target, kinds):
    prompts, lengths = encoded(tiny_target, PROMPTS[:len(kinds)]), LENGTHS[:len(kinds)]
    expected = [alone(tiny_target, d, p, SamplingParams(), n, 0)
                for d, p, n in zip(make_drafters(tiny_target, kinds), prompts, lengths)]
    rounds = []
    got = together(tiny_target, make_drafters(tiny_target, kinds), prompts, SamplingParams(), lengths,
                   [0] * len(kinds), record=rounds)
    assert got == expected  # tokens and target forwards
    assert [len(t) for t, _ in got] == list(lengths)
    moved, rounds = rounds[-1], rounds[:-1]
    if len(kinds) == 4:
        assert moved >= 1  # the first to finish (row 3, 18 tokens) was not last: a row was packed
    batched = [r for r in rounds if len(r[0]) > 1]
    assert len(batched) >= 5 and any(len(set(pasts)) > 1 for _, pasts in batched)  # ragged caches
    if kinds[1] == "oracle":
        assert any(len(set(sizes)) > 1 for sizes, _ in batched)  # ragged trees in one forward


@pytest.mark.parametrize("kinds", [("eagle", "oracle", "ngram"), ("vanilla", "vanilla", "vanilla")],
                         ids=["mixed", "vanilla"])
def test_seeded_sampling_batched_equals_alone(tiny_llama, kinds):
    """Each sequence draws from its own generator: the same seed gives the same tokens at any batch."""
    params = SamplingParams(temperature=0.8, top_p=0.95)
    prompts, lengths, seeds = encoded(tiny_llama, PROMPTS[:3]), LENGTHS[:3], (3, 4, 5)
    expected = [alone(tiny_llama, d, p, params, n, s)
                for d, p, n, s in zip(make_drafters(tiny_llama, kinds), prompts, lengths, seeds)]
    got = together(tiny_llama, make_drafters(tiny_llama, kinds), prompts, params, lengths, seeds)
    assert got == expected


@pytest.mark.slow
@pytest.mark.parametrize("batched_drafting,sampled_drafts,family,window",
                         [(False, True, "llama", 0), (False, False, "llama", 0), (True, False, "llama", 0),
                          (False, True, "gemma3", 2)],
                         ids=["sampled-drafts", "top-k-drafting-alone", "top-k-drafting-batched",
                              "sampled-drafts-gemma3-window2"])
def test_sampling_at_batch_four_keeps_the_target_distribution(batched_drafting, sampled_drafts, family, window):
    """Four sequences per forward (two prompts of different lengths, each row its own seed),
    every row's 3-token sample tallied per prompt: both must follow the target's exact
    sequence distribution (the chi-square test of test_sampling_lossless, whose negative
    controls show it rejects a wrong acceptance rule). Drafting per sequence, or batched
    (eagle_lab/drafters/eagle/batch.py, as the server drafts top-k trees at batch >= 2); trees drawn from the
    head's distribution are drafted per sequence. Also a Gemma 3 target whose sliding layers see 2 tokens (the
    longer prompt's 10 positions are 5 windows)."""
    target = small_vocab_target(family=family, sliding_window=window)
    params = SamplingParams(temperature=0.9)
    prompts = [torch.tensor([1, 4, 2, 0]), torch.tensor([3, 1, 4, 2, 0, 1, 3])]
    prototype = EagleDrafter(new_head(target, seed=4), target, TreeShape(depth=2, topk=2, total_tokens=4),
                             sampled_drafts=sampled_drafts)
    length, groups = 3, 1000
    counts: list[dict] = [{}, {}]
    accepted = 0
    rows = static_rows(target, context=64)
    for group in range(groups):
        sequences = [Sequence(target, prototype.fork(), prompts[row % 2], params, Stopper(target.tokenizer, length,
                                                                                              set()),
                              torch.Generator().manual_seed(4 * group + row), rows) for row in range(4)]
        tokens = [s.prefill() for s in sequences]
        live = [i for i, s in enumerate(sequences) if not s.done]
        drafting = BatchDrafter()
        while live:
            batch = [sequences[i] for i in live]
            if batched_drafting and len(batch) > 1:
                assert drafting.draft(batch) == [None] * len(batch)
            else:
                drafting.release()
                for s in batch:
                    s.draft()
            for i, scored in zip(live, score_rows(rows, batch)):
                tokens[i] += sequences[i].accept(scored)
            live = [i for i in live if not sequences[i].done]
        drafting.release()
        for row, (s, t) in enumerate(zip(sequences, tokens)):
            counts[row % 2][tuple(t)] = counts[row % 2].get(tuple(t), 0) + 1
            accepted += s.stats.accepted_draft_tokens > 0
    samples = 2 * groups
    assert 0.1 * 2 * samples < accepted < 2 * samples  # drafts were accepted, but not always
    for prompt, observed in zip(prompts, counts):
        expected = exact_sequence_probs(target, prompt, params, length)
        assert chi_square_pvalue(observed, expected, samples) > ALPHA


# ---------------------------------------------------------------- the batch scheduler

@pytest.fixture(scope="module")
def engine(tiny_llama) -> Engine:
    prototype = EagleDrafter(new_head(tiny_llama, seed=0), tiny_llama, TreeShape(depth=3, topk=2, total_tokens=6))
    return Engine(serve_config(*TINY), tiny_llama, drafter_factory(prototype), static_rows(tiny_llama, context=512))


def test_sequences_join_and_leave_between_rounds(engine):
    """max_batch 3, six requests of different lengths (two sampled): later ones join as earlier ones
    finish, two more arrive while the batch runs; each equals its run alone."""
    plans = [plan(engine, f"Request {i}: {'x' * (3 * i)}", n, t, seed=i)
             for i, (n, t) in enumerate([(12, 0), (40, 0), (20, 0.8), (30, 0), (16, 0.8), (25, 0)])]
    scheduler = BatchScheduler(max_batch=3, max_queue=8, target=engine.target, rows=engine.rows)
    clients = [Client(engine, p, f"r{i}") for i, p in enumerate(plans)]
    for client in clients[:4]:
        scheduler.submit(client.job)
    scheduler.start()
    clients[0].finished.wait(60)
    for client in clients[4:]:  # arrive mid-batch
        scheduler.submit(client.job)
    scheduler.stop(timeout=120)
    assert [c.tokens for c in clients] == [expected_alone(engine, p) for p in plans]
    assert scheduler.counts["completed"] == 6
    assert scheduler.batch_sizes.get(3, 0) >= 3 and min(scheduler.batch_sizes) < 3  # it batched, then shrank


def test_cancelled_sequence_frees_its_slot_and_cache(engine):
    long, other, waiting = plan(engine, "a long one", 400), plan(engine, "the other one", 30), plan(engine, "next", 20)
    scheduler = BatchScheduler(max_batch=2, max_queue=4, target=engine.target, rows=engine.rows)
    clients = run_all(scheduler, [Client(engine, long, "long", cancel_after=4), Client(engine, other, "other"),
                                  Client(engine, waiting, "waiting")])
    cancelled = clients[0]
    assert len(cancelled.events) == 4 and not cancelled.finished.is_set()  # no round after the cancel
    assert not cancelled.decoding.sequence.row.attached and cancelled.decoding.sequence.stats.stop_reason == "cancelled"
    assert clients[1].tokens == expected_alone(engine, other) and clients[2].tokens == expected_alone(engine, waiting)
    assert scheduler.counts["cancelled"] == 1 and scheduler.counts["completed"] == 2 and scheduler.active == 0


def test_a_failing_batched_forward_fails_its_jobs_and_the_server_goes_on(engine, monkeypatch):
    import eagle_lab.decoding.sequence as sequence_module

    def broken(rows, sequences):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(sequence_module, "score_rows", broken)
    scheduler = BatchScheduler(max_batch=2, max_queue=4, target=engine.target, rows=engine.rows)
    first = [Client(engine, plan(engine, f"doomed {i}", 10), f"d{i}") for i in range(2)]
    for client in first:
        scheduler.submit(client.job)
    scheduler.start()
    for client in first:
        assert client.finished.wait(60)
    assert all(c.events[-1].status == 500 and "simulated" in c.events[-1].message for c in first)
    monkeypatch.undo()
    later = plan(engine, "after the failure", 12)
    survivor = Client(engine, later, "later")
    scheduler.submit(survivor.job)
    scheduler.stop(timeout=60)
    assert survivor.tokens == expected_alone(engine, later) and scheduler.counts["failed"] == 2
    assert all(not c.decoding.sequence.row.attached for c in first)  # their rows were freed
