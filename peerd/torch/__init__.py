"""Trainer side of peerd: the only package that imports torch.

``Optimizer`` wraps a torch optimizer so its steps average with the swarm through the local daemon;
``DropCompute`` stops gradient accumulation when a compute budget is spent; ``DiLoCo`` takes H local steps
with any inner optimizer, then an outer step averaged (and agreed on) with the swarm.
"""

from ..localsock.client import DaemonError
from .diloco import DiLoCo, DiLoCoError
from .dropcompute import DropCompute, Threshold, choose_threshold, expected_max
from .errors import NoGroupError
from .optimizer import Optimizer
from .report import StepReport

__all__ = ["DaemonError", "DiLoCo", "DiLoCoError", "DropCompute", "NoGroupError", "Optimizer", "StepReport",
           "Threshold", "choose_threshold", "expected_max"]
