"""Tooling around the daemon: benches, labs, fault injectors, the simulator, local swarms and demo trainers.

Nothing in the daemon's packages imports this package; ``peerd.cli`` reaches it lazily, inside the subcommands
that need it, and extends a daemon from outside (``peerd.tools.bench.ops.install_bench_ops``)."""
