"""Sampling is lossless: speculative samples follow the target's own distribution.

Each test compares empirical counts with exact probabilities by a chi-square test at
alpha = 1e-3 (a correct implementation fails one run in a thousand per test; seeds are
fixed, so a run is reproducible). The negative control shows the same test rejects a
subtly wrong acceptance rule.
"""

import pytest
import torch
from scipy.stats import chisquare

from eagle_lab.decoding.generate import Stopper, generate, speculative_decode
from eagle_lab.decoding.sampling import SamplingParams, draw, greedy_token, target_probs
from eagle_lab.decoding.tree import build_tree
from eagle_lab.decoding.verify import verify_sampling
from eagle_lab.drafters.ngram import NgramDrafter, NgramProposer, merge_chain
from eagle_lab.errors import EagleLabError
from tests.conftest import NoisyDrafter, small_vocab_target

ALPHA = 1e-3


def chi_square_pvalue(observed: dict, expected_prob: dict, samples: int) -> float:
    """Pool bins with expected count < 5; a sample in a zero-probability bin gives p = 0."""
    if any(count and expected_prob.get(key, 0.0) <= 0 for key, count in observed.items()):
        return 0.0
    obs, exp, pool_obs, pool_exp = [], [], 0, 0.0
    for key, prob in expected_prob.items():
        if prob <= 0:
            continue
        if prob * samples < 5:
            pool_obs += observed.get(key, 0)
            pool_exp += prob * samples
        else:
            obs.append(observed.get(key, 0))
            exp.append(prob * samples)
    if pool_exp > 0:
        obs.append(pool_obs)
        exp.append(pool_exp)
    scale = sum(obs) / sum(exp)
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


# ---- the draw itself: one index from unnormalised weights ----------------------------------

def draw_counts(weights: torch.Tensor, samples: int, seed: int, sampler=draw) -> dict:
    g = torch.Generator().manual_seed(seed)
    counts: dict = {}
    for _ in range(samples):
        index = sampler(weights, g)
        counts[index] = counts.get(index, 0) + 1
    return counts


def test_draw_follows_the_weights_and_never_draws_a_zero():
    # unnormalised, zeros inside and at both ends, one tiny weight (a residual after rejections)
    weights = torch.tensor([0.0, 0.3, 0.0, 1.2, 1e-3, 0.5, 0.0, 2.0, 0.0])
    samples = 20000
    counts = draw_counts(weights, samples, seed=3)
    expected = {i: float(w / weights.sum()) for i, w in enumerate(weights)}
    assert all(weights[i] > 0 for i in counts)
    assert chi_square_pvalue(counts, expected, samples) > ALPHA


def test_draw_negative_control_detects_a_shifted_cdf():
    """The same test rejects an inverse CDF that is off by one index (each index drawn with its
    left neighbour's weight)."""
    weights = torch.tensor([0.3, 1.2, 0.5, 2.0])
    samples = 20000

    def shifted(w, g):
        cdf = w.double().cumsum(0)
        u = torch.rand((), generator=g, dtype=torch.float64)
        return min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)) + 1, w.numel() - 1)

    counts = draw_counts(weights, samples, seed=3, sampler=shifted)
    expected = {i: float(w / weights.sum()) for i, w in enumerate(weights)}
    assert chi_square_pvalue(counts, expected, samples) < ALPHA


def test_greedy_token_is_argmax_ties_included():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(49152, generator=g)
        assert greedy_token(logits) == int(logits.argmax())
    tied = torch.zeros(1000)
    tied[[17, 400, 999]] = 3.0  # several maxima: the first, as argmax
    assert greedy_token(tied) == int(tied.argmax()) == 17
    assert greedy_token(tied[400:]) == 0


def test_draw_refuses_an_empty_distribution():
    with pytest.raises(EagleLabError, match="no mass"):
        draw(torch.zeros(5), None)


# ---- verification rule alone: exact p per node, many draws --------------------------------

