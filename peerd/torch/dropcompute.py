"""DropCompute (Giladi et al., NeurIPS 2023): stop taking micro-batches when a compute budget is spent.

In a synchronous step everyone waits for the slowest worker. With a threshold tau, a worker starts a
micro-batch only while its step has run for less than tau, then joins the average with the samples it
has; peerd uses the sample count as the averaging weight, so the average stays correctly normalized.

``budget_s="auto"`` picks tau from logged micro-batch times, as in the paper: log a few dozen full steps,
then try thresholds and keep the one that maximizes the effective speedup

    (1 - drop rate) / (1 - time saved) - 1

where the step time of N workers is the expected maximum over N of one worker's (thresholded) compute
time, estimated from the logged steps as an empirical order statistic. This module does not import torch:
it only measures time and counts samples.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

INF = float("inf")
EPS = 1e-9  # "start a micro-batch only while elapsed < tau - EPS": tau at a logged end time excludes it exactly


@dataclass(frozen=True)
class Threshold:
    tau: float  # seconds; inf: never drop
    speedup: float  # the objective at tau (0 for inf)
    drop_rate: float  # fraction of micro-batches dropped at tau, over the logged steps
    time_saved: float  # 1 - E[max step time at tau] / E[max step time]


def expected_max(values: Sequence[float], workers: int) -> float:
    """E[max of ``workers`` i.i.d. draws] from the empirical distribution of ``values`` (exact, deterministic)."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        return 0.0
    total = 0.0
    for i, x in enumerate(xs, start=1):
        total += x * ((i / n) ** workers - ((i - 1) / n) ** workers)
    return total


def _run_to(times: Sequence[float], tau: float) -> tuple[int, float]:
    """Micro-batches a worker computes under the rule "start one only while elapsed < tau", and its time."""
    elapsed, done = 0.0, 0
    for t in times:
        if done and elapsed >= tau - EPS:
            break
        elapsed += t
        done += 1
    return done, elapsed


def choose_threshold(steps: Sequence[Sequence[float]], workers: int, *, overhead_s: float = 0.0) -> Threshold:
    """The tau that maximizes (1 - drop rate) / (1 - time saved) - 1 over the logged ``steps``.

    ``steps`` holds one list of micro-batch durations per logged step (taken without a threshold);
    ``workers`` is how many workers wait for each other (the group size); ``overhead_s`` is per-step time
    that a threshold cannot shorten (communication). Returns tau = inf when no threshold helps.
    """
    steps = [list(s) for s in steps if len(s) > 0]
    if not steps:
        return Threshold(INF, 0.0, 0.0, 0.0)
    workers = max(1, int(workers))
    full = expected_max([sum(s) for s in steps], workers) + overhead_s
    total_mb = sum(len(s) for s in steps)
    best = Threshold(INF, 0.0, 0.0, 0.0)
    candidates = sorted({sum(s[: j + 1]) for s in steps for j in range(len(s) - 1)})
    for tau in candidates:
        done, times = 0, []
        for s in steps:
            n, t = _run_to(s, tau)
            done += n
            times.append(t)
        drop = 1.0 - done / total_mb
        ratio = (expected_max(times, workers) + overhead_s) / full if full > 0 else 1.0
        speedup = (1.0 - drop) / ratio - 1.0 if ratio > 0 else 0.0
        if speedup > best.speedup + 1e-9:
            best = Threshold(tau, speedup, drop, 1.0 - ratio)
    return best


class DropCompute:
    """Gradient accumulation with a compute budget per step.

    ::

        dc = DropCompute(budget_s="auto", workers=4)
        for batch in loader:
            dc.start_step()
            for x, y in micro_batches(batch):
                if not dc.keep_going():
                    break
                with dc.microbatch(len(x)):
                    loss_fn(model(x), y, reduction="sum").backward()
            dc.mean_grads(model.parameters())   # gradients are now the mean over dc.samples
            opt.step(samples=dc.samples)        # the sample count is the averaging weight

    ``budget_s=None`` never drops (but still counts samples and logs times); a float is a fixed tau;
    ``"auto"`` logs ``warmup_steps`` full steps, then picks tau with :func:`choose_threshold`, and
    then runs one full (probe) step every ``probe_every`` steps and re-picks tau from the most recent
    ``window`` logged steps every ``refit_every`` probes.
    """

    def __init__(self, budget_s: float | str | None = "auto", *, workers: int = 4, warmup_steps: int = 20,
                 probe_every: int = 10, refit_every: int = 5, window: int = 200, overhead_s: float = 0.0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if budget_s is not None and budget_s != "auto" and not (isinstance(budget_s, int | float) and budget_s > 0):
            raise ValueError('budget_s must be a positive number of seconds, "auto" or None')
        self.mode = budget_s
        self.workers = workers
        self.warmup_steps = warmup_steps
        self.probe_every = probe_every
        self.refit_every = refit_every
        self.window = window
        self.overhead_s = overhead_s
        self.clock = clock
        self.tau: float = float(budget_s) if isinstance(budget_s, int | float) else INF
        self.choice: Threshold | None = None
        self.log: list[list[float]] = []
        self.steps = 0
        self.samples = 0
        self.dropped = 0  # micro-batches skipped over all steps (as far as the loop told us, see keep_going)
        self.computed = 0
        self._times: list[float] = []
        self._start = 0.0
        self._probe = False

    def start_step(self) -> None:
        self._start = self.clock()
        self._times = []
        self.samples = 0
        # "auto" logs full steps: all of the warm-up, then one probe step every ``probe_every``. Only
        # probes are logged, never thresholded steps, whose times the threshold itself has cut short.
        self._probe = self.mode == "auto" and (
            self.steps < self.warmup_steps or self.steps % self.probe_every == 0
        )

    def elapsed(self) -> float:
        return self.clock() - self._start

    def keep_going(self) -> bool:
        """Start another micro-batch? Always the first; then only while the step has run under tau."""
        if not self._times or self._probe or self.elapsed() < self.tau - EPS:
            return True
        self.dropped += 1
        return False

    @contextmanager
    def microbatch(self, samples: int) -> Iterator[None]:
        """Time one micro-batch of ``samples`` samples (counted only if the body completes)."""
        t0 = self.clock()
        yield
        self._times.append(self.clock() - t0)
        self.samples += int(samples)
        self.computed += 1

    def end_step(self) -> int:
        """Close the step (mean_grads calls it); returns its sample count."""
        if self._probe and self._times:
            self.log.append(self._times)
            del self.log[: -self.window]
            if len(self.log) >= self.warmup_steps and (self.choice is None or len(self.log) % self.refit_every == 0):
                self.choice = choose_threshold(self.log, self.workers, overhead_s=self.overhead_s)
                self.tau = self.choice.tau
        self.steps += 1
        self._times = []
        return self.samples

    def mean_grads(self, parameters) -> int:  # noqa: ANN001 - torch parameters; this module avoids torch
        """Divide summed gradients by the step's sample count (the daemon averages means); returns it."""
        samples = self.end_step()
        if samples > 0:
            for p in parameters:
                if p.grad is not None:
                    p.grad.div_(samples)
        return samples
