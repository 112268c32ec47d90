"""Running the real CLI and reading what real daemons export, for end-to-end tests."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request


def peerd(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    """Run the peerd CLI as a user would."""
    proc = subprocess.run([sys.executable, "-m", "peerd", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise AssertionError(f"peerd {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def peerd_json(*args: str, timeout: float = 60) -> dict:
    return json.loads(peerd(*args, "--json", timeout=timeout).stdout)


def scrape(metrics_addr: str) -> str:
    with urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=10) as r:
        return r.read().decode()


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        if metric != name:
            continue
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total += float(value)
    return total


def wait_until(predicate, timeout: float, interval: float = 1.0, what: str = "condition"):
    """Poll gently (these machines have 2 cores); returns the predicate's truthy value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def peerd_process(*args: str, stdout: int = subprocess.DEVNULL) -> subprocess.Popen:
    """Start the peerd CLI in the background (its stderr piped, as text, for the test to read)."""
    return subprocess.Popen([sys.executable, "-m", "peerd", *args], stdin=subprocess.DEVNULL, stdout=stdout,
                            stderr=subprocess.PIPE, text=True)


def lines_until(stream, marker: str, timeout: float) -> list[str]:
    """Read ``stream``'s lines up to the first holding ``marker`` (included), its end, or ``timeout`` seconds."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        lines.append(line)
        if marker in line:
            break
    return lines


def killed_lab(module: str, *args: str) -> dict:
    """Start ``python -m module hold ARGS`` (a lab that holds its namespaces), read the JSON line that names them,
    then SIGKILL it, so that nothing it made is removed: that line."""
    proc = subprocess.Popen([sys.executable, "-m", module, "hold", *args], stdout=subprocess.PIPE, text=True)
    info = json.loads(proc.stdout.readline())
    proc.kill()
    proc.wait()
    return info