def fixed_tree_case(vocab=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    # root -> children tokens 1, 3 ; node1 -> 0, 2 ; node2 -> 4, 1
    tree = build_tree(torch.tensor([5, 1, 3, 0, 2, 4, 1]), torch.tensor([-1, 0, 0, 1, 1, 2, 2]))
    probs = torch.distributions.Dirichlet(torch.full((vocab,), 0.8)).sample((tree.size,))  # [N, V]
    del g
    return tree, probs


def exact_two_step(tree, probs):
    """P(first emitted, second emitted within the round or None)."""
    expected = {}
    root_children = {int(tree.tokens[c]): c for c in range(1, tree.size) if tree.parents[c] == 0}
    for first in range(probs.shape[1]):
        p_first = float(probs[0, first])
        if first in root_children:
            node = root_children[first]
            for second in range(probs.shape[1]):
                expected[(first, second)] = p_first * float(probs[node, second])
        else:
            expected[(first, None)] = p_first
    return expected


def sample_two_step(rule, tree, probs, samples, seed):
    g = torch.Generator().manual_seed(seed)
    counts = {}
    for _ in range(samples):
        accepted, bonus = rule(tree, lambda node: probs[node], g)
        emitted = tree.tokens[accepted[1:]].tolist() + [bonus]
        key = (emitted[0], emitted[1]) if accepted.numel() > 1 else (emitted[0], None)
        counts[key] = counts.get(key, 0) + 1
    return counts


def test_verify_rule_keeps_distribution():
    torch.manual_seed(0)
    tree, probs = fixed_tree_case()
    samples = 20000
    counts = sample_two_step(verify_sampling, tree, probs, samples, seed=1)
    assert chi_square_pvalue(counts, exact_two_step(tree, probs), samples) > ALPHA


def broken_rule(tree, node_probs, generator):
    """Wrong on purpose: a rejected sibling is not removed from the final draw."""
    probs = torch.stack([node_probs(i) for i in range(tree.size)])
    node, path = 0, [0]
    while True:
        children = [c for c in range(tree.size) if tree.parents[c] == node]
        for child in children:
            if torch.rand((), generator=generator) < probs[node, tree.tokens[child]]:
                node = child
                path.append(child)
                break
        else:
            return torch.tensor(path), int(torch.multinomial(probs[node], 1, generator=generator))


def test_negative_control_detects_a_wrong_rule():
    torch.manual_seed(0)
    tree, probs = fixed_tree_case()
    samples = 20000
    counts = sample_two_step(broken_rule, tree, probs, samples, seed=1)
    assert chi_square_pvalue(counts, exact_two_step(tree, probs), samples) < ALPHA


# ---- whole loop on a small-vocabulary target ----------------------------------------------

def exact_sequence_probs(target, prompt, params, length):
    vocab = target.vocab_size
    prefix_probs = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for prefix, prob in prefix_probs.items():
            context = torch.cat([prompt, torch.tensor(prefix, dtype=torch.long)])
            logits = target.logits(target.forward(context[None]).features[0, -1])
            p = target_probs(logits, params)
            for token in range(vocab):
                if p[token] > 0:
                    nxt[prefix + (token,)] = prob * float(p[token])
        prefix_probs = nxt
    return prefix_probs


def sampled_sequences(target, drafter, prompt, params, length: int, samples: int, seed: int, backend=None):
    """Sample `samples` continuations of `length` tokens; -> (counts per sequence, runs that accepted a draft)."""
    g = torch.Generator().manual_seed(seed)
    counts, accepted_any = {}, 0
    for _ in range(samples):
        result = generate(speculative_decode(target, drafter, prompt, params, Stopper(target.tokenizer, length, set()),
                                             g, backend=backend))
        key = tuple(result.token_ids)
        counts[key] = counts.get(key, 0) + 1
        accepted_any += result.stats.accepted_draft_tokens > 0
    return counts, accepted_any


def assert_noisy_drafts_keep_distribution(target, params: SamplingParams, backend=None,
                                          prompt: tuple[int, ...] = (1, 4, 2, 0)) -> None:
    """3,000 sampled 3-token continuations drafted by a noisy drafter (useful but imperfect, or the test would
    mean nothing) follow the target's exact sequence probabilities (chi-square)."""
    prompt = torch.tensor(prompt)
    length, samples = 3, 3000
    drafter = NoisyDrafter(target, depth=2, topk=2, noise=1.0, seed=5)
    counts, accepted_any = sampled_sequences(target, drafter, prompt, params, length, samples, seed=11, backend=backend)
    assert 0.2 * samples < accepted_any < samples
    assert chi_square_pvalue(counts, exact_sequence_probs(target, prompt, params, length), samples) > ALPHA


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.8),
], ids=["t1", "t0.7-topk3", "topp0.8"])
@pytest.mark.slow
def test_speculative_sampling_matches_target(params):
    assert_noisy_drafts_keep_distribution(small_vocab_target(), params)


