"""key=value arguments of the small measuring tools (`python -m eagle_lab.benchmark.<tool> k=v ...`)."""

from __future__ import annotations


def key_values(tool: str, argv: list[str], known: tuple[str, ...]) -> dict[str, str]:
    """argv as {key: value}; SystemExit with one line naming the tool for a malformed or unknown argument."""
    malformed = [a for a in argv if "=" not in a or not a.split("=", 1)[0]]
    if malformed:
        raise SystemExit(f"{tool}: arguments are key=value pairs, got {malformed}")
    args = dict(a.split("=", 1) for a in argv)
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise SystemExit(f"{tool}: unknown argument(s) {unknown} (known: {', '.join(known)})")
    return args
