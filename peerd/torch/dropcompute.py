"""DropCompute (Giladi et al., NeurIPS 2023): stop taking micro-batches when a compute budget is spent.

In a synchronous step everyone waits for the slowest worker. With a threshold tau, a worker starts a
micro-batch only while its step has run for less than tau, then joins the average with the samples it
has; peerd uses the sample count as the averaging weight, so the average stays correctly normalized.

``budget_s="auto"`` picks tau from logged micro-batch times, as in the paper: log some steps, then try
thresholds and keep the one that maximizes the effective speedup

    (1 - drop rate) / (1 - time saved) - 1

where the step time of N workers is the expected maximum over N of one worker's (thresholded) compute
time plus the per-step time a threshold cannot shorten (communication and the rest of the loop).

Two estimators of that objective:

- ``"steps"`` (the paper's): log full steps (a warm-up, then one full probe step every few steps) and
  evaluate each candidate tau on them, with the maximum over N as an empirical order statistic. With a few
  dozen steps this is noisy: the tau that looks best on 20 steps often loses on the next 200.
- ``"pooled"`` (the default): pool the durations of every micro-batch computed, thresholded steps included
  (whether a micro-batch starts does not depend on how long it will take, so they are unbiased draws), and
  evaluate the candidates on a few thousand synthetic full steps resampled from the pool with a fixed seed.
  This assumes micro-batch times are independent of their position in the step; it needs no probe steps
  after the warm-up, and its choice is stable from ten warm-up steps on.

The per-step overhead is measured, not guessed: a step's cycle (start of compute to start of the next
step's compute) is the group's slowest compute plus the overhead, so the mean cycle minus the expected
maximum of N of this worker's compute times estimates it (:func:`estimate_overhead`). The time a worker
spends in the averaging round itself would overstate it: most of that is waiting for the slowest member,
the very time a threshold removes.

This module does not import torch: it only measures time and counts samples.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

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


def _expected_max_rows(values: np.ndarray, workers: int) -> np.ndarray:
    """:func:`expected_max` of each row of a 2-D array."""
    xs = np.sort(values, axis=-1)
    n = xs.shape[-1]
    i = np.arange(1, n + 1, dtype=np.float64)
    w = (i / n) ** workers - ((i - 1) / n) ** workers
    return xs @ w


def choose_threshold_pooled(times: Sequence[float], micro: int, workers: int, *, overhead_s: float = 0.0,
                            draws: int = 2048, candidates: int = 64, seed: int = 0,
                            min_speedup: float = 0.01) -> Threshold:
    """The tau that maximizes (1 - drop rate) / (1 - time saved) - 1 over synthetic full steps.

    ``times`` are micro-batch durations pooled over any steps (thresholded ones included); ``micro`` is how
    many micro-batches a full step has. ``draws`` synthetic steps of ``micro`` durations each are drawn from
    the pool with replacement (seeded: the same pool gives the same tau), and ``candidates`` thresholds, the
    quantiles of the synthetic micro-batch start times, are tried. A tau whose predicted speedup is below
    ``min_speedup`` is not worth the dropped samples: tau = inf then.
    """
    pool = np.asarray([t for t in times if t >= 0], dtype=np.float64)
    workers = max(1, int(workers))
    if pool.size == 0 or micro < 2:
        return Threshold(INF, 0.0, 0.0, 0.0)
    rng = np.random.default_rng(seed)
    ends = np.cumsum(rng.choice(pool, size=(draws, micro)), axis=1)  # end time of each micro-batch
    starts = ends[:, :-1]  # start time of micro-batches 2..micro
    full = float(_expected_max_rows(ends[:, -1], workers)) + overhead_s
    if full <= 0:
        return Threshold(INF, 0.0, 0.0, 0.0)
    taus = np.unique(np.quantile(starts, np.linspace(0.0, 1.0, candidates)))
    # done[c, k]: micro-batches of synthetic step k under tau c (the first always runs)
    done = 1 + (starts[None, :, :] < taus[:, None, None] - EPS).sum(axis=2)
    step_times = np.take_along_axis(np.broadcast_to(ends, (len(taus), *ends.shape)), done[..., None] - 1,
                                    axis=2)[..., 0]
    kept = done.mean(axis=1) / micro
    ratio = (_expected_max_rows(step_times, workers) + overhead_s) / full
    speedup = kept / ratio - 1.0
    best = int(np.argmax(speedup))
    if not speedup[best] > min_speedup:
        return Threshold(INF, 0.0, 0.0, 0.0)
    return Threshold(float(taus[best]), float(speedup[best]), float(1.0 - kept[best]), float(1.0 - ratio[best]))


def estimate_overhead(computes: Sequence[float], cycles: Sequence[float], workers: int) -> float:
    """Per-step time that a threshold cannot shorten, from one worker's own steps.

    ``computes[i]`` is a step's compute time and ``cycles[i]`` the time from its start to the start of the
    next step. In a synchronous step the cycle is the slowest member's compute plus the overhead, so the
    overhead is the mean cycle less the expected maximum over ``workers`` of the compute times (which takes
    the workers' compute times as draws from this worker's). Never negative.
    """
    if not computes or len(computes) != len(cycles):
        return 0.0
    return max(0.0, sum(cycles) / len(cycles) - expected_max(computes, workers))


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
    ``"auto"`` runs ``warmup_steps`` full steps, then picks tau and re-picks it from the recent logs:

    - ``estimate="pooled"`` (default): every step's micro-batch times go to the log (the last ``window``
      steps); tau comes from :func:`choose_threshold_pooled` after the warm-up and every ``refit_every``
      steps after that. No step runs in full after the warm-up.
    - ``estimate="steps"`` (the paper's): only full steps are logged, the warm-up and then one probe step
      every ``probe_every`` steps; tau comes from :func:`choose_threshold` every ``refit_every`` probes.

    ``overhead_s``: per-step time a threshold cannot shorten; None (default) measures it from this
    worker's step cycles (:func:`estimate_overhead`, over the last ``window`` steps), which needs the loop
    to call :meth:`start_step` once per step, as above.
    """

    def __init__(self, budget_s: float | str | None = "auto", *, workers: int = 4, estimate: str = "pooled",
                 warmup_steps: int | None = None, probe_every: int = 10, refit_every: int | None = None,
                 window: int = 200, overhead_s: float | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if budget_s is not None and budget_s != "auto" and not (isinstance(budget_s, int | float) and budget_s > 0):
            raise ValueError('budget_s must be a positive number of seconds, "auto" or None')
        if estimate not in ("pooled", "steps"):
            raise ValueError('estimate must be "pooled" or "steps"')
        self.mode = budget_s
        self.workers = workers
        self.estimate = estimate
        pooled = estimate == "pooled"
        self.warmup_steps = (10 if pooled else 20) if warmup_steps is None else warmup_steps
        self.probe_every = probe_every
        self.refit_every = (10 if pooled else 5) if refit_every is None else refit_every
        self.window = window
        self.overhead_s = overhead_s  # None: measured (overhead_estimate)
        self.overhead_estimate = 0.0 if overhead_s is None else overhead_s  # the overhead the last choice used
        self.clock = clock
        self.tau: float = float(budget_s) if isinstance(budget_s, int | float) else INF
        self.choice: Threshold | None = None
        self.log: list[list[float]] = []
        self.micro = 0  # micro-batches in the longest step seen: a full step
        self.steps = 0
        self.samples = 0
        self.dropped = 0  # micro-batches skipped over all steps (as far as the loop told us, see keep_going)
        self.computed = 0
        self.computes: deque[float] = deque(maxlen=window)  # compute time of recent steps ...
        self.cycles: deque[float] = deque(maxlen=window)  # ... and the time from their start to the next start
        self._times: list[float] = []
        self._start = 0.0
        self._last: tuple[float, float] | None = None  # (start, compute time) of the step before this one
        self._probe = False
        self._closing = False  # decide_last said the micro-batch under way is the step's last

    def start_step(self) -> None:
        now = self.clock()
        if self._last is not None:
            start, compute = self._last
            self.computes.append(compute)
            self.cycles.append(now - start)
            self._last = None
        self._start = now
        self._times = []
        self.samples = 0
        self._closing = False
        # "auto" runs the warm-up in full; "steps" also runs one probe step every ``probe_every``. Those
        # estimates log only full steps, never thresholded ones, whose times the threshold itself cut short.
        self._probe = self.mode == "auto" and (
            self.steps < self.warmup_steps
            or (self.estimate == "steps" and self.probe_every > 0 and self.steps % self.probe_every == 0)
        )

    def elapsed(self) -> float:
        return self.clock() - self._start

    def keep_going(self) -> bool:
        """Start another micro-batch? Always the first; then only while the step has run under tau."""
        if not self._times or (not self._closing and (self._probe or self.elapsed() < self.tau - EPS)):
            return True
        self.dropped += 1
        return False

    def decide_last(self, index: int, total: int) -> bool:
        """Before the forward of micro-batch ``index`` (0-based) of ``total``, which keep_going() allowed: will it
        be the step's last? With overlap its backward already sends the gradients (peerd.torch.Optimizer's
        ``last_microbatch``), so this is decided before it runs: the last of ``total``, or (thresholded) when the
        step will have run past tau by its end at this step's mean micro-batch time. A True commits: keep_going()
        refuses the next one."""
        last = index >= total - 1
        if not last and not self._probe and self.tau < INF and self._times:
            mean = sum(self._times) / len(self._times)
            last = self.elapsed() + mean >= self.tau - EPS
        self._closing = self._closing or last
        return last

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
        if self._times:
            self._last = (self._start, self.clock() - self._start)
            self.micro = max(self.micro, len(self._times))
        if self.mode == "auto" and self._times and (self._probe or self.estimate == "pooled"):
            self.log.append(self._times)
            del self.log[: -self.window]
            if self._refit_due():
                self.refit()
        self.steps += 1
        self._times = []
        return self.samples

    def _refit_due(self) -> bool:
        if self.estimate == "pooled":
            since = self.steps + 1 - self.warmup_steps
            return since >= 0 and since % max(1, self.refit_every) == 0
        return len(self.log) >= self.warmup_steps and (self.choice is None or len(self.log) % self.refit_every == 0)

    def refit(self) -> Threshold:
        """Pick tau again from the log (and the overhead from the recent cycles, unless it is fixed)."""
        if self.overhead_s is None:
            self.overhead_estimate = estimate_overhead(list(self.computes), list(self.cycles), self.workers)
        else:
            self.overhead_estimate = self.overhead_s
        if self.estimate == "pooled":
            pool = [t for step in self.log for t in step]
            self.choice = choose_threshold_pooled(pool, self.micro, self.workers, overhead_s=self.overhead_estimate)
        else:
            self.choice = choose_threshold(self.log, self.workers, overhead_s=self.overhead_estimate)
        self.tau = self.choice.tau
        return self.choice

    def mean_grads(self, parameters) -> int:  # noqa: ANN001 - torch parameters; this module avoids torch
        """Divide summed gradients by the step's sample count (the daemon averages means); returns it."""
        samples = self.end_step()
        if samples > 0:
            for p in parameters:
                if p.grad is not None:
                    p.grad.div_(samples)
        return samples
