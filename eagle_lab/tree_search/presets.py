"""Tree presets by name, read from conf/tree/<name>.yaml: what `tree=<name>` composes in Hydra,
for code that needs several trees in one run (bench methods such as eagle@cpu). A fixed shape can be
named inline too: `d2k1n2` is depth 2, top-k 1, 2 tokens (a 2-token chain); a `-top` suffix drafts the
head's top-k at every temperature instead of drawing from it when sampling (tree.sampled_drafts=false)."""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import OmegaConf

from eagle_lab.errors import EagleLabError
from eagle_lab.tree_search.tree_config import TreeConfig

TREE_DIR = Path(__file__).resolve().parents[1] / "conf" / "tree"
INLINE_SHAPE = re.compile(r"d(\d+)k(\d+)n(\d+)(-top)?")


def preset_names() -> list[str]:
    return sorted(path.stem for path in TREE_DIR.glob("*.yaml"))


def tree_preset(name: str) -> TreeConfig:
    """The TreeConfig that tree=<name> gives; EagleLabError naming the presets for an unknown one."""
    inline = INLINE_SHAPE.fullmatch(name)
    if inline:
        depth, topk, total = (int(v) for v in inline.groups()[:3])
        if min(depth, topk, total) < 1:
            raise EagleLabError(f"tree '{name}': depth, top-k and tokens must be >= 1")
        return TreeConfig(name=name, online=False, depth=depth, topk=topk, total_tokens=total,
                          sampled_drafts=inline.group(4) is None)
    path = TREE_DIR / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(preset_names()) or f"none found in {TREE_DIR}"
        raise EagleLabError(f"unknown tree preset '{name}' (presets: {known}, or a shape such as d2k1n2)")
    merged = OmegaConf.merge(OmegaConf.structured(TreeConfig), OmegaConf.load(path))
    return TreeConfig(**OmegaConf.to_container(merged))
