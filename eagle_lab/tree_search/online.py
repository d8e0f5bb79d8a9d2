"""The online chain controller (`tree=online`): each round drafts the chain length expected to give the most
tokens per millisecond, from this machine's round costs and this reply's acceptance so far.

Acceptance climbs along a reply (a head drafts a reply's opening worst), so no single length is best for a
whole reply. The controller keeps, per chain length L (0 = no draft, then 1 .. max_depth):
  - its round's cost in ms: a cost curve timed once per machine (`measure_round_costs`: rounds of every
    length taken in turn within one decode, so the machine's drift falls on all of them alike; medians),
    greedy and sampling (drawn drafts and rejection sampling cost more), cached under a fingerprint of what
    it depends on (target, head, backend, the round's code: costs.timing_fingerprint), so it is timed again
    when any of them changes;
  - the acceptance at each draft depth d, P(depth d accepted | depth d - 1 accepted), from decayed counts of
    this request's rounds (an observation counts half after `half_life` more rounds, so it follows the
    reply). Its prior, worth `PRIOR_WEIGHT` rounds, is what the drafter's earlier requests at the same
    temperature accepted (slowly aging counts), else the head card's held-out accuracy.
It picks argmax_L (1 + sum_{j <= L} prod_{i <= j} a_i) / cost_L. Every round ages the evidence at every depth,
drafted or not, so after a stretch without drafts the acceptance returns towards the prior and drafting is
tried again where it would pay again.

With hybrid drafting the n-gram chain a round proposes is priced the same way: its acceptance by position
(this request's, starting from what earlier requests at its temperature saw, else NGRAM_PRIOR), its cost the
target's forward over the extra tokens (a forward curve timed with the cost curve). The round takes the chain
length L and the chain's first m tokens with the most expected tokens per ms, a round's tokens being one plus the
longer of the head's and the chain's accepted prefixes (the two taken as independent).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle_lab.decoding.generate import Stopper, speculative_decode
from eagle_lab.decoding.sampling import SamplingParams
from eagle_lab.tree_search.costs import forward_ms, measure_target_costs

log = logging.getLogger(__name__)

DEFAULT_PRIOR = 0.6  # acceptance at every depth before any request at a temperature was drafted
PRIOR_WEIGHT = 4.0  # rounds' worth of evidence the prior counts for
LONG_RUN_DECAY = 0.5 ** (1 / 512)  # the shared acceptance: an observation counts half after 512 more
LONG_RUN_MIN = 8.0  # observations at a depth before the shared acceptance there is used as a prior
TIMED_ROUNDS = 24  # timed rounds per chain length in the cost curve
TURN_ROUNDS = 16  # rounds of one length in a row while the cost curve is timed (the first is not timed)
FORWARD_CONTEXT = 256  # cached positions the forward curve (n-gram chains' cost) is timed after
SAMPLED_TEMPERATURE = 1.0  # the cost curve of sampled rounds (drawn drafts, rejection sampling) is timed at it
NGRAM_PRIOR = 0.5  # an n-gram chain's acceptance at each position before this request showed its own
NGRAM_POSITIONS = 16  # chain positions whose acceptance is kept (longer chains reuse the last)


@dataclass
class ChainMemory:
    """What the requests of one drafter share: ms per round by chain length (the cost curve), and the acceptance by
    depth at each temperature over all of them."""

    ms: dict[int, float] = field(default_factory=dict)  # chain length -> ms per round
    forward_ms: dict[int, float] = field(default_factory=dict)  # K scored tokens -> ms (n-gram chains' cost)
    sampled_ms: dict[int, float] = field(default_factory=dict)  # chain length -> ms per round sampling (T > 0)
    accepted: dict[float, list[float]] = field(default_factory=dict)  # temperature -> aging counts by depth
    reached: dict[float, list[float]] = field(default_factory=dict)
    chain_accepted: dict[float, list[float]] = field(default_factory=dict)  # the same by n-gram chain position
    chain_reached: dict[float, list[float]] = field(default_factory=dict)
    _forward_at: dict[int, float] = field(default_factory=dict, repr=False)  # forward_ms interpolated, by K

    def forward(self, k: int) -> float:
        """ms of the target's forward over k scored tokens (interpolated on the forward curve once per k)."""
        if k not in self._forward_at:
            self._forward_at[k] = forward_ms(self.forward_ms, k)
        return self._forward_at[k]

    def _counts(self, chain: bool) -> tuple[dict[float, list[float]], dict[float, list[float]]]:
        return (self.chain_accepted, self.chain_reached) if chain else (self.accepted, self.reached)

    def remember(self, temperature: float, depth: int, hit: bool, chain: bool = False) -> None:
        """A round at `temperature` reached `depth` (0-based) of the head's chain (chain: of the n-gram chain) and
        accepted it or not."""
        accepted, reached = self._counts(chain)
        accepted, reached = accepted.setdefault(temperature, []), reached.setdefault(temperature, [])
        while len(reached) <= depth:
            accepted.append(0.0)
            reached.append(0.0)
        accepted[depth] = accepted[depth] * LONG_RUN_DECAY + float(hit)
        reached[depth] = reached[depth] * LONG_RUN_DECAY + 1.0

    def prior(self, temperature: float, depths: int, default: list[float], chain: bool = False) -> list[float]:
        """The acceptance by depth (chain: by n-gram chain position) earlier requests at `temperature` saw, where
        they saw enough (else default)."""
        accepted, reached = self._counts(chain)
        accepted, reached = accepted.get(temperature, []), reached.get(temperature, [])
        return [accepted[d] / reached[d] if d < len(reached) and reached[d] >= LONG_RUN_MIN else default[d]
                for d in range(depths)]


