"""Shared-memory segments in /dev/shm that the ranks of one host map to exchange rows, and the host's identity."""

from __future__ import annotations

import mmap
import os
import secrets
import socket
import sys

import numpy as np

from .agreement import _digest

#: Where the shared-memory exchange creates its segments (a tmpfs on Linux), and how their names begin.
SHM_FOLDER = "/dev/shm"
SEGMENT_PREFIX = "fastembed-"
#: A segment's buffers are sized in multiples of this (a huge page), so that nearby batch sizes share one.
SEGMENT_GRANULE = 2 * 2**20


class _Segment:
    """A mapped shared-memory file of two buffers of `buffer_bytes`; its name is already unlinked."""

    def __init__(self, mapping: mmap.mmap, buffer_bytes: int) -> None:
        self._mapping = mapping
        self.buffer_bytes = buffer_bytes
        whole = np.frombuffer(mapping, np.uint8)
        self.buffers: tuple[np.ndarray, ...] = (whole[:buffer_bytes], whole[buffer_bytes: 2 * buffer_bytes])

    def close(self) -> None:
        self.buffers = ()
        try:
            self._mapping.close()
        except BufferError:  # a view of it is still alive somewhere: the map goes with the last one
            pass


def _host_identity() -> tuple[int, bool]:
    """A hash of what ranks sharing memory have in common (host, boot, user, /dev/shm), and whether it is usable."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot_file:
            boot = boot_file.read().strip()
        folder = os.stat(SHM_FOLDER)
    except OSError:
        return _digest(socket.gethostname().encode(), secrets.token_bytes(8)), False
    getuid = getattr(os, "getuid", None)
    user = getuid() if getuid is not None else -1
    host = _digest(socket.gethostname().encode(), b"\0", boot.encode(),
                   f"\0{user}\0{folder.st_dev}:{folder.st_ino}".encode())
    usable = (sys.platform.startswith("linux") and hasattr(os, "posix_fallocate")
              and os.access(SHM_FOLDER, os.W_OK | os.X_OK))
    return host, usable


def _create_mapping(path: str, size: int) -> mmap.mmap:
    """A new file of `size` bytes at `path`, its pages reserved, mapped read-write; the file is removed on failure."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        # Reserving the pages now makes a full /dev/shm an OSError here rather than a SIGBUS at the first write.
        os.posix_fallocate(descriptor, 0, size)
        return mmap.mmap(descriptor, size)
    except BaseException:
        _unlink_quietly(path)
        raise
    finally:
        os.close(descriptor)


def _open_mapping(path: str, size: int) -> mmap.mmap:
    """Map the file rank 0 made at `path`, after checking that it is this user's and `size` bytes long."""
    descriptor = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        status = os.fstat(descriptor)
        if status.st_uid != os.getuid() or status.st_size != size:
            raise ValueError(f"{path} is not the segment rank 0 made (owner {status.st_uid}, {status.st_size} bytes)")
        return mmap.mmap(descriptor, size)
    finally:
        os.close(descriptor)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
