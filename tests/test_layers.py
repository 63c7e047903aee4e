"""The shape the code is held to (ARCHITECTURE.md): every import goes down the layers or stays within
one, there are no import cycles, family folders do not import each other, and no module grows past
400 lines. Read from the sources with `ast`, function-level (lazy) imports included."""

from __future__ import annotations

import ast
from pathlib import Path


from conftest import REPO

PACKAGE = REPO / "ckpttool"

LAYERS: list[set[str]] = [  # bottom to top; a module is in the layer of its longest matching prefix
    {"ckpttool.version", "ckpttool.settings", "ckpttool.errors", "ckpttool.dtypes", "ckpttool.defaults",
     "ckpttool.timing", "ckpttool.faults", "ckpttool.progress"},
    {"ckpttool.io"},  # reading only: safetensors, checkpoints, the names of ckpttool's own files
    {"ckpttool.kernels"},  # numpy and Triton kernels
    {"ckpttool.formats"},  # one row per quantization format
    {"ckpttool.model"},  # torch building blocks shared by the bundled models
    {"ckpttool.families"},  # one folder per model family, and the table of them
    {"ckpttool.plan", "ckpttool.layouts"},  # headers -> Plan; the layouts (HF, mp, DCP) a plan writes and reads
    {"ckpttool.execute"},  # Plan -> bytes in the staging directory
    {"ckpttool.publish"},  # staging directory -> output
    {"ckpttool.hub", "ckpttool.verify", "ckpttool.describe"},  # download; proving an output; `inspect`
    {"ckpttool.recipe"},  # recipes and presets -> what to do
    {"ckpttool.runner"},  # the one entry point: request -> plan, execute, publish, verify
    {"ckpttool.api", "ckpttool.cli"},  # the commands as functions; flags -> request, report -> terminal
    {"ckpttool", "ckpttool.__main__"},  # the package (exports api's functions, loaded on first use); the executable
]
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """ckpttool modules `name` imports, anywhere in the file; `from pkg import mod` counts as pkg.mod."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{name}: use absolute imports"
            base = node.module or ""
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        found |= {t for t in targets if t == "ckpttool" or t.startswith("ckpttool.")}
    return found - {name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def layer(module: str) -> int:
    best = max((p for group in LAYERS for p in group if module == p or module.startswith(p + ".")), key=len)
    return next(i for i, group in enumerate(LAYERS) if best in group)


def test_every_module_has_a_layer():
    for name in MODULES:
        layer(name)  # raises if no prefix matches


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
            for a, targets in graph.items() for b in targets if layer(b) > layer(a)]


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, as the list of modules around it, or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt in graph and state.get(nxt) is None and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for name in sorted(graph):
        if state.get(name) is None and (cycle := visit(name)):
            return cycle
    return None


def cross_family_imports(graph: dict[str, set[str]]) -> list[str]:
    def family(module: str) -> str | None:
        parts = module.split(".")
        return parts[2] if len(parts) > 3 and parts[1] == "families" else None

    return [f"{a} imports {b}" for a, targets in graph.items() for b in targets
            if family(a) and family(b) and family(a) != family(b)]


def test_imports_only_go_down():
    assert not (found := upward_imports(GRAPH)), "\n".join(found)


def test_no_import_cycles():
    assert (cycle := import_cycle(GRAPH)) is None, "import cycle: " + " -> ".join(cycle)


def test_family_folders_do_not_import_each_other():
    assert not (found := cross_family_imports(GRAPH)), "\n".join(found)


def test_no_module_is_too_long():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these along a seam: {long}"


def test_the_checks_see_what_they_guard():
    """Each rule finds a violation planted in a copy of the real graph."""
    assert any(m.startswith("ckpttool.plan.") for m in GRAPH["ckpttool.runner"])  # real edges are read
    doctored = {k: set(v) for k, v in GRAPH.items()}
    doctored["ckpttool.io.layout"].add("ckpttool.plan.types")  # io reaching up into the plan
    assert upward_imports(doctored) == ["ckpttool.io.layout (layer 1) imports ckpttool.plan.types (layer 6)"]
    doctored = {k: set(v) for k, v in GRAPH.items()}
    doctored["ckpttool.plan.types"].add("ckpttool.plan.build")  # build imports types already
    assert import_cycle(doctored) is not None
    doctored["ckpttool.families.dense.model"].add("ckpttool.families.deepseek.model")
    assert cross_family_imports(doctored) == ["ckpttool.families.dense.model imports ckpttool.families.deepseek.model"]
