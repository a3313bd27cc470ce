"""Checks shared by the loaders: the path is a file, what a wrong file looks like, short name lists."""
from __future__ import annotations

import codecs
import contextlib
import errno
import os
import stat
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO, Literal, NamedTuple

import numpy as np

from ..arrays.numpy_adapter import mapping_of

#: How many names an error message lists before "... and N more".
NAMES_SHOWN = 12

#: File-name endings of PyTorch checkpoints (torch.save: a zip archive or a legacy pickle).
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
#: The formats fastembed opens, and with which calls: the end of every "another format" message.
OPENS = ("fastembed opens safetensors files (fastembed.Embedding.from_safetensors), .npy files (from_npy) and "
         "GGUF files (from_gguf); Embedding.from_pretrained and fastembed.io.open_table open any of them, "
         "and checkpoint directories")
_HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


def convert_pickle(path: str | os.PathLike, target: str | os.PathLike = "model.safetensors") -> str:
    """How to turn the PyTorch checkpoint at `path` (zip archive or pickle) into the safetensors file `target`."""
    return ("convert it once, in a trusted environment, with the safetensors package: "
            "import torch; from safetensors.torch import save_file; "
            f"save_file({{k: v.contiguous().clone() for k, v in torch.load({os.fspath(path)!r}, map_location='cpu', "
            f"weights_only=True).items()}}, {os.fspath(target)!r})")


def shorten(names: Iterable[str], total: int | None = None, limit: int = NAMES_SHOWN) -> str:
    """The first `limit` names, quoted, then "... and N more" when there are more.

    Args:
        names: the names, in the order to show them (only the first `limit` are read
            when `total` is given).
        total: how many names there are in all, when `names` holds only the first ones.
        limit: how many to show.

    Returns:
        A string such as ``'a', 'b' ... and 187 more``, or ``(none)``.
    """
    shown: list[str] = []
    count = 0
    for name in names:
        if len(shown) < limit:
            shown.append(repr(name))
        count += 1
        if total is not None and len(shown) >= limit:
            break
    total = count if total is None else total
    if not shown:
        return "(none)"
    text = ", ".join(shown)
    return text + (f" ... and {total - len(shown)} more" if total > len(shown) else "")


class FileIdentity(NamedTuple):
    """The file a path named when a loader read its header: the bytes it maps must come from that file, unchanged.

    The change time counts beside the modification time: a rewrite that puts
    the modification time back (``touch -r``, ``rsync --inplace -t``) still
    moves it (and so do a ``chmod`` and a hard link made or removed, which
    count as changes too).
    """

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, status: os.stat_result) -> FileIdentity:
        """The identity `status` (an ``os.stat`` or ``os.fstat`` result) gives.

        Example:
            >>> import os, tempfile
            >>> from fastembed.io import FileIdentity
            >>> with tempfile.NamedTemporaryFile() as handle:
            ...     FileIdentity.of(os.fstat(handle.fileno())).size
            0
        """
        return cls(status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)


def _changed(path: str | os.PathLike) -> ValueError:
    return ValueError(f"{path}: changed while it was being opened (another program replaced or rewrote it: a "
                      "download finishing?); open it again")


@contextlib.contextmanager
def opened(path: str | os.PathLike, opener: str) -> Iterator[tuple[BinaryIO, FileIdentity]]:
    """The regular file at `path` open for reading, and its identity: a loader reads all of a header through it.

    Raises:
        TypeError, FileNotFoundError: as :func:`check_file`.
        ValueError: as :func:`check_file`; the path named another file, or the file changed, between the check
            and the opening.
    """
    status = _status(path, opener)
    with _open_for_reading(path) as handle:
        identity = FileIdentity.of(os.fstat(handle.fileno()))
        if identity != FileIdentity.of(status):
            raise _changed(path)
        yield handle, identity


