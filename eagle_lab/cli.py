"""Shared entry-point plumbing: user errors become one line on stderr and exit code 2."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from eagle_lab.errors import EagleLabError


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
