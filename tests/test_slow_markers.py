"""A test kept out of the default suite says why in its marker, `@pytest.mark.slow(reason=...)`: what it costs, and
which default test runs its path in a smaller form. Read from the test files' syntax, so no run can skip it."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _silent_slow_marks(source: str) -> list[int]:
    """Lines of `pytest.mark.slow` used bare or called without a non-empty `reason=`."""
    tree = ast.parse(source)
    called = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "slow" and ast.unparse(node) == "pytest.mark.slow":
            call = called.get(id(node))
            reason = next((k.value for k in call.keywords if k.arg == "reason"), None) if call else None
            if not (isinstance(reason, ast.Constant) and isinstance(reason.value, str) and reason.value.strip()):
                out.append(node.lineno)
    return out


def test_every_slow_test_says_why() -> None:
    silent = {
        str(f.relative_to(TESTS)): lines
        for f in sorted(TESTS.rglob("*.py"))
        if (lines := _silent_slow_marks(f.read_text(encoding="utf-8")))
    }
    assert silent == {}, f"slow marks without a reason (file: lines): {silent}"


def test_a_bare_or_empty_slow_mark_is_found() -> None:
    src = (
        "import pytest\n\n@pytest.mark.slow\ndef test_a(): ...\n\n@pytest.mark.slow(reason='')\ndef test_b(): ...\n\n"
        "@pytest.mark.slow(reason='two runs')\ndef test_c(): ...\n\n"
        "@pytest.mark.parametrize('x', [pytest.param(1, marks=pytest.mark.slow)])\ndef test_d(x): ...\n"
    )
    assert _silent_slow_marks(src) == [3, 6, 12]
