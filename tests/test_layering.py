"""The package's layers, read from its imports (ast, no import is run): docs/architecture.md explains them.

A module may import from its own package and from packages in lower layers only; nothing in the daemon imports
the tooling (peerd/tools/) or the trainer library (peerd/torch/); no two modules import each other, however far
round; and a sans-I/O core imports no I/O, directly or through what it imports. Each rule has a test below that
feeds it a violation, so a checker that stopped looking would fail too."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from .support.cores import CORES

ROOT = Path(__file__).resolve().parent.parent
PEERD = ROOT / "peerd"

# Lowest first. An area is a subpackage of peerd, or a top-level module (daemon, cli), or "peerd" (its __init__:
# the version). A module may import only from its own area and from areas in LOWER layers: never sideways within
# a layer, never upward.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    # the C extension, rng, metrics; the deadline tuner (a pure core the rounds, the trainer and the status share);
    # the argparse pieces the command line and the tooling's commands share; the daemon's BLAS threads; a
    # service's own nursery
    ("foundation", frozenset({"peerd", "_dataplane", "entropy", "metrics", "deadlines", "nurseries", "cliargs",
                              "blas"})),
    ("wire", frozenset({"wire"})),  # envelope, sealing, messages: what a datagram is
    # moving bytes, coding arrays; the owner's views (status: the page's HTTP server, the terminal table)
    ("links", frozenset({"transport", "compress", "localsock", "addresses", "status"})),
    ("protocols", frozenset({"dht", "allreduce", "nat", "linkcap"})),  # one protocol each, over the transport
    # averaging rounds over dht + allreduce; snapshots; the per-peer view over transport and nat
    ("rounds", frozenset({"moshpit", "statesync", "peers"})),
    ("trainer", frozenset({"trainer"})),  # the daemon's side of a trainer's session
    ("daemon", frozenset({"daemon"})),  # wires one node's services together
    ("tools", frozenset({"tools"})),  # benches, labs, simulator, local swarms, demos: drive daemons from outside
    ("entry", frozenset({"cli"})),  # the command line
    ("main", frozenset({"__main__"})),  # python -m peerd
)
# The trainer-side library runs in the trainer's process, beside the daemon and never inside it: it sits above
# the "links" layer (it talks to the daemon over the local socket, codes arrays with compress) and only tooling
# and the command line import it (rule below).
SIDE_LAYERS: Mapping[str, str] = {"torch": "links"}
# Imports that break the layer order on purpose, each with why. (importer module, imported module) -> reason.
EXCEPTIONS: Mapping[tuple[str, str], str] = {
    ("peerd.torch.optimizer", "peerd.allreduce.robust"):
        "the trainer checks its robust= option with the daemon's own parser, so both refuse the same strings",
}
# Areas that only the tooling and the entry layer may import.
OFF_DAEMON = ("tools", "torch")
MAY_IMPORT_OFF_DAEMON = frozenset({"tools", "cli", "__main__", "torch"})

# Sans-I/O modules: protocol logic and the pure helpers it uses. Each takes time and randomness from its caller
# and imports no I/O (an I/O library, or a module that imports one), so it runs the same under a test's virtual
# time, in `peerd sim` and in the daemon.
SANS_IO: tuple[str, ...] = (
    "wire/envelope.py", "wire/errors.py", "wire/messages.py", "wire/replay.py", "wire/schema.py", "wire/seal.py",
    "compress/base.py", "compress/floats.py", "compress/quant.py", "compress/rounding.py", "compress/topk.py",
    "transport/core.py", "transport/guard.py", "transport/rto.py", "transport/qdelay.py", "transport/rotation.py",
    "transport/pacing.py", "transport/pacing_judge.py", "transport/pacing_params.py", "transport/pacing_records.py",
    "transport/caps.py", "transport/receive.py", "transport/paths.py",
    "dht/core.py", "dht/lookup.py", "dht/reads.py", "dht/records.py", "dht/routing.py",
    "allreduce/group.py", "allreduce/intake.py", "allreduce/outbox.py", "allreduce/finalize.py", "allreduce/phase.py",
    "allreduce/kernels.py", "allreduce/options.py", "allreduce/actions.py", "allreduce/running.py",
    "allreduce/host.py", "allreduce/held.py", "allreduce/robust.py", "allreduce/shards.py", "allreduce/frames.py",
    "allreduce/liveness.py",
    "nat/punch.py", "nat/reach.py", "nat/relay.py", "nat/paths.py",
    "linkcap/core.py", "linkcap/budget.py", "linkcap/rates.py",
    "moshpit/keys.py", "moshpit/matchmaking.py", "moshpit/records.py", "moshpit/rounds.py", "moshpit/sticky.py",
    "moshpit/expect.py", "moshpit/actions.py", "moshpit/liveness.py",
    "statesync/choice.py",
    "trainer/agreement.py", "trainer/records.py",
    "deadlines.py",
)
IO_LIBRARIES = frozenset({"trio", "socket", "asyncio", "selectors", "select", "subprocess", "ssl"})
# socket's address-text helpers are pure functions: a module that uses only these is not doing I/O.
PURE_SOCKET = frozenset({"inet_ntop", "inet_pton", "AF_INET", "AF_INET6", "AddressFamily"})


@dataclass(frozen=True)
class Import:
    module: str  # the module importing
    target: str  # the peerd module (or package) imported, or an outside top-level name
    line: int
    typing_only: bool = False  # under ``if TYPE_CHECKING:``: an annotation's, never run

def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def read_sources(root: Path) -> dict[str, str]:
    """Module name -> source, for every module under ``root`` (a package directory)."""
    return {module_name(p, root): p.read_text() for p in sorted(root.rglob("*.py"))}


def imports_of(module: str, source: str, modules: Iterable[str], is_package: bool = False) -> list[Import]:
    """Every import in ``source``, at any depth (a lazy import inside a function counts as much as one at the
    top). ``from X import y`` where X.y is a module is an import of X.y alone (a package's __init__ is already
    loaded by then), otherwise of X."""
    known = set(modules)
    package = module if is_package else module.rpartition(".")[0]
    tree = ast.parse(source)
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node.test)
                   for stmt in node.body for n in ast.walk(stmt)}
    out = []
    for node in ast.walk(tree):
        guarded = id(node) in typing_only
        if isinstance(node, ast.Import):
            out += [Import(module, a.name, node.lineno, guarded) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                where = ".".join(base + ([node.module] if node.module else []))
            else:
                where = node.module or ""
            subs = [f"{where}.{a.name}" for a in node.names if f"{where}.{a.name}" in known]
            out += [Import(module, s, node.lineno, guarded) for s in subs]
            if len(subs) < len(node.names):
                out.append(Import(module, where, node.lineno, guarded))
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def all_imports(sources: Mapping[str, str]) -> list[Import]:
    return [i for name, src in sources.items()
            for i in imports_of(name, src, sources, is_package=_is_package(name, sources))]


def _is_package(name: str, sources: Mapping[str, str]) -> bool:
    return any(other.startswith(name + ".") for other in sources)


def area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def rank(name: str) -> float:
    for i, (_, areas) in enumerate(LAYERS):
        if name in areas:
            return float(i)
    if name in SIDE_LAYERS:
        return next(i for i, (layer, _) in enumerate(LAYERS) if layer == SIDE_LAYERS[name]) + 0.5
    raise KeyError(name)


def layer_of(name: str) -> frozenset[str]:
    """The areas that share ``name``'s layer (its own alone for a side layer)."""
    return next((areas for _, areas in LAYERS if name in areas), frozenset({name}))


