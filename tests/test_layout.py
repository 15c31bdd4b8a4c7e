"""The import graph of nano/ and cli/: one way down the layers, and no cycle anywhere.

Every `import` statement counts, wherever it stands: at the top, inside a function, or under TYPE_CHECKING.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]
# Top to bottom; a module may import only modules on a lower line (or, inside one package, its siblings as long
# as no cycle forms). cli/ is installed as nano.cli.
LAYERS = [
    ["nano.__main__"],
    ["nano.cli"],
    ["nano.disagg", "nano.tp_worker"],
    ["nano"],                       # the package's own __init__: LLM, SamplingParams, NanoError
    ["nano.llm"],
    ["nano.engine"],
    ["nano.parallel"],
    ["nano.scheduler"],
    ["nano.integrity"],
    ["nano.model"],
    ["nano.batch"],
    ["nano.kv"],
    ["nano.loader"],
    ["nano.presets"],
    ["nano.tokenizer", "nano.sampling"],
    ["nano.quant"],
    ["nano.kernels"],
    ["nano.config"],
    ["nano.errors"],
]


def module_files() -> dict[str, Path]:
    files = {}
    for folder, package in ((ROOT / "nano", "nano"), (ROOT / "cli", "nano.cli")):
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join([package, *parts])] = path
    return files


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The nano modules `name` imports (a `from package import module` counts as the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source == "cli" or source.startswith("cli."):   # the folder's own name, installed as nano.cli
                source = "nano." + source
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                       for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(name, path, set(files)) for name, path in files.items()}


def layer_of(module: str) -> int:
    best = max((prefix for layer in LAYERS for prefix in layer
                if module == prefix or module.startswith(prefix + ".")), key=len)
    return next(i for i, layer in enumerate(LAYERS) if best in layer)


def test_every_module_has_a_layer():
    assert all(layer_of(module) >= 0 for module in graph())


def test_imports_point_down_the_layers():
    upward = [f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
              for module, targets in graph().items() for target in targets
              if layer_of(target) < layer_of(module)
              or (layer_of(target) == layer_of(module) and target.split(".")[:2] != module.split(".")[:2])]
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    edges, state, cycles = graph(), {}, []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(edges[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


def test_the_walker_sees_upward_and_circular_imports(tmp_path):
    """The checks above can fail: an upward import (the old engine <-> integrity circle) is found."""
    source = tmp_path / "integrity.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from nano.engine import Engine\n")
    found = imports_of("nano.integrity", source, {"nano.engine", "nano.integrity"})
    assert found == {"nano.engine"} and layer_of("nano.engine") < layer_of("nano.integrity")
