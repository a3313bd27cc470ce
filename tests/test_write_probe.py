"""fastembed.arrays.write_probe: which memory is probed, and the probe's pipe on other systems and when interrupted."""
from __future__ import annotations

import ctypes
import mmap
import os
import sys

import numpy as np
import pytest

from fastembed.arrays import write_probe
from helpers import interrupted_runs

pytestmark = pytest.mark.skipif(not hasattr(os, "readv"), reason="the probe needs os.readv")


def test_lent_memory_is_told_apart_from_numpys_own_and_buffers():
    owned = np.empty(8)
    assert not write_probe.lent(owned) and not write_probe.lent(owned[2:])
    assert not write_probe.lent(np.frombuffer(bytearray(8), np.uint8))
    assert not write_probe.lent(np.frombuffer(mmap.mmap(-1, mmap.PAGESIZE), np.uint8))
    assert write_probe.lent(np.ctypeslib.as_array((ctypes.c_float * 8)()))  # through a memoryview of ctypes memory
    # numpy's stride tricks put a holder of their own between the view and the array: followed to that array's memory
    assert not write_probe.lent(np.lib.stride_tricks.as_strided(owned, (4,), (16,)))
    assert write_probe.lent(np.lib.stride_tricks.as_strided(np.ctypeslib.as_array((ctypes.c_float * 8)()), (4,), (8,)))

    class Interface:  # another library's object exporting its memory, as the stride tricks' holder does
        def __init__(self, array):
            self.__array_interface__, self.base = array.__array_interface__, array

    assert write_probe.lent(np.asarray(Interface(owned)))


def test_the_ends_of_a_pipe_need_not_share_an_inode(monkeypatch):
    """macOS and the BSDs give each end of a pipe an inode of its own; Linux one for both."""
    fstat = os.fstat

    def end_own_inode(fd):
        status = fstat(fd)
        if not write_probe.stat.S_ISFIFO(status.st_mode):
            return status
        return os.stat_result((status[0], status[1] * 1000 + fd, *status[2:10]))

    monkeypatch.setattr(write_probe.os, "fstat", end_own_inode)
    monkeypatch.setattr(write_probe, "_probe_pipe", None)
    memory = np.arange(16, dtype=np.uint8)
    assert write_probe.can_write(memory) and write_probe.can_write(memory)  # made once, then found again
    assert np.array_equal(memory, np.arange(16, dtype=np.uint8))
    write_probe._close_still_ours(*write_probe._probe_pipe)  # this test's pipe: the process's comes back after it


def test_an_interrupted_probe_leaves_the_pipe_empty(monkeypatch):
    """Bytes left between the write and the read would land in the next probe's memory."""
    memory = np.full(16, 7, np.uint8)
    assert write_probe.can_write(memory)
    readv = os.readv

    def interrupted(fd, buffers):
        monkeypatch.setattr(write_probe.os, "readv", readv)
        raise KeyboardInterrupt

    monkeypatch.setattr(write_probe.os, "readv", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_probe.can_write(memory)
    other = np.full(16, 9, np.uint8)
    assert write_probe.can_write(other)
    assert (other == 9).all() and (memory == 7).all()
    with pytest.raises(BlockingIOError):
        os.read(write_probe._probe_pipe[0], 1)


def test_an_interrupt_anywhere_in_a_probe_leaves_its_lock_free_its_pipe_empty_and_the_memory_as_it_was():
    """Ctrl-C just after the probe's lock was taken used to keep it taken: every later probe made a pipe of its own."""
    memory = np.full(16, 7, np.uint8)
    assert write_probe.can_write(memory)
    runs = 0
    for _ in interrupted_runs(lambda code: code.co_filename == write_probe.__file__,
                              lambda: write_probe.can_write(memory)):
        runs += 1
        assert not write_probe._probe_lock.locked()
        assert (memory == 7).all()
        with pytest.raises(BlockingIOError):
            os.read(write_probe._probe_pipe[0], 1)
    assert runs > 5


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mprotect as Linux has it")
def test_read_only_ctypes_memory_is_lent_and_refused():
    page = mmap.PAGESIZE
    memory = mmap.mmap(-1, page)
    libc = ctypes.CDLL(None, use_errno=True)
    address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    assert libc.mprotect(ctypes.c_void_p(address), page, mmap.PROT_READ) == 0
    try:
        view = np.ctypeslib.as_array((ctypes.c_uint8 * page).from_address(address))
        assert view.flags.writeable and write_probe.lent(view)  # numpy cannot tell
        assert not write_probe.can_write(view)
    finally:
        libc.mprotect(ctypes.c_void_p(address), page, mmap.PROT_READ | mmap.PROT_WRITE)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd")
def test_a_pipe_with_one_end_closed_is_replaced_and_its_other_end_closed():
    """A process closing one of the pipe's numbers (and perhaps reusing it) must not leak the other end."""
    assert write_probe.can_write(np.ones(4))
    read_end, _, identity = write_probe._probe_pipe
    assert _open_ends_of(identity)  # the test sees the pipe's ends
    os.close(read_end)
    assert write_probe.can_write(np.ones(4))
    assert write_probe._probe_pipe[2] != identity  # a new pipe
    assert _open_ends_of(identity) == []  # the old write end was closed too


def _open_ends_of(identity: tuple[int, ...]) -> list[int]:
    """The descriptors of this process open on either end of the pipe of `identity` (as the probe records it)."""
    ends = {identity[:2], identity[2:]}
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            status = os.fstat(int(name))
        except OSError:  # closed meanwhile (the listing's own descriptor among them)
            continue
        if (status.st_dev, status.st_ino) in ends:
            found.append(int(name))
    return found
