"""The agreement board of fastembed.distributed, its ranks played by threads of one process.

Every rank's agreement returns every rank's post, in step; a rank that is
gone or late ends the others' wait with BoardError (at once, or after the
timeout), after which the board refuses every agreement; opening fails alike on every
rank and leaves no name behind; a post whose wake-up never came is seen
within a poll interval.
"""
from __future__ import annotations

import os
import select
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from fastembed.distributed import board

pytestmark = pytest.mark.skipif(not board.usable(), reason="the board needs Linux named pipes on x86-64")

TIMEOUT_S = 30.0


class ThreadAgreement:
    """The process group's agreement for ranks that are threads: every rank raises when any rank passes an error."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world, timeout=10)
        self.errors: list[Exception | None] = [None] * world

    def for_rank(self, rank: int):
        def agree(error: Exception | None, what: str) -> None:
            self.errors[rank] = error
            self.barrier.wait()
            failed = [str(error) for error in self.errors if error is not None]
            self.barrier.wait()
            if failed:
                raise OSError(f"{what}: {failed[0]}")
        return agree


def open_boards(folder, world: int) -> list[board.Board]:
    agreement = ThreadAgreement(world)
    with ThreadPoolExecutor(world) as pool:
        futures = [pool.submit(board.open_board, "board", str(folder), 7, rank, world, agreement.for_rank(rank))
                   for rank in range(world)]
        return [future.result() for future in futures]


def posted(receiver: board.Board, sender: int) -> None:
    """Return once `sender`'s wake-up waits in `receiver`'s pipe (it has posted), leaving it there to be read."""
    inbox = next(descriptor for descriptor, rank in receiver._rank_of.items() if rank == sender)
    assert select.select([inbox], [], [], TIMEOUT_S)[0], f"rank {sender} did not post within {TIMEOUT_S} s"


class Polling:
    """A board's poller that says when its rank starts to wait for a wake-up."""

    def __init__(self, poller) -> None:
        self.poller, self.waiting = poller, threading.Event()

    def poll(self, timeout_ms):
        self.waiting.set()
        return self.poller.poll(timeout_ms)

    def __getattr__(self, name):
        return getattr(self.poller, name)


def run_ranks(boards: list[board.Board], task) -> list:
    with ThreadPoolExecutor(len(boards)) as pool:
        return [future.result() for future in [pool.submit(task, one) for one in boards]]


@pytest.mark.parametrize("world", [2, 3, 5])
def test_every_agreement_returns_every_ranks_post_in_step(tmp_path, world):
    boards = open_boards(tmp_path, world)
    assert os.listdir(tmp_path) == []  # the board and every pipe are unlinked once all ranks hold them
    assert {one.identity for one in boards} == {7}
    rounds = 400

    def task(one: board.Board) -> list:
        rng = np.random.default_rng(one.rank)
        seen = []
        for turn in range(rounds):
            if rng.random() < 0.1:
                time.sleep(rng.random() * 0.002)  # a different rank arrives last, now and then
            seen.append(one.agree(turn % 3, turn * 100 + one.rank, TIMEOUT_S))
        return seen

    for rank, seen in enumerate(run_ranks(boards, task)):
        for turn, posts in enumerate(seen):
            assert posts == [[turn % 3, turn * 100 + other] for other in range(world)], (rank, turn)


def test_a_rank_that_closes_its_board_ends_the_others_wait_at_once(tmp_path):
    first, second = open_boards(tmp_path, 2)
    threading.Timer(0.2, second.close).start()
    started = time.monotonic()
    with pytest.raises(board.BoardError, match="rank 1 closed its end of the agreement board"):
        first.agree(0, 1, TIMEOUT_S)
    assert time.monotonic() - started < TIMEOUT_S / 3
    started = time.monotonic()
    with pytest.raises(board.BoardError, match="an earlier agreement failed on rank 0: rank 1 closed"):
        first.agree(0, 1, TIMEOUT_S)
    assert time.monotonic() - started < 1
    with pytest.raises(board.BoardError, match="closed"):
        second.agree(0, 1, TIMEOUT_S)


