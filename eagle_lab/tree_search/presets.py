"""Tree presets by name, read from conf/tree/<name>.yaml: what `tree=<name>` composes in Hydra,
for code that needs several trees in one run (bench methods such as eagle@auto)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from eagle_lab.errors import EagleLabError
from eagle_lab.tree_search.space import TreeConfig

TREE_DIR = Path(__file__).resolve().parents[1] / "conf" / "tree"


def preset_names() -> list[str]:
    return sorted(path.stem for path in TREE_DIR.glob("*.yaml"))


def tree_preset(name: str) -> TreeConfig:
    """The TreeConfig that tree=<name> gives; EagleLabError naming the presets for an unknown one."""
    path = TREE_DIR / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(preset_names()) or f"none found in {TREE_DIR}"
        raise EagleLabError(f"unknown tree preset '{name}' (presets: {known})")
    merged = OmegaConf.merge(OmegaConf.structured(TreeConfig), OmegaConf.load(path))
    return TreeConfig(**OmegaConf.to_container(merged))
