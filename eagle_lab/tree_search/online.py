"""The online chain controller (`tree=online`): each round drafts the chain length expected to give the most
tokens per millisecond, from this machine's round costs and this reply's acceptance so far.

Acceptance climbs along a reply (a head drafts a reply's opening worst), so no single length is best for a
whole reply. The controller keeps, per chain length L (0 = no draft, then 1 .. max_depth):
  - its round's cost in ms: a cost curve timed once per machine (`measure_round_costs`: rounds of every
    length taken in turn within one decode, so the machine's drift falls on all of them alike; medians),
    cached beside tree=auto's calibration under the same fingerprint (target, head, backend, graphs' code),
    so it is timed again when any of them changes;
  - the acceptance at each draft depth d, P(depth d accepted | depth d - 1 accepted), from decayed counts of
    this request's rounds (an observation counts half after `half_life` more rounds, so it follows the
    reply). Its prior, worth `PRIOR_WEIGHT` rounds, is what the drafter's earlier requests at the same
    temperature accepted (slowly aging counts), else the head card's held-out accuracy.
It picks argmax_L (1 + sum_{j <= L} prod_{i <= j} a_i) / cost_L. Every round ages the evidence at every depth,
drafted or not, so after a stretch without drafts the acceptance returns towards the prior and drafting is
tried again where it would pay again.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ONLINE_DEPTH = 3  # the longest chain when tree.depth is not set: 4 tokens, the largest small bucket
DEFAULT_PRIOR = 0.6  # acceptance at every depth before any request at a temperature was drafted
PRIOR_WEIGHT = 4.0  # rounds' worth of evidence the prior counts for
LONG_RUN_DECAY = 0.5 ** (1 / 512)  # the shared acceptance: an observation counts half after 512 more
LONG_RUN_MIN = 8.0  # observations at a depth before the shared acceptance there is used as a prior
TIMED_ROUNDS = 24  # timed rounds per chain length in the cost curve


@dataclass
class ChainMemory:
    """What the requests of one drafter share: ms per round by chain length (the cost curve), and the acceptance by
    depth at each temperature over all of them."""

    ms: dict[int, float] = field(default_factory=dict)  # chain length -> ms per round
    accepted: dict[float, list[float]] = field(default_factory=dict)  # temperature -> aging counts by depth
    reached: dict[float, list[float]] = field(default_factory=dict)

    def remember(self, temperature: float, depth: int, hit: bool) -> None:
        """A round at `temperature` reached `depth` (0-based) and accepted it or not."""
        accepted, reached = self.accepted.setdefault(temperature, []), self.reached.setdefault(temperature, [])
        while len(reached) <= depth:
            accepted.append(0.0)
            reached.append(0.0)
        accepted[depth] = accepted[depth] * LONG_RUN_DECAY + float(hit)
        reached[depth] = reached[depth] * LONG_RUN_DECAY + 1.0

    def prior(self, temperature: float, depths: int, default: list[float]) -> list[float]:
        """The acceptance by depth earlier requests at `temperature` saw, where they saw enough (else default)."""
        accepted, reached = self.accepted.get(temperature, []), self.reached.get(temperature, [])
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
        self.temperature: float | None = None  # set by the request's first choose()
        self.prior = self.default

    def acceptance(self) -> list[float]:
        """P(depth d accepted | depth d - 1 accepted), d = 1 .. max_depth."""
        return [(self.accepted[d] + PRIOR_WEIGHT * self.prior[d]) / (self.reached[d] + PRIOR_WEIGHT)
                for d in range(self.max_depth)]

    def expected_tokens(self) -> list[float]:
        """Tokens a round of each length emits on average (the bonus token included)."""
        out, alive, total = [1.0], 1.0, 1.0
        for a in self.acceptance():
            alive *= a
            total += alive
            out.append(total)
        return out

    def rates(self) -> dict[int, float]:
        """Expected tokens per ms of every length."""
        tokens = self.expected_tokens()
        return {length: tokens[length] / self.memory.ms[length] for length in range(self.max_depth + 1)}

    def choose(self, temperature: float = 0.0) -> int:
        """The chain length of the next round of a request sampling at `temperature` (0: greedy)."""
        if self.temperature is None:  # the request's first round: start from what earlier ones accepted
            self.temperature = temperature
            self.prior = [min(max(a, 0.01), 0.99)
                          for a in self.memory.prior(temperature, self.max_depth, self.default)]
        rates = self.rates()
        return max(rates, key=lambda length: (rates[length], -length))

    def observe(self, length: int, accepted: int, ms: float | None = None) -> None:
        """A round that drafted a chain of `length` and accepted `accepted` of it (ms: its time, unused: the
        costs are the curve's)."""
        for depth in range(self.max_depth):  # every round ages every depth's evidence
            self.reached[depth] *= self.decay
            self.accepted[depth] *= self.decay
        for depth in range(min(accepted + 1, length)):  # depths 1 .. accepted + 1 were reached
            self.reached[depth] += 1.0
            self.accepted[depth] += 1.0 if depth < accepted else 0.0
            self.memory.remember(self.temperature or 0.0, depth, depth < accepted)


class TakeTurns:
    """The cost curve's controller: chain lengths 0 .. max_depth in turn, each round's time kept by length. A
    round that drafts after one that did not also feeds the head what that one left (untimed), so each turn
    drafts nothing twice, then every length twice."""

    def __init__(self, max_depth: int):
        self.order = [0, 0] + list(range(1, max_depth + 1)) * 2
        self.times: dict[int, list[float]] = {length: [] for length in range(max_depth + 1)}
        self.turn = 0

    def choose(self, temperature: float = 0.0) -> int:
        self.turn += 1
        return self.order[(self.turn - 1) % len(self.order)]

    def observe(self, length: int, accepted: int, ms: float | None) -> None:
        if ms is not None:
            self.times[length].append(ms)

    def reset(self) -> None:
        pass

    def fork(self) -> TakeTurns:
        return self

    def done(self) -> bool:
        return min(len(times) for times in self.times.values()) >= TIMED_ROUNDS


def measure_round_costs(target, drafter, prompts: list[list[int]], max_depth: int, backend=None,
                        new_tokens: int = 256) -> dict[int, float]:
    """Median ms per greedy round of each chain length 0 .. max_depth, the lengths taken in turn within each
    decode of `prompts` until every length has TIMED_ROUNDS timed rounds (or the prompts run out)."""
    from eagle_lab.decoding.generate import Stopper, speculative_decode
    from eagle_lab.decoding.sampling import SamplingParams

    turns, kept = TakeTurns(max_depth), drafter.controller
    drafter.control(turns)
    try:
        for ids in prompts:
            drafter.reset()
            decoder = speculative_decode(target, drafter, torch.tensor(ids, device=target.device), SamplingParams(),
                                         Stopper(target.tokenizer, new_tokens, set()), backend=backend)
            for _ in decoder:
                if turns.done():
                    break
            if turns.done():
                break
    finally:
        drafter.control(kept)
    return {length: statistics.median(times) for length, times in turns.times.items() if times}


def round_costs(target, drafter, prompts: list[list[int]], max_depth: int, path: Path,
                backend=None) -> dict[int, float]:
    """The cost curve from `path`, else measured (seconds) and written there."""
    if path.is_file():
        try:
            cached = {int(length): float(ms) for length, ms in json.loads(path.read_text()).items()}
            if all(cached.get(length, 0) > 0 for length in range(max_depth + 1)):
                return cached
        except (OSError, ValueError) as exc:
            log.warning("tree=online: the cost curve %s is unreadable (%s); timing it again", path, exc)
    start = time.perf_counter()
    costs = measure_round_costs(target, drafter, prompts, max_depth, backend)
    if any(costs.get(length, 0) <= 0 for length in range(max_depth + 1)):
        raise ValueError(f"tree=online: the calibration prompts gave no timed round for some chain lengths: {costs}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(costs))
    log.info("tree=online: round cost by chain length %s ms, timed in %.1f s (%s)",
             " / ".join(f"{costs[length]:.2f}" for length in sorted(costs)), time.perf_counter() - start, path)
    return costs
