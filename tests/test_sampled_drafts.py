"""Drafts drawn from the head's distribution (T > 0): the draw, the recursive rejection rule, the spine.

Chi-square tests as in test_sampling_lossless (alpha = 1e-3, fixed seeds); the negative control shows the
same test rejects a rule that forgets the siblings were drawn without replacement.
"""

import math

import pytest
import torch

from eagle_lab.decoding.generate import Stopper, generate, speculative_decode
from eagle_lab.decoding.sampling import DraftSampling, SamplingParams, draw
from eagle_lab.decoding.tree import Proposals, tree_from_lists
from eagle_lab.decoding.verify import verify_sampling
from eagle_lab.drafters.ngram import merge_chain
from eagle_lab.drafters.sampled import draw_distinct, grow_sampled_tree, proposal
from tests.conftest import small_vocab_target
from tests.test_sampling_lossless import ALPHA, chi_square_pvalue, exact_sequence_probs

VOCAB = 6


def test_draw_distinct_draws_in_order_without_replacement():
    q = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05])
    g = torch.Generator().manual_seed(0)
    samples = 20000
    counts: dict = {}
    for _ in range(samples):
        key = tuple(draw_distinct(q, 2, g))
        counts[key] = counts.get(key, 0) + 1
    # P(a then b) = q(a) * q(b) / (1 - q(a)); index 1 (q = 0) never drawn
    expected = {(a, b): float(q[a] * q[b] / (1 - q[a])) for a in range(5) for b in range(5)
                if a != b and q[a] > 0 and q[b] > 0}
    assert chi_square_pvalue(counts, expected, samples) > ALPHA
    assert draw_distinct(torch.tensor([0.0, 1.0, 0.0]), 3, g) == [1]  # fewer when q has fewer non-zero entries


def test_proposal_warps_the_heads_top_tokens_like_the_target():
    logp = torch.tensor([-0.5, -1.0, -2.0, -4.0])
    q = proposal(logp, SamplingParams(temperature=0.5, top_k=3))
    expected = torch.tensor([-1.0, -2.0, -4.0]).softmax(-1)
    torch.testing.assert_close(q[:3], expected)
    assert q[3] == 0


def sampled_root_tree(q_root: torch.Tensor, q_child: torch.Tensor, k: int, generator, chain: list[int] = ()):
    """A round's tree as a sampled drafter builds it: k root children drawn from q_root without
    replacement, the first getting k children from q_child; optionally an n-gram chain merged after."""
    ids = torch.arange(VOCAB)
    first = draw_distinct(q_root, k, generator)
    tokens, parents = [5], [-1]
    tokens += first
    parents += [0] * len(first)
    second = draw_distinct(q_child, k, generator)
    tokens += second
    parents += [1] * len(second)
    n = len(tokens)
    probs = torch.zeros(n, VOCAB)
    probs[0], probs[1] = q_root, q_child
    tree = tree_from_lists(tokens, parents, torch.device("cpu"))
    tree.proposals = Proposals(ids=ids.expand(n, VOCAB).clone(), probs=probs,
                               sampled=torch.tensor([False] + [True] * (n - 1)))
    return merge_chain(tree, list(chain)) if chain else tree


def case(seed=0):
    g = torch.Generator().manual_seed(seed)
    dirichlet = torch.distributions.Dirichlet(torch.full((VOCAB,), 0.7))
    torch.manual_seed(seed)
    p_root, p_child, p_other = dirichlet.sample((3,))  # target at the root, at every root child, elsewhere
    q_root, q_child = dirichlet.sample((2,))  # the draft's distributions, unlike p
    return g, p_root, p_child, p_other, q_root, q_child


