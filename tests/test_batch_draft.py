"""Batched drafting (eagle_lab/drafters/eagle/batch.py): one head forward per tree level serves every
sequence sharing a head, and each sequence gets the very tree its own EagleDrafter builds alone.

Every batched round is checked against a twin drafter per sequence (a fork of the same head, fed
the same sequence and unseen features, drafting alone): same tokens, parents and n-gram marks, over
rounds with ragged prompts, ragged accepted lengths, ragged tree shapes and depths in one batch,
members leaving, joining and dropping to batch 1 and back. The fp32 tiny models make the trees match
exactly; the head caches handed back match the twins' up to float rounding.
"""

from __future__ import annotations

import pytest
import torch

from eagle_lab.decoding.generate import Stopper
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.decoding.sequence import Sequence, score_rows
from eagle_lab.drafters.eagle.batch import BatchDrafter, HeadBatch
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.eagle.kinds import new_head
from eagle_lab.drafters.growth import TreeShape
from eagle_lab.drafters.ngram import NgramDrafter, NgramProposer
from eagle_lab.models.prompts import as_tensor, encode_prompt
from eagle_lab.serving.batching import BatchScheduler
from eagle_lab.serving.engine import Engine, drafter_factory
from tests.conftest import small_vocab_target
from tests.scheduler_helpers import Client, expected_alone, plan, run_plans, static_rows
from tests.serving_helpers import TINY, serve_config

SHAPES = (TreeShape(3, 2, 6), TreeShape(2, 3, 5), TreeShape(4, 1, 4), TreeShape(3, 2, 6))  # ragged k and depth


def head_for(target, kind: str, seed: int = 0):
    if kind == "eagle3":  # a reduced draft vocabulary too, when the target's is big enough
        vocab = torch.arange(0, target.vocab_size, 2) if target.vocab_size > 50 else None
        return new_head(target, kind="eagle3", draft_vocab_ids=vocab, seed=seed)
    return new_head(target, seed=seed)


def fork_with(prototype: EagleDrafter, shape: TreeShape, hybrid: bool = True) -> EagleDrafter:
    """A drafter of the prototype's head (batched with its forks) drafting `shape`, with the prototype's n-gram
    chains merged (hybrid) or none."""
    return EagleDrafter(prototype.head, prototype.target, shape, prototype.ngram if hybrid else None)


def new_sequence(target, drafter, prompt, length: int, rows) -> Sequence:
    sequence = Sequence(target, drafter, prompt, SamplingParams(), Stopper(target.tokenizer, length, set()), None,
                        rows, plain=drafter is None)
    sequence.prefill()
    return sequence


def same_tree(got, want) -> bool:
    marks = [t.from_ngram.tolist() if t.from_ngram is not None else [False] * t.size for t in (got, want)]
    return (torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents)
            and marks[0] == marks[1])


def run_rounds(target, sequences, joining, drafting, depth_cap=None, rounds=40):
    """Rounds over the live sequences (`joining`: round -> sequence joining then), each drafted by
    `drafting` and, for every EAGLE row, by its twin alone; -> per round the unseen counts of EAGLE rows
    whether every tree matched its twin's, the batch size, and how many EAGLE trees got n-gram nodes. The
    live sequences are scored by one forward of their rows (one per kind of features their drafters read);
    depth_cap(round, index) lowers a row's max depth (as the context limit would)."""
    twins = {id(s): s.drafter.fork() for s in sequences if isinstance(s.drafter, EagleDrafter)}
    live, log = list(sequences), []
    for number in range(rounds):
        for sequence in joining.get(number, []):
            live.append(sequence)
            twins[id(sequence)] = sequence.drafter.fork()
        live = [s for s in live if not s.done]
        if not live:
            break
        expected, counts = {}, []
        for index, sequence in enumerate(live):
            max_depth = sequence.prepare_draft()
            if depth_cap is not None and max_depth is not None:
                max_depth = min(max_depth, depth_cap(number, index))
                sequence.prepare_draft = lambda plain, cap=max_depth: cap  # noqa: B023 - this round's cap
            if id(sequence) in twins and max_depth is not None:
                twin = twins[id(sequence)]
                counts.append(sequence.unseen.shape[0])
                expected[id(sequence)] = twin.draft(sequence.sequence, sequence.unseen, max_depth)
        if len(live) > 1:
            assert drafting.draft(live) == [None] * len(live)
        else:
            drafting.release()
            live[0].draft()
        for sequence in live:
            sequence.__dict__.pop("prepare_draft", None)
        matched = all(same_tree(s.tree, expected[id(s)]) for s in live if id(s) in expected)
        chains = sum(s.tree.from_ngram is not None for s in live if id(s) in expected)  # trees with n-gram nodes
        log.append((counts, matched, len(live), chains))
        for sequence in live:  # every candidate's draft score, not only the kept ones, up to float rounding
            twin = twins.get(id(sequence))
            if twin is not None and twin.last_candidates is not None:
                torch.testing.assert_close(sequence.drafter.last_candidates.scores, twin.last_candidates.scores,
                                           rtol=1e-4, atol=1e-4)
        for layers in {s.layer_ids for s in live}:  # one forward per kind of target features read
            group = [s for s in live if s.layer_ids == layers]
            for sequence, scored in zip(group, score_rows(group[0].scorer.rows, group)):
                sequence.accept(scored)
    drafting.release()
    for sequence in live:  # every live drafter's own cache is back, and in step with its twin's
        twin = twins.get(id(sequence))
        if twin is not None and not sequence.done:
            assert sequence.drafter.committed == twin.committed
            torch.testing.assert_close(sequence.drafter.cache.keys, twin.cache.keys[:, :, :twin.committed],
                                       rtol=1e-4, atol=1e-5)
    return log


