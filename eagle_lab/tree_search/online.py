"""An online chain controller (`tree.online=true`): each round drafts the chain length that is expected to
give the most tokens per millisecond, from what this machine and this reply have shown so far.

Acceptance climbs along a reply (a head drafts the opening of a reply worst) and a round's cost drifts with
the machine, so no single length is best for a whole reply. The controller keeps, per chain length L
(0 = no draft, then 1 .. max_depth):
  - its round's cost: the median wall time of the last `COST_WINDOW` rounds that drafted L (a median, so that a
    round that loaded a graph or met a collection does not count; shared by the requests one drafter serves:
    the machine's costs are not the reply's);
  - the acceptance at each draft depth d, P(depth d accepted | depth d - 1 accepted), from counts of this
    request's rounds that reached depth d, each older one weighing less (half after `half_life` of them), so it
    follows the reply. Its prior, worth `PRIOR_WEIGHT` rounds, is what the drafter's earlier requests at the same
    temperature accepted (slowly aging counts, shared like the costs), else `DEFAULT_PRIOR`.
It then picks argmax_L (1 + sum_{j <= L} prod_{i <= j} a_i) / cost_L. A length never timed is tried once
first (its cost is unknown); every `explore_every` rounds the length timed longest ago is drafted until
a round of it is timed (a round that first feeds the head what rounds without drafts left is not timed:
that cost is theirs), so every cost and the deeper acceptance stay measured, and drafting comes back on
when it pays again.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

ONLINE_DEPTH = 3  # the longest chain when tree.depth is not set: 4 tokens, the largest small bucket
DEFAULT_PRIOR = 0.6  # acceptance at every depth before any request at a temperature was drafted
PRIOR_WEIGHT = 4.0  # rounds' worth of evidence the prior counts for
LONG_RUN_DECAY = 0.5 ** (1 / 512)  # the shared acceptance: an observation counts half after 512 more
LONG_RUN_MIN = 8.0  # observations at a depth before the shared acceptance there is used as a prior
COST_WINDOW = 9  # rounds whose median is a length's cost
EXPLORE_TRIES = 3  # rounds an explored length is drafted at most until one of them is timed


@dataclass
class ChainMemory:
    """What the requests of one drafter share: ms per round by chain length, and the acceptance by depth at each
    temperature over all of them."""

    times: dict[int, deque] = field(default_factory=dict)  # length -> the last COST_WINDOW rounds' ms
    timed_at: dict[int, int] = field(default_factory=dict)  # length -> the observation count when last timed
    count: int = 0
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

    @property
    def ms(self) -> dict[int, float]:
        return {length: statistics.median(times) for length, times in self.times.items()}

    def observe(self, length: int, ms: float) -> None:
        self.times.setdefault(length, deque(maxlen=COST_WINDOW)).append(ms)
        self.count += 1
        self.timed_at[length] = self.count

    def stalest(self, lengths) -> int:
        """Of `lengths`, the one timed longest ago."""
        return min(lengths, key=lambda length: self.timed_at.get(length, -1))


class ChainController:
    def __init__(self, max_depth: int, memory: ChainMemory | None = None, prior: list[float] | None = None,
                 half_life: float = 32.0, explore_every: int = 16, decay: float | None = None):
        """prior: acceptance by depth 1, 2, ... (shorter lists repeat their last value); half_life: observations at a
        depth after which one counts half (decay: the per-round factor itself, when given)."""
        if max_depth < 1:
            raise ValueError("an online chain needs max_depth >= 1")
        self.max_depth, self.explore_every = max_depth, explore_every
        self.memory = memory if memory is not None else ChainMemory()
        prior = list(prior or [DEFAULT_PRIOR])
        self.default = [prior[min(d, len(prior) - 1)] for d in range(max_depth)]
        self.decay = decay if decay is not None else 0.5 ** (1.0 / half_life)
        self.reset()

    def fork(self) -> ChainController:
        """A controller for another sequence: the costs shared, its own acceptance."""
        return ChainController(self.max_depth, self.memory, self.default, explore_every=self.explore_every,
                               decay=self.decay)

    def reset(self) -> None:
        """A new request: acceptance goes back to the prior; costs are kept."""
        self.accepted = [0.0] * self.max_depth  # decayed count of rounds that accepted depth d + 1
        self.reached = [0.0] * self.max_depth  # decayed count of rounds that drafted depth d + 1 and reached it
        self.rounds = 0
        self.last_explored = 0
        self.temperature: float | None = None  # set by the request's first choose()
        self.prior = self.default
        self.exploring: tuple[int, int, int] | None = None  # (length, cost count when begun, rounds drafted)

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
        """Expected tokens per ms of every length whose cost is known."""
        tokens = self.expected_tokens()
        return {length: tokens[length] / ms for length, ms in self.memory.ms.items() if ms > 0}

    def choose(self, temperature: float = 0.0) -> int:
        """The chain length of the next round of a request sampling at `temperature` (0: greedy)."""
        if self.temperature is None:  # the request's first round: start from what earlier ones accepted
            self.temperature = temperature
            self.prior = [min(max(a, 0.01), 0.99)
                          for a in self.memory.prior(temperature, self.max_depth, self.default)]
        for length in range(self.max_depth + 1):
            if length not in self.memory.times:
                return length  # never timed: time it once
        if self.exploring is not None:  # until it is timed: its first round may have been untimed
            length, since, tries = self.exploring
            if self.memory.timed_at.get(length, -1) <= since and tries < EXPLORE_TRIES:
                self.exploring = (length, since, tries + 1)
                return length
            self.exploring = None
        rates = self.rates()
        best = max(rates, key=lambda length: (rates[length], -length))
        if self.rounds - self.last_explored >= self.explore_every:
            self.last_explored = self.rounds
            length = self.memory.stalest([length for length in rates if length != best])
            self.exploring = (length, self.memory.count, 1)
            return length
        return best

    def observe(self, length: int, accepted: int, ms: float | None) -> None:
        """A round that drafted a chain of `length`, accepted `accepted` of it and took `ms` (None: untimed)."""
        if ms is not None:
            self.memory.observe(length, ms)
        self.rounds += 1
        for depth in range(min(accepted + 1, length)):  # depths 1 .. accepted + 1 were reached
            # evidence ages by observations at its depth, not by rounds: a stretch without drafts keeps it
            self.reached[depth] = self.reached[depth] * self.decay + 1.0
            self.accepted[depth] = self.accepted[depth] * self.decay + (1.0 if depth < accepted else 0.0)
            self.memory.remember(self.temperature or 0.0, depth, depth < accepted)