def upward(imports: Iterable[Import]) -> list[str]:
    """Imports of an area in the same or a higher layer (sideways or upward), less the declared EXCEPTIONS."""
    found = []
    for i in imports:
        if not i.target.startswith("peerd"):
            continue
        a, b = area(i.module), area(i.target)
        if a == b or (i.module, i.target) in EXCEPTIONS:
            continue
        if rank(b) >= rank(a) and not (b == "peerd" and a in layer_of("peerd")):
            found.append(f"{i.module}:{i.line} imports {i.target} ({b} is not below {a})")
    return found


def off_daemon(imports: Iterable[Import]) -> list[str]:
    """Imports of the tooling or the trainer library from the daemon's modules."""
    return [f"{i.module}:{i.line} imports {i.target}" for i in imports
            if i.target.startswith("peerd.") and area(i.target) in OFF_DAEMON
            and area(i.module) not in MAY_IMPORT_OFF_DAEMON]


def cycles(imports: Iterable[Import], modules: Iterable[str]) -> list[list[str]]:
    """The import cycles between modules: strongly connected components of more than one module (Tarjan's,
    iterative, so no recursion limit). An import for annotations only (``if TYPE_CHECKING:``) runs nothing and
    makes no cycle."""
    known = set(modules)
    graph: dict[str, set[str]] = {m: set() for m in known}
    for i in imports:
        if i.target in known and i.target != i.module and not i.typing_only:
            graph[i.module].add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return found


