"""Blocking client of the local socket, for the CLI and (later) the trainer."""

from __future__ import annotations

import os
import socket
from typing import Any

from .frames import FrameDecoder, FrameError, encode_frame


class DaemonError(Exception):
    """The daemon is unreachable, went away, or refused the request; the message says what to do."""


def default_socket_path() -> str:
    env = os.environ.get("PEERD_SOCKET")
    if env:
        return env
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "peerd.sock")
    return f"/tmp/peerd-{os.getuid()}.sock"


class LocalClient:
    def __init__(self, path: str | None = None, *, timeout: float = 30.0) -> None:
        self.path = path or default_socket_path()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(self.path)
        except (FileNotFoundError, ConnectionRefusedError):
            self._sock.close()
            raise DaemonError(
                f"no peerd daemon is listening on {self.path}: start one with 'peerd join', "
                f"or point --socket (or PEERD_SOCKET) at the daemon's socket"
            ) from None
        except PermissionError:
            self._sock.close()
            raise DaemonError(f"no permission to use {self.path}: run as the daemon's user") from None
        self._decoder = FrameDecoder()

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> LocalClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        try:
            self._sock.sendall(encode_frame({"op": op, **args}))
            while True:
                data = self._sock.recv(65536)
                if not data:
                    raise DaemonError(f"the daemon at {self.path} closed the connection (did it stop?)")
                replies = self._decoder.feed(data)
                if replies:
                    break
        except TimeoutError:
            raise DaemonError(f"the daemon at {self.path} did not answer {op!r} in time") from None
        except (BrokenPipeError, ConnectionResetError):
            raise DaemonError(f"the daemon at {self.path} went away during {op!r}") from None
        except FrameError as e:
            raise DaemonError(f"the daemon at {self.path} sent a bad frame: {e}") from None
        reply = replies[0]
        if not reply.get("ok"):
            raise DaemonError(str(reply.get("error", "request failed")))
        return reply
