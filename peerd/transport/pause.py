"""The receive loop's junk-moderation pause, on a timerfd where it can be.

Under a flood of junk the receive loop pauses a few milliseconds after each pass so that the next pass takes a
batch (ReceivePolicy.receive_pass). ``trio.sleep`` costs about 115 us of CPU per wakeup on these machines: most
of it is the cancel scope behind it (a deadline, a Cancelled raised and caught, an Error outcome). Waiting for
a timerfd armed for the pause is an ordinary readiness wait (about 65 us less per pass), and per pass is what
the pause costs: at 40 datagrams a pass it is half of the outsider's CPU per datagram (`peerd bench soak`).
Linux only, through ctypes: where timerfd_create is not there, or trio runs on another clock than the system's
(a test's MockClock: virtual time must stay virtual), it is ``trio.sleep``.
"""

from __future__ import annotations

import ctypes
import os

import trio

CLOCK_MONOTONIC = 1
TFD_NONBLOCK = os.O_NONBLOCK
TFD_CLOEXEC = os.O_CLOEXEC


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        create, settime = libc.timerfd_create, libc.timerfd_settime
    except (OSError, AttributeError):
        return None
    create.argtypes, create.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p]
    settime.restype = ctypes.c_int
    return libc


_LIBC = _libc()


def _system_clock() -> bool:
    """trio runs on its own clock (real time), not a test's."""
    return type(trio.lowlevel.current_clock()).__name__ == "SystemClock"


class Pause:
    """``await pause.wait(seconds)``: a sleep that costs one readiness wait. One task waits on it at a time (the
    receive loop); ``close`` when the loop ends."""

    def __init__(self) -> None:
        self._fd = -1
        self._spec = _Itimerspec()
        if _LIBC is not None and _system_clock():
            fd = _LIBC.timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC)
            if fd >= 0:
                self._fd = fd

    @property
    def timerfd(self) -> bool:
        """Whether it waits on a timerfd (else trio.sleep)."""
        return self._fd >= 0

    async def wait(self, seconds: float) -> None:
        if self._fd < 0 or not 0 < seconds < 1:
            await trio.sleep(seconds)
            return
        value = self._spec.it_value
        value.tv_sec, value.tv_nsec = 0, max(1, int(seconds * 1e9))
        if _LIBC.timerfd_settime(self._fd, 0, ctypes.byref(self._spec), None) < 0:  # type: ignore[union-attr]
            await trio.sleep(seconds)
            return
        await trio.lowlevel.wait_readable(self._fd)
        try:
            os.read(self._fd, 8)
        except BlockingIOError:  # re-armed since it fired: nothing to clear
            pass

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            try:
                trio.lowlevel.notify_closing(fd)
            except RuntimeError:  # outside trio: nothing waits on it
                pass
            os.close(fd)
