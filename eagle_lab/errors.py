"""The one exception type for mistakes a user can cause (bad path, config, prompt...), and the
entry points' wrapper around it: it prints one line on stderr and exits with code 2; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException


class EagleLabError(Exception):
    """A user-facing error: the message alone must say what is wrong and how to fix it."""


def run_entry(job: Callable[[DictConfig], object], cfg: DictConfig) -> object:
    try:
        return job(cfg)
    except EagleLabError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except OmegaConfBaseException as exc:  # a typed-config check failed after composition
        first = str(exc).strip().splitlines()[0]
        print(f"error: bad configuration: {first}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        logging.getLogger(__name__).warning("interrupted")
        sys.exit(130)


def key_values(tool: str, argv: list[str], known: tuple[str, ...]) -> dict[str, str]:
    """The key=value arguments of a small tool (`python -m eagle_lab.<module> k=v ...`) as {key: value};
    SystemExit with one line naming the tool for a malformed or unknown argument."""
    malformed = [a for a in argv if "=" not in a or not a.split("=", 1)[0]]
    if malformed:
        raise SystemExit(f"{tool}: arguments are key=value pairs, got {malformed}")
    args = dict(a.split("=", 1) for a in argv)
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise SystemExit(f"{tool}: unknown argument(s) {unknown} (known: {', '.join(known)})")
    return args