@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
def test_batched_trees_equal_each_drafters_own(tiny_target, kind):
    """Three EAGLE rows of one head (ragged shapes, hybrid and not), two of another head, n-gram and
    vanilla rows; a fourth row of the first head joins at round 3, the short ones leave (the second
    head's last row then drafts alone in the batch), the last rounds run at batch 1."""
    prototype = EagleDrafter(head_for(tiny_target, kind), tiny_target, SHAPES[0],
                             ngram=NgramProposer(1, 3, 4))
    other = EagleDrafter(head_for(tiny_target, kind, seed=1), tiny_target, TreeShape(2, 2, 3))
    prompts = [as_tensor(encode_prompt(tiny_target.tokenizer, p, chat=False), tiny_target.device)
               for p in ("Hi", "Tell me a story about a dragon.", "1 2 3 1 2 3 1 2", "def f(x):", "abc abc ab",
                         "x = 1; y = 2; x = 1;")]
    drafters = [fork_with(prototype, SHAPES[0], hybrid=False), fork_with(prototype, SHAPES[1]), other.fork(),
                NgramDrafter(NgramProposer(1, 3, 4)), None, other.fork()]  # hybrid and not, in one head batch
    rows = static_rows(tiny_target, rows=8)
    sequences = [new_sequence(tiny_target, d, p, n, rows) for d, p, n in zip(drafters, prompts, (8, 30, 12, 10, 6, 20))]
    joiner = new_sequence(tiny_target, fork_with(prototype, SHAPES[2]), prompts[2], 24, rows)
    drafting = BatchDrafter()
    log = run_rounds(tiny_target, sequences, {3: [joiner]}, drafting)
    assert all(matched for _, matched, _, _ in log)
    assert len(log) >= 10 and all(s.done for s in sequences + [joiner])
    assert any(len(set(counts)) > 1 for counts, _, _, _ in log)  # ragged step-1 lengths in one forward
    assert [size for _, _, size, _ in log][-1] == 1 and max(size for _, _, size, _ in log) == 7  # 7 rows, then 1
    assert sum(chains for _, _, size, chains in log if size > 1) >= 3  # batched rows' n-gram merges compared
    assert len(drafting.batches) == 2 and all(b.gathers >= 1 for b in drafting.batches.values())  # two heads
    assert drafting.gathers >= 3  # rebuilt when the joiner came and when rows left


def test_ragged_accepts_and_depths_near_the_context_limit():
    """A 5-token target whose drafts are often accepted (ragged accepted lengths), rows capped to
    depths 0 .. 2 some rounds (commit only, shallower trees), and the n-gram merge capped alike."""
    target = small_vocab_target()
    prototype = EagleDrafter(new_head(target, seed=4), target, SHAPES[0], ngram=NgramProposer(1, 3, 3))
    prompts = [torch.tensor(p) for p in ([1, 4, 2, 0], [3, 1, 4, 2, 0, 1, 3], [2, 2], [0, 1, 0, 1, 0, 1, 4])]
    rows = static_rows(target, rows=len(prompts))
    sequences = [new_sequence(target, fork_with(prototype, shape), p, 40, rows) for shape, p in zip(SHAPES, prompts)]
    caps = (0, 1, 2, 50, 50)
    log = run_rounds(target, sequences, {}, BatchDrafter(), lambda number, index: caps[(number + index) % len(caps)])
    assert all(matched for _, matched, _, _ in log)
    assert sum(len(set(counts)) > 1 and max(counts) > 1 for counts, *_ in log[1:]) >= 3  # accepted lengths differ


