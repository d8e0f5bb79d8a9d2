"""`python -m eagle_lab.training.scaling_report RUN_DIR... [--out DIR] [--prompts N]`: the data-scaling table and plot.

Reads each run's `head/card.json` (written by train.py, MT-bench tau added by
`mode=bench bench.update_card=true`) and writes `scaling.md` (a Markdown table, one row per
run, sorted by training tokens) and `scaling.png` (held-out chain tau and MT-bench tau against
training tokens, log scale; one series per kind of training text: the source's replies, the
target's own, or a mix) to --out (default: the current directory). Held-out figures are each run's
own held-out set (the target's replies for self-distilled runs); MT-bench tau is comparable across
series. Every point shows MT-bench tau on the same number of prompts where the cards have it
(--prompts, 20 by default: the curve's measure), so a head also benched on all 80 does not mix two
measures in one column.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from eagle_lab.drafters.card import HeadCard, bench_prompts, read_card


def load_cards(run_dirs: list[Path]) -> list[tuple[Path, HeadCard]]:
    cards = []
    for run in run_dirs:
        card = read_card(run / "head") or read_card(run)
        if card is None:
            print(f"warning: {run} has no card.json (in head/ or itself): skipped", file=sys.stderr)
            continue
        cards.append((run, card))
    return sorted(cards, key=lambda rc: (rc[1].train_tokens, str(rc[0])))


def series(card: HeadCard) -> str:
    """The kind of training text a head saw (cards from before `data.parts` count as the source's)."""
    parts = card.data.get("parts") or [{"replies": card.data.get("heldout_replies", "source")}]
    kinds = sorted({part["replies"] for part in parts})  # "source" before "target"
    return " + ".join({"source": "source replies", "target": "target's replies"}[k] for k in kinds)


def mtbench_tau(card: HeadCard, prompts: int, tree: str = "cpu", temperature: str = "T=0") -> tuple[float, int] | None:
    """(tau, prompt count) for a tree at a temperature, measured on `prompts` prompts when the card
    has that figure (a curve compares like with like), else on the most prompts it has."""
    by_t = card.mtbench_tau.get(tree, {})
    found = {bench_prompts(key): tau for key, tau in by_t.items()
             if key == temperature or key.startswith(temperature + ",")}
    if not found:
        return None
    n = prompts if prompts in found else max(found)
    return found[n], n


def mtbench(card: HeadCard, prompts: int = 20) -> str:
    entry = mtbench_tau(card, prompts)
    if entry is None:
        return "-"
    tau, n = entry
    return f"{tau:.2f} ({n} prompts)"


def table(cards: list[tuple[Path, HeadCard]], prompts: int = 20) -> str:
    depth = max((len(c.heldout_top1) for _, c in cards), default=0)
    head = (["run", "replies", "conversations", "tokens", "epochs", "steps"]
            + [f"top-1 @{d}" for d in range(1, depth + 1)] + ["chain tau", "MT-bench tau (tree=cpu, T=0)"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run, card in cards:
        top1 = [f"{a:.3f}" for a in card.heldout_top1] + ["-"] * (depth - len(card.heldout_top1))
        row = [run.name, series(card), str(card.train_conversations), f"{card.train_tokens / 1e6:.2f}M",
               f"{card.epochs:.2f}", str(card.steps), *top1, f"{card.heldout_tau_chain:.3f}", mtbench(card, prompts)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plot(cards: list[tuple[Path, HeadCard]], path: Path, prompts: int = 20) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    plain = FuncFormatter(lambda value, _: f"{value:g}")  # 0.3, not 3x10^-1
    depth = max((len(c.heldout_top1) for _, c in cards), default=0)
    kinds = sorted({series(c) for _, c in cards})
    looks = [("o", "-"), ("^", "--"), ("s", ":"), ("D", "-.")]  # (marker, line) per series; colour: the measure
    for k, kind in enumerate(kinds):
        marker, line = looks[k % len(looks)]
        members = [c for _, c in cards if series(c) == kind]
        tokens = [c.train_tokens / 1e6 for c in members]
        for d in range(depth):
            left.plot(tokens, [c.heldout_top1[d] if d < len(c.heldout_top1) else float("nan") for c in members],
                      marker=marker, linestyle=line, color=f"C{d}")
        right.plot(tokens, [c.heldout_tau_chain for c in members], marker=marker, linestyle=line, color="C0")
        points = [(t, entry[0]) for t, c in zip(tokens, members) if (entry := mtbench_tau(c, prompts)) is not None]
        if points:
            right.plot(*zip(*points), marker=marker, linestyle=line, color="C1")
    kind_keys = [Line2D([], [], color="grey", marker=looks[k % len(looks)][0], linestyle=looks[k % len(looks)][1],
                        label=kind) for k, kind in enumerate(kinds)] if len(kinds) > 1 else []
    left.legend(handles=[Line2D([], [], color=f"C{d}", label=f"position {d + 1}") for d in range(depth)] + kind_keys,
                fontsize=8)
    right.legend(handles=[Line2D([], [], color="C0", label="held-out chain tau (own held-out set)"),
                          Line2D([], [], color="C1", label="MT-bench tau (tree=cpu, T=0)")] + kind_keys, fontsize=8)
    left.set(xscale="log", xlabel="training tokens (M)", ylabel="held-out top-1",
             title="held-out top-1 by draft position")
    right.set(xscale="log", xlabel="training tokens (M)", ylabel="tokens per target forward", title="tau")
    for ax in (left, right):
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(plain)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report_parser(doc: str, runs_help: str, stem: str) -> argparse.ArgumentParser:
    """The arguments every run report takes: run directories, --out, --prompts."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help=runs_help)
    parser.add_argument("--out", type=Path, default=Path("."), help=f"where {stem}.md and {stem}.png go")
    parser.add_argument("--prompts", type=int, default=20,
                        help="MT-bench figure to show, by prompt count, where a card has several (default 20)")
    return parser


def write_report(out: Path, stem: str, text: str, draw: Callable[[Path], None]) -> int:
    """Writes `<stem>.md` (the table) and `<stem>.png` (drawn by `draw`) into `out`, and prints the table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(text)
    draw(out / f"{stem}.png")
    print(text, end="")
    print(f"wrote {out / (stem + '.md')} and {out / (stem + '.png')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = report_parser(__doc__, "training run directories (runs/<name>)", "scaling").parse_args(argv)
    cards = load_cards(args.runs)
    if not cards:
        print("error: none of the given runs has a head card", file=sys.stderr)
        return 2
    return write_report(args.out, "scaling", table(cards, args.prompts),
                        lambda path: plot(cards, path, args.prompts))


if __name__ == "__main__":
    sys.exit(main())
