"""The online chain controller (tree=online): its choices on a made-up cost curve and acceptance, the cost curve
timed and cached, and decoding under it (greedy identical to plain decoding while lengths change in a reply)."""

import pytest
import torch

from eagle_lab.decoding.generate import Stopper, generate, speculative_decode, vanilla_decode
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.drafters.eagle.drafter import EagleDrafter
from eagle_lab.drafters.eagle.kinds import new_head
from eagle_lab.drafters.growth import TreeShape
from eagle_lab.tree_search import online
from eagle_lab.tree_search.online import (
    ChainController,
    ChainMemory,
    TakeTurns,
    card_prior,
    cost_curve,
    measure_round_costs,
)


def costs(*ms: float) -> ChainMemory:
    return ChainMemory(ms=dict(enumerate(ms)))


def feed(controller: ChainController, length: int, accepted: int, rounds: int) -> None:
    for _ in range(rounds):
        controller.observe(length, accepted)


def test_it_drafts_longer_as_acceptance_climbs_and_stops_where_nothing_pays():
    # a plain step 10 ms; a chain of L costs 13 + 2 L ms (a round's fixed cost, then each level)
    controller = ChainController(max_depth=4, memory=costs(10, 15, 17, 19, 21), prior=[0.5])
    feed(controller, 4, 0, 40)  # the head is never right: drafting does not pay
    assert controller.choose() == (0, 0)
    controller.reset()
    feed(controller, 4, 1, 40)  # depth 1 always, depth 2 never: a chain of one
    assert controller.choose() == (1, 0)
    feed(controller, 4, 4, 200)  # then it is always right: the longest chain
    assert controller.choose() == (4, 0)
    expected = controller.expected_tokens()
    assert expected[0] == 1.0 and expected[4] > 4.4


def test_the_choice_is_the_most_expected_tokens_per_millisecond():
    controller = ChainController(max_depth=2, memory=costs(10, 14, 17), prior=[0.5, 0.8])
    # tokens 1, 1.5, 1.9 over 10, 14, 17 ms: 0.100, 0.107, 0.112 per ms
    assert controller.expected_tokens() == pytest.approx([1.0, 1.5, 1.9])
    assert controller.choose() == (2, 0)
    cheaper_plain = ChainController(max_depth=2, memory=costs(8, 14, 17), prior=[0.5, 0.8])
    assert cheaper_plain.choose() == (0, 0)  # 0.125 per ms


def test_it_follows_the_reply_not_its_whole_history():
    controller = ChainController(max_depth=2, memory=costs(10, 13, 15), half_life=8)
    feed(controller, 2, 0, 100)
    assert controller.choose() == (0, 0)
    feed(controller, 2, 2, 24)  # three half-lives of a head that is right
    assert controller.choose() == (2, 0)


def test_drafting_comes_back_on_after_a_stretch_without_drafts():
    memory = costs(10, 13)
    for request_round in range(100):  # earlier requests accepted 60% of first drafts
        memory.remember(0.0, 0, request_round % 5 < 3)
    controller = ChainController(max_depth=1, memory=memory, half_life=8)
    controller.choose()
    feed(controller, 1, 0, 20)  # this reply rejects every draft: drafting off
    chosen = []
    for _ in range(80):
        chosen.append(controller.choose()[0])
        controller.observe(chosen[-1], 0)
    first_back = chosen.index(1)
    assert chosen[:first_back] == [0] * first_back and first_back > 8  # off for a while, then tried again
    assert chosen[first_back + 1] == 0  # one rejected try turns it off again


def test_forks_share_costs_and_long_run_acceptance_and_keep_their_own():
    parent = ChainController(max_depth=2, memory=costs(10, 12, 14))
    child = parent.fork()
    child.choose()
    feed(child, 1, 1, 3)
    assert parent.memory is child.memory and child.memory.reached[0.0][0] > 0
    assert parent.acceptance() != child.acceptance()


def test_sampled_rounds_are_priced_by_the_sampled_curve():
    memory = ChainMemory(ms={0: 10.0, 1: 12.0}, sampled_ms={0: 10.0, 1: 30.0})
    assert ChainController(max_depth=1, memory=memory, prior=[0.5]).choose(0.0) == (1, 0)  # 1.5 / 12 > 1 / 10
    assert ChainController(max_depth=1, memory=memory, prior=[0.5]).choose(1.0) == (0, 0)  # 1.5 / 30 < 1 / 10


