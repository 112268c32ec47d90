"""Blocking client of the local socket, for the CLI and the trainer.

Every call has a timeout, and a daemon that dies closes the socket, so a caller always gets a
DaemonError that says what happened rather than a hang. A client whose daemon went away is dead;
make a new one (the trainer's optimizer does, and re-declares its session) to reconnect.
"""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from typing import Any

from .access import AccessError, check_client_dir, default_socket_path, peer_uid, same_uid_only, trusted_daemon
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
            raise DaemonError(f"no permission to use {self.path}: run as the daemon's user, or as a member of its "
                              f"--socket-group") from None
        except OSError as e:
            self._sock.close()
            raise DaemonError(f"cannot connect to {self.path}: {e.strerror or e}") from None
        uid = peer_uid(self._sock)
        if not same_uid_only(uid) and not trusted_daemon(self.path, uid):
            self._sock.close()
            raise DaemonError(
                f"the socket {self.path} is served by uid {uid}, not by you (uid {os.geteuid()}): refusing to "
                f"hand it gradients; start your own daemon ('peerd join') or use --socket / PEERD_SOCKET"
            )
        self._decoder = FrameDecoder()
        self._plain: deque[dict[str, Any]] = deque()  # replies to calls without an id, in order
        self._done: dict[int, dict[str, Any]] = {}  # replies to submitted requests, by id, not yet collected
        self._inflight: set[int] = set()  # ids submitted and not yet answered
        self._next_id = 0

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
        self._send(op, fds, args)
        reply = self._wait(lambda: self._plain.popleft() if self._plain else None, op,
                           self.timeout if reply_timeout is None else reply_timeout)
        return self._unwrap(reply)

    def submit(self, op: str, **args: Any) -> int:
        """Send a request that runs beside this connection's others (no descriptors); returns its id for
        ``collect``. Its reply may come before or after replies to later requests."""
        rid = self._next_id
        self._next_id = (self._next_id + 1) % (1 << 32)
        self._send(op, (), {**args, "id": rid})
        self._inflight.add(rid)
        return rid

    def collect(self, rid: int, *, timeout: float | None = None) -> dict[str, Any]:
        """Wait for the reply to submitted request ``rid`` (raises DaemonError as ``call`` does)."""
        if rid not in self._inflight and rid not in self._done:
            raise ValueError(f"request {rid} was never submitted, or was collected already")
        reply = self._wait(lambda: self._done.pop(rid, None), f"request {rid}",
                           self.timeout if timeout is None else timeout)
        return self._unwrap(reply)

    def ready(self, rid: int) -> bool:
        """True if the reply to ``rid`` is here (reads what the socket holds without waiting)."""
        if rid in self._done:
            return True
        if self.broken:
            return False
        try:
            self._sock.settimeout(0.0)
            data = self._sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return False  # the next collect reports it
        finally:
            self._sock.settimeout(self.timeout)
        if data:
            self._feed(data)
        return rid in self._done

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def _send(self, op: str, fds: tuple[int, ...] | list[int], args: dict[str, Any]) -> None:
        if self.broken:
            raise DaemonError(f"the connection to the daemon at {self.path} is broken; reconnect")
        try:
            frame = encode_frame({"op": op, **({"fds": len(fds)} if fds else {}), **args})
        except FrameTooLarge as e:
            raise DaemonError(f"request {op!r} is too large for the local socket ({e}): send less per call") from None
        except (TypeError, ValueError, OverflowError) as e:
            raise DaemonError(f"request {op!r} cannot be encoded: {e}") from None
        self._sock.settimeout(self.timeout)
        try:
            if fds:
                sent = socket.send_fds(self._sock, [frame], list(fds))
                if sent < len(frame):
                    self._sock.sendall(frame[sent:])
            else:
                self._sock.sendall(frame)
        except TimeoutError:
            self.broken = True
            raise DaemonError(f"the daemon at {self.path} did not take {op!r} in time") from None
        except (BrokenPipeError, ConnectionResetError):
            self.broken = True
            why = self._parting_error()  # a daemon that refuses a connection says why, then closes it
            raise DaemonError(why or f"the daemon at {self.path} went away during {op!r}") from None

    def _feed(self, data: bytes) -> None:
        try:
            replies = self._decoder.feed(data)
        except FrameError as e:
            self.broken = True
            raise DaemonError(f"the daemon at {self.path} sent a bad frame: {e}") from None
        for reply in replies:
            rid = reply.get("id")
            if type(rid) is int and rid in self._inflight:
                self._inflight.discard(rid)
                self._done[rid] = reply
            else:
                self._plain.append(reply)

    def _wait(self, take: Any, what: str, timeout: float) -> dict[str, Any]:
        """Read frames until ``take()`` returns a reply; DaemonError on a timeout or a closed connection."""
        deadline = time.monotonic() + timeout
        while True:
            reply = take()
            if reply is not None:
                return reply
            if self.broken:
                raise DaemonError(f"the connection to the daemon at {self.path} is broken; reconnect")
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                self._sock.settimeout(left)
                data = self._sock.recv(65536)
                if not data:
                    self.broken = True
                    raise DaemonError(f"the daemon at {self.path} closed the connection (did it stop?)")
            except TimeoutError:
                # A late reply would be read as the answer to the next request: this connection is done.
                self.broken = True
                raise DaemonError(f"the daemon at {self.path} did not answer {what!r} in time") from None
            except (BrokenPipeError, ConnectionResetError):
                self.broken = True
                why = self._parting_error()
                raise DaemonError(why or f"the daemon at {self.path} went away during {what!r}") from None
            self._feed(data)

    @staticmethod
    def _unwrap(reply: dict[str, Any]) -> dict[str, Any]:
        if not reply.get("ok"):
            raise DaemonError(str(reply.get("error", "request failed")))
        return reply
