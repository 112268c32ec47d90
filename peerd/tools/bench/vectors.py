"""Seeded vectors shared by the daemon's bench ops, the gloo workers and the bench's exact mean."""

from __future__ import annotations

import numpy as np


def seeded_vector(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(size, dtype=np.float32)
