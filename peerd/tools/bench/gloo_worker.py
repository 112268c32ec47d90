"""One rank of the gloo baseline: torch.distributed all-reduce of the same vectors peerd averages.

The bench starts N of these; each line "go" on stdin runs one timed weighted average and answers
"done SECONDS CPU_S SYS_S" (this rank's CPU seconds in it, all threads, and the kernel's part); "quit" ends
it. Run as: python -m peerd.tools.bench.gloo_worker RANK WORLD PORT SIZE SEED WEIGHT
"""

from __future__ import annotations

import os
import resource
import sys
import time


def main() -> int:
    rank, world, port, size, seed = (int(x) for x in sys.argv[1:6])
    weight = float(sys.argv[6])
    import torch
    import torch.distributed as dist

    from .vectors import seeded_vector

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    vector = torch.from_numpy(seeded_vector(seed, size))
    total = torch.tensor([weight], dtype=torch.float64)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        work = vector * weight  # what a trainer would do: weight by its sample count
        dist.barrier()
        t0, usage0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        dist.all_reduce(work)
        w = total.clone()
        dist.all_reduce(w)
        work /= float(w.item())
        seconds = time.perf_counter() - t0
        usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread's: gloo's I/O threads too
        user, system = usage.ru_utime - usage0.ru_utime, usage.ru_stime - usage0.ru_stime
        print(f"done {seconds:.6f} {user + system:.6f} {system:.6f}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
