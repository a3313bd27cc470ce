"""A mapped file truncated, overwritten or replaced: what the OS does, and what FileWatch.check notices."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from fastembed import io
from helpers import past_a_file_time_tick, random_table


@pytest.fixture
def mapped(tmp_path):
    path = tmp_path / "table.npy"
    np.save(path, random_table(4096, 256, "float16"))  # 2 MiB: the last rows lie on pages far from the header
    table = io.map_npy(path)
    return path, table, io.FileWatch.for_table(table)


def test_an_unchanged_file_passes(mapped):
    path, table, watch = mapped
    assert watch.needed_bytes == os.path.getsize(path) == table.offset + table.nbytes
    watch.check()
    watch.check()


def test_a_shrunken_file_is_reported_before_any_page_is_touched(mapped):
    path, _, watch = mapped
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(io.FileChangedError, match="shrank to .* bytes while memory-mapped.*SIGBUS"):
        watch.check()


def test_a_file_modified_in_place_is_reported(mapped):
    path, _, watch = mapped
    with open(path, "r+b") as handle:
        handle.seek(-2, os.SEEK_END)
        handle.write(b"\0\0")
    status = os.stat(path)
    # The kernel's file-time clock ticks every few ms: make the change visible whatever the tick.
    os.utime(path, ns=(status.st_atime_ns, watch.mtime_ns + 10_000_000))
    with pytest.raises(io.FileChangedError, match="modified in place"):
        watch.check()


def test_a_rewrite_that_puts_the_modification_time_back_is_reported(mapped):
    path, _, watch = mapped
    past_a_file_time_tick(path.parent, watch.ctime_ns)
    before = os.stat(path)
    with open(path, "r+b") as handle:
        handle.seek(-2, os.SEEK_END)
        handle.write(b"\0\0")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # as touch -r or rsync --inplace -t leave it
    assert os.stat(path).st_mtime_ns == watch.mtime_ns
    with pytest.raises(io.FileChangedError, match="modified in place"):
        watch.check()


def test_a_rewrite_that_puts_the_modification_time_back_after_a_hard_link_is_reported(mapped, tmp_path):
    path, _, watch = mapped
    past_a_file_time_tick(path.parent, watch.ctime_ns)
    os.link(path, tmp_path / "another-name.npy")  # the link count changes, and the change time with it
    before = os.stat(path)
    with open(tmp_path / "another-name.npy", "r+b") as handle:
        handle.seek(-2, os.SEEK_END)
        handle.write(b"\0\0")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == watch.mtime_ns
    with pytest.raises(io.FileChangedError, match="modified in place"):
        watch.check()


def test_a_replaced_file_is_harmless(mapped, tmp_path):
    path, table, watch = mapped
    before = np.array(table[-1])
    np.save(tmp_path / "new.npy", np.zeros((8, 8), np.float16))
    os.replace(tmp_path / "new.npy", path)  # how downloaders update a file: the map keeps the old inode
    watch.check()
    np.testing.assert_array_equal(table[-1], before)


def test_watch_contract(tmp_path, mapped):
    _, _, watch = mapped
    assert io.FileWatch.for_table(np.zeros((2, 2))) is None
    watch.close()
    with pytest.raises(ValueError, match="closed"):
        watch.check()
    with pytest.raises(FileNotFoundError):
        io.FileWatch(tmp_path / "missing.npy", 10)
    (tmp_path / "short").write_bytes(b"1234")
    with pytest.raises(ValueError, match="shorter than the 100"):
        io.FileWatch(tmp_path / "short", 100)


TRUNCATE_THEN_LOOK_UP = """
import os, sys, numpy as np, fastembed
from fastembed import io
path = sys.argv[1]
table = io.map_npy(path)
watch = io.FileWatch.for_table(table)
os.truncate(path, 4096)
if sys.argv[2] == "check":
    try:
        watch.check()
    except io.FileChangedError:
        print("FileChangedError")
        sys.exit(0)
print(fastembed.lookup(table, [table.shape[0] - 1]).sum())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the signal a lost page raises is the OS's choice")
@pytest.mark.parametrize("check", ["check", "no-check"])
def test_a_lookup_on_a_truncated_file_dies_of_sigbus_unless_checked(tmp_path, check):
    path = tmp_path / "table.npy"
    np.save(path, random_table(4096, 256, "float16"))
    result = subprocess.run([sys.executable, "-c", TRUNCATE_THEN_LOOK_UP, str(path), check], capture_output=True, text=True,
                            check=False, timeout=300)
    if check == "check":
        assert result.returncode == 0 and result.stdout.strip() == "FileChangedError"
    else:
        assert result.returncode == -signal.SIGBUS, (result.returncode, result.stderr[-500:])


