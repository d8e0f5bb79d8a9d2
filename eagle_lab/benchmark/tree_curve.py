"""What a tree=auto calibration says about tree sizes: for each number of draft tokens, the best
shape's accept length (tau) greedy and expected under sampling, and its modelled tokens/s.
python -m eagle_lab.benchmark.tree_curve [file=PATH] [ngram=false]

file: a calibration written by tree=auto (default: the newest under the cache's tree_auto/).
ngram: include rows with n-gram chains merged (hybrid drafting); the head's trees alone otherwise.
Reads the cache only; nothing is measured. The curve shows why a tree size wins or loses: the
accept length a size buys against what a round of that size costs on this device.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from eagle_lab.drafters.growth import TreeShape
from eagle_lab.errors import key_values
from eagle_lab.models.embedded import cache_root
from eagle_lab.tree_search.auto import choose, cost_model


def newest_calibration() -> Path:
    """The newest tree=auto calibration in the cache; the server's per-batch-size choices, kept beside them
    (`<target>-rows-*.json`, no cost model), are passed over."""
    files = sorted((cache_root() / "tree_auto").glob("*.json"), key=lambda f: f.stat().st_mtime, reverse=True)
    for file in files:
        try:
            if "cost_model" in json.loads(file.read_text()):
                return file
        except (OSError, json.JSONDecodeError):
            continue
    raise SystemExit(f"tree_curve: no calibration under {cache_root() / 'tree_auto'} (run serve.py with tree=auto)")


def best_by_size(ranked: list[dict], ngram: bool) -> dict[int, dict]:
    """Draft tokens (the tree's, plus the chain's when merged) -> the fastest ranked row of that size."""
    best: dict[int, dict] = {}
    for row in ranked:
        if row.get("ngram_tokens") and not ngram:
            continue
        size = row["shape"]["total_tokens"] + int(row.get("ngram_tokens", 0))
        if size not in best or row["tokens_per_s"] > best[size]["tokens_per_s"]:
            best[size] = row
    return best


def label(row: dict) -> str:
    shape = row["shape"]
    chain = int(row.get("ngram_tokens", 0))
    head = f"d{shape['depth']} k{shape['topk']} n{shape['total_tokens']}" if shape["depth"] else "plain"
    return head + (f" + chain {chain}" if chain else "")


def curve(summary: dict, ngram: bool = False) -> list[str]:
    """Markdown rows: per draft-token count and temperature, the fastest shape, its tau and modelled tok/s."""
    costs = cost_model(summary)
    temperatures = [0.0] + sorted(float(t) for t in (summary["shapes"][0].get("sampled_tau") or {}))
    by_temperature = {t: best_by_size(choose(summary["shapes"], costs, TreeShape(0, 0, 0), t)[1], ngram)
                      for t in temperatures}
    lines = ["| draft tokens | " + " | ".join(f"T={t:g}: shape, tau, tok/s" for t in temperatures) + " |",
             "|---:|" + "---|" * len(temperatures)]
    for size in sorted(by_temperature[0.0]):
        cells = []
        for t in temperatures:
            row = by_temperature[t].get(size)
            cells.append(f"{label(row)}, {row['tau']:.2f}, {row['tokens_per_s']:.1f}" if row else "-")
        lines.append(f"| {size} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str]) -> None:
    args = key_values("tree_curve", argv, ("file", "ngram"))
    path = Path(args["file"]) if "file" in args else newest_calibration()
    if not path.is_file():
        raise SystemExit(f"tree_curve: no such file {path}")
    try:
        summary = json.loads(path.read_text())
        lines = curve(summary, args.get("ngram", "false").lower() in ("1", "true", "yes"))
    except (json.JSONDecodeError, KeyError, ValueError) as err:
        raise SystemExit(f"tree_curve: {path} is not a tree=auto calibration with sampled accept lengths "
                         f"({err})") from err
    print(f"{path} ({summary['rounds']} recorded rounds; modelled tok/s, before timing in the loop)")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