def io_uses(source: str) -> set[str]:
    """The I/O libraries ``source`` imports (socket only where it uses more than the address-text helpers)."""
    tree = ast.parse(source)
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module.split(".")[0]]
            if names == ["socket"] and all(a.name in PURE_SOCKET for a in node.names):
                names = []
        found |= {n for n in names if n in IO_LIBRARIES}
    if "socket" in found:
        used = {n.attr for n in ast.walk(tree)
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "socket"}
        if used <= PURE_SOCKET:
            found.discard("socket")
    return found


def io_reached(core: str, sources: Mapping[str, str], imports: Iterable[Import]) -> list[str]:
    """How ``core`` reaches I/O: each chain of peerd imports from it to a module that imports an I/O library."""
    graph: dict[str, set[str]] = {}
    for i in imports:
        if i.target in sources:
            graph.setdefault(i.module, set()).add(i.target)
    found = []
    seen = {core}
    frontier = [(core, [core])]
    while frontier:
        module, path = frontier.pop()
        io = io_uses(sources[module])
        if io:
            found.append(" -> ".join(path) + f" imports {', '.join(sorted(io))}")
            continue
        for nxt in sorted(graph.get(module, ())):
            if nxt not in seen:
                seen.add(nxt)
                frontier.append((nxt, path + [nxt]))
    return found


@pytest.fixture(scope="module")
def peerd_imports() -> tuple[dict[str, str], list[Import]]:
    sources = read_sources(PEERD)
    return sources, all_imports(sources)


def test_every_area_has_a_layer(peerd_imports) -> None:
    sources, _ = peerd_imports
    unplaced = sorted({area(m) for m in sources} - {a for _, areas in LAYERS for a in areas} - set(SIDE_LAYERS))
    assert not unplaced, f"give these a layer in LAYERS (and docs/architecture.md): {unplaced}"


def test_no_import_runs_sideways_or_upward(peerd_imports) -> None:
    found = upward(peerd_imports[1])
    assert not found, "imports against the layer order (docs/architecture.md):\n" + "\n".join(found)


def test_the_declared_exceptions_are_still_needed(peerd_imports) -> None:
    _, imports = peerd_imports
    present = {(i.module, i.target) for i in imports}
    stale = [pair for pair in EXCEPTIONS if pair not in present]
    assert not stale, f"drop these from EXCEPTIONS, nothing imports that way any more: {stale}"


def test_the_daemon_imports_no_tooling_and_no_trainer_library(peerd_imports) -> None:
    found = off_daemon(peerd_imports[1])
    assert not found, "peerd/tools and peerd/torch are reached only from the command line:\n" + "\n".join(found)