def two_step_counts(rule, samples: int, k: int, chain=()) -> tuple[dict, dict, int]:
    g, p_root, p_child, p_other, q_root, q_child = case()

    def node_probs(tree):
        # the target's distribution after the root's first child is p_child; after any other node p_other
        return lambda node: p_root if node == 0 else p_child if node == 1 else p_other

    counts: dict = {}
    accepted_first = 0
    for _ in range(samples):
        tree = sampled_root_tree(q_root, q_child, k, g, chain)
        accepted, bonus = rule(tree, node_probs(tree), g)
        emitted = tree.tokens[accepted[1:]].tolist() + [bonus]
        accepted_first += accepted.numel() > 1 and int(accepted[1]) == 1
        key = (emitted[0], emitted[1] if len(emitted) > 1 else None)
        counts[key] = counts.get(key, 0) + 1

    return counts, {"p_root": p_root, "p_child": p_child, "p_other": p_other, "q_root": q_root}, accepted_first


def first_token_law(counts: dict) -> dict:
    law: dict = {}
    for (first, _), count in counts.items():
        law[first] = law.get(first, 0) + count
    return law


@pytest.mark.parametrize("k,chain", [(1, ()), (3, ()), (2, (4, 2))], ids=["chain", "three-siblings", "with-ngram"])
def test_sampled_siblings_keep_the_target_distribution(k, chain):
    samples = 20000
    counts, laws, _ = two_step_counts(verify_sampling, samples, k, chain)
    expected = {x: float(laws["p_root"][x]) for x in range(VOCAB)}
    assert chi_square_pvalue(first_token_law(counts), expected, samples) > ALPHA


def replacement_blind_rule(tree, node_probs, generator):
    """Wrong on purpose: every sampled sibling is judged against the node's full q, as if the siblings
    had been drawn with replacement (they were drawn without)."""
    full = tree.proposals.probs.clone()
    blind = Proposals(ids=tree.proposals.ids, probs=full, sampled=tree.proposals.sampled)
    children = [c for c in range(tree.size) if tree.parents[c] == 0]
    p = node_probs(0)
    residual = p.clone()
    for child in children:
        token = int(tree.tokens[child])
        q = blind.probs[0] / blind.probs[0].sum()
        mass = residual.sum()
        if torch.rand((), generator=generator) * q[token] * mass < residual[token]:
            return torch.tensor([0, child]), draw(node_probs(child), generator)
        residual = (residual / mass - q).clamp(min=0)
    return torch.tensor([0]), draw(residual if residual.sum() > 0 else p, generator)


def test_negative_control_detects_siblings_judged_with_replacement():
    samples = 20000
    counts, laws, _ = two_step_counts(replacement_blind_rule, samples, 3)
    expected = {x: float(laws["p_root"][x]) for x in range(VOCAB)}
    assert chi_square_pvalue(first_token_law(counts), expected, samples) < ALPHA


def test_a_sampled_chain_accepts_the_overlap_of_p_and_q():
    """One drawn child is accepted with probability sum_x min(p(x), q(x)) (within 4 standard errors),
    more than the target gives the draft's most likely token, which is what a top-1 draft gets."""
    samples = 20000
    _, laws, accepted = two_step_counts(verify_sampling, samples, 1)
    p, q = laws["p_root"], laws["q_root"]
    overlap = float(torch.minimum(p, q).sum())
    assert abs(accepted / samples - overlap) < 4 * math.sqrt(overlap * (1 - overlap) / samples)
    assert overlap > float(p[q.argmax()])


def test_the_spine_grows_from_the_first_drawn_child():
    g = torch.Generator().manual_seed(3)
    ids = torch.tensor([10, 11, 12, 13])
    logp = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    expanded = []

    def expand(level, token):
        expanded.append((level, token))
        return logp, ids + 10 * level

    tree = grow_sampled_tree(7, logp, ids, depth=3, topk=2, total_tokens=5,
                             sampling=DraftSampling(SamplingParams(temperature=1.0), g), expand=expand)
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 3]  # 2 under the root, 2 under its first, 1 (the budget)
    assert [token for _, token in expanded] == [int(tree.tokens[1]), int(tree.tokens[3])]
    assert tree.proposals.sampled.tolist() == [False] + [True] * 5
    assert tree.proposals.ids[1].tolist() == [20, 21, 22, 23] and tree.proposals.probs[2].sum() == 0
    assert len(set(tree.tokens[1:3].tolist())) == 2