def map_file(path: str | os.PathLike, dtype: Any, offset: int, shape: tuple[int, ...],
             order: Literal["C", "F"] = "C", identity: FileIdentity | None = None) -> np.memmap:
    """A read-only np.memmap of `shape` at byte `offset` of the file at `path` (a path whose ``__fspath__`` gives bytes too).

    The path is resolved (symbolic links, then ``..``, as the system resolves
    it) and passed on as text, so the map's ``filename`` names the file
    mapped and :class:`~fastembed.io.FileWatch` can watch it (numpy would
    drop ``link/..`` as text, naming another file). With `identity` (the
    file its header was read from, :func:`opened`), the file is opened again
    and mapped through that descriptor only if it is still that file,
    unchanged: so the map holds the bytes the header describes.

    Raises:
        ValueError: the path names another file than `identity` now, or the file changed.
    """
    name = _resolved(os.fsdecode(os.fspath(path)))
    if identity is None:
        return np.memmap(name, dtype=dtype, mode="r", offset=offset, shape=shape, order=order)
    try:
        handle = _open_for_reading(name)
    except OSError:
        raise _changed(path) from None
    with handle:
        if FileIdentity.of(os.fstat(handle.fileno())) != identity:
            raise _changed(path)
        array = np.memmap(handle, dtype=dtype, mode="r", offset=offset, shape=shape, order=order)
    _MAPPED_FROM[array.base] = identity
    return array


def _resolved(name: str) -> str:
    """`name` with its links and ``..`` resolved, where that still names the same file.

    A name the resolution cannot give back stays as given: ``/proc/self/fd/N``
    of a deleted file (or a memfd) resolves to a name that opens nothing.
    """
    resolved = os.path.realpath(name)
    try:
        return resolved if os.path.samefile(resolved, name) else name
    except OSError:
        return name


def _open_for_reading(path: str | os.PathLike) -> BinaryIO:
    """`path` open for reading, without waiting when it has become a FIFO (its identity then tells it apart)."""
    return open(path, "rb", opener=lambda name, flags: os.open(name, flags | getattr(os, "O_NONBLOCK", 0)))


#: The file each map that :func:`map_file` checked comes from, by the map (the mmap at the root of its arrays' bases).
_MAPPED_FROM: weakref.WeakKeyDictionary[Any, FileIdentity] = weakref.WeakKeyDictionary()


def mapped_identity(array: Any) -> FileIdentity | None:
    """The file `array` (a map :func:`map_file` made with an identity, or a view of one) was mapped from; else None."""
    mapping = mapping_of(array)
    return None if mapping is None else _MAPPED_FROM.get(mapping)


def check_file(path: str | os.PathLike, opener: str) -> int:
    """The size of the regular file at `path`.

    Args:
        path: the file.
        opener: the call that was asked to open it, for messages.

    Returns:
        Its size in bytes.

    Raises:
        TypeError: `path` is not a str or os.PathLike (an int would be taken as a file descriptor).
        FileNotFoundError: nothing exists at `path` (or a symbolic link there leads nowhere).
        ValueError: `path` holds a NUL character, is a directory, not a regular file, or a loop of symbolic links.
    """
    return _status(path, opener).st_size


def path_text(path: Any, opener: str, *, kinds: tuple[type, ...] = (str, os.PathLike)) -> str:
    """`path` as text, after the checks every opener and writer of a file makes first.

    Raises:
        TypeError: `path` is none of `kinds` (an int would be taken as a file descriptor).
        ValueError: `path` holds a NUL character, which no file name can.
    """
    if not isinstance(path, kinds):
        words = [("os.PathLike" if kind is os.PathLike else kind.__name__) for kind in kinds]
        names = ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else words[0]
        raise TypeError(f"{opener}: the path must be a {names}, got {type(path).__module__}.{type(path).__qualname__}")
    text = os.fsdecode(path)  # type: ignore[arg-type]  # one of `kinds`, each of which fsdecode takes
    if "\0" in text:
        raise ValueError(f"{opener}: the path {text!r} holds a NUL character, which no file name can")
    return text