def test_no_import_cycle(peerd_imports) -> None:
    found = cycles(peerd_imports[1], peerd_imports[0])
    assert not found, "modules that import each other (move the shared part below both):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_the_sans_io_modules_exist(peerd_imports) -> None:
    sources, _ = peerd_imports
    names = {module_name(PEERD / rel, PEERD) for rel in SANS_IO}
    assert names <= set(sources), f"SANS_IO names modules that do not exist: {sorted(names - set(sources))}"


def test_every_cores_module_is_sans_io() -> None:
    listed = {module_name(PEERD / rel, PEERD) for rel in SANS_IO}
    missing = sorted({module for module, _ in CORES} - listed)
    assert not missing, f"a core's module belongs on SANS_IO (so its imports are checked): {missing}"


@pytest.mark.parametrize("rel", SANS_IO)
def test_a_sans_io_module_reaches_no_io(rel: str, peerd_imports) -> None:
    sources, imports = peerd_imports
    found = io_reached(module_name(PEERD / rel, PEERD), sources, imports)
    assert not found, "a sans-I/O module must not import I/O (take what it needs from its caller):\n" + "\n".join(
        found)


# -- the checker itself: each rule catches a violation made for it ---------------------------------------------
def _fake(tmp_path: Path, files: Mapping[str, str]) -> tuple[dict[str, str], list[Import]]:
    root = tmp_path / "peerd"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    sources = read_sources(root)
    return sources, all_imports(sources)


def test_the_checker_catches_an_upward_and_a_sideways_import(tmp_path: Path) -> None:
    _, imports = _fake(tmp_path, {
        "__init__.py": "", "wire/__init__.py": "", "dht/__init__.py": "", "nat/__init__.py": "",
        "wire/envelope.py": "def f():\n    from ..dht import core\n",
        "dht/core.py": "from ..nat import punch\nfrom ..wire import envelope\n",
        "nat/punch.py": "",
    })
    found = upward(imports)
    assert any("peerd.wire.envelope" in f and "peerd.dht.core" in f for f in found)  # upward, and lazy
    assert any("peerd.dht.core" in f and "peerd.nat.punch" in f for f in found)  # sideways
    assert not any("imports peerd.wire.envelope" in f for f in found)  # downward is fine


def test_the_checker_catches_the_daemon_importing_tools(tmp_path: Path) -> None:
    _, imports = _fake(tmp_path, {
        "__init__.py": "", "tools/__init__.py": "", "tools/bench.py": "",
        "daemon.py": "from .tools import bench\n", "cli.py": "def main():\n    from .tools import bench\n",
    })
    assert off_daemon(imports) == ["peerd.daemon:1 imports peerd.tools.bench"]


def test_the_checker_catches_a_cycle(tmp_path: Path) -> None:
    sources, imports = _fake(tmp_path, {
        "__init__.py": "", "dht/__init__.py": "",
        "dht/a.py": "from .b import x\n", "dht/b.py": "from .c import y\n", "dht/c.py": "from . import a\n",
        "dht/d.py": "from .a import z\nfrom .e import w\n",
        # e imports d for annotations only: d -> e -> d is no cycle
        "dht/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import z\n",
    })
    assert cycles(imports, sources) == [["peerd.dht.a", "peerd.dht.b", "peerd.dht.c"]]


def test_the_checker_catches_a_core_reaching_io(tmp_path: Path) -> None:
    sources, imports = _fake(tmp_path, {
        "__init__.py": "", "dht/__init__.py": "",
        "dht/core.py": "from .routing import Table\n", "dht/routing.py": "from .service import run\n",
        "dht/service.py": "import trio\n",
        "dht/text.py": "import socket\nX = socket.inet_ntop(socket.AF_INET, b'1234')\n",
        "dht/udp.py": "import socket\nS = socket.socket()\n",
    })
    assert io_reached("peerd.dht.core", sources, imports) == [
        "peerd.dht.core -> peerd.dht.routing -> peerd.dht.service imports trio"]
    assert io_reached("peerd.dht.text", sources, imports) == []  # address text only: not I/O
    assert io_reached("peerd.dht.udp", sources, imports) == ["peerd.dht.udp imports socket"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
