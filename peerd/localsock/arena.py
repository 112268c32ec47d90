"""The shared-memory tensor arena between a trainer and its daemon (both sides import this module).

Why a memfd: ``multiprocessing.shared_memory`` in 3.11 registers segments with a resource tracker that
unlinks them when *any* process exits, and /dev/shm is capped at 64 MB in containers. A memfd lives in
anonymous memory, has no name to leak, and dies with the last descriptor or mapping. The trainer creates
it (mode 0600 is implied: nobody else can open it without the descriptor) and hands the descriptor to
its daemon with ``socket.send_fds``; both map it, so a step moves no gradient bytes through the socket.

Why sealed: a mapping of a file that shrinks under it raises SIGBUS on the next touch, which would kill
the daemon. So the trainer creates the memfd with MFD_ALLOW_SEALING and seals it against shrinking
(F_SEAL_SHRINK, then F_SEAL_SEAL so the seals cannot change); the daemon refuses a descriptor whose
seals lack F_SEAL_SHRINK, and one smaller than the declared layout, before it maps anything.

Layout (all integers little-endian)::

    header (64 bytes): magic "PEERDAR1", version u32, nslots u32, elems u64, slot_stride u64, reserved
    slot i at HEADER + i * slot_stride:
        slot header (64 bytes): step u64   (the step id the trainer wrote this slot for)
                                samples f64 (the averaging weight: the trainer's sample count)
                                state u32   (EMPTY, REQUEST, RESULT)
                                result_step u64 (the step id the daemon wrote a result for)
        vector: elems float32 (the trainer's gradients or parameters; the daemon writes the result in place)

Step id s uses slot s % nslots. The daemon writes a result only into the slot of the step it was asked
for, only while no later step has been requested on the session, and stamps ``result_step``; the
trainer accepts a result only if ``result_step`` is its step. So a late result can never land in a
later step, even when the daemon finishes a timed-out round after the trainer has moved on.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from collections.abc import Callable
from typing import BinaryIO

import numpy as np

MAGIC = b"PEERDAR1"
VERSION = 1
HEADER = struct.Struct("<8sIIQQ")  # magic, version, nslots, elems, slot_stride
HEADER_SIZE = 64
SLOT_HEADER = struct.Struct("<QdIxxxxQ")  # step, samples, state, pad, result_step
SLOT_HEADER_SIZE = 64
EMPTY, REQUEST, RESULT = 0, 1, 2
MAX_SLOTS = 64
MAX_ELEMS = 2**34  # 64 GiB of float32: far beyond any arena a daemon should accept, but bounded


SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL  # what every arena and blob is sealed with


class ArenaError(Exception):
    """The arena is malformed, too small, unsealed, or a slot does not hold what the caller expects."""


def _sealed_memfd(name: str) -> int:
    return os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)


def _seal(fd: int) -> None:
    """Seal a fresh memfd (already at its final size) against shrinking; no seal can be changed after."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)