def card_prior(heldout_top1: list[float]) -> list[float]:
    """A head card's held-out top-1 by draft position -> acceptance by depth given the depth before
    (position d's accuracy over position d - 1's, at most 0.95)."""
    prior, before = [], 1.0
    for accuracy in heldout_top1:
        prior.append(min(max(accuracy / before, 0.01), 0.95) if before > 0 else DEFAULT_PRIOR)
        before = accuracy
    return prior or [DEFAULT_PRIOR]


class ChainController:
    def __init__(self, max_depth: int, memory: ChainMemory, prior: list[float] | None = None,
                 half_life: float = 32.0):
        """memory: shared with the controller's forks, its `ms` the cost curve of lengths 0 .. max_depth;
        prior: acceptance by depth 1, 2, ... (shorter lists repeat their last value)."""
        if max_depth < 1:
            raise ValueError("an online chain needs max_depth >= 1")
        missing = [length for length in range(max_depth + 1) if memory.ms.get(length, 0) <= 0]
        if missing:
            raise ValueError(f"the cost curve has no time for chain lengths {missing}")
        self.max_depth, self.memory = max_depth, memory
        prior = list(prior or [DEFAULT_PRIOR])
        self.default = [prior[min(d, len(prior) - 1)] for d in range(max_depth)]
        self.decay = 0.5 ** (1.0 / half_life)
        self.reset()

    def fork(self) -> ChainController:
        """A controller for another sequence: the costs and long-run acceptance shared, its own acceptance."""
        fork = ChainController(self.max_depth, self.memory, self.default)
        fork.decay = self.decay
        return fork

    def reset(self) -> None:
        """A new request: acceptance goes back to the prior; costs are kept."""
        self.accepted = [0.0] * self.max_depth  # decayed count of rounds that accepted depth d + 1
        self.reached = [0.0] * self.max_depth  # decayed count of rounds that drafted depth d + 1 and reached it
        self.chain_accepted = [0.0] * NGRAM_POSITIONS  # the same for the n-gram chain's positions
        self.chain_reached = [0.0] * NGRAM_POSITIONS
        self.temperature: float | None = None  # set by the request's first choose()
        self.prior = self.default
        self.chain_prior = [NGRAM_PRIOR] * NGRAM_POSITIONS

    def acceptance(self) -> list[float]:
        """P(depth d accepted | depth d - 1 accepted), d = 1 .. max_depth."""
        return [(self.accepted[d] + PRIOR_WEIGHT * self.prior[d]) / (self.reached[d] + PRIOR_WEIGHT)
                for d in range(self.max_depth)]

    def chain_acceptance(self) -> list[float]:
        """P(n-gram position i accepted | position i - 1 accepted), i = 1 .. NGRAM_POSITIONS."""
        return [(self.chain_accepted[i] + PRIOR_WEIGHT * self.chain_prior[i]) / (self.chain_reached[i] + PRIOR_WEIGHT)
                for i in range(NGRAM_POSITIONS)]

    def expected_tokens(self, chain: int = 0) -> list[float]:
        """Tokens a round of each length emits on average (the bonus token included), with the first `chain`
        tokens of an n-gram chain merged in."""
        return self._expected_tokens(_survival(self.acceptance()), self._chain_survival(chain), chain)

    def _chain_survival(self, chain: int) -> list[float]:
        """[chain] P(the n-gram chain's first i + 1 tokens accepted)."""
        by_position = self.chain_acceptance()
        return _survival([by_position[min(i, NGRAM_POSITIONS - 1)] for i in range(chain)])

    def _expected_tokens(self, head: list[float], copied: list[float], chain: int) -> list[float]:
        """expected_tokens from the head's survival [max_depth] and the chain's [>= chain]."""
        out = []
        for length in range(self.max_depth + 1):
            # P(a round's k-th token is accepted) = 1 - P(neither the head's nor the chain's prefix reaches it)
            missed = [(1.0 - (head[k] if k < length else 0.0)) * (1.0 - (copied[k] if k < chain else 0.0))
                      for k in range(max(length, chain))]
            out.append(1.0 + sum(1.0 - m for m in missed))
        return out

    def round_ms(self, length: int, chain: int) -> float:
        """A round's cost: the curve's for `length`, plus the target's forward over `chain` more tokens."""
        rounds = self.memory.sampled_ms if self.temperature and self.memory.sampled_ms else self.memory.ms
        if chain == 0:
            return rounds[length]
        return rounds[length] + self.memory.forward(1 + length + chain) - self.memory.forward(1 + length)

    def choose(self, temperature: float = 0.0, proposed: int = 0) -> tuple[int, int]:
        """(chain length, n-gram tokens to merge of the `proposed` ones) for the next round of a request
        sampling at `temperature` (0: greedy)."""
        if self.temperature is None:  # the request's first round: start from what earlier ones accepted
            self.temperature = temperature
            self.prior = [min(max(a, 0.01), 0.99)
                          for a in self.memory.prior(temperature, self.max_depth, self.default)]
            self.chain_prior = [min(max(a, 0.01), 0.99) for a in self.memory.prior(
                temperature, NGRAM_POSITIONS, [NGRAM_PRIOR] * NGRAM_POSITIONS, chain=True)]
        chains = proposed if self.memory.forward_ms else 0
        head, copied = _survival(self.acceptance()), self._chain_survival(chains)  # computed once a round
        tokens = [self._expected_tokens(head, copied, chain) for chain in range(chains + 1)]  # [chain][length]
        best, best_rate = (0, 0), -1.0
        for length in range(self.max_depth + 1):  # ties: the shorter chain, then the fewer n-gram tokens
            for chain in range(chains + 1):
                rate = tokens[chain][length] / self.round_ms(length, chain)
                if rate > best_rate:
                    best, best_rate = (length, chain), rate
        return best

    def observe(self, length: int, accepted: int, ms: float | None = None, chain: int = 0,
                chain_accepted: int = 0) -> None:
        """A round that drafted a chain of `length` and accepted the first `accepted` of it, and merged `chain`
        n-gram tokens of which the first `chain_accepted` were accepted (ms: its time, unused: the costs are
        the curve's)."""
        for counts in (self.reached, self.accepted, self.chain_reached, self.chain_accepted):
            for i in range(len(counts)):  # every round ages all evidence
                counts[i] *= self.decay
        for depth in range(min(accepted + 1, length)):  # depths 1 .. accepted + 1 were reached
            self.reached[depth] += 1.0
            self.accepted[depth] += 1.0 if depth < accepted else 0.0
            self.memory.remember(self.temperature or 0.0, depth, depth < accepted)
        for position in range(min(chain_accepted + 1, chain, NGRAM_POSITIONS)):
            self.chain_reached[position] += 1.0
            self.chain_accepted[position] += 1.0 if position < chain_accepted else 0.0
            self.memory.remember(self.temperature or 0.0, position, position < chain_accepted, chain=True)


