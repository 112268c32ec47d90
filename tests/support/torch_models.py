"""A small model and its parameters as one flat tensor, for the trainer library's tests."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def model(seed: int = 0, hidden: int = 8) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))


def flat(ps) -> torch.Tensor:
    """Every parameter of a module (or of an iterable of tensors) as one flat CPU tensor, to compare replicas."""
    if isinstance(ps, torch.nn.Module):
        ps = ps.parameters()
    return torch.cat([p.detach().reshape(-1).cpu() for p in ps])


