"""The shared-memory arena: layout, mode, fd passing, and the rule that a result only lands in its own step."""

from __future__ import annotations

import os
import socket
import stat

import numpy as np
import pytest

from peerd.localsock.arena import (
    HEADER_SIZE,
    RESULT,
    Arena,
    ArenaError,
    arena_size,
    fill_blob,
    read_blob,
    slot_stride,
    write_blob,
    write_blob_from,
)


def test_layout_is_aligned_and_sized() -> None:
    assert slot_stride(1) == 128  # 64-byte slot header + 4 bytes, rounded to 64
    assert slot_stride(16) == 128
    assert slot_stride(17) == 192
    assert arena_size(4, 1000) == HEADER_SIZE + 4 * slot_stride(1000)
    a = Arena.create(4, 1000)
    try:
        assert os.fstat(a.fd).st_size == arena_size(4, 1000)
        assert stat.S_IMODE(os.fstat(a.fd).st_mode) == 0o600
        for step in range(8):
            assert a.vector(step).ctypes.data % 64 == 0
    finally:
        a.close()


def test_daemon_sees_trainer_writes_through_a_passed_fd() -> None:
    """The trainer sends the memfd over a Unix socket; both sides map the same memory."""
    trainer = Arena.create(3, 5)
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        socket.send_fds(left, [b"x"], [trainer.fd])
        _, fds, _, _ = socket.recv_fds(right, 1, 1)
        daemon = Arena.attach(fds[0], 3, 5)
        trainer.vector(7)[:] = [1, 2, 3, 4, 5]
        trainer.write_request(7, 32)
        assert daemon.check_request(7) == 32.0
        assert daemon.vector(7).tolist() == [1, 2, 3, 4, 5]
        daemon.write_result(7, np.full(5, 9, np.float32))
        assert trainer.result(7).tolist() == [9] * 5
        assert trainer.read_header(7)[2] == RESULT
        daemon.close()
    finally:
        left.close()
        right.close()
        trainer.close()


def test_a_result_for_one_step_is_never_read_as_another_steps() -> None:
    a = Arena.create(2, 4)
    try:
        a.vector(1)[:] = 1
        a.write_request(1, 1)
        a.write_result(1, np.zeros(4, np.float32))
        # step 3 uses the same slot: the trainer rewrote it, so the old result is gone for step 3 ...
        a.vector(3)[:] = 3
        a.write_request(3, 1)
        with pytest.raises(ArenaError, match="no result for step 3"):
            a.result(3)
        # ... and step 1's result cannot be read once the slot belongs to step 3
        with pytest.raises(ArenaError):
            a.result(1)
        # the daemon refuses a request whose slot holds another step
        with pytest.raises(ArenaError, match="holds step 3"):
            a.check_request(5)
    finally:
        a.close()


def test_attach_checks_the_declared_layout() -> None:
    a = Arena.create(4, 100)
    try:
        with pytest.raises(ArenaError, match="needs"):
            Arena.attach(os.dup(a.fd), 4, 10_000)
        with pytest.raises(ArenaError, match="does not match"):
            Arena.attach(os.dup(a.fd), 4, 99)
        with pytest.raises(ArenaError, match="slots"):
            Arena.create(1, 10)
        with pytest.raises(ArenaError, match="positive"):
            a.write_request(0, 0)
            a.check_request(0)
    finally:
        a.close()


def test_blobs_round_trip_and_short_blobs_are_refused() -> None:
    data = os.urandom(100_000)
    fd = write_blob(data)
    try:
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600
        assert read_blob(fd, len(data)) == data
        with pytest.raises(ArenaError, match="expected"):
            read_blob(fd, len(data) + 1)
        with pytest.raises(ArenaError, match="empty"):
            fill_blob(fd, b"short")  # sealed against shrinking: only an empty blob is filled
    finally:
        os.close(fd)
    fd = write_blob(b"")
    try:
        fill_blob(fd, b"short")
        assert read_blob(fd, 5) == b"short"
        assert os.fstat(fd).st_size == 5
    finally:
        os.close(fd)


def test_a_blob_written_as_a_file_is_sealed_and_sized() -> None:
    """A snapshot serialized straight into the memfd: the size it reports is what was written, and the blob is
    sealed as ``write_blob``'s (the daemon refuses one that is not); an error while saving leaves no fd open."""
    parts = [os.urandom(70_000), os.urandom(5)]
    fd, size = write_blob_from(lambda f: [f.write(p) for p in parts], name="peerd-test")
    try:
        assert size == 70_005 and stat.S_IMODE(os.fstat(fd).st_mode) == 0o600
        assert read_blob(fd, size) == b"".join(parts)
        with pytest.raises(ArenaError, match="empty"):
            fill_blob(fd, b"x")
    finally:
        os.close(fd)
    before = len(os.listdir("/proc/self/fd"))

    def broken(f: object) -> None:
        raise RuntimeError("serializer failed")

    with pytest.raises(RuntimeError, match="serializer"):
        write_blob_from(broken)
    assert len(os.listdir("/proc/self/fd")) == before
