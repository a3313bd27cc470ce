"""The ranks' agreements through shared memory: a board every rank of one host maps, and named pipes that wake them.

An agreement is one post per rank: its status code and digest, then the
count of agreements so far, on its own line of the board. A rank waits until
every line of this agreement carries that count. Posts alternate between two
sets of lines, so a rank that goes on to the next agreement cannot overwrite
a line another rank is still reading (it cannot get two agreements ahead).

Each ordered pair of ranks shares a named pipe: after posting, a rank writes
a byte into its pipe to every other rank, which wakes a rank waiting in
``poll``; and when a rank's process ends or its board is closed, the pipes
it writes are closed, which its readers see at once as a hang-up (unless a
child process it forked still holds them).

A board serves every layer built on one process group, as the group's own
collectives would: the ranks' agreements pair up in the order they are made,
whichever layer makes them, so that ranks calling different layers are told
so by the digests rather than waiting for each other.

The count is written after the code and digest, and a reader takes a line
whose count it sees; that relies on stores becoming visible in program
order, as on x86-64 (:func:`usable`). Elsewhere the layers agree through
their process group.
"""

from __future__ import annotations

import math
import mmap
import os
import platform
import select
import stat
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from .segments import create_mapping, open_mapping, unlink_quietly

#: int64 words per rank and turn: count, status code, digest, and padding to a 64-byte cache line of its own.
_LINE_WORDS = 8
#: The longest single wait in poll (milliseconds): a post whose wake-up never came (its rank was interrupted
#: in between) is still seen within this.
_MAX_POLL_MS = 100
#: Hang-up, error or a closed descriptor: the rank writing that pipe is gone.
_GONE = select.POLLHUP | select.POLLERR | select.POLLNVAL if hasattr(select, "POLLHUP") else 0

#: Each process group's board on this rank (weakly: it lives as long as the group object).
BOARDS: weakref.WeakKeyDictionary[Any, Board] = weakref.WeakKeyDictionary()


def usable() -> bool:
    """Whether this machine can agree through a board: Linux named pipes and poll, and stores seen in program order."""
    return (sys.platform.startswith("linux") and platform.machine().lower() in ("x86_64", "amd64")
            and hasattr(os, "mkfifo") and hasattr(select, "poll"))


class BoardError(Exception):
    """An agreement through the board failed: a rank is gone or late, or (`earlier`) an earlier one failed here."""

    def __init__(self, message: str, earlier: bool = False) -> None:
        super().__init__(message)
        self.earlier = earlier