def test_a_cost_curve_missing_a_length_is_refused():
    with pytest.raises(ValueError, match="no time for chain lengths \\[2\\]"):
        ChainController(max_depth=2, memory=costs(10, 12))


def test_a_new_request_starts_from_what_earlier_ones_at_its_temperature_accepted():
    controller = ChainController(max_depth=2, memory=costs(10, 13, 15), prior=[0.6])
    controller.choose(1.0)
    feed(controller, 2, 0, 40)  # at T=1 the head is never right
    controller.reset()
    controller.choose(1.0)
    assert controller.acceptance()[0] < 0.1
    controller.reset()
    controller.choose(0.0)  # nothing learnt at T=0 yet: the default prior
    assert controller.acceptance() == [0.6, 0.6]


def test_a_new_request_starts_its_ngram_chains_from_what_earlier_ones_at_its_temperature_accepted():
    controller = ChainController(max_depth=1, memory=with_forward(costs(10, 12), *range(10, 30)), prior=[0.5])
    assert controller.choose(1.0, proposed=4)[1] > 0  # at the default prior a chain pays for some of its tokens
    for _ in range(40):  # at T=1 the chains' first token is never right
        controller.observe(0, 0, chain=4, chain_accepted=0)
    controller.reset()
    assert controller.choose(1.0, proposed=4)[1] == 0  # the next request at T=1 merges none from its first round
    assert controller.chain_acceptance()[0] < 0.1
    controller.reset()
    controller.choose(0.0, proposed=4)  # nothing learnt at T=0 yet: the default prior
    assert controller.chain_acceptance()[0] == online.NGRAM_PRIOR


def test_a_head_cards_accuracy_by_position_becomes_acceptance_by_depth():
    assert card_prior([0.6, 0.48, 0.45]) == pytest.approx([0.6, 0.8, 0.9375])
    assert card_prior([0.5, 0.5]) == pytest.approx([0.5, 0.95])  # capped: a depth is never certain
    assert card_prior([]) == [online.DEFAULT_PRIOR]


def test_taking_turns_times_runs_of_each_length_but_their_first_rounds():
    turns = TakeTurns(2)
    chosen = [turns.choose(proposed=4) for _ in range(2 * 3 * online.TURN_ROUNDS)]
    assert chosen == [(length, 0) for length in [0, 1, 2] for _ in range(online.TURN_ROUNDS)] * 2
    for length, _ in chosen:
        turns.observe(length, 0, 10.0 + length)
    assert turns.times == {length: [10.0 + length] * (2 * (online.TURN_ROUNDS - 1)) for length in range(3)}


def _drafter(target, controller=None):
    return EagleDrafter(new_head(target, seed=1), target, TreeShape(3, 1, 3), controller=controller)


def test_decoding_is_lossless_while_the_chain_length_changes_every_other_round(tiny_target, monkeypatch):
    monkeypatch.setattr(online, "TURN_ROUNDS", 2)
    prompt = torch.tensor([5, 9, 3, 17, 2, 11])
    stopper = Stopper(tiny_target.tokenizer, 40, set())
    plain = generate(vanilla_decode(tiny_target, prompt, SamplingParams(), stopper))
    turns = TakeTurns(3)
    result = generate(speculative_decode(tiny_target, _drafter(tiny_target, turns), prompt, SamplingParams(),
                                         Stopper(tiny_target.tokenizer, 40, set())))
    assert result.token_ids == plain.token_ids
    assert all(turns.times[length] for length in range(4))  # every length drafted and timed