def _survival(acceptance: list[float]) -> list[float]:
    """P(depth d accepted | d - 1 accepted) -> P(the first d + 1 accepted), d = 0 ..."""
    out, alive = [], 1.0
    for a in acceptance:
        alive *= a
        out.append(alive)
    return out


class TakeTurns:
    """The cost curve's controller: chain lengths 0 .. max_depth in turn, TURN_ROUNDS rounds each, each round's
    time kept by length. The first round of a turn is not kept: it switches the target's compiled step (and
    after rounds without drafts feeds the head what they left), which a run of one length pays once."""

    def __init__(self, max_depth: int):
        self.order = [length for length in range(max_depth + 1) for _ in range(TURN_ROUNDS)]
        self.times: dict[int, list[float]] = {length: [] for length in range(max_depth + 1)}
        self.turn = 0
        self.previous: int | None = None  # the length of the round observed last

    def choose(self, temperature: float = 0.0, proposed: int = 0) -> tuple[int, int]:
        self.turn += 1
        return self.order[(self.turn - 1) % len(self.order)], 0  # the head's chains alone

    def observe(self, length: int, accepted: int, ms: float | None, chain: int = 0, chain_accepted: int = 0) -> None:
        if ms is not None and length == self.previous:
            self.times[length].append(ms)
        self.previous = length

    def reset(self) -> None:
        pass

    def fork(self) -> TakeTurns:
        return self

    def done(self) -> bool:
        return min(len(times) for times in self.times.values()) >= TIMED_ROUNDS


