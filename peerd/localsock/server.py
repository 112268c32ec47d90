"""Daemon side of the local socket: a Unix stream socket, mode 0600 (0660 with a socket group), own uid (and that
group) only, one task per connection."""

from __future__ import annotations

import array
import contextlib
import errno
import itertools
import logging
import math
import os
import socket as stdsocket
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ..metrics import Metrics
from .access import AccessError, fallback_dir, may_use, prepare_socket_dir
from .frames import FrameDecoder, FrameError, FrameTooLarge, encode_frame

log = logging.getLogger("peerd.local")

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
ConnHandler = Callable[[dict[str, Any], "Connection"], Awaitable[dict[str, Any]]]

MAX_FDS = 4  # descriptors one request may carry (a trainer sends one: its arena or a state blob)
MAX_QUEUED_FDS = 4 * MAX_FDS  # descriptors received ahead of the requests that declare them
MAX_CONNECTIONS = 256  # clients served at once (each may buffer up to one 16 MiB frame)
FRAME_TIMEOUT_S = 30.0  # a frame that has begun must be complete within this (a local socket is fast)
# A request that carries an ``id`` (an integer in [0, 2**32)) runs beside the connection's other requests and
# its reply carries the same id: a trainer with overlap hands the daemon each gradient bucket as backward
# produces it and collects the results later. At most this many run at once per connection; the next waits.
MAX_INFLIGHT = 64
MAX_REQUEST_ID = 2**32
_RECV = 65536


async def acquire_now(lock: trio.Lock) -> None:
    """Acquire ``lock`` without a schedule point when it is free: a reply the trainer waits for goes out before
    the event loop runs its other tasks (a receive pass, a sender's slice), not after them."""
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        await lock.acquire()


class Connection:
    """One client of the local socket, as seen by handlers registered with ``connection=True``.

    Why handlers need it: a trainer's session (its arena mapping, its run) belongs to its connection,
    and must be torn down when the trainer goes away, even in the middle of a step. ``fds`` are the
    descriptors that arrived with the current request; a handler that keeps one takes it out of the
    list (``take_fd``), the server closes whatever is left after the request.
    """

    _ids = itertools.count(1)

    def __init__(self) -> None:
        self.id = next(self._ids)
        self.fds: list[int] = []
        self._queued: deque[int] = deque()
        self._on_close: list[Callable[[], None]] = []
        self.closed = False

    def take_fd(self) -> int:
        if not self.fds:
            raise OpError("this request needs a file descriptor sent with it (socket.send_fds)")
        return self.fds.pop(0)

    def on_close(self, callback: Callable[[], None]) -> None:
        """``callback()`` runs once when the client disconnects (or the server stops); it must not raise."""
        self._on_close.append(callback)

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for fd in itertools.chain(self.fds, self._queued):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()
        self._queued.clear()
        for callback in reversed(self._on_close):
            try:
                callback()
            except Exception:  # cleanup of one session must not take the daemon down
                log.exception("local connection cleanup failed")


class OpError(Exception):
    """A request the daemon refuses; the message goes back to the client as ``error``."""


class SocketInUse(Exception):
    pass


def bind_unix(path: str, group: int | None = None) -> stdsocket.socket:
    """Bind ``path`` with mode 0600 (``group``: 0660, owned by that group), replacing a stale file but never a
    live daemon's socket.

    A plain socket, not a trio one: startup binds it before trio runs, and a startup that fails later (a busy
    metrics port) must be able to close it and remove the file outside trio.

    In the per-user fallback directory (/tmp/peerd-UID) the directory is created 0700 and refused if
    it is someone else's or open to others (SocketInUse, with what to do)."""
    if group is not None and os.path.dirname(os.path.abspath(path)) == fallback_dir():
        raise SocketInUse(f"--socket-group: {fallback_dir()} is private to this user, so the group could not reach "
                          f"the socket; give --socket a path in a directory the group can enter (e.g. /run/peerd)")
    try:
        prepare_socket_dir(path)
    except AccessError as e:
        raise SocketInUse(str(e)) from None
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
    try:
        if group is not None:
            try:
                os.chown(path, -1, group)
            except PermissionError:
                raise SocketInUse(f"--socket-group: cannot give {path} to group {group}: the daemon's user must be "
                                  f"a member of that group") from None
        os.chmod(path, 0o600 if group is None else 0o660)
        sock.listen(64)
    except (OSError, SocketInUse) as e:
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        if isinstance(e, SocketInUse):
            raise
        raise SocketInUse(f"cannot listen on local socket {path}: {e.strerror}") from None
    return sock


