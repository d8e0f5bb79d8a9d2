"""Head card: `card.json` beside a head's weights says what it was trained on and how well it drafts.

Written by the trainer on export (data, steps, held-out accuracy, the command), carried along by
`python -m eagle_lab.export`, completed by `mode=bench bench.update_card=true` (MT-bench tau per
tree and temperature), and summarised in one log line whenever serve.py loads the head.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from eagle_lab.errors import EagleLabError

log = logging.getLogger(__name__)
CARD_NAME = "card.json"
# Overrides that control how a run is carried out (resumed, time-boxed), not what it trains: a
# head trained in several resumed stretches is reproduced without them.
RUN_CONTROL_OVERRIDES = ("trainer.resume", "trainer.time_limit_min", "trainer.stop_at")


def reproducing_command(script: str, overrides: list[str]) -> str:
    """The command line for a head card: `python <script>` and its Hydra overrides, less the
    run-control ones (a head resumed over three stretches is reproduced by one plain run)."""
    kept = [o for o in overrides if o.partition("=")[0].lstrip("+~") not in RUN_CONTROL_OVERRIDES]
    return " ".join(["python", script, *map(shlex.quote, kept)])


@dataclass
class HeadCard:
    target: str
    kind: str
    train_conversations: int = 0
    train_tokens: int = 0  # tokens in the training set (epochs not counted)
    epochs: float = 0.0  # passes over the training set the steps add up to
    steps: int = 0
    heldout_top1: list[float] = field(default_factory=list)  # by draft position 1, 2, ...
    heldout_conversations: int = 0
    heldout_tau_chain: float = 0.0
    heldout_opening_top1: float = 0.0  # position 1 over each held-out reply's first 64 supervised tokens
    mtbench_tau: dict[str, dict[str, float]] = field(default_factory=dict)  # tree -> "T=<temperature>" -> tau
    draft_vocab_size: int = 0
    trainable_parameters: int = 0  # what training updated (a draft LM's frozen embeddings and LM head excluded)
    data: dict[str, object] = field(default_factory=dict)  # source, max_length, ...
    # how it was trained: lr, global batch, warm-up, schedule floor, head MLP width (0 = the target's), ...
    recipe: dict[str, object] = field(default_factory=dict)
    command: str = ""  # reproduces the head

    def summary(self) -> str:
        top1 = "/".join(f"{a:.2f}" for a in self.heldout_top1[:3]) or "?"
        taus = ", ".join(f"{tree} {t}: {tau:.2f}" for tree, by_t in sorted(self.mtbench_tau.items())
                         for t, tau in sorted(by_t.items()))
        return (f"head card: {self.kind} for {self.target}, trained on {self.train_conversations} conversations "
                f"({self.train_tokens / 1e6:.2f}M tokens) x {self.epochs:.1f} epochs ({self.steps} steps); "
                f"held-out top-1 {top1} (positions 1-3); MT-bench tau {taus or 'not measured'}")


def read_card(head_dir: str | Path) -> HeadCard | None:
    """The card of a head directory, or None if it has none (published heads have none)."""
    path = Path(head_dir) / CARD_NAME
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        known = {f.name for f in fields(HeadCard)}
        return HeadCard(**{k: v for k, v in raw.items() if k in known})
    except (OSError, ValueError, TypeError) as exc:
        raise EagleLabError(f"head card {path} is unreadable: {exc}") from exc


def write_card(head_dir: str | Path, card: HeadCard) -> Path:
    path = Path(head_dir) / CARD_NAME
    tmp = path.with_name(f".{CARD_NAME}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(card), indent=2) + "\n")
    tmp.replace(path)
    return path


MTBENCH_QUESTIONS = 80


def record_mtbench_tau(head_dir: str | Path, tree: str, temperature: float, tau: float, prompts: int) -> bool:
    """Put a measured MT-bench tau into the head's card (keyed "T=0", or "T=0,n=20" when fewer
    than all 80 first turns were run); False if the head has no card."""
    card = read_card(head_dir)
    if card is None:
        return False
    key = f"T={temperature:g}" + ("" if prompts >= MTBENCH_QUESTIONS else f",n={prompts}")
    card.mtbench_tau.setdefault(tree, {})[key] = round(tau, 3)
    write_card(head_dir, card)
    return True