def test_the_eagle_drafter_draws_only_when_sampling_and_verification_sees_its_q():
    from eagle_lab.drafters.eagle.drafter import EagleDrafter
    from eagle_lab.drafters.eagle.kinds import new_head
    from eagle_lab.drafters.growth import TreeShape

    target = small_vocab_target()
    prompt = torch.tensor([1, 4, 2, 0])
    features = target.forward(prompt[None]).features[0]  # [T, H]
    drafter = EagleDrafter(new_head(target, seed=4), target, TreeShape(depth=3, topk=2, total_tokens=5))
    sampling = DraftSampling(SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    tree = drafter.draft(prompt, features, max_depth=8, sampling=sampling)
    assert tree.proposals is not None and tree.parents.tolist() == [-1, 0, 0, 1, 1, 3]
    assert torch.allclose(tree.proposals.probs[[0, 1, 3]].sum(-1), torch.ones(3))
    drafter.reset()
    assert drafter.draft(prompt, features, max_depth=8).proposals is None  # greedy: top-k point masses
    drafter.reset()
    off = EagleDrafter(drafter.head, target, TreeShape(depth=3, topk=2, total_tokens=5), sampled_drafts=False)
    assert off.draft(prompt, features, max_depth=8, sampling=sampling).proposals is None


@pytest.mark.slow
def test_sampled_spine_keeps_the_distribution_through_the_loop():
    """The whole loop with drafts drawn from a random head at T = 0.8 and top-p: 3,000 3-token samples."""
    from eagle_lab.drafters.eagle.drafter import EagleDrafter
    from eagle_lab.drafters.eagle.kinds import new_head
    from eagle_lab.drafters.growth import TreeShape

    target = small_vocab_target()
    params = SamplingParams(temperature=0.8, top_p=0.9)
    prompt = torch.tensor([1, 4, 2, 0])
    length, samples = 3, 3000
    drafter = EagleDrafter(new_head(target, seed=4), target, TreeShape(depth=2, topk=3, total_tokens=5))
    g = torch.Generator().manual_seed(21)
    counts, accepted = {}, 0
    for _ in range(samples):
        result = generate(speculative_decode(target, drafter, prompt, params, Stopper(target.tokenizer, length, set()),
                                             g))
        counts[tuple(result.token_ids)] = counts.get(tuple(result.token_ids), 0) + 1
        accepted += result.stats.accepted_draft_tokens > 0
    assert 0.1 * samples < accepted < samples
    assert chi_square_pvalue(counts, exact_sequence_probs(target, prompt, params, length), samples) > ALPHA


def test_the_draft_model_and_medusa_draw_spines_when_sampling():
    from eagle_lab.drafters.draft_model.drafter import DraftModelDrafter
    from eagle_lab.drafters.growth import TreeShape
    from eagle_lab.drafters.medusa.drafter import MedusaDrafter
    from tests.test_medusa import random_heads

    target = small_vocab_target()
    prompt = torch.tensor([1, 4, 2, 0])
    features = target.forward(prompt[None]).features[0]  # [T, H]
    sampling = DraftSampling(SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    drafters = [DraftModelDrafter(small_vocab_target(seed=9), TreeShape(3, 2, 5), target.vocab_size),
                MedusaDrafter(random_heads(target, num_heads=3, seed=3), target, TreeShape(3, 2, 5))]
    for drafter in drafters:
        drafter.reset()
        tree = drafter.draft(prompt, features, max_depth=8, sampling=sampling)
        assert tree.proposals is not None and tree.parents.tolist() == [-1, 0, 0, 1, 1, 3]
        assert torch.allclose(tree.proposals.probs[[0, 1, 3]].sum(-1), torch.ones(3))
        drafter.reset()
        assert drafter.draft(prompt, features, max_depth=8).proposals is None
