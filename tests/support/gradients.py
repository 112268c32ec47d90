"""Honest members' gradients, and how close an average came to them."""

from __future__ import annotations

import numpy as np


def cos(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity, computed in float64."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def gradients(n: int, length: int, seed: int) -> list[np.ndarray]:
    """Honest replicas' gradients: a common signal plus noise of the same size."""
    rng = np.random.default_rng(seed)
    signal = rng.standard_normal(length)
    return [(signal + rng.standard_normal(length)).astype(np.float32) for _ in range(n)]
