"""Benchmarks: real daemons as processes on 127.0.0.1, baselines measured in the same run."""
