"""Imports go one way: a package never imports one above it, and peers never import each other.

Order (lowest first): ``conversation``, ``tokenizer``, ``io``, ``layout``, ``process_groups``, ``record_formats``,
``token_cache`` -> ``prompt_formats``
-> ``sidecar`` -> ``packing`` | ``data`` (peers) -> ``loss`` | ``model`` (peers) -> ``train``. Every
``packsft`` import counts, including those inside functions.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "packsft"
BASE = {"packsft", "conversation", "tokenizer", "io", "layout", "process_groups", "record_formats", "token_cache"}
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