def _status(path: str | os.PathLike, opener: str) -> os.stat_result:
    """:func:`check_file`'s checks; the file's status."""
    path_text(path, opener)
    try:
        status = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):  # a copied Hugging Face snapshot whose links into the cache no longer resolve, say
            raise FileNotFoundError(errno.ENOENT, f"a symbolic link to {os.readlink(os.fspath(path))!r}, which does not exist",
                                    os.fsdecode(os.fspath(path))) from None
        raise FileNotFoundError(errno.ENOENT, "no such file", str(path)) from None
    except NotADirectoryError:
        raise FileNotFoundError(errno.ENOENT, "no such file (a parent is not a directory)", str(path)) from None
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        raise ValueError(f"{path}: a loop of symbolic links (each leads back to another), which leads to no file") from None
    if stat.S_ISDIR(status.st_mode):
        raise ValueError(
            f"{path}: is a directory; {opener} opens one file. To open a checkpoint directory "
            "(model.safetensors, or shards with model.safetensors.index.json) use fastembed.Embedding.from_pretrained (or fastembed.io.open_table)"
        )
    if not stat.S_ISREG(status.st_mode):
        raise ValueError(f"{path}: not a regular file; {opener} opens a regular file")
    return status


def check_tensor_name(path: str | os.PathLike, name: object) -> None:
    """Raise TypeError unless `name` (a tensor to open or write) is None or a str, ValueError unless it is text.

    Checkpoint formats store tensor names as UTF-8, which a str holding a lone
    surrogate (``os.fsdecode`` of undecodable bytes, say) has none of.
    """
    if name is None:
        return
    if not isinstance(name, str):
        raise TypeError(f"{path}: the tensor name must be a string, got {type(name).__module__}.{type(name).__qualname__}")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{path}: the tensor name {name!r} is not valid Unicode text ({error.reason}); "
                         "checkpoints store tensor names as UTF-8") from None


def looks_like_safetensors(head: bytes) -> bool:
    """Whether a file's first bytes (at least 9) are a safetensors header's start: a length below 2**40, then ``{``."""
    return len(head) >= 9 and head[8:9] == b"{" and head[5:8] == b"\0\0\0"


def describe(path: str | os.PathLike, head: bytes) -> str | None:
    """What a file looks like when it is not what a loader expected, and how to open it.

    By its first bytes where its format has a magic number (safetensors' header, .npy,
    zip archives: .npz or PyTorch, pickles, GGUF, HDF5, TensorFlow Lite, JSON, text),
    else by its name's ending (Flax ``.msgpack``, ONNX ``.onnx``, Keras/TensorFlow
    ``.h5``, PyTorch ``.bin``/``.pt``/``.pth``/``.ckpt``). Formats fastembed does not
    open come with the call that converts them.

    Args:
        path: the file (a zip archive's directory is listed to tell .npz from PyTorch).
        head: its first bytes (at least 16 when the file is that long).

    Returns:
        A sentence starting with "is", or None when the file looks like no known format:
        the caller then says what its own format needs that the bytes lack.
    """
    where = os.fspath(path)
    if looks_like_safetensors(head):
        return "is a safetensors file; open it with fastembed.Embedding.from_safetensors (or fastembed.io.open_table)"
    if head.startswith(b"\x93NUMPY"):
        return "is a .npy file; open it with fastembed.Embedding.from_npy (or fastembed.io.map_npy)"
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        first = _first_zip_member(path)
        if first.endswith(".npy"):
            return (f"is a .npz archive (np.savez) whose first array is {first!r}; extract one array as a .npy file "
                    f"(np.save('table.npy', np.load({where!r})[{first[:-4]!r}])) and open it with fastembed.Embedding.from_npy")
        if first.endswith("data.pkl"):  # torch.save writes the pickle first
            return f"is a PyTorch checkpoint (torch.save zip archive, a pickle); fastembed never unpickles: {convert_pickle(path)}"
        return ("is a zip archive (a PyTorch torch.save checkpoint or a .npz?); fastembed reads only safetensors "
                f"and .npy files. If it is a PyTorch checkpoint, {convert_pickle(path)}")
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return f"is a Python pickle (a legacy PyTorch .bin/.pt checkpoint?); fastembed never unpickles: {convert_pickle(path)}"
    if head.startswith(b"GGUF"):
        return "is a GGUF file (llama.cpp); open it with fastembed.Embedding.from_gguf (or fastembed.io.open_table)"
    if head.startswith(_HDF5_MAGIC):
        return (f"is an HDF5 file (TensorFlow/Keras .h5 weights?); {OPENS}. Read the table with h5py and save it as "
                f".npy: import h5py, numpy as np; f = h5py.File({where!r}); f.visit(print)  # the dataset names; "
                "then np.save('table.npy', f[NAME][()])")
    if head[4:8] == b"TFL3":
        return f"is a TensorFlow Lite model; {OPENS}"
    stripped = head.lstrip(b" \t\r\n\xef\xbb\xbf")
    if stripped.startswith((b"{", b"[")):
        if _mentions(path, b'"weight_map"'):
            return ("is a sharded checkpoint's index (model.safetensors.index.json), not a tensor file; "
                    "pass it, or its directory, to fastembed.io.open_table")
        return "is a JSON text file, not a tensor file"
    if _is_text(head):
        return "is a text file, not a tensor file"
    return _described_by_name(where)


