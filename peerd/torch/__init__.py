"""Trainer side of peerd: the only package that imports torch.

``Optimizer`` wraps a torch optimizer so its steps average with the swarm through the local daemon;
``DropCompute`` stops gradient accumulation when a compute budget is spent.
"""

from ..localsock.client import DaemonError
from .dropcompute import DropCompute, Threshold, choose_threshold, expected_max
from .optimizer import NoGroupError, Optimizer

__all__ = ["DaemonError", "DropCompute", "NoGroupError", "Optimizer", "Threshold", "choose_threshold",
           "expected_max"]
