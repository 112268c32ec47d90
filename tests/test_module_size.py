"""Every Python module under peerd/ short enough to read in one sitting: at most 800 lines (the C functions'
bound is tests/test_native_shape.py's). A module that grows past it splits along its jobs (docs/architecture.md)."""

from __future__ import annotations

from pathlib import Path

PEERD = Path(__file__).resolve().parent.parent / "peerd"
MAX_LINES = 800


def module_lengths(root: Path) -> dict[str, int]:
    """Lines of every ``*.py`` below ``root``, by its path relative to ``root``."""
    return {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in sorted(root.rglob("*.py"))}


def test_no_module_is_over_800_lines() -> None:
    lengths = module_lengths(PEERD)
    assert len(lengths) > 50  # the walk found the package
    long = {name: n for name, n in lengths.items() if n > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them along their jobs): {long}"


def test_the_counter_counts_lines(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n" * 801)
    (tmp_path / "sub" / "b.py").write_text("y = 2\n\n")
    (tmp_path / "c.txt").write_text("not python\n")
    assert module_lengths(tmp_path) == {"a.py": 801, "sub/b.py": 2}
