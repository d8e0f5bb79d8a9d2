"""The online chain controller (tree.online=true): its choices on made-up costs and acceptance, and decoding
under it (greedy identical to plain decoding, lengths that change within one reply)."""

import pytest
import torch

from eagle_lab.decoding.generate import Stopper, generate, speculative_decode, vanilla_decode
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.tree_search.online import COST_WINDOW, ChainController, ChainMemory


def costs(*ms: float) -> ChainMemory:
    shared = ChainMemory()
    for length, value in enumerate(ms):
        shared.observe(length, value)
    return shared


def feed(controller: ChainController, length: int, accepted: int, ms: float, rounds: int) -> None:
    for _ in range(rounds):
        controller.observe(length, accepted, ms)


def test_every_length_is_timed_once_before_any_is_chosen():
    controller = ChainController(max_depth=3, memory=ChainMemory())
    chosen = []
    for _ in range(4):
        length = controller.choose()
        chosen.append(length)
        controller.observe(length, 0, 10.0)
    assert chosen == [0, 1, 2, 3]


def test_it_drafts_longer_as_acceptance_climbs_and_stops_where_nothing_pays():
    # a plain step 10 ms; a chain of L costs 13 + 2 L ms (a round's fixed cost, then each level)
    controller = ChainController(max_depth=4, memory=costs(10, 15, 17, 19, 21), prior=[0.5], explore_every=10 ** 6)
    feed(controller, 4, 0, 21, 40)  # the head is never right: drafting does not pay
    assert controller.choose() == 0
    controller.reset()
    feed(controller, 4, 1, 21, 40)  # depth 1 always, depth 2 never: a chain of one
    assert controller.choose() == 1
    feed(controller, 4, 4, 21, 200)  # then it is always right: the longest chain
    assert controller.choose() == 4
    expected = controller.expected_tokens()
    assert expected[0] == 1.0 and expected[4] > 4.4


def test_it_follows_the_reply_not_its_whole_history():
    controller = ChainController(max_depth=2, memory=costs(10, 13, 15), half_life=8, explore_every=10 ** 6)
    feed(controller, 2, 0, 15, 100)
    assert controller.choose() == 0
    feed(controller, 2, 2, 15, 24)  # three half-lives of a head that is right
    assert controller.choose() == 2


def test_it_retimes_the_length_timed_longest_ago_now_and_then():
    controller = ChainController(max_depth=3, memory=costs(10, 30, 40, 50), prior=[0.1], explore_every=4)
    chosen = []
    for _ in range(13):
        length = controller.choose()
        chosen.append(length)
        controller.observe(length, 0, controller.memory.ms[length])
    assert chosen == [0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 3]  # drafting is retried every fourth round


def test_a_cost_is_the_median_of_recent_rounds_so_a_stall_does_not_count():
    shared = costs(1000.0)  # a first round that loaded a graph
    for ms in (10.0, 12.0, 11.0, 500.0, 10.5, 10.8):
        shared.observe(0, ms)
    assert shared.ms[0] == pytest.approx(11.0)
    for _ in range(COST_WINDOW):
        shared.observe(0, 20.0)  # the machine slowed down: the cost follows within a window
    assert shared.ms[0] == 20.0


def test_forks_share_costs_and_keep_their_own_acceptance():
    parent = ChainController(max_depth=2, memory=costs(10, 12, 14))
    child = parent.fork()
    child.observe(1, 1, 11.0)
    assert parent.memory.ms[1] == child.memory.ms[1]
    assert parent.acceptance() != child.acceptance()


def test_online_decoding_is_lossless_and_changes_length_within_a_reply(tiny_target):
    from eagle_lab.drafters.eagle.drafter import EagleDrafter
    from eagle_lab.drafters.eagle.kinds import new_head
    from eagle_lab.drafters.growth import TreeShape

    prompt = torch.tensor([5, 9, 3, 17, 2, 11])
    length = 40
    plain = generate(vanilla_decode(tiny_target, prompt, SamplingParams(), Stopper(tiny_target.tokenizer, length,
                                                                                   set())))
    controller = ChainController(max_depth=3, memory=ChainMemory(), explore_every=3)
    drafter = EagleDrafter(new_head(tiny_target, seed=1), tiny_target, TreeShape(3, 1, 3), controller=controller)
    lengths = []
    observe = controller.observe

    def record(length_, accepted, ms):
        lengths.append(length_)
        observe(length_, accepted, ms)

    controller.observe = record
    result = generate(speculative_decode(tiny_target, drafter, prompt, SamplingParams(),
                                         Stopper(tiny_target.tokenizer, length, set())))
    assert result.token_ids == plain.token_ids
    assert {0, 1, 2, 3} <= set(lengths)  # every length timed, drafting off and on again in one reply


def test_rounds_without_drafts_keep_what_was_learnt_of_acceptance():
    controller = ChainController(max_depth=2, memory=costs(10, 13, 15), half_life=8)
    feed(controller, 2, 2, 15, 30)
    learnt = controller.acceptance()
    feed(controller, 0, 0, 10, 200)
    assert controller.acceptance() == learnt


def test_an_explored_length_is_drafted_until_a_round_of_it_is_timed():
    controller = ChainController(max_depth=1, memory=costs(10, 30), prior=[0.1], explore_every=3)
    for _ in range(3):
        assert controller.choose() == 0
        controller.observe(0, 0, 10.0)
    assert controller.choose() == 1  # explored; its round catches up on the head's features: untimed
    controller.observe(1, 0, None)
    assert controller.choose() == 1  # again, timed this time
    controller.observe(1, 0, 30.0)
    assert controller.choose() == 0


def test_a_new_request_starts_from_what_earlier_ones_at_its_temperature_accepted():
    controller = ChainController(max_depth=2, memory=costs(10, 13, 15), prior=[0.6])
    controller.choose(1.0)
    feed(controller, 2, 0, 15, 40)  # at T=1 the head is never right
    controller.reset()
    controller.choose(1.0)
    assert controller.acceptance()[0] < 0.1
    controller.reset()
    controller.choose(0.0)  # nothing learnt at T=0 yet: the default prior
    assert controller.acceptance() == [0.6, 0.6]
