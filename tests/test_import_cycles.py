"""Imports point down the layers (LAYERS below), and no module imports itself back, even lazily."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "ragtrain"


def _imports(module: str) -> set[str]:
    """ragtrain modules `module` imports anywhere in its file (top level or inside functions)."""
    path = PKG.parent / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = PKG.parent / module.replace(".", "/") / "__init__.py"
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:  # `from .chunk import x`: relative to the package
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            node.module = f"{base}.{node.module}" if node.module else base
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ragtrain"):
            for alias in node.names:  # `from ragtrain.tune import space` imports the module ragtrain.tune.space
                sub = f"{node.module}.{alias.name}"
                exists = (PKG.parent / (sub.replace(".", "/") + ".py")).exists()
                out.add(sub if exists else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("ragtrain"))
    return out


def _reaches_itself(start: str) -> list[str] | None:
    """An import path from `start` back to `start`, or None."""
    stack, seen = [(start, [start])], set()
    while stack:
        module, path = stack.pop()
        for dep in _imports(module):
            if dep == start:
                return path + [dep]
            if dep not in seen:
                seen.add(dep)
                stack.append((dep, path + [dep]))
    return None


INDEX_MODULES = sorted(
    ".".join(p.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__")
    for p in (PKG / "index").rglob("*.py")
)  # every module of the index layer, found on disk: a new one is covered without being listed


@pytest.mark.parametrize(
    "module",
    [
        "ragtrain.sync.base",
        "ragtrain.sync.composed",
        "ragtrain.sync.reducers.base",
        "ragtrain.sync.mixers.base",
        "ragtrain.sync.scopes.base",
        "ragtrain.config.sync",
        "ragtrain.tune.sweep",
        "ragtrain.tune.results",
        "ragtrain.corpus.dataset",
        "ragtrain.data.store",
        *INDEX_MODULES,
    ],
)
def test_no_import_cycle_through(module: str) -> None:
    assert _reaches_itself(module) is None, " -> ".join(_reaches_itself(module))


def test_every_index_module_is_covered() -> None:
    """The list above is read from disk: every module of ragtrain/index/, the packages' __init__ included."""
    assert {"ragtrain.index", "ragtrain.index.sharded", "ragtrain.index.consistency.base"} <= set(INDEX_MODULES)
    assert len(INDEX_MODULES) == len(list((PKG / "index").rglob("*.py")))


def test_consistency_policies_import_nothing_of_the_refresh_service() -> None:
    """A policy lands a round through the `RefreshRound` it is handed (consistency/base.py), not through the
    service that holds it, nor the shards' module."""
    policies = [m for m in INDEX_MODULES if m.startswith("ragtrain.index.consistency")]
    reached = {m: _reachable(m) & {"ragtrain.index.refresh_service", "ragtrain.index.sharded"} for m in policies}
    assert reached == {m: set() for m in policies}


def _reachable(start: str) -> set[str]:
    """Every ragtrain module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for dep in _imports(todo.pop()) - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def test_relative_imports_are_followed() -> None:
    """`from .chunk import chunk_document` in ragtrain/corpus/dataset.py is an edge to ragtrain.corpus.chunk."""
    assert {"ragtrain.corpus.chunk", "ragtrain.data.clean", "ragtrain.data.store"} <= _imports(
        "ragtrain.corpus.dataset"
    )
    assert "ragtrain.data.types" in _imports("ragtrain.data.store")


# Every folder and top-level module of ragtrain, lowest first: each may import only what comes before it (or
# itself), at the top of a file or inside a function. A new folder or module must take its place here.
LAYERS = (
    "runtime config track cluster data embed corpus eval index sync train retriever repair reranker generator joint "
    "pipeline commands tune __main__"
).split()


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_imports_point_down_the_layers() -> None:
    rank = {u: i for i, u in enumerate(LAYERS)}
    modules = [
        ".".join(p.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__") for p in PKG.rglob("*.py")
    ]
    units = {_unit(m) for m in modules} - {"__init__"}
    assert units == set(LAYERS), f"place these in LAYERS: {sorted(units - set(LAYERS))}"
    upward = sorted(
        f"{m} -> {dep}"
        for m in modules
        if _unit(m) in rank
        for dep in _imports(m)
        if _unit(dep) in rank and rank[_unit(dep)] > rank[_unit(m)]
    )
    assert upward == []


def test_recipes_do_not_import_recipes() -> None:
    """A training recipe (a `train.py` of a stage's package) imports no other recipe: what two recipes share lives
    in a module below them (weights I/O in ragtrain/embed/weights.py, the generator's steps in
    ragtrain/generator/steps.py), so a change to one recipe's loop cannot reach into another's."""
    recipes = {".".join(p.relative_to(PKG.parent).with_suffix("").parts) for p in PKG.rglob("train.py")}
    assert {"ragtrain.retriever.train", "ragtrain.generator.train", "ragtrain.joint.train"} <= recipes
    crossing = sorted(f"{m} -> {dep}" for m in recipes for dep in _imports(m) if dep in recipes - {m})
    assert crossing == [], "recipes importing recipes: " + ", ".join(crossing)


def test_function_level_imports_say_why() -> None:
    """An import inside a function defers an optional or heavy dependency, or breaks a cycle, and says which: a
    comment on its line, or on the line above it (or above the run of imports it belongs to). Others go on top."""
    silent = []
    for path in sorted(PKG.rglob("*.py")):
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        nested = {
            node
            for fn in ast.walk(tree)
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
            for node in ast.walk(fn)
            if isinstance(node, ast.Import | ast.ImportFrom)
        }
        import_lines = {i for node in nested for i in range(node.lineno, node.end_lineno + 1)}
        for node in nested:
            if any("#" in lines[i - 1] for i in range(node.lineno, node.end_lineno + 1)):
                continue
            above = node.lineno - 1
            while above in import_lines and "#" not in lines[above - 1]:
                above -= 1  # a run of imports shares the comment above its first one
            if above < 1 or "#" not in lines[above - 1]:
                silent.append(f"{path.relative_to(PKG.parent)}:{node.lineno}")
    assert silent == [], "function-level imports without a comment saying why: " + ", ".join(sorted(silent))


def _missing(path: Path) -> list[str]:
    """The `ragtrain.*` modules `path` imports (anywhere in the file) that are not in this tree."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else []
        names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
        for name in (n for n in names if n == "ragtrain" or n.startswith("ragtrain.")):
            file = PKG.parent / name.replace(".", "/")
            if not (file.with_suffix(".py").exists() or (file / "__init__.py").exists()):
                out.append(f"{path.relative_to(PKG.parent)}: {name}")
    return out


def test_every_ragtrain_import_names_a_module_of_this_tree() -> None:
    """An editable install resolves a module this tree lacks (a moved one's old path) to another checkout's copy,
    so a stale import could pass every other test: each import must name a module that is here."""
    files = [
        p for folder in ("ragtrain", "tests", "benchmarks", "experiments") for p in (PKG.parent / folder).rglob("*.py")
    ]
    assert [m for f in sorted(files) for m in _missing(f)] == []