class Board:
    """One rank's view of the board: post this rank's status, wait for every other rank's.

    Built by :func:`open_board`, a collective. After a failed or interrupted
    agreement the ranks are out of step, and every later agreement raises
    :class:`BoardError` at once. One thread at a time, in the process that
    made it: the layers hold their group's lock, and refuse a forked child.
    """

    def __init__(self, mapping: mmap.mmap, identity: int, rank: int, world_size: int, inboxes: dict[int, int],
                 outboxes: list[int]) -> None:
        #: The same number on every rank of the board, and another for every board.
        self.identity = identity
        self.rank, self.world_size = rank, world_size
        self._lines = np.frombuffer(mapping, np.int64).reshape(2, world_size, _LINE_WORDS)
        self._posts = 0
        self._outboxes = outboxes
        self._rank_of = {descriptor: other for other, descriptor in inboxes.items()}
        self._poller = select.poll()
        for descriptor in inboxes.values():
            self._poller.register(descriptor, select.POLLIN)
        self._gone: set[int] = set()
        self._failed: str | None = None
        #: The process that made it: a forked child must not post on its lines.
        self.pid = os.getpid()
        self._closer = weakref.finalize(self, _close, mapping, [*inboxes.values(), *outboxes])

    def agree(self, code: int, digest: int, timeout_s: float) -> list[list[int]]:
        """Post (`code`, `digest`), wait for every rank's post of this agreement; every rank's ``[code, digest]``.

        Raises:
            BoardError: a rank that has not posted closed its pipes, or did not
                post within `timeout_s` (naming which), or an earlier agreement
                failed or was interrupted on this rank.
        """
        if self._failed is not None:
            raise BoardError(self._failed, earlier=True)
        try:
            return self._agree(code, digest, timeout_s)
        except BoardError as error:
            self._failed = f"an earlier agreement failed on rank {self.rank}: {error}"
            raise
        except BaseException as interrupt:
            self._failed = f"an earlier agreement was interrupted on rank {self.rank} ({type(interrupt).__name__})"
            raise

    def close(self) -> None:
        """Close this rank's pipes and unmap the board; the other ranks' waits then end with :class:`BoardError`."""
        self._failed = "this rank's board was closed"
        self._lines = np.empty((2, self.world_size, _LINE_WORDS), np.int64)  # the map's last view goes first
        self._closer()

    def _agree(self, code: int, digest: int, timeout_s: float) -> list[list[int]]:
        count = self._posts + 1
        self._posts = count
        lines = self._lines[count % 2]
        mine = lines[self.rank]
        mine[1] = code
        mine[2] = digest
        mine[0] = count  # last: a rank that sees the count sees the code and digest too
        for descriptor in self._outboxes:
            try:
                os.write(descriptor, b"\1")
            except BlockingIOError:  # a full pipe: its reader has wake-ups waiting already
                pass
        self._wait(lines, count, timeout_s)
        return lines[:, 1:3].tolist()

    def _wait(self, lines: np.ndarray, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            waiting = np.flatnonzero(lines[:, 0] != count).tolist()
            if not waiting:
                return
            gone = [rank for rank in waiting if rank in self._gone]
            if gone:
                raise BoardError(f"rank {gone[0]} closed its end of the agreement board before this agreement (its "
                                 "process ended, or its process group was destroyed there)")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BoardError(f"rank(s) {', '.join(map(str, waiting))} did not reach the agreement in time")
            for descriptor, events in self._poller.poll(min(math.ceil(remaining * 1000), _MAX_POLL_MS)):
                if events & select.POLLIN:
                    _drain(descriptor)
                if events & _GONE:
                    self._gone.add(self._rank_of[descriptor])
                    self._poller.unregister(descriptor)  # else every later poll returns at once


def open_board(name: str, folder: str, identity: int, rank: int, world_size: int,
               agree: Callable[[Exception | None, str], None]) -> Board:
    """Make the board and the pipes together with the other ranks (a collective), and unlink their names.

    Every rank unlinks every name once the ranks hold them, or once the
    making failed (a rank that died meanwhile leaves none of its names).

    Args:
        name: the board's file name in `folder`, the same on every rank and hard
            to guess; the pipes are named after it.
        identity: :attr:`Board.identity`, the same on every rank.
        agree: the process group's agreement: raises on every rank when any
            rank passes an error.

    Raises:
        OSError, ValueError: a rank could not make or open its part (on every
            rank); and whatever `agree` raises (a rank that died meanwhile).
    """
    board_path = os.path.join(folder, name)
    size = 2 * world_size * _LINE_WORDS * 8
    others = [other for other in range(world_size) if other != rank]
    names = [board_path] + [_pipe_path(board_path, sender, receiver) for sender in range(world_size)
                            for receiver in range(world_size) if sender != receiver]
    inboxes: dict[int, int] = {}
    outboxes: list[int] = []
    mapping = None
    error: Exception | None = None
    try:
        try:
            for other in others:
                path = _pipe_path(board_path, other, rank)
                os.mkfifo(path, 0o600)  # fails if the name exists: no one else's pipe is taken over
                inboxes[other] = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            if rank == 0:
                mapping = create_mapping(board_path, size)
        except Exception as caught:
            error = caught
        agree(error, "making the agreement board")
        try:
            if rank != 0:
                mapping = open_mapping(board_path, size)
            for other in others:
                # Read-write, so that the pipe always has a reader: a write to a rank that is gone cannot raise
                # SIGPIPE, whatever the process does with that signal.
                outboxes.append(_open_pipe(_pipe_path(board_path, rank, other)))
        except Exception as caught:
            error = caught
        agree(error, "opening the agreement board")
    except BaseException:
        _close(mapping, [*inboxes.values(), *outboxes])
        raise
    finally:
        error = None  # the error's traceback holds this frame, which would hold the error
        for path in names:
            try:
                unlink_quietly(path)
            except OSError:  # not this user's file to remove (a sticky folder): not ours either
                pass
    assert mapping is not None
    return Board(mapping, identity, rank, world_size, inboxes, outboxes)


def _pipe_path(board_path: str, sender: int, receiver: int) -> str:
    return f"{board_path}-{sender}-{receiver}"


def _open_pipe(path: str) -> int:
    """Open the named pipe another rank made at `path` to write into it, after checking that it is this user's pipe."""
    descriptor = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    status = os.fstat(descriptor)
    if not stat.S_ISFIFO(status.st_mode) or status.st_uid != os.getuid():
        os.close(descriptor)
        raise ValueError(f"{path} is not the pipe another rank made (mode {status.st_mode:o}, owner {status.st_uid})")
    return descriptor


def _drain(descriptor: int) -> None:
    try:
        while os.read(descriptor, 4096):
            pass
    except BlockingIOError:
        pass


def _close(mapping: mmap.mmap | None, descriptors: list[int]) -> None:
    for descriptor in descriptors:
        try:
            os.close(descriptor)
        except OSError:
            pass
    if mapping is not None:
        try:
            mapping.close()
        except BufferError:  # a view of it is still alive: the map goes with the last one
            pass