@pytest.mark.slow
def test_eagle_drafter_sampling_matches_target():
    """The real EAGLE drafter (random head: on 5 tokens it is right often enough)."""
    from eagle_lab.drafters.eagle.drafter import EagleDrafter
    from eagle_lab.drafters.eagle.kinds import new_head
    from eagle_lab.drafters.growth import TreeShape

    target = small_vocab_target()
    params = SamplingParams(temperature=0.9)
    prompt = torch.tensor([1, 4, 2, 0])
    length, samples = 3, 3000
    drafter = EagleDrafter(new_head(target, seed=4), target, TreeShape(depth=2, topk=2, total_tokens=4))
    g = torch.Generator().manual_seed(12)
    counts, accepted_any = {}, 0
    for _ in range(samples):
        stopper = Stopper(target.tokenizer, length, set())
        result = generate(speculative_decode(target, drafter, prompt, params, stopper, g))
        counts[tuple(result.token_ids)] = counts.get(tuple(result.token_ids), 0) + 1
        accepted_any += result.stats.accepted_draft_tokens > 0
    assert 0.1 * samples < accepted_any < samples
    assert chi_square_pvalue(counts, exact_sequence_probs(target, prompt, params, length), samples) > ALPHA


# ---- hybrid drafting: trees with n-gram branches ----------------------------------------------

def ngram_tree_case(vocab=6, seed=0):
    """The fixed tree above (minus one leaf) with two n-gram chains merged in: one under the root
    (4 -> 2), one agreeing with node 1 and then hanging 4 -> 3 under it, after the head's children."""
    g = torch.Generator().manual_seed(seed)
    base = build_tree(torch.tensor([5, 1, 3, 0, 2]), torch.tensor([-1, 0, 0, 1, 1]))
    tree = merge_chain(merge_chain(base, [4, 2]), [1, 4, 3])
    assert tree.tokens.tolist() == [5, 1, 3, 0, 2, 4, 2, 4, 3]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 0, 5, 1, 7]
    probs = torch.distributions.Dirichlet(torch.full((vocab,), 0.8)).sample((tree.size,))  # [N, V]
    del g
    return tree, probs


def exact_round(tree, probs):
    """P(tokens emitted in one round): draw x ~ p at the node; descend if a child holds x, else stop."""
    children: dict[int, dict[int, int]] = {}
    for child in range(1, tree.size):
        children.setdefault(int(tree.parents[child]), {})[int(tree.tokens[child])] = child
    expected = {}

    def walk(node, prefix, prob):
        for token in range(probs.shape[1]):
            p = prob * float(probs[node, token])
            if token in children.get(node, {}):
                walk(children[node][token], prefix + (token,), p)
            else:
                expected[prefix + (token,)] = p

    walk(0, (), 1.0)
    return expected


def sample_rounds(rule, tree, probs, samples, seed):
    g = torch.Generator().manual_seed(seed)
    counts = {}
    for _ in range(samples):
        accepted, bonus = rule(tree, lambda node: probs[node], g)
        key = tuple(tree.tokens[accepted[1:]].tolist() + [bonus])
        counts[key] = counts.get(key, 0) + 1
    return counts


def test_verify_rule_keeps_distribution_with_ngram_branches():
    torch.manual_seed(0)
    tree, probs = ngram_tree_case()
    samples = 20000
    counts = sample_rounds(verify_sampling, tree, probs, samples, seed=1)
    through_ngram = sum(c for key, c in counts.items() if key[0] == 4 or key[:2] == (1, 4))
    assert through_ngram > 0.05 * samples  # n-gram nodes were accepted often
    assert chi_square_pvalue(counts, exact_round(tree, probs), samples) > ALPHA