def check_sealed(fd: int, what: str = "arena") -> None:
    """Raise ArenaError unless ``fd`` is a memfd sealed against shrinking (so mapping it cannot SIGBUS us)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:
        raise ArenaError(f"the {what} is not a sealable memfd ({e.strerror}): create it with "
                         f"peerd.localsock.arena (memfd_create with MFD_ALLOW_SEALING)") from None
    if not seals & fcntl.F_SEAL_SHRINK:
        raise ArenaError(f"the {what} is not sealed against shrinking (seals {seals:#x}): seal it with "
                         f"fcntl(F_ADD_SEALS, F_SEAL_SHRINK) before sending it; upgrade peerd on the trainer side")


def slot_stride(elems: int) -> int:
    """Bytes per slot, rounded to 64 so every vector starts cache-line (and SIMD) aligned."""
    raw = SLOT_HEADER_SIZE + 4 * elems
    return (raw + 63) // 64 * 64


def arena_size(nslots: int, elems: int) -> int:
    return HEADER_SIZE + nslots * slot_stride(elems)


class Arena:
    """A mapped arena. ``create`` (trainer side) makes a fresh memfd; ``attach`` (daemon side) maps one."""

    def __init__(self, fd: int, nslots: int, elems: int, *, owns_fd: bool = True) -> None:
        self.fd = fd
        self.nslots = nslots
        self.elems = elems
        self.stride = slot_stride(elems)
        self.size = arena_size(nslots, elems)
        self._owns_fd = owns_fd
        self.map = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._closed = False

    @classmethod
    def create(cls, nslots: int, elems: int, *, name: str = "peerd-arena") -> Arena:
        _check_shape(nslots, elems)
        fd = _sealed_memfd(name)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, arena_size(nslots, elems))
            _seal(fd)
            arena = cls(fd, nslots, elems)
        except BaseException:
            os.close(fd)
            raise
        HEADER.pack_into(arena.map, 0, MAGIC, VERSION, nslots, elems, arena.stride)
        return arena

    @classmethod
    def attach(cls, fd: int, nslots: int, elems: int) -> Arena:
        """Map a descriptor a trainer sent; checks seals, size and header against what the trainer declared.

        On success the arena owns ``fd`` (closes it); on failure the caller still does."""
        _check_shape(nslots, elems)
        check_sealed(fd)
        size = os.fstat(fd).st_size
        if size < arena_size(nslots, elems):
            raise ArenaError(f"arena is {size} bytes, the declared layout needs {arena_size(nslots, elems)}")
        arena = cls(fd, nslots, elems)
        magic, version, n, e, stride = HEADER.unpack_from(arena.map, 0)
        if (magic, version, n, e, stride) != (MAGIC, VERSION, nslots, elems, arena.stride):
            arena._owns_fd = False  # the caller still owns the descriptor it passed
            arena.close()
            raise ArenaError(
                f"arena header (magic {magic!r}, version {version}, {n} slots of {e} elements) does not match "
                f"the declared layout ({nslots} slots of {elems} elements, version {VERSION})"
            )
        return arena

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.map.close()
        except BufferError:
            # a numpy view still exports the buffer; the mapping goes when the last view does
            pass
        if self._owns_fd:
            os.close(self.fd)

    # -- slots ----------------------------------------------------------------------------------
    def slot_of(self, step: int) -> int:
        return step % self.nslots

    def _slot_offset(self, step: int) -> int:
        return HEADER_SIZE + self.slot_of(step) * self.stride

    def vector(self, step: int) -> np.ndarray:
        """The float32 vector of ``step``'s slot, as a view into shared memory (no copy)."""
        return np.frombuffer(self.map, np.float32, self.elems, self._slot_offset(step) + SLOT_HEADER_SIZE)

    def read_header(self, step: int) -> tuple[int, float, int, int]:
        """(step, samples, state, result_step) of ``step``'s slot."""
        return SLOT_HEADER.unpack_from(self.map, self._slot_offset(step))

    def write_request(self, step: int, samples: float) -> None:
        """Trainer: mark the slot as holding ``step``'s input (write the vector first)."""
        SLOT_HEADER.pack_into(self.map, self._slot_offset(step), step, float(samples), REQUEST, 0)

    def check_request(self, step: int) -> float:
        """Daemon: the sample count of ``step``'s request; raises ArenaError if the slot holds another step."""
        got, samples, state, _ = self.read_header(step)
        if got != step or state != REQUEST:
            raise ArenaError(f"slot {self.slot_of(step)} holds step {got} (state {state}), not a request "
                             f"for step {step}: write the vector and call write_request first")
        if not (samples > 0 and np.isfinite(samples)):
            raise ArenaError(f"sample count must be a positive finite number, got {samples}")
        return samples

    def write_result(self, step: int, result: np.ndarray) -> None:
        """Daemon: write ``step``'s result in place and stamp it (the caller checked the step is current)."""
        self.vector(step)[:] = result
        off = self._slot_offset(step)
        got, samples, _, _ = SLOT_HEADER.unpack_from(self.map, off)
        SLOT_HEADER.pack_into(self.map, off, got, samples, RESULT, step)

    def write_range(self, step: int, offset: int, result: np.ndarray) -> None:
        """Daemon: write one bucket of ``step``'s result in place (overlap: buckets finish one by one; the
        trainer learns that a bucket is done from the reply to its request, so the slot is not stamped)."""
        if not 0 <= offset <= offset + result.size <= self.elems:
            raise ArenaError(f"range [{offset}, {offset + result.size}) is outside the {self.elems} elements")
        got, _, state, _ = self.read_header(step)
        if got != step or state != REQUEST:
            raise ArenaError(f"slot {self.slot_of(step)} holds step {got} (state {state}), not step {step}'s request")
        self.vector(step)[offset: offset + result.size] = result

    def result(self, step: int) -> np.ndarray:
        """Trainer: ``step``'s result view; raises ArenaError unless the daemon stamped it for this step."""
        got, _, state, result_step = self.read_header(step)
        if state != RESULT or result_step != step or got != step:
            raise ArenaError(f"slot {self.slot_of(step)} holds no result for step {step} "
                             f"(step {got}, state {state}, result for {result_step})")
        return self.vector(step)


