"""The tests' own layout: what tests share lives in tests/support/ (or a conftest fixture), defined once; a test
file never imports another test file (a helper there would be found by grepping tests, not by reading support)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _sources() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text()) for p in sorted(TESTS.rglob("*.py")) if "fuzz" not in p.parts}


def test_no_test_file_imports_another() -> None:
    found = []
    for path, tree in _sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                last = (node.module or "").rsplit(".", 1)[-1]
                names = [last] if node.module else [a.name for a in node.names]
                if any(n.startswith("test_") or n == "conftest" for n in names):
                    found.append(f"{path.relative_to(TESTS)}:{node.lineno} imports from {node.module or names}")
            elif isinstance(node, ast.Import) and any(a.name.rsplit(".", 1)[-1].startswith("test_")
                                                      for a in node.names):
                found.append(f"{path.relative_to(TESTS)}:{node.lineno} imports a test file")
    assert not found, "move what is shared into tests/support/:\n" + "\n".join(found)


def test_no_helper_is_defined_twice() -> None:
    """The same top-level function or class (same name, same code) in two files is one helper written twice."""
    seen: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path, tree in _sources().items():
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and not node.name.startswith(
                    "test_"):
                seen[(node.name, ast.dump(node, include_attributes=False))].append(str(path.relative_to(TESTS)))
    twice = {name: files for (name, _), files in seen.items() if len(files) > 1}
    assert not twice, f"define these once in tests/support/: {twice}"