def test_the_cost_curve_times_every_length_and_is_cached(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setattr(online, "TIMED_ROUNDS", 3)
    drafter = _drafter(tiny_target)
    curve = measure_round_costs(tiny_target, drafter, [[5, 9, 3, 17, 2, 11]], 3, new_tokens=64)
    assert sorted(curve) == [0, 1, 2, 3] and all(ms > 0 for ms in curve.values())
    assert drafter.controller is None  # the drafter is handed back as it was

    measured = []
    monkeypatch.setattr(online, "measure_round_costs",
                        lambda *args, temperature=0.0: measured.append(temperature) or {0: 1.0 + temperature, 1: 2.0})
    path = tmp_path / "curve.json"
    assert cost_curve(tiny_target, drafter, [], 1, path).ms == {0: 1.0, 1: 2.0}
    cached = cost_curve(tiny_target, drafter, [], 1, path)
    assert cached.sampled_ms == {0: 2.0, 1: 2.0} and measured == [0.0, online.SAMPLED_TEMPERATURE]
    assert cost_curve(tiny_target, drafter, [], 1, path).forward_ms == {}  # no n-gram proposer: no forward curve
    with pytest.raises(ValueError, match="no timed round"):
        cost_curve(tiny_target, drafter, [], 2, tmp_path / "other.json")



def with_forward(memory: ChainMemory, *ms: float) -> ChainMemory:
    memory.forward_ms = {k: value for k, value in enumerate(ms, start=1)}
    return memory


def test_a_round_with_an_ngram_chain_emits_the_longer_accepted_prefix():
    controller = ChainController(max_depth=1, memory=costs(10, 12), prior=[0.5])
    # head: P(first accepted) 0.5; chain of 2 at the prior 0.5 each: P(first) 0.5, P(both) 0.25
    # token 1 is missed by both with 0.5 * 0.5, token 2 reached only by the chain: 1 + 0.75 + 0.25
    assert controller.expected_tokens(chain=2) == pytest.approx([1.75, 2.0])
    assert controller.expected_tokens(chain=0) == pytest.approx([1.0, 1.5])


def test_an_ngram_chain_is_merged_as_far_as_its_acceptance_pays_for_its_tokens():
    # a forward over 1, 2, 3, ... tokens: 10, 11, 12, ... ms (each token 1 ms); the head's chain costs 12 ms
    controller = ChainController(max_depth=1, memory=with_forward(costs(10, 12), *range(10, 20)), prior=[0.1])
    for _ in range(60):  # chains of 4 whose tokens are always right
        controller.observe(0, 0, chain=4, chain_accepted=4)
    assert controller.choose(proposed=4) == (0, 4)
    controller.reset()
    for _ in range(60):  # chains whose first token is never right
        controller.observe(0, 0, chain=4, chain_accepted=0)
    assert controller.choose(proposed=4) == (0, 0)
    controller.reset()
    for _ in range(60):  # right for two tokens, never the third
        controller.observe(0, 0, chain=4, chain_accepted=2)
    assert controller.choose(proposed=4) == (0, 2)
    no_curve = ChainController(max_depth=1, memory=costs(10, 12))
    assert no_curve.choose(proposed=4)[1] == 0  # without a forward curve no chain is priced, none merged


def test_online_hybrid_decoding_is_lossless_and_merges_chains(tiny_target):
    from eagle_lab.drafters.ngram import NgramProposer

    class EchoProposer(NgramProposer):
        """Proposes the last four tokens again, every round (a random target rarely repeats itself)."""

        def propose(self, sequence):
            return sequence[-4:].tolist()

    prompt = torch.tensor([5, 9, 3, 17, 2, 11])
    plain = generate(vanilla_decode(tiny_target, prompt, SamplingParams(), Stopper(tiny_target.tokenizer, 48, set())))
    controller = ChainController(max_depth=2, memory=with_forward(costs(10, 12, 14), *range(10, 30)), prior=[0.3])
    merged = []
    observe = controller.observe

    def record(length, accepted, ms=None, chain=0, chain_accepted=0):
        merged.append(chain)
        observe(length, accepted, ms, chain, chain_accepted)

    controller.observe = record
    drafter = EagleDrafter(new_head(tiny_target, seed=1), tiny_target, TreeShape(2, 1, 2), EchoProposer(2, 4, 4),
                           controller=controller)
    result = generate(speculative_decode(tiny_target, drafter, prompt, SamplingParams(),
                                         Stopper(tiny_target.tokenizer, 48, set())))
    assert result.token_ids == plain.token_ids
    assert merged[0] > 0 and 0 in merged  # chains merged on the prior, then dropped when never accepted


class Script:
    """A controller that drafts the lengths of `script` in turn and records what it is told of each round."""

    def __init__(self, script: list[int]):
        self.script, self.turn, self.told = script, 0, []

    def choose(self, temperature: float = 0.0, proposed: int = 0) -> tuple[int, int]:
        self.turn += 1
        return self.script[(self.turn - 1) % len(self.script)], 0

    def observe(self, length, accepted, ms=None, chain=0, chain_accepted=0) -> None:
        self.told.append((length, accepted))

    def reset(self) -> None:
        self.turn, self.told = 0, []

    def fork(self):
        return self


def test_batched_rows_draft_their_controllers_chains_losslessly(tiny_target):
    """Three sequences decode in one batch of rows, each drafting the chain length its own controller picks (0 too:
    then it scores the root alone), sharing head steps where they draft: each sequence's tokens equal plain greedy
    decoding, and each controller hears of every round it planned, with the accepted count its sequence saw."""
    from eagle_lab.decoding.sequence import Sequence, score_rows
    from eagle_lab.drafters.eagle.batch import BatchDrafter
    from tests.scheduler_helpers import static_rows

    prompts = [torch.tensor(p) for p in ([5, 9, 3, 17, 2, 11], [4, 4, 8, 1], [30, 2, 7, 7, 7, 19, 3])]
    scripts = [[3, 0, 1], [2, 2, 0, 0], [1, 3]]
    prototype = _drafter(tiny_target)
    rows = static_rows(tiny_target, rows=4)
    sequences, controllers = [], []
    for prompt, script in zip(prompts, scripts):
        drafter = prototype.fork()
        controllers.append(Script(script))
        drafter.control(controllers[-1])
        sequences.append(Sequence(tiny_target, drafter, prompt, SamplingParams(),
                                  Stopper(tiny_target.tokenizer, 30, set()), None, rows))
        sequences[-1].prefill()
    drafting, seen = BatchDrafter(), [[] for _ in sequences]
    while not any(s.done for s in sequences):
        assert drafting.draft(sequences) == [None] * len(sequences)
        lengths = [s.tree.size - 1 for s in sequences]
        for index, (sequence, row) in enumerate(zip(sequences, score_rows(rows, sequences))):
            seen[index].append((lengths[index], len(sequence.accept(row)) - 1))
    drafting.release()
    assert any(b.gathers for b in drafting.batches.values())  # rows that drafted shared head steps
    for sequence, prompt, controller, script, rounds in zip(sequences, prompts, controllers, scripts, seen):
        stopper = Stopper(tiny_target.tokenizer, 30, set())
        plain = generate(vanilla_decode(tiny_target, prompt, SamplingParams(), stopper))
        assert sequence.stopper.generated == plain.token_ids[:len(sequence.stopper.generated)]
        assert [length for length, _ in rounds] == [script[i % len(script)] for i in range(len(rounds))]
        assert controller.told == rounds[:-1]  # every round but the last (told when the next is planned)


def test_a_server_of_controlled_drafters_gives_each_request_its_output_alone(tiny_llama):
    """The scheduler's batched rounds over requests whose drafters each have a controller (forks of one prototype,
    sharing its cost curve): every request's greedy tokens are the ones it gets decoded alone."""
    from eagle_lab.serving.batching import BatchScheduler
    from eagle_lab.serving.engine import Engine, drafter_factory
    from tests.scheduler_helpers import expected_alone, plan, run_plans, static_rows
    from tests.serving_helpers import TINY, serve_config

    controller = ChainController(max_depth=3, memory=costs(10, 10.5, 11, 11.5), prior=[0.6, 0.5, 0.4])
    prototype = EagleDrafter(new_head(tiny_llama, seed=2), tiny_llama, TreeShape(3, 1, 3), controller=controller)
    engine = Engine(serve_config(*TINY), tiny_llama, drafter_factory(prototype), static_rows(tiny_llama))
    plans = [plan(engine, f"Request {i}: {'q' * (3 * i)} 4 5 4 5", n) for i, n in enumerate((12, 28, 20))]
    clients = run_plans(BatchScheduler(max_batch=3, max_queue=8, target=engine.target, rows=engine.rows), engine, plans)
    assert [c.tokens for c in clients] == [expected_alone(engine, p) for p in plans]
    depths = [len(c.decoding.sequence.stats.reached_depth) for c in clients]
    assert max(depths) >= 1  # the controllers drafted
