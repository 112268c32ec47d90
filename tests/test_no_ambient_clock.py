"""The protocol packages take time and randomness from their callers (issue 14): a sans-I/O core that read the
wall clock or an unseeded generator could not run in `peerd sim`'s virtual time, nor repeat a test exactly.

This greps the packages for the ambient sources. Where a caller injected no rng, code falls back through
peerd/entropy.py (outside these packages, so visible in one place). A module on the allow list draws entropy for
keys and tokens or only measures its own duration; each entry says which."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PEERD = Path(__file__).resolve().parent.parent / "peerd"

# Packages whose decisions must be reproducible from (inputs, now, rng).
PROTOCOL_PACKAGES = ("wire", "transport", "dht", "allreduce", "moshpit", "statesync", "tools/sim", "compress", "nat")

AMBIENT = re.compile(
    r"\btime\.(time|monotonic|perf_counter|time_ns|monotonic_ns)\(\)"
    r"|\bdatetime\.now\("
    r"|\brandom\.(random|randint|choice|choices|sample|shuffle|uniform|getrandbits|randrange|gauss)\("
    r"|\brandom\.(Random|SystemRandom)\(\)"
    r"|\bnp\.random\.(default_rng\(\)|(rand|randn|randint|random|choice|shuffle|seed)\()"
    r"|\bsecrets\.|\bos\.urandom\("
)

ALLOWED = {
    # Entropy for secrets: a node's identity and swarm keys must never be reproducible.
    "wire/identity.py": "key generation",
    # The default token source when no rng is injected (two processes sharing a token would reuse nonces).
    "wire/seal.py": "default sealing token",
    # The trio shell times each average for peerd_allreduce_seconds; no decision reads it.
    "allreduce/service.py": "duration metric",
    # The simulators report their wall time on stderr, never in the JSON.
    "tools/sim/dht.py": "wall time on stderr",
    "tools/sim/moshpit.py": "wall time on stderr",
}


def _violations() -> list[str]:
    found = []
    for package in PROTOCOL_PACKAGES:
        for path in sorted((PEERD / package).rglob("*.py")):
            rel = path.relative_to(PEERD).as_posix()
            if rel in ALLOWED:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if AMBIENT.search(code):
                    found.append(f"peerd/{rel}:{number}: {line.strip()}")
    return found


def test_protocol_packages_read_no_ambient_clock_or_randomness() -> None:
    found = _violations()
    assert not found, "inject now/rng instead (or add the module to ALLOWED with why):\n" + "\n".join(found)


@pytest.mark.parametrize("line", [
    "now = time.time()", "t = time.monotonic()", "rng = random.Random()", "x = random.random()",
    "token = secrets.randbits(64)", "r = random.SystemRandom()", "g = np.random.default_rng()", "k = os.urandom(8)",
])
def test_the_pattern_catches_each_ambient_source(line: str) -> None:
    assert AMBIENT.search(line)


@pytest.mark.parametrize("line", [
    "rng = random.Random(seed)", "g = np.random.default_rng(seed)", "now = trio.current_time()",
    "self.rng.random()", "def handle(self, now: float) -> None:",
])
def test_the_pattern_lets_injected_sources_through(line: str) -> None:
    assert not AMBIENT.search(line)