def certain_proposal_rule(tree, node_probs, generator):
    """Wrong on purpose, for n-gram nodes only: a copied token is a point mass q = delta(c), so
    it is accepted with min(1, p(c) / q(c)) = p(c), ignoring the siblings already rejected
    (the residual's mass). Head children follow the right rule."""
    children = [[c for c in range(tree.size) if tree.parents[c] == n] for n in range(tree.size)]
    node, path = 0, [0]
    while True:
        p = node_probs(node)
        residual = p.clone()
        for child in children[node]:
            token = int(tree.tokens[child])
            u = torch.rand((), generator=generator)
            if bool(tree.from_ngram[child]):
                accept = u < p[token]
            else:
                accept = u * residual.sum() < residual[token]
            if accept:
                node = child
                path.append(child)
                break
            residual[token] = 0.0
        else:
            return torch.tensor(path), int(torch.multinomial(residual, 1, generator=generator))


def test_negative_control_detects_a_wrong_rule_for_ngram_nodes():
    torch.manual_seed(0)
    tree, probs = ngram_tree_case()
    samples = 20000
    counts = sample_rounds(certain_proposal_rule, tree, probs, samples, seed=1)
    assert chi_square_pvalue(counts, exact_round(tree, probs), samples) < ALPHA


def ngram_loop_counts(kind: str, samples: int):
    """Whole loop on a prompt that repeats itself: the head's tree with n-gram branches
    (eagle+ngram), or n-gram drafting alone. Returns (sequence counts, n-gram tokens accepted)."""
    from eagle_lab.drafters.eagle.drafter import EagleDrafter
    from eagle_lab.drafters.eagle.kinds import new_head
    from eagle_lab.drafters.growth import TreeShape

    target = small_vocab_target()
    proposer = NgramProposer(min_match=1, max_match=3, max_tokens=3)
    drafter = (EagleDrafter(new_head(target, seed=4), target, TreeShape(depth=2, topk=2, total_tokens=3), proposer)
               if kind == "eagle+ngram" else NgramDrafter(proposer))
    g = torch.Generator().manual_seed(13)
    counts, accepted_ngram = {}, 0
    for _ in range(samples):
        result = generate(speculative_decode(target, drafter, LOOP_PROMPT, LOOP_PARAMS,
                                             Stopper(target.tokenizer, LOOP_LENGTH, set()), g))
        counts[tuple(result.token_ids)] = counts.get(tuple(result.token_ids), 0) + 1
        accepted_ngram += result.stats.accepted_ngram_tokens
    return counts, accepted_ngram


LOOP_PROMPT = torch.tensor([1, 4, 2, 0, 3, 1, 4, 2, 0, 3, 1, 4])
LOOP_PARAMS, LOOP_LENGTH = SamplingParams(temperature=0.9), 3


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle+ngram", "ngram"])
def test_ngram_drafting_sampling_matches_target(kind):
    samples = 3000
    counts, accepted_ngram = ngram_loop_counts(kind, samples)
    assert accepted_ngram > 0.1 * samples  # copied tokens were accepted, not just proposed
    expected = exact_sequence_probs(small_vocab_target(), LOOP_PROMPT, LOOP_PARAMS, LOOP_LENGTH)
    assert chi_square_pvalue(counts, expected, samples) > ALPHA


@pytest.mark.slow
def test_whole_loop_rejects_the_wrong_rule_for_ngram_nodes(monkeypatch):
    """The same loop and test with certain_proposal_rule verifying trees that hold n-gram nodes."""
    import eagle_lab.decoding.sequence

    right = eagle_lab.decoding.sequence.verify

    def verify_wrong_on_ngram(tree, node_logits, params, generator=None):
        if tree.from_ngram is None:
            return right(tree, node_logits, params, generator)
        return certain_proposal_rule(tree, lambda node: target_probs(node_logits(node), params), generator)

    monkeypatch.setattr(eagle_lab.decoding.sequence, "verify", verify_wrong_on_ngram)
    samples = 3000
    counts, _ = ngram_loop_counts("eagle+ngram", samples)
    expected = exact_sequence_probs(small_vocab_target(), LOOP_PROMPT, LOOP_PARAMS, LOOP_LENGTH)
    assert chi_square_pvalue(counts, expected, samples) < ALPHA
