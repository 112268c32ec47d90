"""The documentation a newcomer reads stays true: short README, no history, links that resolve, commands that parse,
generated reference pages that match the code."""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gen_docs  # noqa: E402

README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
SEVEN_PAGES = {"benchmarks.md", "security.md", "how-it-works.md", "trainer-api.md", "deploy.md", "metrics.md",
               "cli.md"}

# Development history belongs in commit messages and issue notes, not in the files a user reads.
HISTORY = [
    (re.compile(r"\bsession \d+", re.IGNORECASE), "a numbered session of work"),
    (re.compile(r"\bround \d+ of work", re.IGNORECASE), "a numbered round of work"),
    (re.compile(r"tried and not kept|tried and dropped|was not kept", re.IGNORECASE), "a try that was not kept"),
    (re.compile(r"\bissue \d+", re.IGNORECASE), "an issue number"),
]
# a short commit hash in Markdown prose: 7 hex characters with both a digit and a letter (not in a code block)
COMMIT = re.compile(r"(?<![\w/.-])`?(?=[0-9a-f]{7}\b)(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])([0-9a-f]{7})`?(?![\w/-])")


def tracked_files() -> list[Path]:
    """The repository's files: git's list in a checkout, else every file under the root but build output."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        return [ROOT / p for p in out.decode().split("\0") if p and (ROOT / p).is_file()]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", "build", "dist", "__pycache__", ".venv", "wheels"}
        return [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)]


def text_of(path: Path) -> str | None:
    try:
        return path.read_text()
    except (UnicodeDecodeError, OSError):
        return None  # binary


def prose_lines(text: str):
    """(line number, line) of Markdown outside fenced code blocks."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield n, line


def test_readme_is_at_most_400_lines():
    lines = README.read_text().count("\n")
    assert lines <= 400, f"README.md has {lines} lines; move detail into docs/"


def test_docs_has_the_seven_pages():
    assert {p.name for p in DOCS} >= SEVEN_PAGES, f"missing: {SEVEN_PAGES - {p.name for p in DOCS}}"


def test_generated_pages_match_the_code():
    assert gen_docs.stale() == [], "run: python scripts/gen_docs.py"


def test_every_metric_the_code_defines_is_in_the_metrics_page():
    defined = set()
    for path in (ROOT / "peerd").rglob("*.py"):
        defined |= set(re.findall(r"(?:Counter|Gauge|Histogram|Info|Summary)\(\s*\"(peerd_\w+?)(?:_total)?\"",
                                  path.read_text()))
    page = (ROOT / "docs" / "metrics.md").read_text()
    missing = sorted(name for name in defined if f"`{name}" not in page)
    assert not missing, (f"metrics not on docs/metrics.md: {missing} (run python scripts/gen_docs.py; if they are "
                         "still missing, add the class that registers them to gen_docs.py)")


def test_no_development_history_outside_tests():
    found = []
    for path in tracked_files():
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "tests" or path.suffix in {".json", ".bin"}:
            continue
        text = text_of(path)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            found += [f"{rel}:{n}: {why}: {line.strip()[:100]}" for pattern, why in HISTORY if pattern.search(line)]
        if path.suffix == ".md":
            found += [f"{rel}:{n}: a commit hash: {line.strip()[:100]}" for n, line in prose_lines(text)
                      if COMMIT.search(line)]
    assert not found, "development history in the repository's files:\n" + "\n".join(found)


