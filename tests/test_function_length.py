"""No function (or method, or nested function) in ragtrain/ is longer than MAX_LINES, from its `def` line to its
last line: a longer one does several things, each of which wants a name, a docstring and a test of its own."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "ragtrain"
MAX_LINES = 80


def _lengths(path: Path, root: Path = PKG.parent) -> dict[str, int]:
    """`file::Class.function` -> its length in lines, for every function of the file at any depth."""
    out: dict[str, int] = {}
    rel = path.relative_to(root).as_posix()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out[f"{rel}::{name}"] = child.end_lineno - child.lineno + 1
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text()), "")
    return out


def _too_long() -> dict[str, int]:
    lengths = {k: v for p in sorted(PKG.rglob("*.py")) for k, v in _lengths(p).items()}
    return {k: v for k, v in lengths.items() if v > MAX_LINES}


def test_no_function_is_over_80_lines() -> None:
    long = _too_long()
    offenders = sorted(f"{k} ({v} lines)" for k, v in long.items())
    assert offenders == [], f"functions over {MAX_LINES} lines: split them: " + ", ".join(offenders)


def test_lengths_are_counted_for_nested_functions_and_methods(tmp_path: Path) -> None:
    src = "class A:\n    def f(self):\n        def g():\n            return 1\n\n        return g\n"
    path = tmp_path / "probe.py"
    path.write_text(src)
    assert _lengths(path, tmp_path) == {"probe.py::A.f": 5, "probe.py::A.f.g": 2}
