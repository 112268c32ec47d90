#!/usr/bin/env python3
"""Write docs/cli.md (every command and option with its default, from peerd's argparse parser) and
docs/deploy-env.md (every environment variable of deploy/entrypoint.sh, from its ``# env:`` lines).

Why generated: a reference written by hand drifts from the code; tests/test_cli_docs.py and tests/test_deploy.py
fail when these files differ from what this script writes.

    python scripts/gen_cli_docs.py           # rewrite both files
    python scripts/gen_cli_docs.py --check   # exit 1 if either is stale
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLI_MD = ROOT / "docs" / "cli.md"
ENV_MD = ROOT / "docs" / "deploy-env.md"
ENTRYPOINT = ROOT / "deploy" / "entrypoint.sh"
GENERATED = "Generated from the code by `python scripts/gen_cli_docs.py`: edit the code, not this file."


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    """The default as a user would type it, or "" where there is none (the help says what happens then)."""
    d = action.default
    if d is None or d is argparse.SUPPRESS or d == [] or isinstance(action, argparse._StoreTrueAction):
        return ""
    if isinstance(d, tuple):  # HOST:PORT pairs
        return "`" + ":".join(str(x) for x in d) + "`"
    if isinstance(d, float) and d.is_integer():
        d = int(d)
    return f"`{d}`"


def _option(action: argparse.Action, fmt: argparse.HelpFormatter) -> str:
    names = ", ".join(action.option_strings) if action.option_strings else (action.metavar or action.dest)
    if action.nargs != 0 and action.option_strings:
        metavar = fmt._format_args(action, action.dest.upper())
        names = f"{names} {metavar}"
    return f"`{names}`"


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _section(name: str, parser: argparse.ArgumentParser, about: str, out: list[str]) -> None:
    """One command: what it does, then a table of options per argument group; then its subcommands."""
    out += [f"## {name}", "", _cell(about or parser.description or ""), ""]
    fmt = argparse.HelpFormatter(parser.prog, width=100)
    sub = _subparsers(parser)
    for group in parser._action_groups:
        rows = []
        for a in group._group_actions:
            if a.help is argparse.SUPPRESS or isinstance(a, argparse._HelpAction | argparse._SubParsersAction):
                continue
            rows.append(f"| {_option(a, fmt)} | {_default(a)} | {_cell(fmt._expand_help(a) if a.help else '')} |")
        if rows:
            title = "options" if group.title in ("optional arguments", "options") else group.title
            out += [f"{title}:", "", "| option | default | what it does |", "|---|---|---|", *rows, ""]
    if sub is not None:
        helps = {a.dest: a.help for a in sub._choices_actions}
        seen: set[int] = set()
        for child, p in sub.choices.items():
            if id(p) in seen:  # an old name (alias) of a command already listed
                continue
            seen.add(id(p))
            _section(f"{name} {child}", p, helps.get(child, ""), out)


def render_cli() -> str:
    from peerd.cli import COMMAND_GROUPS, build_parser

    parser = build_parser()
    sub = _subparsers(parser)
    assert sub is not None
    helps = {a.dest: a.help for a in sub._choices_actions}
    out = ["# peerd command line", "", GENERATED, "",
           "`peerd` alone, or `peerd --help`, lists the commands; `peerd COMMAND --help` shows a command's options "
           "with their defaults. `peerd --version` prints the version.", ""]
    for title, names in COMMAND_GROUPS:
        out += [f"**{title}**", ""]
        out += [f"- [`peerd {n}`](#peerd-{n.replace(' ', '-')}): {_cell(helps[n])}" for n in names]
        out.append("")
    aliases = {name: p for name, p in sub.choices.items() if name not in helps}
    if aliases:
        out += ["Old names that still work for one release, with a deprecation line on stderr:", ""]
        for name, p in aliases.items():
            new = next(n for n, q in sub.choices.items() if q is p and n in helps)
            out.append(f"- `peerd {name}`: now `peerd {new}`")
        out += ["- `peerd keygen PATH`: now `peerd keygen --identity PATH`",
                "- `peerd keygen --swarm-key PATH`: now `peerd keygen --swarm-key-file PATH`",
                "- `peerd bench allreduce --compare-gloo`: now `--baseline gloo`", ""]
    for _title, names in COMMAND_GROUPS:
        for n in names:
            _section(f"peerd {n}", sub.choices[n], helps[n], out)
    return "\n".join(out).rstrip("\n") + "\n"


_ENV_LINE = re.compile(r"^# env: (PEERD_\w+) \| (.+)$")
_DEFAULT = re.compile(r"\$\{(PEERD_\w+)(:?-)([^}]*)\}")


def entrypoint_env() -> list[tuple[str, str, str]]:
    """(name, default, description) of every ``# env: NAME | what`` line of the entrypoint, the default taken from
    the ``${NAME:-default}`` on the line after it."""
    lines = ENTRYPOINT.read_text().splitlines()
    found = []
    for i, line in enumerate(lines):
        m = _ENV_LINE.match(line)
        if not m:
            continue
        name, what = m.groups()
        default = ""
        for later in lines[i + 1:i + 4]:
            d = _DEFAULT.search(later)
            if d and d.group(1) == name:
                default = d.group(3).replace("$state", "$PEERD_STATE")
                break
        found.append((name, default, what))
    return found


def render_env() -> str:
    out = ["# Container environment", "", GENERATED, "",
           "The image's entrypoint (`deploy/entrypoint.sh`) reads these variables; docker-compose.yml sets some of "
           "them. `peerd-entrypoint bootstrap` starts a swarm, `peerd-entrypoint peer` joins one, anything else "
           "runs as a command (e.g. `peerd status`).", "",
           "| variable | default | what it does |", "|---|---|---|"]
    for name, default, what in entrypoint_env():
        out.append(f"| `{name}` | {f'`{default}`' if default else ''} | {_cell(what)} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="write docs/cli.md and docs/deploy-env.md from the code")
    ap.add_argument("--check", action="store_true", help="exit 1 if a file is stale, writing nothing")
    args = ap.parse_args(argv)
    stale = []
    for path, text in ((CLI_MD, render_cli()), (ENV_MD, render_env())):
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path.relative_to(ROOT))
        if not args.check:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
    if args.check and stale:
        print(f"stale: {', '.join(map(str, stale))}; run python scripts/gen_cli_docs.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
