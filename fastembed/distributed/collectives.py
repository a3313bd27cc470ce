"""One rank's collectives on a layer's process group: agreements, data collectives within a timeout, and the
broken state a failed or interrupted one leaves.

Every step of a layer that can fail on one rank ends in an *agreement*: each
rank shares its status (an error code, or a fingerprint of what it was asked)
and all raise the same error unless every rank is fine and all fingerprints
are equal. The agreement goes through the group's board in shared memory
where the group has one (:mod:`fastembed.distributed.board`), else through one
small all-gather over the group. Once a collective has failed or been
interrupted on this rank, the ranks may be out of step, and every later call
of the layer raises :class:`CommunicationError` at once.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..arrays import torch_adapter
from . import board
from .agreement import CommunicationError, errno_of, error_code, shared_error
from .segments import SEGMENT_PREFIX, SHM_FOLDER

#: Bytes of an error message or description one rank shares with the others (longer ones are cut).
MESSAGE_BYTES = 2048
FORKED = ("a VocabParallelEmbedding and its process group serve the process that built them, not a forked child "
          "(whose writes would land in the parent's shared memory)")


def board_of(group: Any) -> board.Board | None:
    """The agreement board of `group` on this rank, if it has one (every rank alike).

    Raises:
        RuntimeError: this process is a forked child of the one that made it.
    """
    held = None if group is None else board.BOARDS.get(group)
    if held is not None and held.pid != os.getpid():
        raise RuntimeError(FORKED)
    return held


class Collectives:
    """This rank's collectives on one layer's process group, each waited for at most `timeout` seconds.

    Args:
        torch, dist: the torch module and torch.distributed.
        group: the process group the layer was given (None: the default group).
        built_on: returns the group object the layer was built on (weakly held; None once it is gone).
        timeout: seconds each collective may take, or None for the group's own timeout.
        wire: where the agreements' small tensors live: ``"cpu"``, or ``"cuda:N"`` on a group of NCCL alone.

    Attributes:
        broken: why this rank's layer can no longer call, or None while it can.
    """

    def __init__(self, torch: Any, dist: Any, group: Any, built_on: Callable[[], Any], timeout: float | None,
                 wire: str) -> None:
        self.torch, self.dist, self.group, self.built_on = torch, dist, group, built_on
        self.rank: int = dist.get_rank(group)
        self.world_size: int = dist.get_world_size(group)
        self.timeout, self.wire = timeout, wire
        self.broken: str | None = None
        # What the agreements through a board of the group wait.
        self._board_timeout_s = timeout if timeout is not None else self._group_timeout_s()
        self._mine = self.on_wire(np.zeros(2, np.int64))
        self._theirs = self.on_wire(np.zeros((self.world_size, 2), np.int64))
        self._theirs_list = list(self._theirs.unbind(0))

    def held_board(self) -> board.Board | None:
        """:func:`board_of` the group the layer was built on."""
        return board_of(self.built_on())

    def ensure_board(self, key: bytes, identities: tuple[int, ...]) -> None:
        """Give the group a board (a collective), unless every rank holds the same one already.

        `key` names it; `identities` are the boards every rank holds (0: none).
        Where a rank cannot make its part (on every rank alike), the group's
        layers go on agreeing through the group, and the next layer built tries again.
        """
        held = self.held_board()
        if held is not None and set(identities) == {held.identity}:
            return
        group = self.built_on()
        board.BOARDS.pop(group, None)  # meanwhile the ranks agree through the group, all of them
        identity = int.from_bytes(key, "little", signed=True) or 1
        name = SEGMENT_PREFIX + hashlib.blake2b(b"board", key=key, digest_size=12).hexdigest()
        try:
            made = board.open_board(name, SHM_FOLDER, identity, self.rank, self.world_size,
                                    lambda error, what: self.agree(error, 0, lambda: "", what, ""))
        except CommunicationError:
            raise
        except Exception:  # raised alike on every rank by the agreement
            return
        board.BOARDS[group] = made

    def agree(self, error: Exception | None, digest: int, describe: Callable[[], str], what: str,
              requirement: str) -> None:
        """Share every rank's (status, digest) (the group's board, else an all-gather); raise the same error on every
        rank unless all are fine and equal.

        A rank's error is raised on every rank (its type and message; "(on rank r
        of n)" added unless every rank raised it); otherwise differing digests
        raise a ValueError saying `what` they disagree on and the `requirement`,
        with each rank's description (`describe()`).
        """
        code = 0 if error is None else error_code(error)
        number = digest if error is None else errno_of(error)
        held = self.held_board()
        if held is not None:
            rows = self._board_agree(held, code, number, f"the agreement on {what}")
        else:
            self._mine[0], self._mine[1] = code, number
            self.run(lambda: self.dist.all_gather(self._theirs_list, self._mine, group=self.group, async_op=True),
                     f"the agreement on {what}")
            rows = self._theirs.tolist()  # one read back: on NCCL each read of the GPU tensor waits for the device
        codes, digests = [row[0] for row in rows], [row[1] for row in rows]
        if not any(codes) and len(set(digests)) == 1:
            return
        texts = self._gather_texts(str(error) if error is not None else describe())
        raise shared_error(codes, texts, what, requirement, digests) from error

    def agreed_step(self, step: Callable[[], None], what: str) -> float:
        """Run this rank's `step`, then agree on its outcome (a barrier carrying every rank's status); when it ended.

        Raises:
            As :meth:`agree`: a rank's error from `step`, on every rank.
        """
        error: Exception | None = None
        try:
            step()
        except Exception as caught:
            error = caught
        ended = time.perf_counter()
        try:
            self.agree(error, 0, lambda: "", what, "")
        finally:
            error = None  # the error's traceback holds this frame, which would hold the error
        return ended

    def all_gather_ints(self, values: list[int], what: str) -> list[list[int]]:
        """Every rank's `values` (the same count of int64 on every rank), on every rank."""
        mine = self.on_wire(np.array(values, np.int64))
        theirs = self.on_wire(np.zeros((self.world_size, len(values)), np.int64))
        listed = list(theirs.unbind(0))
        self.run(lambda: self.dist.all_gather(listed, mine, group=self.group, async_op=True), what)
        return [[int(value) for value in row] for row in theirs.tolist()]

    def all_reduce(self, tensor: Any, what: str) -> None:
        """The integer SUM all-reduce of `tensor`, in place."""
        self.run(lambda: self.dist.all_reduce(tensor, group=self.group, async_op=True), what)

    def reduce_scatter(self, mine: Any, parts: Any, what: str) -> None:
        """`mine` = this rank's part of the sum over the ranks: `parts` is one tensor of equal parts, or a list."""
        if isinstance(parts, list):
            self.run(lambda: self.dist.reduce_scatter(mine, parts, group=self.group, async_op=True), what)
        else:
            self.run(lambda: self.dist.reduce_scatter_single(mine, parts, group=self.group, async_op=True), what)

    def on_wire(self, host: np.ndarray) -> Any:
        """`host` as a tensor the agreements send: a CPU tensor over it, or a copy on this rank's GPU (NCCL alone)."""
        return self.torch.from_numpy(host) if self.wire == "cpu" else torch_adapter.ADAPTER.from_host(host, self.wire)

    def group_exists(self) -> bool:
        """Whether the group the layer was built on is still registered with torch (not destroyed, not replaced)."""
        group = self.built_on()
        if group is None:
            return False
        try:
            self.dist.get_backend(group)
        except (ValueError, RuntimeError):
            return False
        return True

    def mark_interrupted(self, interrupt: BaseException, where: str) -> None:
        """Leave the layer unusable after a KeyboardInterrupt (or another BaseException) `where`.

        Between two collectives or in one, the other ranks may be waiting in
        a collective this rank never starts, or be past one it has not
        finished with, so that every later call would pair with another
        call's collectives. A group of one rank has no other rank to be out
        of step with.
        """
        if self.broken is None and self.world_size > 1:
            self.broken = (f"VocabParallelEmbedding: {where} was interrupted on rank {self.rank} of {self.world_size} "
                           f"({type(interrupt).__name__}); the ranks may no longer be in step: destroy the group and "
                           "end the process")

    def run(self, start: Callable[[], Any], what: str) -> None:
        """Start a collective and wait for it, at most `timeout` seconds.

        Raises:
            CommunicationError: torch raised a RuntimeError (a timeout, a lost
                connection, a rank that left); the layer is broken from then on.
            Anything else that starting or waiting raised (a KeyboardInterrupt),
            unchanged; the layer is broken from then on too, as the ranks may be out of step.
        """
        try:
            work = start()
            if work is not None:  # None on a rank outside the group, which cannot happen here
                if self.timeout is None:
                    work.wait()
                else:
                    work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as error:  # torch's DistBackendError, "Operation timed out!", gloo's lost connections
            raise self._lost(what, f"torch.distributed said: {str(error).strip()}") from error
        except BaseException as interrupt:
            self.mark_interrupted(interrupt, what)
            raise

    def _board_agree(self, held: board.Board, code: int, number: int, what: str) -> list[list[int]]:
        """:meth:`agree`'s exchange of every rank's (code, number) through the board, at most `timeout` seconds."""
        try:
            return held.agree(code, number, self._board_timeout_s)
        except board.BoardError as error:
            if error.earlier:  # this rank's own failure, in a call of this or another layer of the group
                self.broken = (f"VocabParallelEmbedding: {what} cannot run on rank {self.rank} of {self.world_size}: "
                               f"{error}; the ranks are out of step. This process group is unusable now: destroy "
                               "it and end the process")
                raise CommunicationError(self.broken) from error
            raise self._lost(what, f"The shared-memory board said: {error}") from error
        except BaseException as interrupt:
            self.mark_interrupted(interrupt, what)
            raise

    def _lost(self, what: str, said: str) -> CommunicationError:
        """Mark the layer unusable after `what` failed on this rank, and the error to raise (`said`: by what)."""
        limit = "the group's timeout" if self.timeout is None else f"timeout={self.timeout:g} s"
        self.broken = (f"VocabParallelEmbedding: {what} failed on rank {self.rank} of {self.world_size}: another rank "
                       f"died, hung or stopped calling ({limit}). This process group is unusable now: destroy it "
                       f"and end the process. {said}")
        return CommunicationError(self.broken)

    def _gather_texts(self, text: str) -> list[str]:
        """Every rank's `text` (cut to MESSAGE_BYTES), on every rank: only on the error path."""
        encoded = text.encode("utf-8", "replace")[:MESSAGE_BYTES]
        buffer = np.zeros(MESSAGE_BYTES, np.uint8)
        buffer[: len(encoded)] = np.frombuffer(encoded, np.uint8)
        mine = self.on_wire(buffer)
        theirs = list(self.on_wire(np.zeros((self.world_size, MESSAGE_BYTES), np.uint8)).unbind(0))
        self.run(lambda: self.dist.all_gather(theirs, mine, group=self.group, async_op=True),
                 "the exchange of error messages")
        return [bytes(tensor.cpu().numpy()).rstrip(b"\0").decode("utf-8", "replace") for tensor in theirs]

    def _group_timeout_s(self) -> float:
        """The timeout the group was made with (``init_process_group(timeout=...)``), or torch's default for it."""
        try:
            limit = self.built_on()._get_backend(self.torch.device("cpu")).options._timeout
        except (AttributeError, RuntimeError, ValueError):  # torch keeps it in a private field
            limit = self.dist.default_pg_timeout
        return float(limit.total_seconds())