def measure_round_costs(target, drafter, prompts: list[list[int]], max_depth: int, backend=None,
                        new_tokens: int = 256, temperature: float = 0.0) -> dict[int, float]:
    """Median ms per round of each chain length 0 .. max_depth, sampling at `temperature` (0: greedy), the lengths
    taken in turn within each decode of `prompts` until every length has TIMED_ROUNDS timed rounds (or the
    prompts run out)."""
    params = SamplingParams(temperature=temperature)
    generator = None if params.greedy else torch.Generator(device=target.device).manual_seed(0)
    turns, kept = TakeTurns(max_depth), drafter.controller
    drafter.control(turns)
    try:
        for ids in prompts:
            drafter.reset()
            decoder = speculative_decode(target, drafter, torch.tensor(ids, device=target.device), params,
                                         Stopper(target.tokenizer, new_tokens, set()), generator, backend)
            for _ in decoder:
                if turns.done():
                    break
            if turns.done():
                break
    finally:
        drafter.control(kept)
    return {length: statistics.median(times) for length, times in turns.times.items() if times}


def cost_curve(target, drafter, prompts: list[list[int]], max_depth: int, path: Path, backend=None) -> ChainMemory:
    """The cost curve from `path`, else measured (seconds) and written there: ms per round by chain length and,
    for a hybrid drafter, ms of the target's forward by scored tokens (what an n-gram chain adds)."""
    if path.is_file():
        try:
            cached = json.loads(path.read_text())
            memory = ChainMemory({int(k): float(v) for k, v in cached["rounds"].items()},
                                 {int(k): float(v) for k, v in cached["forward"].items()},
                                 {int(k): float(v) for k, v in cached["sampled_rounds"].items()})
            if all(min(memory.ms.get(length, 0), memory.sampled_ms.get(length, 0)) > 0
                   for length in range(max_depth + 1)):
                return memory
        except (OSError, ValueError, KeyError) as exc:
            log.warning("tree=online: the cost curve %s is unreadable (%s); timing it again", path, exc)
    start = time.perf_counter()
    rounds = measure_round_costs(target, drafter, prompts, max_depth, backend)
    sampled = measure_round_costs(target, drafter, prompts, max_depth, backend, temperature=SAMPLED_TEMPERATURE)
    if any(min(rounds.get(length, 0), sampled.get(length, 0)) <= 0 for length in range(max_depth + 1)):
        raise ValueError(f"tree=online: the calibration prompts gave no timed round for some chain lengths: "
                         f"{rounds}, sampling {sampled}")
    widest = 1 + max_depth + drafter.ngram.max_tokens if drafter.ngram is not None else 0
    forward = {} if widest == 0 else measure_target_costs(
        target, FORWARD_CONTEXT, sorted(k for k in {1, 2, 3, 4, 6, 8, 12, 16, widest} if k <= widest), backend)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rounds": rounds, "forward": forward, "sampled_rounds": sampled}))
    log.info("tree=online: round cost by chain length %s ms (sampling: %s)%s, timed in %.1f s (%s)",
             " / ".join(f"{rounds[length]:.2f}" for length in sorted(rounds)),
             " / ".join(f"{sampled[length]:.2f}" for length in sorted(sampled)),
             f", the target's forward over 1 / {max(forward)} tokens {forward[1]:.2f} / {forward[max(forward)]:.2f} ms"
             if forward else "", time.perf_counter() - start, path)
    return ChainMemory(rounds, forward, sampled)
