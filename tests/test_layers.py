"""The package's layers import in one direction only, and no module imports itself back in a circle.

Every `import eagle_lab...` counts, function-local ones included, so a circle cannot hide inside a
function. A module may import its own layer and the layers below it, never one above.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "eagle_lab"

# top to bottom; a module belongs to the first layer one of whose prefixes it starts with
LAYERS = [
    ("entry points", ["eagle_lab.serve", "eagle_lab.train", "eagle_lab.export", "eagle_lab.cli", "eagle_lab.compile",
                     "eagle_lab.training.trainer",
                      "eagle_lab.training.scaling_report", "eagle_lab.training.recipe_report"]),
    ("benchmark", ["eagle_lab.benchmark"]),
    ("serving", ["eagle_lab.serving", "eagle_lab.text_stream"]),
    ("builders and configs", ["eagle_lab.builders", "eagle_lab.config"]),
    ("tree search and training", ["eagle_lab.tree_search", "eagle_lab.training"]),
    ("loops", ["eagle_lab.generate"]),
    ("drafters", ["eagle_lab.draft", "eagle_lab.draft_model", "eagle_lab.medusa_draft"]),
    ("decoding core", ["eagle_lab.decoding", "eagle_lab.verify", "eagle_lab.ngram", "eagle_lab.cache"]),
    ("models", ["eagle_lab.llama_cpp", "eagle_lab.target", "eagle_lab.head", "eagle_lab.eagle3", "eagle_lab.head_kinds", "eagle_lab.interop",
                "eagle_lab.tiny", "eagle_lab.tree", "eagle_lab.sampling", "eagle_lab.card", "eagle_lab.prompts",
                "eagle_lab.medusa", "eagle_lab.medusa_layout", "eagle_lab.draft_lm_store", "eagle_lab.quantized",
                "eagle_lab.packed_linear"]),
    ("base", ["eagle_lab.errors", "eagle_lab.device", "eagle_lab.embedded", "eagle_lab.packages",
              "eagle_lab.model_shape", "eagle_lab.conf", "eagle_lab"]),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("eagle_lab"):
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("eagle_lab"))
        graph[module_name(path)] = found
    return graph


def layer_of(module: str) -> int:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes if p != "eagle_lab") or module == "eagle_lab":
            return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")


def test_every_module_has_a_layer_and_imports_only_downwards():
    upward = []
    for module, targets in imports().items():
        for target in targets:
            if layer_of(target) < layer_of(module):
                upward.append(f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} "
                              f"({LAYERS[layer_of(target)][0]})")
    assert not upward, "\n".join(sorted(upward))


def test_no_import_circles():
    graph = imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if target not in graph:
                continue
            if state.get(target) == 1:
                return path + [module, target]
            if state.get(target) is None:
                found = visit(target, path + [module])
                if found:
                    return found
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            circle = visit(module, [])
            assert circle is None, " -> ".join(circle)


def test_the_check_sees_an_upward_import():
    assert layer_of("eagle_lab.decoding.round") > layer_of("eagle_lab.serving.engine")
    assert layer_of("eagle_lab.errors") == len(LAYERS) - 1
