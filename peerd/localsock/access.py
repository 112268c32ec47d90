"""Who may use the local socket: its default path, its private directory, and the peer's uid.

Why: the socket hands out averaged gradients and accepts memfds the daemon maps, so it serves only the
uid it runs as (root gets no exception) and, when the operator names one (``peerd join --socket-group``),
the members of one system group. A client talks to a daemon of its own uid, or of another uid only where
nobody else could have put the socket (else a squatter on a shared path would receive its gradients).
The file mode is one guard, SO_PEERCRED (and SO_PEERGROUPS) the other. Both sides import this module.
"""

from __future__ import annotations

import grp
import os
import socket
import stat
import struct

_UCRED = struct.Struct("3i")  # pid, uid, gid (struct ucred)
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13: the peer's supplementary groups
_PEERGROUPS_BUF = 1024  # bytes: 256 groups, the most Python's getsockopt reads; more falls back to /proc


class AccessError(Exception):
    """The socket's directory or the process on the other end is not this user's; the message says what to do."""


def fallback_dir() -> str:
    """The per-user directory used when neither PEERD_SOCKET nor XDG_RUNTIME_DIR names a place."""
    return f"/tmp/peerd-{os.geteuid()}"


def default_socket_path() -> str:
    env = os.environ.get("PEERD_SOCKET")
    if env:
        return env
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "peerd.sock")
    return os.path.join(fallback_dir(), "peerd.sock")


def check_private_dir(path: str) -> None:
    """Raise AccessError unless ``path`` is a real directory (not a link) owned by us with no group/other access."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise AccessError(f"{path} exists and is not a directory: remove it, or set PEERD_SOCKET / --socket")
    if st.st_uid != os.geteuid():
        raise AccessError(
            f"{path} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}): someone may be squatting the "
            f"socket directory; remove it, or set XDG_RUNTIME_DIR, PEERD_SOCKET or --socket"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise AccessError(
            f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: other users could reach the socket; "
            f"'chmod 700 {path}' (or remove it) and start again"
        )


def prepare_socket_dir(socket_path: str) -> None:
    """Daemon: create the per-user fallback directory 0700 if ``socket_path`` lives in it, and check it.

    Paths the operator chose (--socket, PEERD_SOCKET, XDG_RUNTIME_DIR) are left as they are; the socket
    file itself is 0600 and SO_PEERCRED is checked on every connection anyway."""
    directory = os.path.dirname(os.path.abspath(socket_path))
    if directory != fallback_dir():
        return
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise AccessError(f"cannot create the socket directory {directory}: {e.strerror}") from None
    check_private_dir(directory)


def check_client_dir(socket_path: str) -> None:
    """Client: refuse a fallback directory that is not ours (a missing one is the caller's 'no daemon')."""
    directory = os.path.dirname(os.path.abspath(socket_path))
    if directory != fallback_dir():
        return
    try:
        check_private_dir(directory)
    except FileNotFoundError:
        return


def peer_uid(sock: socket.socket) -> int:
    """The effective uid of the process on the other end of a connected Unix socket (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    _, uid, _ = _UCRED.unpack(raw)
    return uid


def same_uid_only(uid: int) -> bool:
    """Only our own uid: root, too, must run its trainer as the daemon's user."""
    return uid == os.geteuid()


def resolve_group(name: str) -> int:
    """The gid of a group given by name (or as a number); AccessError if there is no such group."""
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise AccessError(f"--socket-group {name}: no such group on this machine (create it with groupadd)") from None


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process on the other end of a connected Unix socket (SO_PEERCRED)."""
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return pid, uid, gid


def peer_groups(sock: socket.socket, pid: int) -> set[int]:
    """The peer's supplementary groups as they were when it connected (SO_PEERGROUPS); on kernels without it,
    or with more than 256 groups, the Groups line of /proc/PID/status (empty when unreadable)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, _PEERGROUPS_BUF)
        return set(struct.unpack(f"={len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:] if g.isdigit()}
    except OSError:
        pass
    return set()


def may_use(sock: socket.socket, group: int | None) -> tuple[bool, int]:
    """Daemon: (whether the peer may use the socket, its uid). Our own uid always; with ``group``, a peer whose
    primary or supplementary group it is. Root is no exception either way."""
    pid, uid, gid = peer_credentials(sock)
    if same_uid_only(uid):
        return True, uid
    if group is None:
        return False, uid
    return (gid == group or group in peer_groups(sock, pid)), uid


def trusted_daemon(socket_path: str, uid: int) -> bool:
    """Client: a daemon of another uid is trusted when nobody but it (or root) could have put the socket there:
    the socket file is its, and the directory holding it is its or root's and writable by no one else."""
    try:
        st = os.lstat(socket_path)
        dst = os.stat(os.path.dirname(os.path.abspath(socket_path)))
    except OSError:
        return False
    return (stat.S_ISSOCK(st.st_mode) and st.st_uid == uid and dst.st_uid in (uid, 0)
            and not stat.S_IMODE(dst.st_mode) & 0o022)
