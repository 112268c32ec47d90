"""DropCompute under a fake clock: a step of accumulation that a test can time exactly."""

from __future__ import annotations

from peerd.torch.dropcompute import DropCompute


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def run_step(dc: DropCompute, clock: FakeClock, times: list[float], per_mb: int = 8) -> int:
    dc.start_step()
    for t in times:
        if not dc.keep_going():
            break
        with dc.microbatch(per_mb):
            clock.t += t
    return dc.end_step()
