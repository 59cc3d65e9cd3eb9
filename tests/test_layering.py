"""Imports go one way: a package never imports one above it, and peers never import each other; no import cycle
between files, no import of another module's ``_private`` names, no module over 450 lines (those still over it are
listed with their size today and may only shrink).

Order (lowest first): ``conversation``, ``tokenizer``, ``io``, ``layout``, ``process_groups``, ``record_formats``,
``token_cache`` -> ``prompt_formats``
-> ``sidecar`` -> ``packing`` | ``data`` (peers) -> ``loss`` | ``model`` (peers) -> ``train``. Every
``packsft`` import counts, including those inside functions.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "packsft"
BASE = {"packsft", "conversation", "jsonl", "tokenizer", "io", "layout", "process_groups", "record_formats",
        "token_cache", "config_rules", "extras"}
ALLOWED = {
    "base": BASE,
    "prompt_formats": BASE | {"prompt_formats"},
    "sidecar": BASE | {"prompt_formats", "sidecar"},
    "packing": BASE | {"prompt_formats", "sidecar", "packing"},
    "data": BASE | {"prompt_formats", "sidecar", "data"},
    "loss": BASE | {"prompt_formats", "sidecar", "loss"},
    "model": BASE | {"prompt_formats", "sidecar", "model"},
    "train": BASE | {"prompt_formats", "sidecar", "packing", "data", "loss", "model", "train"},
}


def _unit(module: str) -> str:
    """``packsft.data.row`` -> ``data``; ``packsft`` -> ``packsft``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _layer(unit: str) -> str:
    return "base" if unit in BASE else unit


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return [(line, name) for line, name in found if name == "packsft" or name.startswith("packsft.")]


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_unit_has_a_layer():
    units = {_unit(".".join(("packsft", *p.relative_to(PACKAGE).with_suffix("").parts))) for p in MODULES}
    units = {"packsft" if u == "__init__" else u for u in units}
    assert {_layer(u) for u in units} <= set(ALLOWED), units


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_one_way(path):
    own = path.relative_to(PACKAGE).with_suffix("").parts[0]
    own = "packsft" if own == "__init__" else own
    allowed = ALLOWED[_layer(own)]
    bad = [f"line {line}: {name}" for line, name in _imports(path) if _unit(name) not in allowed]
    assert not bad, f"packsft/{path.relative_to(PACKAGE)} ({_layer(own)}) imports upwards or across: {bad}"


def test_the_check_can_fail(tmp_path):
    upward = tmp_path / "row.py"
    upward.write_text("from packsft.packing.algorithms import pack\n")
    assert _unit(_imports(upward)[0][1]) not in ALLOWED["data"]


# -- one room per concept: no import cycles between files, no reaching into a sibling's private names, small modules --
def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _file_imports(path: Path) -> set[str]:
    """The packsft modules ``path`` imports (``from packsft.x import y`` counts ``packsft.x.y`` when that is a
    module, else ``packsft.x``), inside functions included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("packsft"):
            names |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULE_NAMES else node.module
                      for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("packsft")}
    return {n for n in names if n in MODULE_NAMES} - {_module_name(path)}


MODULE_NAMES = {_module_name(p) for p in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _package_graph() -> dict[str, set[str]]:
    """Module -> modules it imports; a package's ``__init__`` only re-exports, so its edges are left out."""
    return {_module_name(p): _file_imports(p) for p in MODULES if p.name != "__init__.py"}


def test_no_import_cycles_between_files():
    assert not _cycles(_package_graph()), _cycles(_package_graph())


def test_the_cycle_check_can_fail():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _private_imports(path: Path) -> list[str]:
    """``from packsft.x import _name`` of another module's private name (a module's own package excepted for
    ``__init__``)."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("packsft"):
            bad += [f"line {node.lineno}: from {node.module} import {a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    return bad


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_another_modules_private_names(path):
    assert not _private_imports(path), _private_imports(path)


MAX_LINES = 450
OVERSIZE = {          # modules still over MAX_LINES, each capped at its size today: they may shrink, never grow
}


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_stay_small(path):
    name = str(path.relative_to(PACKAGE))
    assert _lines(path) <= OVERSIZE.get(name, MAX_LINES), (
        f"packsft/{name} has {_lines(path)} lines (limit {OVERSIZE.get(name, MAX_LINES)}): split it by concept")


def test_the_oversize_list_is_current():
    """An entry leaves :data:`OVERSIZE` once its module is within :data:`MAX_LINES`."""
    assert [n for n in OVERSIZE if _lines(PACKAGE / n) <= MAX_LINES] == []