class LocalServer:
    def __init__(self, path: str, metrics: Metrics, group: int | None = None) -> None:
        self.path = path
        self.metrics = metrics
        self.group = group  # a gid whose members may use the socket besides our own uid (None: nobody else)
        self._ops: dict[str, tuple[Handler | ConnHandler, bool]] = {}
        self._sock = bind_unix(path, group)
        self._trio_sock: trio.socket.SocketType | None = None  # once serving (inside trio)
        self._active = 0

    def register(self, op: str, handler: Handler | ConnHandler, *, connection: bool = False) -> None:
        """``handler(request)``, or with ``connection=True`` ``handler(request, conn)`` (see Connection)."""
        self._ops[op] = (handler, connection)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._trio_sock = trio.socket.from_stdlib_socket(self._sock)
        listener = trio.SocketListener(self._trio_sock)
        task_status.started()
        try:
            await trio.serve_listeners(self._connection, [listener])
        finally:
            self.close()

    def close(self) -> None:
        """Close the socket and remove its file; safe outside trio (a failed startup) and more than once."""
        if self._trio_sock is not None:
            self._trio_sock.close()  # tells trio first (only ever set inside trio)
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def _connection(self, stream: trio.SocketStream) -> None:
        """One client; whatever goes wrong in it is logged and counted, never fatal to the daemon
        (trio.serve_listeners would otherwise take every other client and the daemon down with it)."""
        if self._active >= MAX_CONNECTIONS:
            self.metrics.local_refused.labels("connections").inc()
            log.warning("refused a local client: %d connections already", self._active)
            async with stream:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    await stream.send_all(encode_frame({"ok": False, "error": (
                        f"this daemon already serves {MAX_CONNECTIONS} local connections: close some and retry")}))
            return
        self._active += 1
        try:
            await self._serve_client(stream)
        except Exception:
            log.exception("local connection failed")
            self.metrics.background_errors.labels("local_connection").inc()
        finally:
            self._active -= 1

    async def _serve_client(self, stream: trio.SocketStream) -> None:
        """Read requests while earlier ones run, so a client that disconnects mid-request is noticed at
        once (its sessions are torn down, a late result is never written); requests still run in order."""
        async with stream:
            try:
                allowed, uid = may_use(stream.socket, self.group)  # type: ignore[arg-type]
            except OSError as e:
                log.warning("local client: cannot read its credentials (%s), closing", e)
                self.metrics.local_refused.labels("uid").inc()
                return
            if not allowed:
                who = f"uid {os.geteuid()}" + ("" if self.group is None else f" and group {self.group}")
                log.warning("refused a local client of uid %d: this daemon serves %s only", uid, who)
                self.metrics.local_refused.labels("uid").inc()
                hint = ("run the trainer as the daemon's user, or start your own daemon ('peerd join')"
                        if self.group is None else
                        f"ask the operator to add you to group {self.group} (then log in again), or start your own "
                        f"daemon ('peerd join')")
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    await stream.send_all(encode_frame({"ok": False, "error": (
                        f"this peerd daemon serves {who} only, you are uid {uid}: {hint}")}))
                return
            conn = Connection()
            send, receive = trio.open_memory_channel[dict[str, Any]](16)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._work, stream, receive, conn)
                    await self._read(stream, send, conn)
            finally:
                conn._close()

    async def _read(self, stream: trio.SocketStream, send: trio.MemorySendChannel, conn: Connection) -> None:
        decoder = FrameDecoder()
        sock = stream.socket
        ancillary = stdsocket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
        async with send:
            try:
                while True:
                    # recvmsg, not receive_some: a request may carry descriptors (SCM_RIGHTS).
                    with trio.move_on_after(FRAME_TIMEOUT_S if decoder.pending else math.inf) as wait:
                        data, anc, flags, _ = await sock.recvmsg(_RECV, ancillary)
                    if wait.cancelled_caught:
                        raise FrameError(f"a frame stayed incomplete for {FRAME_TIMEOUT_S:g} s "
                                         f"({decoder.pending} bytes of it arrived)")
                    conn._queued.extend(_fds_of(anc))
                    if flags & stdsocket.MSG_CTRUNC:
                        raise FrameError(f"a request carried more than {MAX_FDS} file descriptors")
                    if len(conn._queued) > MAX_QUEUED_FDS:  # descriptors no request has claimed yet
                        raise FrameError(f"more than {MAX_QUEUED_FDS} file descriptors sent ahead of their requests")
                    if not data:
                        break
                    for request in decoder.feed(data):
                        await send.send(request)
            except FrameError as e:
                log.warning("local client sent garbage, closing: %s", e)
                await send.send({"op": None, "_frame_error": str(e)})
                return
            except OSError:
                pass  # reset by the client
        conn._close()  # EOF: the client is gone, even if a request of its is still running

    async def _work(self, stream: trio.SocketStream, receive: trio.MemoryReceiveChannel, conn: Connection) -> None:
        """Requests without an ``id`` run in order; one with an id (and no descriptors, which must be claimed in
        order) runs concurrently, at most MAX_INFLIGHT at once, and its reply echoes the id."""
        lock = trio.Lock()  # one frame at a time on the stream
        slots = trio.Semaphore(MAX_INFLIGHT)
        async with receive, trio.open_nursery() as nursery:
            async for request in receive:
                if "_frame_error" in request:
                    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        async with lock:
                            await stream.send_all(encode_frame({"ok": False, "error": request["_frame_error"]}))
                    await stream.aclose()
                    nursery.cancel_scope.cancel()
                    return
                rid = request.get("id")
                if rid is None:
                    await self._answer(stream, lock, conn, request, None)
                    continue
                if type(rid) is not int or not 0 <= rid < MAX_REQUEST_ID or request.get("fds"):
                    await self._reply(stream, lock, conn, request, {"ok": False, "error": (
                        f"request id must be an integer in [0, 2**32) on a request without descriptors, got "
                        f"{rid!r:.40}")}, None)
                    continue
                await slots.acquire()  # backpressure: the reader stops taking frames while MAX_INFLIGHT run
                nursery.start_soon(self._answer, stream, lock, conn, request, rid, slots)

    async def _answer(self, stream: trio.SocketStream, lock: trio.Lock, conn: Connection, request: dict[str, Any],
                      rid: int | None, slots: trio.Semaphore | None = None) -> None:
        try:
            reply = await self._dispatch(request, conn, claim_fds=rid is None)
            await self._reply(stream, lock, conn, request, reply, rid)
        finally:
            if slots is not None:
                slots.release()

    async def _reply(self, stream: trio.SocketStream, lock: trio.Lock, conn: Connection, request: dict[str, Any],
                     reply: dict[str, Any], rid: int | None) -> None:
        if conn.closed:
            return  # nobody to answer
        if rid is not None:
            reply = {**reply, "id": rid}
        try:
            await acquire_now(lock)
            try:
                await stream.send_all(self._encode_reply(request, reply))
            finally:
                lock.release()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            conn._close()  # the client went away mid-request

    def _encode_reply(self, request: dict[str, Any], reply: dict[str, Any]) -> bytes:
        """The reply's frame, or an error reply in its place if it cannot be sent (too large, unencodable):
        the client learns why, and the connection stays in step (one reply per request)."""
        op = request.get("op")
        name = op if isinstance(op, str) and op in self._ops else "unknown"
        try:
            return encode_frame(reply)
        except FrameTooLarge as e:
            self.metrics.local_refused.labels("reply_too_large").inc()
            error = f"the reply to {name} is too large for the local socket ({e}): ask for less (a smaller vector)"
        except Exception as e:  # a handler returned something msgpack cannot encode: a bug, not the client's
            log.exception("local op %s: reply cannot be encoded", name)
            self.metrics.local_refused.labels("reply_unencodable").inc()
            error = f"internal error: the reply to {name} cannot be encoded ({type(e).__name__}: {str(e)[:200]})"
        return encode_frame({"ok": False, "error": error, **({"id": reply["id"]} if "id" in reply else {})})

    async def _dispatch(self, request: dict[str, Any], conn: Connection | None = None, *,
                        claim_fds: bool = True) -> dict[str, Any]:
        """``claim_fds``: False for a concurrent request (it carries none, and must not touch the descriptors of
        the in-order request running beside it)."""
        op = request.get("op")
        entry = self._ops.get(op) if isinstance(op, str) else None
        conn_fds = conn if claim_fds else None
        if conn_fds is not None:
            # The descriptors a request declares arrived with (or before) its first bytes.
            want = request.get("fds", 0)
            if type(want) is not int or not 0 <= want <= MAX_FDS or want > len(conn_fds._queued):
                self.metrics.local_requests.labels(op if entry else "unknown", "error").inc()
                return {"ok": False, "error": f"request declares fds={want!r} but {len(conn_fds._queued)} arrived"}
            conn_fds.fds = [conn_fds._queued.popleft() for _ in range(want)]
        try:
            if entry is None:
                self.metrics.local_requests.labels("unknown", "error").inc()
                return {"ok": False, "error": f"unknown op {op!r}; this daemon knows {sorted(self._ops)}"}
            handler, wants_conn = entry
            try:
                if wants_conn:
                    if conn is None:
                        raise OpError(f"{op} needs a connection")
                    reply = await handler(request, conn)  # type: ignore[call-arg]
                else:
                    reply = await handler(request)  # type: ignore[call-arg]
            except OpError as e:
                self.metrics.local_requests.labels(op, "error").inc()
                return {"ok": False, "error": str(e)}
            except Exception as e:  # a bug in one op must not take the daemon (and every other client) down
                log.exception("local op %s failed", op)
                self.metrics.local_requests.labels(op, "error").inc()
                return {"ok": False, "error": f"internal error in {op}: {type(e).__name__}: {e}"}
            self.metrics.local_requests.labels(op, "ok").inc()
            return {"ok": True, **reply}
        finally:
            if conn_fds is not None:
                for fd in conn_fds.fds:  # descriptors no handler took
                    with contextlib.suppress(OSError):
                        os.close(fd)
                conn_fds.fds = []


def _fds_of(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == stdsocket.SOL_SOCKET and kind == stdsocket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(data[: len(data) - len(data) % arr.itemsize])
            fds.extend(arr)
    return fds
