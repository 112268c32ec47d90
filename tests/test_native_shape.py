"""The native data plane's shape (peerd/_dataplane/*.c): every C function short enough to hold in mind, and the
entry points that take many values take them by keyword and return one shape."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

SOURCES = sorted((Path(__file__).resolve().parent.parent / "peerd" / "_dataplane").glob("*.c"))
MAX_LINES = 150
# a definition starts at column 0 with a name and its parameter list; its body ends at a "}" in column 0
_START = re.compile(r"^(?!typedef|struct|union|enum|#)(?:__attribute__\(\(.*?\)\)\s*)?[A-Za-z_][\w\s\*]*?\b(\w+)\s*\(")
_COMMENT = re.compile(r"/\*.*?\*/")


def _code(line: str) -> str:
    """The line without its one-line comments and trailing blanks."""
    return _COMMENT.sub("", line).rstrip()


def c_functions(text: str) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every function defined in C source ``text``."""
    lines = text.split("\n")
    found = []
    i = 0
    while i < len(lines):
        m = _START.match(lines[i])
        if m is None or "=" in lines[i].split("(")[0]:
            i += 1
            continue
        j = i
        while j < len(lines) and not _code(lines[j]).endswith(("{", ";")):
            j += 1
        if j >= len(lines) or _code(lines[j]).endswith(";"):  # a declaration
            i = j + 1
            continue
        k = j + 1
        while k < len(lines) and lines[k] != "}":
            k += 1
        found.append((m.group(1), i + 1, k - i + 1))
        i = k + 1
    return found


def test_the_counter_finds_functions_and_their_lengths() -> None:
    text = "static int f(int a,\n          int b) {\n    return a;\n}\n\nPyObject *g(void) {\n    x();\n    y();\n}\n"
    text += "static PyMethodDef methods[] = {\n    {NULL},\n};\nint h(void);\n"
    text += "static int k(void) { /* why */\n    return 0;\n}\n"
    text += '__attribute__((target("avx"))) static int v(void) {\n    return 1;\n}\n'
    assert c_functions(text) == [("f", 1, 4), ("g", 6, 4), ("k", 14, 3), ("v", 17, 3)]


@pytest.mark.parametrize("source", SOURCES, ids=[p.name for p in SOURCES])
def test_every_c_function_is_at_most_150_lines(source: Path) -> None:
    text = source.read_text()
    functions = c_functions(text)
    assert len(functions) == text.split("\n").count("}"), f"a function of {source.name} was not recognized"
    long = [(name, line, n) for name, line, n in functions if n > MAX_LINES]
    assert not long, f"{source.name}: functions over {MAX_LINES} lines (name, line, lines): {long}"


def test_the_counter_sees_the_receive_pass_split() -> None:
    names = {name for p in SOURCES for name, _, _ in c_functions(p.read_text())}
    assert {"recv_batch", "recv_options", "receive_pass", "hand_out", "take_rows", "take_check"} <= names


def test_recv_batch_and_take_rows_take_their_options_by_keyword() -> None:
    native = pytest.importorskip("peerd._dataplane._native")
    if getattr(native, "recv_batch", None) is not None:
        with pytest.raises(TypeError):  # the options after ``slot`` are keyword-only
            native.recv_batch(0, bytearray(2048), 1, 2048, None)
    with pytest.raises(TypeError):  # everything after ``rows`` is keyword-only
        native.take_rows(b"", 1, 1, 0)
