"""Blocking client of the local socket, for the CLI and the trainer.

Every call has a timeout, and a daemon that dies closes the socket, so a caller always gets a
DaemonError that says what happened rather than a hang. A client whose daemon went away is dead;
make a new one (the trainer's optimizer does, and re-declares its session) to reconnect.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from .access import AccessError, check_client_dir, default_socket_path, peer_uid, same_uid_only
from .frames import FrameDecoder, FrameError, FrameTooLarge, encode_frame

__all__ = ["DaemonError", "LocalClient", "default_socket_path"]


class DaemonError(Exception):
    """The daemon is unreachable, went away, or refused the request; the message says what to do."""


class LocalClient:
    def __init__(self, path: str | None = None, *, timeout: float = 30.0) -> None:
        self.path = path or default_socket_path()
        self.timeout = timeout
        self.broken = False
        try:
            check_client_dir(self.path)
        except AccessError as e:
            raise DaemonError(str(e)) from None
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
        except OSError as e:
            self._sock.close()
            raise DaemonError(f"cannot connect to {self.path}: {e.strerror or e}") from None
        uid = peer_uid(self._sock)
        if not same_uid_only(uid):
            self._sock.close()
            raise DaemonError(
                f"the socket {self.path} is served by uid {uid}, not by you (uid {os.geteuid()}): refusing to "
                f"hand it gradients; start your own daemon ('peerd join') or use --socket / PEERD_SOCKET"
            )
        self._decoder = FrameDecoder()

    def close(self) -> None:
        self._sock.close()

    def _parting_error(self) -> str | None:
        """The error frame a daemon sent before it closed the connection, if one is already here."""
        try:
            self._sock.settimeout(0.5)
            while True:
                data = self._sock.recv(65536)
                if not data:
                    return None
                for reply in self._decoder.feed(data):
                    if not reply.get("ok") and isinstance(reply.get("error"), str):
                        return reply["error"]
        except (OSError, FrameError):
            return None

    def __enter__(self) -> LocalClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, op: str, *, fds: tuple[int, ...] | list[int] = (), reply_timeout: float | None = None,
             **args: Any) -> dict[str, Any]:
        """Send one request (``fds`` travel as SCM_RIGHTS); wait up to ``reply_timeout`` for the reply."""
        if self.broken:
            raise DaemonError(f"the connection to the daemon at {self.path} is broken; reconnect")
        self._sock.settimeout(self.timeout if reply_timeout is None else reply_timeout)
        try:
            frame = encode_frame({"op": op, **({"fds": len(fds)} if fds else {}), **args})
        except FrameTooLarge as e:
            raise DaemonError(f"request {op!r} is too large for the local socket ({e}): send less per call") from None
        except (TypeError, ValueError, OverflowError) as e:
            raise DaemonError(f"request {op!r} cannot be encoded: {e}") from None
        try:
            if fds:
                sent = socket.send_fds(self._sock, [frame], list(fds))
                if sent < len(frame):
                    self._sock.sendall(frame[sent:])
            else:
                self._sock.sendall(frame)
            while True:
                data = self._sock.recv(65536)
                if not data:
                    raise DaemonError(f"the daemon at {self.path} closed the connection (did it stop?)")
                replies = self._decoder.feed(data)
                if replies:
                    break
        except TimeoutError:
            # A late reply would be read as the answer to the next request: this connection is done.
            self.broken = True
            raise DaemonError(f"the daemon at {self.path} did not answer {op!r} in time") from None
        except (BrokenPipeError, ConnectionResetError):
            self.broken = True
            why = self._parting_error()  # a daemon that refuses a connection says why, then closes it
            raise DaemonError(why or f"the daemon at {self.path} went away during {op!r}") from None
        except FrameError as e:
            self.broken = True
            raise DaemonError(f"the daemon at {self.path} sent a bad frame: {e}") from None
        except DaemonError:
            self.broken = True
            raise
        reply = replies[0]
        if not reply.get("ok"):
            raise DaemonError(str(reply.get("error", "request failed")))
        return reply