def _is_text(head: bytes) -> bool:
    """Whether the first bytes of a file read as UTF-8 text (the last character may be cut) of printable characters."""
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(head[:64])  # keeps a character cut at the end for later
    except UnicodeDecodeError:
        return False
    return bool(text) and b"\0" not in head and all(c.isprintable() or c in "\t\n\r\ufeff" for c in text)


def _described_by_name(path: str) -> str | None:
    """What a file whose bytes carry no known magic number is, by its name's ending (None: no known ending)."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".msgpack":
        return (f"is named like a Flax checkpoint (flax.serialization msgpack, which has no magic number); {OPENS}. "
                "Convert it with the safetensors package: import numpy as np; from flax.serialization import "
                "msgpack_restore; from flax.traverse_util import flatten_dict; from safetensors.numpy import save_file; "
                f"save_file({{'.'.join(k): np.asarray(v) for k, v in flatten_dict(msgpack_restore(open({path!r}, 'rb').read())).items()}}, "
                "'model.safetensors')")
    if suffix == ".onnx":
        return (f"is named like an ONNX model (a protobuf, which has no magic number); {OPENS}. Save its embedding "
                "initializer as .npy with the onnx package: import onnx, numpy as np; from onnx import numpy_helper; "
                f"m = onnx.load({path!r}); print([t.name for t in m.graph.initializer]); "
                "np.save('table.npy', numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == NAME)))")
    if suffix in (".h5", ".hdf5", ".keras"):
        return f"is named like an HDF5 or Keras file, but lacks HDF5's magic number (truncated?); {OPENS}"
    if suffix in PICKLE_SUFFIXES:
        return (f"is named like a PyTorch checkpoint ({suffix}), but its bytes are neither a torch.save zip archive "
                f"nor a pickle (truncated, or another program's file?); {OPENS}")
    return None


def _first_zip_member(path: str | os.PathLike) -> str:
    """The name of a zip archive's first member, read from the local header at its start ("" if there is none).

    Not the archive's directory, which a hostile file can make any length.
    """
    header = read_head(path, _ZIP_LOCAL_HEADER_BYTES + 0xFFFF)
    if not header.startswith(b"PK\x03\x04") or len(header) < _ZIP_LOCAL_HEADER_BYTES:
        return ""
    name_bytes = int.from_bytes(header[26:28], "little")
    return header[_ZIP_LOCAL_HEADER_BYTES:_ZIP_LOCAL_HEADER_BYTES + name_bytes].decode("utf-8", "replace")


#: The fixed part of a zip member's local header, which its name follows.
_ZIP_LOCAL_HEADER_BYTES = 30


def _mentions(path: str | os.PathLike, needle: bytes, limit: int = 1 << 20) -> bool:
    """Whether the first `limit` bytes of the file contain `needle`."""
    return needle in read_head(path, limit)


def read_head(path: str | os.PathLike, size: int = 64) -> bytes:
    """The first `size` bytes of a file (fewer when it is shorter; none where the path has become a FIFO)."""
    with _open_for_reading(path) as handle:
        return handle.read(size) or b""  # None: a FIFO whose writer has written nothing yet