def test_a_copied_layer_watches_through_its_own_descriptor_and_a_mapped_one_refuses_pickling(tmp_path):
    import copy
    import gc
    import pickle

    import fastembed

    path = tmp_path / "table.npy"
    np.save(path, random_table(16, 4, "float32"))
    emb = fastembed.Embedding.from_npy(path)
    twin = copy.deepcopy(emb)
    assert twin._watch._fd != emb._watch._fd
    del twin
    gc.collect()
    with open(tmp_path / "other.txt", "w") as other:  # would get the number a shared descriptor freed
        emb.check_file()
        del emb
        gc.collect()
        other.write("still open")
    with pytest.raises(TypeError, match="cannot be pickled.*from_pretrained"):
        pickle.dumps(fastembed.Embedding.from_npy(path))


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symbolic links")
def test_a_path_through_a_link_and_dotdot_watches_the_file_it_maps(tmp_path):
    """numpy names a map by the path as text, where ``link/..`` drops out: the watch then followed another file."""
    import fastembed

    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real" / "sub")
    table = random_table(512, 64, "float32")
    np.save(tmp_path / "real" / "table.npy", table)  # the file the system opens
    np.save(tmp_path / "table.npy", table)  # what the path says as text
    emb = fastembed.Embedding.from_pretrained(tmp_path / "link" / ".." / "table.npy")
    assert os.path.samefile(emb.table.filename, tmp_path / "real" / "table.npy")
    os.truncate(tmp_path / "real" / "table.npy", 128)
    with pytest.raises(io.FileChangedError, match="shrank"):
        emb.check_file()


def test_a_file_changed_between_its_mapping_and_its_watch_is_refused(tmp_path):
    path = tmp_path / "table.npy"
    np.save(path, random_table(64, 8, "float32"))
    table = io.map_npy(path)
    with open(path, "ab") as handle:  # grown in place after the map: the watch would start from the new state
        handle.write(b"\0" * 64)
    with pytest.raises(ValueError, match="changed since it was mapped"):
        io.FileWatch.for_table(table)


def test_a_rewrite_between_the_mapping_and_the_watch_that_puts_the_modification_time_back_is_refused(tmp_path):
    """The watch compared the file with its map by size and modification time: it started from the rewritten rows."""
    path = tmp_path / "table.npy"
    np.save(path, random_table(64, 8, "float32"))
    table = io.map_npy(path)
    before = os.stat(path)
    past_a_file_time_tick(path.parent, before.st_ctime_ns)
    with open(path, "r+b") as handle:
        handle.seek(-4, os.SEEK_END)
        handle.write(b"\0" * 4)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # as touch -r or rsync --inplace -t leave it
    with pytest.raises(ValueError, match="changed since it was mapped"):
        io.FileWatch.for_table(table)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_watch_on_a_fifo_returns_at_once(tmp_path):
    """Opening a FIFO for reading waits for a writer: a watch made where one now sits would hang for ever."""
    fifo = tmp_path / "table.npy"
    os.mkfifo(fifo)
    source = f"from fastembed import io\ntry:\n    io.FileWatch({str(fifo)!r}, 10)\nexcept ValueError as error:\n    print(error)\n"
    result = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=20)
    assert "shorter than the 10 the table needs" in result.stdout, result.stderr[-2000:]


def test_a_watch_names_a_file_replaced_since_its_mapping(tmp_path):
    path = tmp_path / "table.npy"
    np.save(path, random_table(64, 8, "float32"))
    table = io.map_npy(path)
    os.replace(_saved(tmp_path / "new.npy", random_table(8, 8, "float32")), path)  # shorter, and another file
    with pytest.raises(ValueError, match="no longer the file that was mapped"):
        io.FileWatch.for_table(table)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_a_deleted_file_opened_through_its_descriptor_maps_and_watches(tmp_path):
    """Resolving /proc/self/fd/N of a deleted file gives a name that opens nothing: the name given is kept."""
    import fastembed

    path = tmp_path / "table.npy"
    table = random_table(64, 8, "float32")
    np.save(path, table)
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.unlink(path)
        emb = fastembed.Embedding.from_pretrained(f"/proc/self/fd/{descriptor}")
        assert np.array_equal(emb([3, 60]), table[[3, 60]])
        emb.check_file()
    finally:
        os.close(descriptor)


def _saved(path, table):
    np.save(path, table)
    return path