def test_one_head_forward_per_level_for_the_whole_batch(tiny_llama):
    """Three rows of depth 3: 3 head forwards (step 1, then 2 levels) for all, against 9 alone."""
    prototype = EagleDrafter(new_head(tiny_llama, seed=0), tiny_llama, TreeShape(3, 2, 6))
    prompts = [as_tensor(encode_prompt(tiny_llama.tokenizer, p, chat=False), tiny_llama.device)
               for p in ("a", "bc", "def")]
    sequences = [new_sequence(tiny_llama, prototype.fork(), p, 10, static_rows(tiny_llama, rows=3)) for p in prompts]
    calls = []
    hook = prototype.head.register_forward_hook(lambda module, args, out: calls.append(out.shape[:2]))
    try:
        BatchDrafter().draft(sequences)
    finally:
        hook.remove()
    assert calls == [(3, 3), (3, 2), (3, 2)]  # (B, P) then (B, k) twice


@pytest.fixture(scope="module", params=["eagle2", "eagle2-hybrid", "eagle3"])
def engine(request, tiny_llama) -> Engine:
    kind = request.param.split("-")[0]
    ngram = NgramProposer(1, 3, 4) if request.param.endswith("hybrid") else None
    prototype = EagleDrafter(head_for(tiny_llama, kind), tiny_llama, TreeShape(depth=3, topk=2, total_tokens=6),
                             ngram=ngram)
    return Engine(serve_config(*TINY), tiny_llama, drafter_factory(prototype), static_rows(tiny_llama))


def test_scheduler_greedy_at_batch_three_equals_alone(engine, monkeypatch):
    """Five greedy requests through BatchScheduler (max_batch 3, batched drafting on), joining as
    others finish: each one's tokens equal its run alone, and the rounds at batch >= 2 drafted batched."""
    batched_rows = []
    draft = HeadBatch.draft

    def counting(self, rows):
        batched_rows.append(len(rows))
        return draft(self, rows)

    monkeypatch.setattr(HeadBatch, "draft", counting)
    plans = [plan(engine, f"Request {i}: {'z' * (4 * i)} 1 2 1 2", n) for i, n in enumerate((10, 36, 18, 28, 14))]
    scheduler = BatchScheduler(max_batch=3, max_queue=8, target=engine.target, rows=engine.rows)
    clients = run_plans(scheduler, engine, plans)
    assert [c.tokens for c in clients] == [expected_alone(engine, p) for p in plans]
    assert scheduler.counts["completed"] == 5 and scheduler.batch_sizes.get(3, 0) >= 3
    assert batched_rows.count(3) >= 3 and 2 in batched_rows  # batched at 3, then at 2 as they left
    assert scheduler.drafting.gathers >= 2


def test_a_failing_batched_draft_fails_its_jobs_and_the_server_goes_on(engine, monkeypatch):
    def broken(self, rows):
        raise RuntimeError("head out of memory (simulated)")

    monkeypatch.setattr(HeadBatch, "draft", broken)
    scheduler = BatchScheduler(max_batch=2, max_queue=4, target=engine.target, rows=engine.rows)
    doomed = [Client(engine, plan(engine, f"doomed {i}", 10), f"d{i}") for i in range(2)]
    for client in doomed:
        scheduler.submit(client.job)
    scheduler.start()
    for client in doomed:
        assert client.finished.wait(60)
    assert all(c.events[-1].status == 500 and "simulated" in c.events[-1].message for c in doomed)
    monkeypatch.undo()
    later = [plan(engine, "after the failure", 12), plan(engine, "and another one", 9)]
    survivors = [Client(engine, p, f"s{i}") for i, p in enumerate(later)]
    for client in survivors:
        scheduler.submit(client.job)
    scheduler.stop(timeout=60)
    assert [c.tokens for c in survivors] == [expected_alone(engine, p) for p in later]
    assert scheduler.counts["failed"] == 2 and scheduler.counts["completed"] == 2


def test_batched_hybrid_trees_stay_inside_the_largest_static_bucket():
    """Eight rows drafting hybrid trees in one batch: the n-gram chain is cut to the room the head's tree leaves
    under max_tree_tokens, as single-sequence drafting cuts it, so no tree outgrows the largest static bucket."""
    target = small_vocab_target()  # its greedy output repeats itself: long n-gram chains
    prototype = EagleDrafter(head_for(target, "eagle2"), target, TreeShape(2, 2, 3), ngram=NgramProposer(1, 3, 8))
    prototype.max_tree_tokens = 8
    prompts = [torch.tensor([1, 4, 2, 0] * (3 + i % 3) + [i % 5]) for i in range(8)]
    rows = static_rows(target, rows=8)
    sequences = [new_sequence(target, prototype.fork(), p, 24, rows) for p in prompts]
    drafting, sizes, chains = BatchDrafter(), [], 0
    for _ in range(5):
        live = [s for s in sequences if not s.done]
        for sequence in live:
            sequence.prepare_draft()
        assert drafting.draft(live) == [None] * len(live)
        sizes += [s.tree.size for s in live]
        chains += sum(s.tree.from_ngram is not None for s in live)
        for sequence, scored in zip(live, score_rows(rows, live)):
            sequence.accept(scored)
    drafting.release()
    assert chains > 0 and max(sizes) <= 8, sizes