def _check_shape(nslots: int, elems: int) -> None:
    if type(nslots) is not int or not 2 <= nslots <= MAX_SLOTS:
        raise ArenaError(f"an arena has 2..{MAX_SLOTS} slots, not {nslots!r}")
    if type(elems) is not int or not 1 <= elems <= MAX_ELEMS:
        raise ArenaError(f"an arena vector has 1..{MAX_ELEMS} elements, not {elems!r}")


def write_blob(data: bytes, *, name: str = "peerd-blob") -> int:
    """A fresh memfd (mode 0600, sealed against shrinking) holding ``data``; for state snapshots, which are
    too rare to need slots. It can still grow: the daemon fills an empty one on a state fetch."""
    return write_blob_from(lambda f: f.write(data), name=name)[0]


def write_blob_from(save: Callable[[BinaryIO], object], *, name: str = "peerd-blob") -> tuple[int, int]:
    """A fresh memfd, as ``write_blob``, that ``save`` writes into as a file (a snapshot serialized straight into
    it, without a copy in memory first); returns the fd and the bytes written."""
    fd = _sealed_memfd(name)
    try:
        os.fchmod(fd, 0o600)
        with open(fd, "wb", closefd=False) as f:
            save(f)
        size = os.fstat(fd).st_size
        _seal(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd, size


def read_blob(fd: int, size: int) -> bytes:
    """Read exactly ``size`` bytes from the start of ``fd``; raises ArenaError if it is shorter or unsealed."""
    check_sealed(fd, "blob")
    have = os.fstat(fd).st_size
    if have < size:
        raise ArenaError(f"blob is {have} bytes, expected {size}")
    out = bytearray()
    while len(out) < size:
        chunk = os.pread(fd, min(1 << 24, size - len(out)), len(out))
        if not chunk:
            raise ArenaError(f"blob ended at {len(out)} of {size} bytes")
        out += chunk
    return bytes(out)


def fill_blob(fd: int, data: bytes) -> None:
    """Write ``data`` into an empty sealed memfd someone else created (daemon side of a fetch)."""
    check_sealed(fd, "blob")
    have = os.fstat(fd).st_size
    if have > len(data):
        raise ArenaError(f"the blob to fill holds {have} bytes already; send an empty one (write_blob(b''))")
    try:
        os.ftruncate(fd, len(data))
    except OSError as e:
        raise ArenaError(f"cannot grow the blob to {len(data)} bytes: {e.strerror}") from None
    view = memoryview(data)
    off = 0
    while off < len(view):
        off += os.pwrite(fd, view[off:], off)
