"""Running a test as another (unprivileged) user: free ids, the repository root."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout (tests/support/ is two levels down)


def _free_id(taken: set[int], start: int) -> int:
    n = start
    while n in taken:
        n += 1
    taken.add(n)
    return n


def _blocked_dirs() -> dict[Path, set[str]]:
    """Directories above this checkout's interpreter and code that other users cannot enter (e.g. a /root of mode
    0700 holding the Python installation), each with the names below it that the path goes through."""
    needed = {Path(sys.executable), Path(sys.executable).resolve(), Path(sys.base_prefix).resolve(),
              *(Path(p).resolve() for p in sys.path if p and os.path.isdir(p)), ROOT / "peerd"}
    blocked: dict[Path, set[str]] = {}
    for path in needed:
        for child, parent in zip([path, *path.parents], path.parents, strict=False):
            if not os.stat(parent).st_mode & 0o001:
                blocked.setdefault(parent, set()).add(child.name)
    return blocked


def _as_user(argv: list[str], uid: int, gid: int, groups: list[int], base: Path, umask: int = 0o022) -> list[str]:
    """``argv`` run as uid/gid with exactly ``groups`` as supplementary groups (setpriv). Where the interpreter or
    the checkout sits below a directory other users cannot enter, the command runs in a private mount namespace
    in which that directory is a tmpfs holding only the entries the path needs (nothing outside changes)."""
    groups_opt = f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups"
    prelude = []
    for i, (d, children) in enumerate(sorted(_blocked_dirs().items(), key=lambda kv: len(kv[0].parts))):
        hold = base / f"hold{i}"
        hold.mkdir(exist_ok=True)
        prelude.append(f"mount --bind {shlex.quote(str(d))} {hold} && mount -t tmpfs -o mode=0755 tmpfs "
                       f"{shlex.quote(str(d))}")
        for c in sorted(children):
            prelude.append(f"mkdir {shlex.quote(str(d / c))} && mount --bind {shlex.quote(str(hold / c))} "
                           f"{shlex.quote(str(d / c))}")
    script = " && ".join([*prelude, f"umask {umask:03o}",
                          f'exec setpriv --reuid={uid} --regid={gid} {groups_opt} -- "$@"'])
    wrapper = ["unshare", "-m", "--propagation", "private"] if prelude else []
    return [*wrapper, "sh", "-c", script, "sh", *argv]
