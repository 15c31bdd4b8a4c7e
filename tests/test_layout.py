"""The import graph of nano/ and cli/: one way down the layers, and no cycle anywhere; and the size of each layer.

Every `import` statement counts, wherever it stands: at the top, inside a function, or under TYPE_CHECKING.
Code lines are counted as issue 27 counts them: lines with code, not blank, comment or docstring lines.
"""
from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path


ROOT = Path(__file__).parents[1]
# Top to bottom; a module may import only modules on a lower line (or, inside one package, its siblings as long
# as no cycle forms). cli/ is installed as nano.cli.
LAYERS = [
    ["nano.__main__"],
    ["nano.cli"],
    ["nano.disagg", "nano.tp_worker", "nano.evaluate"],   # built on the library's LLM, used by the CLI only
    ["nano"],                       # the package's own __init__ only (LLM, SamplingParams, NanoError), no prefix
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
    ["nano.settings"],              # the engine's settings and the flag values, without torch (the CLI parses them)
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


def layer_of(module: str) -> int | None:
    """The layer that lists `module` by its own name or by a package above it (the longest such entry wins), None
    when no layer does. The entry "nano" stands for nano/__init__.py alone: were it a prefix, it would hold every
    module, and a module left out of LAYERS would still get a layer."""
    found = [(len(entry), index) for index, layer in enumerate(LAYERS) for entry in layer
             if module == entry or (entry != "nano" and module.startswith(entry + "."))]
    return max(found)[1] if found else None


def unlisted(modules) -> list[str]:
    return sorted(module for module in modules if layer_of(module) is None)


def test_every_module_has_a_layer():
    assert not unlisted(graph()), "add these to LAYERS: " + ", ".join(unlisted(graph()))


def test_a_module_missing_from_the_layers_is_found():
    """The check above can fail: a module no entry names (nor a package entry other than "nano" holds) is
    reported, and so is a sibling whose name merely starts like a package's."""
    assert unlisted(["nano", "nano.llm", "nano.kernels.moe", "nano.cli.bench", "nano.made_up",
                     "nano.kernels_extra", "nano.made_up.inner"]) == ["nano.kernels_extra", "nano.made_up",
                                                                      "nano.made_up.inner"]
    assert layer_of("nano.kernels.moe") == layer_of("nano.kernels") and layer_of("nano") is not None


def test_imports_point_down_the_layers():
    edges = {module: targets for module, targets in graph().items() if layer_of(module) is not None}
    upward = [f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
              for module, targets in edges.items() for target in targets if layer_of(target) is not None
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


# ---- size -----------------------------------------------------------------------------------------------------
# Each layer's code lines (not blank, comment or docstring lines), as a budget: growth past it is a decision, made by
# raising the number here in the same change, not a drift. The engine core is nano/ without the parts built on top
# of it (BUILT_ON_CORE). Issue 27 set the targets core <= 3,000, cli/ <= the core and nano/ + cli/ <= 7,600 (from
# 3,195 / 3,912 / 8,633 at 43ab1ef); where its change left them (the core took the engine settings' one validation,
# which the CLI and the split had each written before) is what these budgets hold, a little above the count then.
# Issue 28 raised them (core 3,237 -> 3,429, built on the core 1,525 -> 1,593, cli 3,852 -> 4,049): bounded chat
# templates and content kept as text (tokenizer +76), checkpoint sizes checked against the shards' headers
# (loader +26, config +21), page checksums (integrity +30), HTTP limits and the contained engine loop (server +128,
# serve +48), the gloo receive off the decode loop (transport +30). The 3,000 target for the core stays open.
# Issue 29 raised them (core 3,429 -> 3,483, built on the core 1,593 -> 1,607, cli 4,049 -> 4,412): the settings the
# command line checks before torch loads moved to nano/settings.py (+137; engine -97, kv -24) with a lazy package
# __init__ (+10) and torch-free model-name checks (presets +15, loader -9); one progress display for the long
# commands (cli/progress.py +128, bench/blog/eval +67); chat's fresh seeds, size checks and warnings (+44); the
# server's content parts, access log and metrics (+75); main's Ctrl-C and hints (+28). Its second part raised "built
# on the core" 1,610 -> 1,620: ranks that meet once all have loaded, before the first pass, and exit at once when
# told to stop (parallel +5, tp_worker +2); a split that kills a worker still starting, and ends requests with the
# worker's own loss reason when a send finds it gone (supervisor +2).
# Issue 30 raised cli 4,420 -> 4,740: the charts of --plot FILE and the sweep's text chart (cli/plot.py, its own
# concern, +279), the flag on bench, profile and eval, and a sweep of each --compare configuration (+30); and the
# core 3,490 -> 3,492: one default thread count per process (llm.process_threads), so compared configurations run
# alike. Issue 31 raised them (core 3,492 -> 3,580, cli 4,740 -> 4,765): three FP8 page layouts (kv +38: each
# layout's encoding, decoding and gathering in one place, the pool's parts by name; the decode kernel reads all
# three, +31; the setting and its checks, settings +10, config +3), the flag, the compare values and the layout in
# /stats, /pages, capacity and the blog (cli +19).
BUDGETS = {"engine core": 3_580, "built on the core": 1_620, "cli": 4_765}
FUNCTION_LIMIT = 60      # lines of one function, from its `def` line to its last line, as the issue measured them
BUILT_ON_CORE = ("nano/disagg/", "nano/parallel.py", "nano/tp_worker.py", "nano/evaluate.py")
SKIPPED_TOKENS = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                  tokenize.ENDMARKER}


def code_lines(source: str) -> set[int]:
    """The numbers of the lines that hold code: a token other than a comment, a line break or indentation, and
    not part of a docstring (a string standing first in a module, class or function). A string over several
    lines (not a docstring) counts on each of them."""
    docstrings = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docstrings.append((first.lineno, first.end_lineno))
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        in_docstring = token.type == tokenize.STRING and any(
            start <= token.start[0] and token.end[0] <= end for start, end in docstrings)
        if token.type not in SKIPPED_TOKENS and not in_docstring:
            lines.update(range(token.start[0], token.end[0] + 1))
    return lines


def long_functions(source: str, limit: int) -> list[tuple[str, int, int]]:
    """(name, first line, length) of every function, nested ones too, longer than `limit` lines from its `def`
    line (decorators not counted) to its last line, blank and comment lines included."""
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


def sources() -> dict[str, str]:
    """Every .py file of nano/ and cli/, by its path from the repository root."""
    return {path.relative_to(ROOT).as_posix(): path.read_text() for folder in ("nano", "cli")
            for path in sorted((ROOT / folder).rglob("*.py"))}


def test_code_lines_leave_out_blanks_comments_and_docstrings():
    source = ('''"""A module docstring
    over two lines."""
import os  # a comment after code counts


# a comment line
def f(x):
    """One line."""
    text = """a string that is not a docstring,
    over two lines"""
    return (x +
            1)


class C:
    """Doc."""
    y: int = 0
''')
    assert sorted(code_lines(source)) == [3, 7, 9, 10, 11, 12, 15, 17]
    assert long_functions(source, 5) == [("f", 7, 6)] and long_functions(source, 6) == []


def layer_of_file(path: str) -> str:
    return "cli" if path.startswith("cli/") else "built on the core" if path.startswith(BUILT_ON_CORE) else \
        "engine core"


def test_each_layer_stays_within_its_code_line_budget():
    files = sources()
    counts = dict.fromkeys(BUDGETS, 0)
    for path, text in files.items():
        counts[layer_of_file(path)] += len(code_lines(text))
    over = [f"{path}:{line} {name}() is {length} lines" for path, text in files.items()
            for name, line, length in long_functions(text, FUNCTION_LIMIT)]
    over += [f"{layer}: {counts[layer]:,} code lines, over its budget of {budget:,}"
             for layer, budget in BUDGETS.items() if counts[layer] > budget]
    assert not over, "\n".join(over)
