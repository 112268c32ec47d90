"""An in-process daemon for trainer tests: the real local socket server and TrainerService, in a thread,
averaging with a real in-process averager (exact weighted means across the sessions that meet in a round),
so trainer-side code can be tested without Moshpit or UDP."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import trio

from peerd.localsock.client import DaemonError
from peerd.localsock.server import LocalServer, OpError
from peerd.metrics import Metrics
from peerd.moshpit.service import RoundResult
from peerd.trainer import TrainerService
from peerd.wire.messages import MAX_KEY, MAX_SUBKEY

WINDOW_END = 1_900_000_000.0


@dataclass
class _Round:
    number: int
    entries: list[tuple[int, np.ndarray, float]] = field(default_factory=list)
    done: trio.Event = field(default_factory=trio.Event)
    mean: np.ndarray | None = None
    closed: bool = False


class InProcessAverager:
    """Callers of the same run id meet in a round; it closes at ``group_size`` callers or after ``wait_s``,
    and everyone gets the weighted mean of what the round holds (or their own vector alone)."""

    def __init__(self, group_size: int, wait_s: float = 5.0, delay_s: float = 0.0) -> None:
        self.group_size = group_size
        self.wait_s = wait_s
        self.delay_s = delay_s  # extra time every round takes (to catch a trainer mid-step)
        self.dims = 1  # the grid's dimensions each result reports (DiLoCo runs that many rounds an outer step)
        self.rounds: dict[str, _Round] = {}
        self.numbers: dict[str, int] = {}
        self.calls: list[tuple[str, float]] = []
        self.keep_rounds: list[int | None] = []  # what each call asked for (None: the daemon's default)
        self.round_numbers: list[int | None] = []  # the round each call named (None: the run's next)
        self.options: list[dict] = []  # the max_weight / robust keywords each call passed (only those set)
        self.readies: list[bool] = []  # whether each call came with ready= (a deferred bucket)
        self.part_rounds: list[tuple[str, int]] = []  # (run id, parts) of each average_parts call
        self.timeouts: list[float] = []  # the timeout_s each call was given
        self.poison: float | None = None  # if set, every averaged result holds this value (e.g. NaN) at [0]
        # what every averaged result reports: the share of datagrams that arrived, and whether the result is the
        # group's common one (a lossy link whose all-gather was repaired: below 1.0, and still complete)
        self.received_fraction = 1.0
        self.complete = True
        self._ids = 0

    def outer_options(self) -> list[dict]:
        """The options of the calls that named their round (DiLoCo's outer averages)."""
        return [o for o, r in zip(self.options, self.round_numbers, strict=True) if r is not None]

    async def average(self, run_id: str, vector: np.ndarray, weight: float, *, timeout_s: float = 30.0,
                      keep_rounds: int | None = None, round_no: int | None = None, ready=None,
                      **options) -> RoundResult:
        # codec keywords are taken and recorded (the average stays exact)
        assert set(options) <= {"max_weight", "robust", "center", "chain_from", "compression", "quant_group",
                                "rounding", "wait_s", "shares"}, options
        wait_s = max(self.wait_s, options.pop("wait_s", 0.0))  # (a round told to wait does, as Moshpit's)
        start = time.monotonic()
        self.readies.append(ready is not None)
        self.timeouts.append(timeout_s)
        if ready is not None:  # as Moshpit with ready=: (the group would form here) then the vector is read
            await ready()
        self.options.append(options)
        self.calls.append((run_id, weight))
        self.keep_rounds.append(keep_rounds)
        self.round_numbers.append(round_no)
        rnd = self.rounds.get(run_id)
        if rnd is None or rnd.closed:
            self.numbers[run_id] = self.numbers.get(run_id, -1) + 1  # from 0, as Moshpit numbers rounds
            rnd = self.rounds[run_id] = _Round(self.numbers[run_id])
        self._ids += 1
        me = self._ids
        rnd.entries.append((me, vector.astype(np.float32), weight))
        if len(rnd.entries) >= self.group_size:
            self._close(rnd)
        with trio.move_on_after(min(wait_s, timeout_s)):
            await rnd.done.wait()
        if not rnd.closed:
            self._close(rnd)
        if self.delay_s:
            await trio.sleep(self.delay_s)
        n = len(rnd.entries)
        # a matchmaking window's end, told apart by round: round r's is WINDOW_END + r
        facts = {"dims": self.dims, "window_end": WINDOW_END + (rnd.number if round_no is None else round_no)}
        if n == 1:
            return RoundResult(vector, "alone", "", 1, [], 0.0, rnd.number, time.monotonic() - start, **facts)
        assert rnd.mean is not None
        mean = rnd.mean.copy()
        if self.poison is not None:
            mean[0] = self.poison
        return RoundResult(mean, "averaged", f"{rnd.number:08x}", n, [str(e[0]) for e in rnd.entries],
                           self.received_fraction, rnd.number, time.monotonic() - start, complete=self.complete,
                           bytes_sent=2 * (n - 1) * vector.nbytes // n, **facts)  # (a butterfly's share)

    async def average_parts(self, run_id: str, parts: list, weight: float, *, timeout_s: float = 30.0,
                            keep_rounds: int | None = None, **options) -> list:
        """As Moshpit's: one "matchmaking" (recorded in ``part_rounds``), then part i averages as run
        ``<run_id>#i`` once its vector is fetched, and its ``done`` hears at once."""
        self.part_rounds.append((run_id, len(parts)))
        results: list = [None] * len(parts)

        async def one(i: int, part) -> None:
            try:
                vector = await part.fetch()
            except Exception as e:
                results[i] = e
            else:
                results[i] = await self.average(f"{run_id}#{i}", vector, weight, timeout_s=timeout_s,
                                                 keep_rounds=keep_rounds, **options)
            if part.done is not None:
                part.done(results[i])

        async with trio.open_nursery() as nursery:
            for i, part in enumerate(parts):
                nursery.start_soon(one, i, part)
        return results

    @staticmethod
    def _close(rnd: _Round) -> None:
        rnd.closed = True
        weights = np.array([w for _, _, w in rnd.entries], dtype=np.float64)
        stacked = np.stack([v.astype(np.float64) for _, v, _ in rnd.entries])
        rnd.mean = ((weights[:, None] * stacked).sum(0) / weights.sum()).astype(np.float32)
        rnd.done.set()


class ThreadDaemon:
    """LocalServer + TrainerService in a trio loop on a thread; ``stop()`` ends it like SIGTERM would."""

    def __init__(self, path: str, averager: InProcessAverager, *, statesync=None, ready: bool = True,
                 parts: bool = True, background: bool = False) -> None:
        self.path = path
        self.background = background  # run the service's background work too, as the daemon does
        self.metrics = Metrics()
        self.averager = averager
        self.server = LocalServer(path, self.metrics)
        self.service = TrainerService(self.metrics, averager.average, statesync=statesync, peer_id="test", ready=ready,
                                      average_parts=averager.average_parts if parts else None)
        self.service.register(self.server)
        self.dht: dict[str, dict[str, bytes]] = {}  # the daemon's dht_put / dht_get, in memory
        self.server.register("dht_put", self._dht_put)
        self.server.register("dht_get", self._dht_get)
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope: trio.CancelScope | None = None
        self._ready = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the in-process daemon did not start")

    async def _dht_put(self, req: dict) -> dict:
        value = req["value"].encode() if isinstance(req["value"], str) else req["value"]
        if len(req["key"].encode()) > MAX_KEY or len((req.get("subkey") or "").encode()) > MAX_SUBKEY:
            raise OpError(f"key must be 1..{MAX_KEY} bytes, subkey at most {MAX_SUBKEY}")  # as the daemon's DHT
        self.dht.setdefault(req["key"], {})[req.get("subkey") or "test"] = value
        return {"stored": 1, "refused": 0, "subkey": req.get("subkey") or "test"}

    async def _dht_get(self, req: dict) -> dict:
        # subkeys come back as bytes, as the daemon's
        return {"values": [{"subkey": k.encode(), "value": v, "expires_at": 0.0, "owner": "test"}
                           for k, v in self.dht.get(req["key"], {}).items()]}

    def _main(self) -> None:
        async def run() -> None:
            self._token = trio.lowlevel.current_trio_token()
            with trio.CancelScope() as scope:
                self._scope = scope
                async with trio.open_nursery() as nursery:
                    if self.background:
                        await nursery.start(self.service.run)
                    await nursery.start(self.server.serve)
                    self._ready.set()
        try:
            trio.run(run)
        except BaseException as e:  # surfaced by the tests
            self.error = e
            self._ready.set()

    def stop(self) -> None:
        if self._token is not None and self.thread.is_alive():
            try:
                trio.from_thread.run_sync(self._scope.cancel, trio_token=self._token)  # type: ignore[union-attr]
            except trio.RunFinishedError:
                pass
        self.thread.join(10)
        assert not self.thread.is_alive(), "the in-process daemon did not stop"

    def counter(self, counter, **labels) -> float:
        return sum(s.value for m in counter.collect() for s in m.samples
                   if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items()))

    def gauge(self, gauge) -> float:
        return next(s.value for m in gauge.collect() for s in m.samples)


@contextmanager
def thread_daemon(tmp_path: Path, group_size: int, wait_s: float = 5.0, delay_s: float = 0.0) -> Iterator[ThreadDaemon]:
    """A ThreadDaemon at ``tmp_path``/d.sock over an InProcessAverager(group_size, wait_s, delay_s), stopped when
    the block ends."""
    daemon = ThreadDaemon(str(tmp_path / "d.sock"), InProcessAverager(group_size, wait_s, delay_s))
    try:
        yield daemon
    finally:
        daemon.stop()


def error_when_the_daemon_dies(call: Callable[[], object], daemon: ThreadDaemon, within: float) -> str:
    """Run ``call`` in a thread and stop ``daemon`` half a second in, while the call waits on it: the call must
    raise a DaemonError within ``within`` seconds, whose text this returns."""
    errors: list[str] = []

    def run() -> None:
        try:
            call()
        except DaemonError as e:
            errors.append(str(e))

    t = threading.Thread(target=run)
    start = time.monotonic()
    t.start()
    time.sleep(0.5)
    daemon.stop()
    t.join(within)
    assert not t.is_alive() and time.monotonic() - start < within
    assert errors, "the call returned instead of raising DaemonError"
    return errors[0]


class MemoryStateSync:
    """The state-sync surface TrainerService uses, in memory and shared by every session of the daemon: what
    each publishes is advertised to the others, and a fetch takes the newest step (``below``: as a founder's
    fetch does, only a later step or, at step 0, a lower hash than the founder's own; the lowest hash first)."""

    def __init__(self) -> None:
        self.blobs: dict[str, dict[bytes, tuple[int, bytes]]] = {}  # run key -> sha -> (step, blob)
        self._kept: dict[str, bytes] = {}

    def keep(self, run_key: str, blob: bytes, *, sha: bytes | None = None) -> bytes:
        import hashlib

        assert sha is None or sha == hashlib.sha256(blob).digest()  # a caller's hash is the blob's
        sha = hashlib.sha256(blob).digest()
        self._kept[run_key] = blob
        return sha

    async def advertise_state(self, run, run_key, layout, *, step: int = -1, size: int = 0, sha: bytes = b"",
                              **kwargs) -> bool:
        if size and run_key in self._kept:
            self.blobs.setdefault(run_key, {})[sha] = (step, self._kept[run_key])
        return True

    async def adverts(self, run: str, *, timeout: float = 10.0) -> list:
        return []

    async def fetch(self, run: str, run_key: str, *, below: bytes | None = None, **kwargs):
        from peerd.statesync import Fetched

        held = self.blobs.get(run_key, {})
        ads = [(step, sha) for sha, (step, _) in held.items() if below is None or step > 0 or sha < below]
        if not ads:
            return None
        step, sha = min(ads, key=lambda a: (-a[0], a[1]))
        return Fetched(step, held[sha][1], sha, 1, 1, 0)


def in_threads(n: int, work: Callable[[int], None], timeout: float = 60.0) -> None:
    """Run ``work(i)`` for i in range(n), each in its own thread (trainers beside one daemon); the first error any
    raised is raised here."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            work(i)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors

