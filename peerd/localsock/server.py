"""Daemon side of the local socket: a Unix stream socket, mode 0600, one task per connection."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket as stdsocket
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ..metrics import Metrics
from .frames import FrameDecoder, FrameError, encode_frame

log = logging.getLogger("peerd.local")

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class OpError(Exception):
    """A request the daemon refuses; the message goes back to the client as ``error``."""


class SocketInUse(Exception):
    pass


def bind_unix(path: str) -> trio.socket.SocketType:
    """Bind ``path`` with mode 0600, replacing a stale file but never a live daemon's socket."""
    if os.path.exists(path):
        probe = stdsocket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale: its daemon is gone
        else:
            raise SocketInUse(f"another daemon is serving {path}; stop it or pick another --socket")
        finally:
            probe.close()
    sock = stdsocket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    except OSError as e:
        sock.close()
        hint = "the directory does not exist" if e.errno == errno.ENOENT else e.strerror
        raise SocketInUse(f"cannot create local socket {path}: {hint}") from None
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(64)
    return trio.socket.from_stdlib_socket(sock)


class LocalServer:
    def __init__(self, path: str, metrics: Metrics) -> None:
        self.path = path
        self.metrics = metrics
        self._ops: dict[str, Handler] = {}
        self._sock = bind_unix(path)

    def register(self, op: str, handler: Handler) -> None:
        self._ops[op] = handler

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listener = trio.SocketListener(self._sock)
        task_status.started()
        try:
            await trio.serve_listeners(self._connection, [listener])
        finally:
            self.close()

    def close(self) -> None:
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def _connection(self, stream: trio.SocketStream) -> None:
        decoder = FrameDecoder()
        async with stream:
            try:
                while True:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    for request in decoder.feed(data):
                        await stream.send_all(encode_frame(await self._dispatch(request)))
            except FrameError as e:
                log.warning("local client sent garbage, closing: %s", e)
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await stream.send_all(encode_frame({"ok": False, "error": str(e)}))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return  # the client went away mid-request; nothing to clean up here

    async def _dispatch(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        handler = self._ops.get(op) if isinstance(op, str) else None
        if handler is None:
            self.metrics.local_requests.labels("unknown", "error").inc()
            return {"ok": False, "error": f"unknown op {op!r}; this daemon knows {sorted(self._ops)}"}
        try:
            reply = await handler(request)
        except OpError as e:
            self.metrics.local_requests.labels(op, "error").inc()
            return {"ok": False, "error": str(e)}
        self.metrics.local_requests.labels(op, "ok").inc()
        return {"ok": True, **reply}
