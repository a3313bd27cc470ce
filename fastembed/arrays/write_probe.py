"""Whether the process can write memory that an array says it may write.

torch marks no tensor read-only, so the numpy view of a tensor over a
read-only memory map (``torch.from_dlpack`` of ``np.load(path,
mmap_mode="r")``, say) says it is writeable, and so does any numpy view
of such a tensor (``tensor.numpy()``) or of another library's DLPack
export: a gather into one would kill the process. :func:`can_write` asks
the kernel instead: the first and last byte of the memory go into a pipe
in one ``os.writev`` (the kernel reads them: EFAULT if it cannot) and come
back into their own addresses in one ``os.readv`` (the kernel writes them:
EFAULT if it cannot), so the memory ends as it was. Validation asks it of
every ``out`` whose memory another library lent (:func:`lent`).
"""
from __future__ import annotations

import mmap
import os
import stat
import threading

import numpy as np

#: The base numpy's stride tricks (as_strided, sliding_window_view) give their views: it holds the memory's
#: array interface and, as its ``base``, the array whose memory it is.
_STRIDE_TRICKS_BASE = type(np.lib.stride_tricks.as_strided(np.empty(1)).base)
#: How far a chain of bases is followed: real ones are short, and nothing is trusted blindly.
_MOST_BASES = 64


def base_of(holder: object) -> object | None:
    """The next object down the chain that `holder`'s memory belongs to: an array's base, a memoryview's object,
    the array behind numpy's stride tricks; None where the chain ends (an array owning its memory, another object)."""
    if isinstance(holder, np.ndarray):
        return holder.base
    if isinstance(holder, memoryview):
        return holder.obj  # a memoryview of a ctypes array (np.ctypeslib.as_array) is the ctypes memory's
    if type(holder) is _STRIDE_TRICKS_BASE:
        return getattr(holder, "base", None)
    return None


def lent(array: np.ndarray) -> bool:
    """Whether `array`'s memory comes from another library's object, whose read-only flag numpy cannot see.

    numpy's own memory, a memory map's and a buffer's (whose read-only flag
    numpy takes over) are not lent; a torch tensor's, a DLPack capsule's or a
    ctypes object's are, and so is memory at the end of a chain too long to follow.
    """
    holder: object = array
    for _ in range(_MOST_BASES):
        if isinstance(holder, np.ndarray) and holder.base is None:
            return False
        if not isinstance(holder, (np.ndarray, memoryview, _STRIDE_TRICKS_BASE)):
            return not isinstance(holder, (mmap.mmap, bytes, bytearray))
        holder = base_of(holder)
    return True


#: The pipe the write probe passes bytes through: (read end, write end, their identity as _pipe_identity gives
#: it), made on first use; and the lock of its one user at a time.
_probe_pipe: tuple[int, int, tuple[int, ...]] | None = None
_probe_lock = threading.Lock()


def can_write(view: np.ndarray) -> bool:
    """Whether the kernel can write the first and last byte of `view`'s memory (a C-contiguous host array).

    Both bytes go into a pipe in one ``os.writev`` (the kernel reads them: EFAULT if it
    cannot) and are read back into their own addresses in one ``os.readv`` (the kernel
    writes them: EFAULT if it cannot), so the memory ends as it was. The pipe is the
    process's own (a forked child makes its own), checked to be still open and still
    that pipe before each use (a daemon closes every descriptor it inherited, and the
    numbers may then name other files), and is left empty. A probe that finds it in use
    (another thread's, or that of the code a signal handler interrupted) uses a pipe of
    its own.
    """
    if not view.flags.writeable:
        return False
    if view.nbytes == 0 or not hasattr(os, "readv"):
        return True
    memory = view.reshape(-1).view(np.uint8).data  # C-contiguous: a view of its bytes
    cells = [memory[:1], memory[-1:]]
    if _probe_lock.locked():
        read_end, write_end = _new_pipe()
        try:
            return _passed_through(read_end, write_end, cells)
        finally:
            os.close(read_end)
            os.close(write_end)
    with _probe_lock:  # not acquire() then try: an exception between the two would keep it taken for good
        read_end, write_end = _probe_ends()
        return _passed_through(read_end, write_end, cells)


def _passed_through(read_end: int, write_end: int, cells: list[memoryview]) -> bool:
    """Whether `cells` went into the pipe and came back into their own memory; the pipe is left empty either way.

    Also when interrupted (KeyboardInterrupt between the two calls): bytes left behind would be read into the
    next probe's memory.
    """
    done = False
    try:
        done = os.writev(write_end, cells) == 2 and os.readv(read_end, cells) == 2
    except OSError:
        pass
    finally:
        if not done:
            _empty(read_end)
    return done


def _new_pipe() -> tuple[int, int]:
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    return read_end, write_end


def _pipe_identity(read_end: int, write_end: int) -> tuple[int, ...] | None:
    """Each descriptor's (st_dev, st_ino) when both are pipes, else None (closed, or other files now).

    The two ends of one pipe share an inode on Linux, not on macOS or the BSDs: each end's is kept.
    """
    try:
        ends = os.fstat(read_end), os.fstat(write_end)
    except OSError:  # closed
        return None
    if not all(stat.S_ISFIFO(end.st_mode) for end in ends):
        return None
    return ends[0].st_dev, ends[0].st_ino, ends[1].st_dev, ends[1].st_ino


def _probe_ends() -> tuple[int, int]:
    """The probe pipe's two ends (holding its lock): the process's pipe, or a new one where that one is gone."""
    global _probe_pipe
    if _probe_pipe is not None:
        read_end, write_end, identity = _probe_pipe
        if _pipe_identity(read_end, write_end) == identity:
            return read_end, write_end
        _close_still_ours(read_end, write_end, identity)  # one end closed or reused: the other is not leaked
        _probe_pipe = None
    read_end, write_end = _new_pipe()
    made = _pipe_identity(read_end, write_end)
    assert made is not None  # a pipe just made
    _probe_pipe = (read_end, write_end, made)
    return read_end, write_end


def _close_still_ours(read_end: int, write_end: int, identity: tuple[int, ...]) -> None:
    """Close each end that is still the probe's pipe end; a number that names another file now is left alone."""
    for end, recorded in ((read_end, identity[:2]), (write_end, identity[2:])):
        try:
            status = os.fstat(end)
        except OSError:  # closed already
            continue
        if stat.S_ISFIFO(status.st_mode) and (status.st_dev, status.st_ino) == recorded:
            os.close(end)


def _empty(read_end: int) -> None:
    """Read whatever a failed probe left in the pipe."""
    try:
        while os.read(read_end, 64):
            pass
    except BlockingIOError:
        pass


def _new_probe_pipe_in_child() -> None:
    """After a fork: the child must not share the parent's pipe (their bytes would mix) nor its lock's state."""
    global _probe_pipe, _probe_lock
    if _probe_pipe is not None:
        _close_still_ours(*_probe_pipe)
    _probe_pipe, _probe_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_probe_pipe_in_child)
