"""Shared-memory segments in /dev/shm that the ranks of one host map to exchange rows, and the host's identity."""

from __future__ import annotations

import hashlib
import mmap
import os
import secrets
import socket
import sys
from typing import TYPE_CHECKING

import numpy as np

from .agreement import CommunicationError, fingerprint

if TYPE_CHECKING:
    from .collectives import Collectives

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


class SharedBuffers:
    """A layer's segment across its calls: two buffers that alternate call by call, grown by every rank together.

    Args:
        collectives: the layer's collectives, which every step of a growth agrees through.
        key: the layer's key (rank 0's), which names its segments.
        required: True (``exchange="shared_memory"``): a segment that cannot be
            made is raised on every rank; False (``"auto"``): the calls it would
            serve use the all-reduce instead.

    Attributes:
        usable: False once a segment could be made but not mapped by every rank
            (another /dev/shm): every later call uses the all-reduce.
        refusal: why the last :meth:`grow` gave shared memory up, for a
            warning; None once it has been given.
    """

    def __init__(self, collectives: Collectives, key: bytes, required: bool) -> None:
        self._collectives, self._key, self._required = collectives, key, required
        self._segment: _Segment | None = None
        self._generation = 0  # segments made so far: with the key, the next segment's name
        self._turn = 0  # which of the segment's two buffers the next call writes
        self._refused: int | None = None  # a buffer size /dev/shm refused: calls needing as much use the all-reduce
        self.usable = True
        self.refusal: str | None = None

    def holds(self, needed: int) -> bool:
        """Whether the segment's buffers hold `needed` bytes each."""
        return self._segment is not None and needed <= self._segment.buffer_bytes

    def next_buffer(self, needed: int) -> np.ndarray | None:
        """The buffer the next call writes, if the segment holds `needed` bytes (more than 0); else None."""
        return self.buffer(self._turn) if needed and self.holds(needed) else None

    def take_turn(self) -> int:
        """The buffer this call uses (0 or 1); the next call uses the other. Every rank calls it after the same
        agreement, whatever happens next, so that the turns stay equal."""
        turn = self._turn
        self._turn ^= 1
        return turn

    def buffer(self, turn: int) -> np.ndarray | None:
        """Buffer `turn` of the segment, or None before the first."""
        return None if self._segment is None else self._segment.buffers[turn]

    def names(self) -> list[str]:
        """The names (in SHM_FOLDER) of every segment made so far, oldest first: all unlinked by now."""
        return [self._name(generation) for generation in range(self._generation)]

    def grow(self, needed: int) -> bool:
        """Replace the segment by one whose buffers hold `needed` bytes, together; False where it cannot be made.

        Every rank unmaps the old segment first; rank 0 creates the file (its
        pages reserved at once), every rank maps it, and it is unlinked once
        all have, or on any failure: nothing stays in /dev/shm. Unless the
        segment is required, a failure makes this and larger calls use the
        all-reduce (a file that another rank cannot open: every call, and
        :attr:`usable` turns False), and :attr:`refusal` says so, for the
        layer to warn once the call's last collective is done (a warning
        raised as an error on one rank must not end its call before the others').

        Raises:
            OSError, ValueError, MemoryError: a required segment could not be
                made or mapped, on every rank.
            CommunicationError: a rank died meanwhile.
        """
        buffer_bytes = -(-needed // SEGMENT_GRANULE) * SEGMENT_GRANULE
        if not self.usable or (self._refused is not None and buffer_bytes >= self._refused):
            return False
        agree = self._collectives.agree
        rank = self._collectives.rank
        if self._segment is not None:
            # No rank reads the old segment after this call's agreement; unmapped by every rank first, its pages
            # do not count beside the new one's in /dev/shm (a new one that fits alone is then never refused).
            self.close()
            agree(None, 0, lambda: "", "releasing the shared-memory segment", "")
        path = os.path.join(SHM_FOLDER, self._name(self._generation))
        self._generation += 1
        mapping: mmap.mmap | None = None
        error: Exception | None = None
        stage = "making"
        try:
            if rank == 0:
                try:
                    mapping = create_mapping(path, 2 * buffer_bytes)
                except Exception as caught:
                    error = caught
            agree(error, 0, lambda: "", "making the shared-memory segment", "")
            stage = "mapping"
            if rank != 0:
                try:
                    mapping = open_mapping(path, 2 * buffer_bytes)
                except Exception as caught:
                    error = caught
            agree(error, 0, lambda: "", "mapping the shared-memory segment", "")
        except CommunicationError:
            if mapping is not None:
                mapping.close()
            raise
        except Exception as shared:  # raised alike on every rank by the agreement
            if mapping is not None:
                mapping.close()
            if self._required:
                raise
            # A refused size fails again only above it; a file another rank cannot open (another /dev/shm), always.
            if stage == "making":
                self._refused = buffer_bytes
            else:
                self.usable = False
                self.close()
            # Sizes are rounded up to whole granules, so every call above the last granule that fits is refused.
            which = (f"calls of more than {buffer_bytes - SEGMENT_GRANULE} bytes" if stage == "making"
                     else "every call of this layer")
            self.refusal = (f"VocabParallelEmbedding: no shared-memory segment of {2 * buffer_bytes} bytes ({shared}); "
                            f"{which} use the all-reduce")
            return False
        finally:
            error = None  # the error's traceback holds this frame, which would hold the error
            unlink_quietly(path)  # every rank has mapped it, or the ranks gave up on it
        self.close()
        assert mapping is not None
        self._segment = _Segment(mapping, buffer_bytes)
        return True

    def close(self) -> None:
        """Unmap the segment (the next call that needs one grows a new one)."""
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    def _name(self, generation: int) -> str:
        hasher = hashlib.blake2b(generation.to_bytes(8, "little"), key=self._key, digest_size=12)
        return SEGMENT_PREFIX + hasher.hexdigest()


def host_identity() -> tuple[int, bool]:
    """A hash of what ranks sharing memory have in common (host, boot, user, /dev/shm), and whether it is usable."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot_file:
            boot = boot_file.read().strip()
        folder = os.stat(SHM_FOLDER)
    except OSError:
        return fingerprint(socket.gethostname().encode(), secrets.token_bytes(8)), False
    getuid = getattr(os, "getuid", None)
    user = getuid() if getuid is not None else -1
    host = fingerprint(socket.gethostname().encode(), b"\0", boot.encode(),
                   f"\0{user}\0{folder.st_dev}:{folder.st_ino}".encode())
    usable = (sys.platform.startswith("linux") and hasattr(os, "posix_fallocate")
              and os.access(SHM_FOLDER, os.W_OK | os.X_OK))
    return host, usable


def create_mapping(path: str, size: int) -> mmap.mmap:
    """A new file of `size` bytes at `path`, its pages reserved, mapped read-write; the file is removed on failure.

    Where the system allows it, the file gets its name only once its pages are reserved (an unnamed file,
    linked to `path`), so a process killed while they are reserved leaves no name behind.
    """
    unnamed = _unnamed_file(os.path.dirname(path))
    if unnamed is None:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    else:
        descriptor = unnamed
    try:
        # Reserving the pages now makes a full /dev/shm an OSError here rather than a SIGBUS at the first write.
        os.posix_fallocate(descriptor, 0, size)
        mapping = mmap.mmap(descriptor, size)
        if unnamed is not None:
            try:
                _name_file(descriptor, path)
            except BaseException:
                mapping.close()
                raise
        return mapping
    except BaseException:
        if unnamed is None:
            unlink_quietly(path)
        raise
    finally:
        os.close(descriptor)


def _name_file(descriptor: int, path: str) -> None:
    """Link the unnamed file of `descriptor` to `path`; FileExistsError if `path` exists, as O_EXCL gives."""
    folder = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        # A folder descriptor makes Python call linkat, which follows /proc's link to the file itself.
        os.link(f"/proc/self/fd/{descriptor}", os.path.basename(path), dst_dir_fd=folder, follow_symlinks=True)
    except OSError as error:
        raise OSError(error.errno, error.strerror, path) from None  # named as an O_EXCL open names it
    finally:
        os.close(folder)


def _unnamed_file(folder: str) -> int | None:
    """A descriptor of a new file in `folder` that has no name yet (Linux's O_TMPFILE), or None where there is none."""
    flag = getattr(os, "O_TMPFILE", None)
    if flag is None or not os.path.isdir("/proc/self/fd"):  # naming it later goes through /proc
        return None
    try:
        return os.open(folder, os.O_RDWR | flag | os.O_CLOEXEC, 0o600)
    except OSError:  # a file system without unnamed files
        return None


def open_mapping(path: str, size: int) -> mmap.mmap:
    """Map the file rank 0 made at `path`, after checking that it is this user's and `size` bytes long."""
    descriptor = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        status = os.fstat(descriptor)
        if status.st_uid != os.getuid() or status.st_size != size:
            raise ValueError(f"{path} is not the segment rank 0 made (owner {status.st_uid}, {status.st_size} bytes)")
        return mmap.mmap(descriptor, size)
    finally:
        os.close(descriptor)


def unlink_quietly(path: str) -> None:
    """Remove the file at `path`, if it is still there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