def test_no_file_refers_to_places_outside_the_repository():
    outside = [re.escape("../shared")]
    if ROOT.parent not in {Path("/"), Path("/tmp"), Path("/home"), Path("/root"), Path("/opt"), Path.home()}:
        outside.append(re.escape(str(ROOT.parent)) + "/")  # the folder this checkout sits in (not a system one)
    pattern = re.compile("|".join(outside))
    found = []
    for path in tracked_files():
        if path == Path(__file__).resolve():
            continue
        text = text_of(path)
        for n, line in enumerate((text or "").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not found, "files that name paths outside the repository:\n" + "\n".join(found)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    return frozenset(github_anchor(line.lstrip("#")) for _, line in prose_lines(path.read_text())
                     if line.startswith("#"))


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for n, line in prose_lines(page.read_text()):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+:", target):
                    continue  # http:, https:, mailto:
                file, _, anchor = target.partition("#")
                dest = (page.parent / file).resolve() if file else page
                if not dest.exists():
                    broken.append(f"{page.relative_to(ROOT)}:{n}: {target} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    broken.append(f"{page.relative_to(ROOT)}:{n}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


# ---- every `peerd ...` command line in README and docs parses ----

# `peerd` as a word or a path's last part (`/opt/peerd/bin/peerd status`), not `/var/lib/peerd` or `peerd.torch`
COMMAND = re.compile(r"(?:(?<![\w./-])|(?<=bin/))peerd((?:[ \t]+[^\s`#;&|)]+)*)")
COMMAND_START = re.compile(r"(?:^|&&|;|\||\(|\$|\bsudo|\bexec|/bin/)\s*$")


def command_lines(text: str) -> list[tuple[int, str]]:
    """`peerd ...` command lines in code: fenced blocks (continuations joined) and inline code spans."""
    found: list[tuple[int, str]] = []
    fenced = False
    pending = ""
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            pending += line.rstrip()
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            code, pending = pending, ""
            spans = [code.split(" #")[0]]
        else:
            spans = re.findall(r"`([^`]+)`", line)
        for span in spans:
            if span.startswith("python "):
                continue
            for m in COMMAND.finditer(span):
                command = " ".join(("peerd" + m.group(1)).split())
                words = command.split()
                # `peerd` where a command starts, or as an argument (`usermod -aG peerd alice`, `compose exec X
                # peerd status`): an argument counts only when a subcommand or an option follows it
                if COMMAND_START.search(span[:m.start()]) or (len(words) > 1 and (
                        words[1].startswith("-") or words[1] in subparsers_of(root_parser()))):
                    found.append((n, command))
    return found


# a line that presents a deprecated name as such ("`peerd train`: now `peerd demo-trainer`")
OLD_NAME_LINE = re.compile(r"deprecat|\bnow `|old names?", re.IGNORECASE)


@functools.cache
def help_of(words: tuple[str, ...]) -> str:
    """`peerd WORDS --help`, from the CLI's own parser in this process (as `python -m peerd` would print it)."""
    from peerd.cli import build_parser

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            build_parser().parse_args([*words, "--help"])
        except SystemExit as e:
            return out.getvalue() if e.code == 0 else ""
    return out.getvalue()


@functools.cache
def root_parser() -> argparse.ArgumentParser:
    from peerd.cli import build_parser

    return build_parser()


def subparsers_of(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps no public list of a parser's subcommands
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def named_in(word: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


def check_command(command: str, old_names_ok: bool) -> str | None:
    """None when the command's subcommands exist and its parser takes every option it uses, all of them shown in
    its --help (hidden ones, the deprecated old names, only where the line says they are old)."""
    words = command.split()[1:]
    parser, path = root_parser(), []
    while words and not words[0].startswith("-") and words[0] in subparsers_of(parser):
        name = words.pop(0)
        if not old_names_ok and not named_in(name, help_of(tuple(path))):
            return f"`peerd {' '.join([*path, name])}` is hidden from the help (an old name?)"
        parser = subparsers_of(parser)[name]
        path.append(name)
    if words and subparsers_of(parser) and not words[0].startswith("-") and not words[0].isupper():
        return f"`peerd {' '.join(path)}` has no subcommand {words[0]!r}"  # (COMMAND and the like: placeholders)
    hidden = {s: a.help == argparse.SUPPRESS for a in parser._actions for s in a.option_strings}
    problems = []
    for word in words:
        option = word.split("=")[0]
        if not re.fullmatch(r"--?[a-zA-Z][\w-]*", option):
            continue
        if option not in hidden:
            problems.append(f"no option {option}")
        elif hidden[option] and not old_names_ok:
            problems.append(f"{option} is hidden from the help (an old name?)")
    return f"`peerd {' '.join(path)}`: {', '.join(problems)}" if problems else None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_peerd_command_line_parses(page):
    lines = page.read_text().splitlines()
    bad = [f"{page.relative_to(ROOT)}:{n}: {command}: {why}" for n, command in command_lines(page.read_text())
           if (why := check_command(command, OLD_NAME_LINE.search(lines[n - 1]) is not None))]
    assert not bad, "\n".join(bad)


def test_the_command_check_refuses_what_does_not_parse():
    assert check_command("peerd join --listen 0.0.0.0:7411 --metrics 9100", False) is None
    assert check_command("peerd bench allreduce --peers 4 --size 25000000 --json", False) is None
    assert check_command("peerd COMMAND --help", False) is None  # a placeholder
    assert "no option --no-such-flag" in check_command("peerd join --no-such-flag", False)
    assert "no subcommand 'jion'" in check_command("peerd jion", False)
    assert "no option --peers" in check_command("peerd status --peers 4", False)


def test_commands_are_found_where_peerd_runs_not_where_it_is_an_argument():
    text = "\n".join(["```bash", "usermod -aG peerd alice", "systemctl enable --now peerd",
                      "/opt/peerd/bin/peerd status --json", "docker compose exec bootstrap peerd status",
                      "peerd join --listen 0.0.0.0:7411 \\", "    --metrics 9100   # a comment", "```",
                      "Run `peerd demo --peers 4`, then `import peerd.torch`."])
    assert [command for _, command in command_lines(text)] == [
        "peerd status --json", "peerd status", "peerd join --listen 0.0.0.0:7411 --metrics 9100",
        "peerd demo --peers 4"]


def test_every_local_socket_op_of_the_daemon_is_in_the_local_protocol():
    """protocol/LOCAL.md is what other trainer implementations build on: every op a daemon serves has its row."""
    from peerd.moshpit.ops import MoshpitOps
    from peerd.trainer.service import TrainerService

    spec = (ROOT / "protocol" / "LOCAL.md").read_text()
    ops = {"status", "dht_put", "dht_get", *MoshpitOps(None).ops(),  # type: ignore[arg-type]
           *TrainerService.ops(object.__new__(TrainerService))}
    missing = sorted(op for op in ops if f"`{op}`" not in spec)
    assert not missing, f"ops the daemon serves that protocol/LOCAL.md does not describe: {missing}"