def test_a_post_made_before_a_rank_left_still_counts(tmp_path):
    first, second = open_boards(tmp_path, 2)
    with pytest.raises(board.BoardError, match=r"rank\(s\) 0 did not reach the agreement in time"):
        second.agree(4, 5, 0.05)  # posted, then gave up waiting
    second.close()
    assert first.agree(2, 3, TIMEOUT_S) == [[2, 3], [4, 5]]
    with pytest.raises(board.BoardError, match="rank 1 closed"):
        first.agree(2, 3, TIMEOUT_S)


def test_a_late_rank_is_named_after_the_timeout(tmp_path):
    first, second, _ = open_boards(tmp_path, 3)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(second.agree, 0, 0, 1.0)
        posted(first, 1)
        started = time.monotonic()
        with pytest.raises(board.BoardError, match=r"rank\(s\) 2 did not reach the agreement in time"):
            first.agree(0, 0, 0.3)
        assert 0.3 <= time.monotonic() - started < 10  # its own timeout, not the other rank's or the board's default
        with pytest.raises(board.BoardError, match=r"rank\(s\) 2 did not reach"):
            waiting.result()


def test_a_full_pipe_loses_no_wake_up(tmp_path):
    first, second = open_boards(tmp_path, 2)
    written = 0
    with pytest.raises(BlockingIOError):
        while True:  # the wake-ups a reader that never had to wait would leave behind
            written += os.write(first._outboxes[0], b"\1" * 4096)
    assert written >= 4096

    def task(one: board.Board) -> list:
        return [one.agree(0, turn, TIMEOUT_S) for turn in range(200)]

    first_seen, second_seen = run_ranks([first, second], task)
    assert first_seen == second_seen == [[[0, turn], [0, turn]] for turn in range(200)]


def test_a_post_whose_wake_up_never_came_is_still_seen(tmp_path):
    first, second = open_boards(tmp_path, 2)
    second._outboxes = []  # as if its rank was interrupted between posting and waking the others
    first._poller = Polling(first._poller)
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        waiting = pool.submit(first.agree, 1, 2, TIMEOUT_S)
        assert first._poller.waiting.wait(TIMEOUT_S)  # it found no post and waits for a wake-up
        assert second.agree(3, 4, TIMEOUT_S) == [[1, 2], [3, 4]]  # the first rank's wake-up came
        assert waiting.result() == [[1, 2], [3, 4]]
        assert time.monotonic() - started < 2


def test_an_interrupted_agreement_refuses_every_later_one(tmp_path):
    first, _ = open_boards(tmp_path, 2)

    class Interrupting:
        def poll(self, timeout):
            raise KeyboardInterrupt

    first._poller = Interrupting()
    with pytest.raises(KeyboardInterrupt):
        first.agree(0, 0, TIMEOUT_S)
    with pytest.raises(board.BoardError, match="an earlier agreement was interrupted on rank 0 \\(KeyboardInterrupt\\)"):
        first.agree(0, 0, TIMEOUT_S)


def test_opening_fails_alike_on_every_rank_and_leaves_no_name(tmp_path):
    squatter = tmp_path / "board-0-1"  # rank 1's pipe from rank 0, taken
    squatter.write_bytes(b"")
    agreement = ThreadAgreement(2)
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(board.open_board, "board", str(tmp_path), 7, rank, 2, agreement.for_rank(rank))
                   for rank in range(2)]
        for future in futures:
            with pytest.raises(OSError, match="making the agreement board: .*File exists"):
                future.result()
    assert os.listdir(tmp_path) == []  # every rank removes every name of the board, the one in the way too
    squatter.write_bytes(b"")
    with pytest.raises(ValueError, match="is not the pipe another rank made"):
        board._open_pipe(str(squatter))
