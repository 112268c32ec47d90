"""A trainer's periodic snapshots for joiners, serialized beside its next steps instead of on a step's path.

Every ``state_every`` steps (DiLoCo: every outer step) a trainer hands its daemon a snapshot for joiners: for the
GPT demo's model 13.5 MB of tensors, which ``torch.save`` and the memfd copy take tens of milliseconds to write,
every member at the same step. ``LaterSnapshots`` takes the state as copied tensors on the trainer's thread (a
consistent cut: the training goes on changing its own tensors), writes them on one worker thread, and hands the
finished memfd back at the trainer's next step, whose call to the daemon then costs a local round trip.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ..localsock.arena import write_blob
from ..localsock.client import DaemonError

log = logging.getLogger("peerd.torch")


@dataclass(frozen=True)
class Written:
    """A snapshot written to a memfd: its descriptor (the caller closes it), size in bytes, and step."""

    fd: int
    size: int
    step: int


def serialize(state: dict[str, Any]) -> bytes:
    """The snapshot's bytes (tensors only, so ``torch.load(..., weights_only=True)`` reads them)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def tensors_copied(obj: Any) -> Any:
    """``obj`` (an optimizer's state_dict: dicts, lists and tuples of tensors and numbers) with every tensor copied."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: tensors_copied(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(tensors_copied(v) for v in obj)
    return obj


def _write(state: dict[str, Any], step: int) -> Written:
    blob = serialize(state)
    return Written(write_blob(blob, name="peerd-state"), len(blob), step)


class LaterSnapshots:
    """At most one snapshot being written at a time; a newer one asked for meanwhile is skipped (``skipped``),
    since the one being written is a moment old and the next period brings another."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future[Written] | None = None
        self.skipped = 0

    def start(self, state: dict[str, Any], step: int) -> bool:
        """Write ``state`` (tensors the trainer no longer changes) in the background; False where the last
        snapshot is still being written (this one is skipped) or was not handed back yet (it is dropped first)."""
        if self._pending is not None:
            if not self._pending.done():
                self.skipped += 1
                return False
            self._drop(self._pending)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="peerd-snapshot")
        self._pending = self._pool.submit(_write, state, step)
        return True

    def take(self, *, wait: bool = False) -> Written | None:
        """The snapshot written since ``start`` (None: none asked for, still being written unless ``wait``, or
        its writing failed, which is logged). The caller owns its descriptor from then on."""
        pending = self._pending
        if pending is None or (not wait and not pending.done()):
            return None
        self._pending = None
        try:
            return pending.result()
        except Exception as e:  # (a full /dev/shm, a serialization error): the next period tries again
            log.warning("writing the snapshot for joiners failed: %s: %s", type(e).__name__, e)
            return None

    def hand_over(self, publish: Callable[[Written], object], *, wait: bool = False) -> None:
        """Pass the snapshot written since ``start`` (if any; ``wait``: for it) to ``publish`` and close its
        descriptor. A daemon that refuses it or went away is logged: the next period publishes again, and the
        trainer's next request reports a daemon that went away."""
        written = self.take(wait=wait)
        if written is None:
            return
        try:
            publish(written)
        except DaemonError as e:
            log.warning("handing the daemon the snapshot of step %d failed: %s", written.step, e)
        finally:
            os.close(written.fd)

    def close(self) -> None:
        """Drop a snapshot not handed back (its descriptor closed) and stop the worker."""
        if self._pending is not None:
            self._pending.add_done_callback(self._drop)
            self._pending = None
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    @staticmethod
    def _drop(done: Future[Written]) -> None:
        try:
            os.close(done.result().fd)
        except Exception:  # noqa: BLE001 - it failed to write: nothing to close
            pass
