"""`python -m eagle_lab.training.recipe_report BASE_RUN RUN... [--out DIR]`: recipe curves at a fixed data size.

Each run changes one knob of the baseline's recipe (epochs, learning rate, head MLP width, ...)
on the same training data and the same held-out set. Reads every run's `head/card.json` (its
`recipe`, held-out top-1, MT-bench tau) and `metrics.jsonl` (training top-1 at the end, to tell an
overfit head from an undertrained one), and writes `recipe.md` (one row per run: the knob it
changed and the figures) and `recipe.png` (held-out top-1 at position 1 and chain tau against the
knob's value, one panel per knob, the baseline in each) to --out.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from eagle_lab.drafters.card import HeadCard
from eagle_lab.drafters.eagle.head import CONFIG_NAME
from eagle_lab.training.scaling_report import load_cards, mtbench, report_parser, write_report

TRAIN_WINDOW_STEPS = 200  # training top-1 at the end: the mean over the last quarter of the steps, at most this many


@dataclass
class RecipeRun:
    run: Path
    card: HeadCard
    knob: str  # the recipe key this run changed against the baseline; "" for the baseline itself
    train_top1: float | None


def knob_value(card: HeadCard, key: str) -> object:
    return card.epochs if key == "epochs" else card.recipe.get(key)


def changed_keys(base: HeadCard, card: HeadCard) -> list[str]:
    """Recipe keys whose values differ from the baseline's (the data must be the same)."""
    keys = sorted(set(base.recipe) | set(card.recipe))
    return [k for k in keys if base.recipe.get(k) != card.recipe.get(k)]


def train_top1_at_end(run: Path, window: int = TRAIN_WINDOW_STEPS) -> float | None:
    """Mean training top-1 at position 1 over the run's last quarter of steps, at most `window` of them
    (metrics.jsonl; None if absent): a short run's early steps would drag the figure down."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = [r for r in rows if "acc_1" in r and "step" in r]
    if not train:
        return None
    last = train[-1]["step"]
    window = min(window, max(last // 4, 1))
    tail = [r["acc_1"] for r in train if r["step"] > last - window]
    return sum(tail) / len(tail)


def recipe_runs(cards: list[tuple[Path, HeadCard]]) -> list[RecipeRun]:
    """The first card is the baseline; every other must differ from it in exactly one recipe key."""
    (base_run, base), rest = cards[0], cards[1:]
    if not base.recipe:
        raise ValueError(f"{base_run}: its card has no recipe (trained before cards recorded one)")
    out = [RecipeRun(base_run, base, "", train_top1_at_end(base_run))]
    for run, card in rest:
        if card.train_tokens != base.train_tokens or card.data.get("source") != base.data.get("source"):
            raise ValueError(f"{run}: trained on other data than the baseline {base_run} "
                             f"({card.train_tokens} against {base.train_tokens} tokens)")
        keys = changed_keys(base, card)
        if len(keys) != 1:
            raise ValueError(f"{run}: changes {keys or 'nothing'} against the baseline; "
                             "a recipe curve changes one knob")
        out.append(RecipeRun(run, card, keys[0], train_top1_at_end(run)))
    return out


def table(runs: list[RecipeRun], prompts: int = 20) -> str:
    depth = max(len(r.card.heldout_top1) for r in runs)
    head = (["run", "change", "epochs", "steps", "train top-1 @1 (end)"] + [f"top-1 @{d}" for d in range(1, depth + 1)]
            + ["chain tau", "MT-bench tau (tree=cpu, T=0)"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        top1 = [f"{a:.3f}" for a in r.card.heldout_top1] + ["-"] * (depth - len(r.card.heldout_top1))
        change = "baseline" if not r.knob else f"{r.knob} {r.card.recipe.get(r.knob)}"
        train = "-" if r.train_top1 is None else f"{r.train_top1:.3f}"
        row = [r.run.name, change, f"{r.card.epochs:.2f}", str(r.card.steps), train, *top1,
               f"{r.card.heldout_tau_chain:.3f}", mtbench(r.card, prompts)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plotted_value(run: RecipeRun, key: str) -> float:
    """A knob's value on the plot's x axis: a head width of 0 (the target's) is read back from the head's config."""
    value = float(knob_value(run.card, key))
    if key == "intermediate_size" and value == 0:
        config = run.run / "head" / CONFIG_NAME
        if config.is_file():
            value = float(json.loads(config.read_text()).get("intermediate_size", 0))
    return value


def plot(runs: list[RecipeRun], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    base = runs[0]
    knobs = sorted({r.knob for r in runs if r.knob})
    top1_max = max(max(r.card.heldout_top1[0], r.train_top1 or 0.0) for r in runs)
    tau_max = max(r.card.heldout_tau_chain for r in runs)
    fig, axes = plt.subplots(1, max(len(knobs), 1), figsize=(4.2 * max(len(knobs), 1), 4), squeeze=False)
    for ax, knob in zip(axes[0], knobs):
        base_x = plotted_value(base, knob)
        points = sorted([(base_x, base)] +
                        [(plotted_value(r, knob), r) for r in runs if r.knob == knob], key=lambda p: p[0])
        xs = [x for x, _ in points]
        ax.plot(xs, [r.card.heldout_top1[0] for _, r in points], marker="o", color="C0", label="held-out top-1 @1")
        ax.plot(xs, [r.train_top1 if r.train_top1 is not None else math.nan for _, r in points], marker="^",
                linestyle="--", color="C0", label="training top-1 @1 (end)")
        twin = ax.twinx()
        twin.plot(xs, [r.card.heldout_tau_chain for _, r in points], marker="s", color="C1", label="held-out chain tau")
        # the same scales in every panel, from 0 (top-1) and 1 (tau), so panels compare at a glance
        ax.set_ylim(0.0, top1_max * 1.1)
        twin.set_ylim(1.0, 1.0 + (tau_max - 1.0) * 1.1)
        twin.set_ylabel("chain tau", color="C1")
        if knob == "lr":
            ax.set_xscale("log")
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set(xlabel=knob, ylabel="top-1 at draft position 1", title=f"{knob} (baseline {base_x:g})")
        handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        ax.legend(handles=handles, fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = report_parser(__doc__, "the baseline run directory first, then the variants", "recipe").parse_args(argv)
    found = {run: card for run, card in load_cards(args.runs)}
    cards = [(run, found[run]) for run in args.runs if run in found]  # the order given: baseline first
    if not cards or cards[0][0] != args.runs[0]:
        print(f"error: the baseline {args.runs[0]} has no head card", file=sys.stderr)
        return 2
    try:
        runs = recipe_runs(cards)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return write_report(args.out, "recipe", table(runs, args.prompts), lambda path: plot(runs, path))


if __name__ == "__main__":
    sys.exit(main())
