"""The public lookup API: ``lookup`` and ``Embedding``. Thin on purpose.

Each call validates (``fastembed.validate``), picks a backend
(``fastembed.dispatch``) and hands over; nothing here knows a kernel.
``lookup`` and ``Embedding.__call__`` spell out the same steps (snapshot,
validate, dispatch) rather than share a helper: a decode step is mostly
Python call overhead, and one more call is a measurable part of it.
"""
from __future__ import annotations

import copy
import os
from typing import Any

import numpy as np

from . import dispatch, validate
from .arrays import aligned_result, call_context, device_of, mark_written, result_like
from .casting import gather_cast
from .formats import QuantizedTable

_NDARRAY = np.ndarray
_AUTO = dispatch.AUTO


def lookup(table: Any, ids: Any, *, out: Any = None, dtype: Any = None, backend: str = "auto") -> Any:
    """Gather rows of an embedding table: ``table[ids]``.

    Args:
        table: 2-D C-contiguous numpy array, np.memmap, torch CPU tensor,
            JAX CPU array or any other DLPack producer in host memory (host),
            or cupy array or torch CUDA tensor (GPU), of any fixed-size dtype; or a
            :class:`fastembed.formats.QuantizedTable` (GGUF block formats,
            fp8 with row scales), dequantized while gathering.
        ids: integers of any dtype and ndim up to 63 with numpy 2 (lists and scalars as numpy
            accepts them) in ``[0, table.shape[0])``. Host ids are copied
            before they are read (int32/int64 keep their dtype; others are
            converted from the copy to int64), so another thread writing
            them meanwhile cannot change what the checks saw.
        out: optional preallocated C-contiguous array of the result's shape
            and dtype, on the table's device; it is filled and returned.
        dtype: the result's dtype (a numpy dtype or its name, or a torch
            dtype). None: the table's dtype (float32 for a quantized
            table). A quantized table dequantizes into float32, float16 or
            bfloat16; a dense float host table casts into those or float64
            (rounding to nearest even).
        backend: ``"auto"`` (or FASTEMBED_BACKEND), ``"numba"``, ``"numpy"``
            or ``"cuda"``.

    Returns:
        ``out``, or a new array of the table's kind on the table's device
        (a torch tensor for a torch table, a JAX array for a JAX table,
        sharing the result's memory; a numpy array for another DLPack
        producer's table; see docs/interop.md).

    Shape:
        ``ids.shape + (table.shape[1],)``, the output dtype.

    Raises:
        TypeError: ids that are not integers; arrays of the wrong kind, dtype or device;
            a `dtype` that is no dtype; a `backend` that is not a string.
        ValueError: ids in nested lists of different lengths, or of more
            dimensions than the result leaves room for (63 with numpy 2); a table or
            ``out`` of the wrong shape or layout; an ``out``
            that is read-only, overlaps the table or the ids (an np.memmap of
            the table's own file bytes too), requires grad, or
            is a torch inference tensor outside inference mode;
            an unknown backend name (in `backend` or FASTEMBED_BACKEND); a
            FASTEMBED_OUTPUT_CACHE_BYTES that is not a byte count (read at the
            first allocating lookup of 4 MiB or more that the numba backend is
            asked to serve, other than a dense one with `dtype`, or on a JAX
            table whatever the backend).
        IndexError: an id out of range, naming the first bad id's position and value.
        BackendUnavailableError: a named backend cannot serve the call.

    On a host error ``out`` is left untouched. Each call works on its own
    snapshot of the arrays: another thread reshaping them meanwhile cannot
    make it read or write out of bounds.

    Example:
        >>> import numpy as np, fastembed
        >>> table = np.arange(12, dtype=np.float32).reshape(4, 3)
        >>> fastembed.lookup(table, [3, 0])
        array([[ 9., 10., 11.],
               [ 0.,  1.,  2.]], dtype=float32)
    """
    table_view = validate.table_snapshot(table)
    if dtype is not None or type(table_view) is not _NDARRAY:
        if type(table_view if type(table_view) is not QuantizedTable else table_view.data) is not _NDARRAY:
            # A device table: its device, its dtype (a snapshot holds some as words) and its library are read again
            # in the call, all of one alias of the caller's arrays, whatever another thread assigns to them meanwhile.
            read = validate.read_once(table)
            if read is not table:  # a torch alias or a quantized table's fields (a cupy array is read as it is)
                table, table_view = read, validate.table_snapshot(read)
        return _lookup_in_call_context(table_view, ids, out, dtype, backend, table)
    ids_view = validate.ids_snapshot(ids, table_view)
    if out is None:
        if isinstance(table, _NDARRAY):  # a numpy table's result is a plain numpy array, an np.memmap's too
            # The default argument (and any literal "auto") is this very object; an equal string takes select().
            if backend is _AUTO:
                # (generation, below_bytes, gather_new, calling_thread_below_bytes, gather_into)
                small = dispatch.ndarray_small_gather
                if small[0] != dispatch.generation:
                    small = dispatch.small_gather_for_ndarray(table_view)
                if ids_view.size * table_view.strides[0] < small[1]:
                    return small[2](table_view, ids_view)
            return dispatch.select(table_view, backend).gather(table_view, ids_view, None)
        return _wrapped_lookup(table_view, ids_view, backend, table)
    out_view = validate.out_snapshot(out, ids_view, table_view, table, ids)
    if backend is _AUTO:  # a decode step into the caller's buffer: the backend's small gather, as above
        small = dispatch.ndarray_small_gather
        if small[0] != dispatch.generation:
            small = dispatch.small_gather_for_ndarray(table_view)
        if ids_view.size * table_view.strides[0] < small[1]:
            small[4](table_view, ids_view, out_view)
            return out if type(out) is _NDARRAY else mark_written(out)
    dispatch.select(table_view, backend).gather(table_view, ids_view, out_view)
    return out if type(out) is _NDARRAY else mark_written(out)


def _wrapped_lookup(table_view: Any, ids_view: Any, backend: str, table: Any) -> Any:
    """The result of a lookup on a table of another library than numpy, as an array of that library."""
    buffer = aligned_result(table, validate.output_shape(ids_view, table_view), table_view.dtype)
    return result_like(dispatch.select(table_view, backend).gather(table_view, ids_view, buffer), table)


def _lookup_in_call_context(table_view: Any, ids: Any, out: Any, dtype: Any, backend: str, table: Any) -> Any:
    """The steps of :func:`lookup` for a table whose snapshot is not a numpy array (a GPU or quantized table) or an explicit ``dtype=``.

    They run in the table's call context (:func:`fastembed.arrays.call_context`:
    for a torch CUDA table its device, and torch's current stream as cupy's).
    `table` is the caller's table as read once for a device table (:func:`fastembed.validate.read_once`),
    and `table_view` its snapshot.
    """
    rows = validate.storage(table)  # a quantized table's results follow its data's library
    with call_context(rows):
        ids_view = validate.ids_snapshot(ids, table_view)
        target = validate.output_dtype(table_view, dtype, None if type(table_view) is QuantizedTable else rows)
        if out is None:
            out_view = aligned_result(rows, validate.output_shape(ids_view, table_view), target)
        else:
            out_view = validate.out_snapshot(out, ids_view, table_view, table, ids, target)
        chosen = dispatch.select(table_view, backend)
        if type(table_view) is QuantizedTable:
            result = chosen.dequantize(table_view, ids_view, out_view, target)  # type: ignore[attr-defined]
        elif target == table_view.dtype:
            try:
                result = chosen.gather(table_view, ids_view, out_view)
            except BaseException:
                if out is not None and type(out) is not _NDARRAY and type(table_view) is not _NDARRAY:
                    mark_written(out)  # a GPU gather writes the rows it can before it reports a bad id (docs/gpu.md)
                raise
        else:
            result = gather_cast(chosen, table_view, ids_view, out_view, target)
        if out is not None:
            return out if type(out) is _NDARRAY else mark_written(out)
        return result if isinstance(rows, _NDARRAY) else result_like(result, rows)


def _rebuilt(kind: type, table: Any, state: dict[str, Any]) -> Embedding:
    """A layer of class `kind` (Embedding or a subclass) over `table`, with `state` (:meth:`Embedding._own_state`)."""
    layer: Embedding = object.__new__(kind)
    Embedding.__init__(layer, table)
    layer.__dict__.update(state)
    return layer


def _host_array(like: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A new host array, not from the output cache, that :func:`result_like` can hand back as an array of `like`'s
    library without a copy."""
    aligned = aligned_result(like, shape, dtype, from_cache=False)
    return np.empty(shape, dtype) if aligned is None else aligned


#: The attributes Embedding.__init__ derives from the table (and the file watch, which only a loader sets).
_FROM_THE_TABLE = frozenset({"_table_as_read", "_view", "_guards", "_table", "_rows", "_numpy", "_watch", "_row_stride",
                             "_host_quantized_dtype"})


class Embedding:
    """A callable embedding layer over a table it references, never copies.

    ``emb(ids, out=None, backend="auto", *, dtype=None)`` is ``lookup(emb.table, ids, ...)``
    without re-validating the table on every call. The layer keeps its own
    view of the table, taken at construction: reassigning the caller's
    ``table.shape`` afterwards does not change the layer.

    ``copy.copy`` gives a layer over the same table; ``copy.deepcopy`` one
    over a deep copy of the table as the layer read it (a layer a loader
    mapped: over the same read-only mapping, which cannot be written, with a
    file watch of its own); pickling carries that table (a mapped layer
    refuses it: open the file again where it is unpickled). Attributes a
    subclass adds travel with them. A layer a loader mapped is one that
    ``from_pretrained``, ``from_npy``, ``from_safetensors`` or ``from_gguf``
    opened from a path; ``Embedding(open_table(path))`` holds a table like
    any other, and its deep copy copies the rows.

    Args:
        table: as for :func:`lookup`.

    Raises:
        TypeError, ValueError: as :func:`lookup` for a bad table.

    Example:
        >>> import numpy as np, fastembed
        >>> emb = fastembed.Embedding(np.arange(12, dtype=np.float32).reshape(4, 3))
        >>> emb([[1], [2]]).shape
        (2, 1, 3)
    """

    def __init__(self, table: Any) -> None:
        # The caller's arrays read once, which the view, the guards, the wrapping of results and the checks of an
        # out all follow. A torch table's memory can be freed under the view (resize_): guarded before every call.
        self._table_as_read, self._view, self._guards = validate.kept_table(table)
        self._table = table
        self._rows = validate.storage(self._table_as_read)  # what results are wrapped like
        self._numpy = isinstance(table, _NDARRAY)  # results of other tables are wrapped back (a torch tensor)
        self._watch: Any = None  # a FileWatch for tables the loaders mapped from a file
        self._row_stride = self._view.strides[0] if type(self._view) is _NDARRAY else 0  # an output row's bytes
        # For a quantized table whose rows numpy holds, the dtype of a lookup without dtype= (else None).
        self._host_quantized_dtype = validate.output_dtype(self._view, None) if (
            type(self._view) is QuantizedTable and isinstance(self._rows, _NDARRAY)) else None

    def __call__(self, ids: Any, out: Any = None, backend: str = "auto", *, dtype: Any = None) -> Any:
        """``table[ids]``, as :func:`lookup` (same arguments, returns, shape and errors).

        Args:
            ids: integer ids of any shape, as :func:`lookup` takes them.
            out: as :func:`lookup`'s ``out`` (here it may also be passed by position).
            backend: as :func:`lookup`'s.
            dtype: as :func:`lookup`'s.

        Returns:
            The rows, shaped ``ids.shape + (dim,)``, as :func:`lookup` returns them.

        Raises:
            ValueError: also when the memory of a torch table was resized in
                place (``resize_`` that moved or grew it) after the layer was built.

        Example:
            >>> import numpy as np, fastembed
            >>> emb = fastembed.Embedding(np.arange(12, dtype=np.float32).reshape(4, 3))
            >>> emb([[3, 0]])
            array([[[ 9., 10., 11.],
                    [ 0.,  1.,  2.]]], dtype=float32)
        """
        table_view = self._view
        for guard in self._guards:  # as _checked_view(), inline: a decode step is mostly call overhead
            guard.check()
        if dtype is not None or type(table_view) is not _NDARRAY:
            if self._host_quantized_dtype is not None and out is None:
                # A decode step on a quantized table: the steps of _lookup_in_call_context that numpy rows need.
                ids_view = validate.ids_snapshot(ids, table_view)
                target = self._host_quantized_dtype if dtype is None else validate.output_dtype(table_view, dtype)
                chosen = dispatch.select(table_view, backend)
                return chosen.dequantize(table_view, ids_view, None, target)  # type: ignore[attr-defined]
            return _lookup_in_call_context(table_view, ids, out, dtype, backend, self._table_as_read)
        ids_view = validate.ids_snapshot(ids, table_view)
        if out is None:
            if self._numpy:
                if backend is _AUTO:  # as in lookup(): a decode step calls the backend's small gather directly
                    small = dispatch.ndarray_small_gather
                    if small[0] != dispatch.generation:
                        small = dispatch.small_gather_for_ndarray(table_view)
                    if ids_view.size * self._row_stride < small[1]:
                        return small[2](table_view, ids_view)
                return dispatch.select(table_view, backend).gather(table_view, ids_view, None)
            return _wrapped_lookup(table_view, ids_view, backend, self._table)
        out_view = validate.out_snapshot(out, ids_view, table_view, self._table, ids)
        if backend is _AUTO:
            small = dispatch.ndarray_small_gather
            if small[0] != dispatch.generation:
                small = dispatch.small_gather_for_ndarray(table_view)
            if ids_view.size * self._row_stride < small[1]:
                small[4](table_view, ids_view, out_view)
                return out if type(out) is _NDARRAY else mark_written(out)
        dispatch.select(table_view, backend).gather(table_view, ids_view, out_view)
        return out if type(out) is _NDARRAY else mark_written(out)

    def __copy__(self) -> Embedding:
        """A layer over the same table (and the same file watch): nothing is copied."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        return twin

    def __deepcopy__(self, memo: dict) -> Embedding:
        """A layer over a deep copy of the table as the layer read it (one copy), or, for a layer a loader mapped,
        over the same read-only mapping with a file watch of its own: rows no one can write through need no copy."""
        if self._watch is not None:
            twin = self.__copy__()
            twin._watch = copy.copy(self._watch)
            return twin
        return _rebuilt(type(self), copy.deepcopy(self._read_table(), memo), copy.deepcopy(self._own_state(), memo))

    def __reduce__(self) -> Any:
        if self._watch is not None:
            self._watch.__reduce__()  # raises, saying why, before any row is written
        return _rebuilt, (type(self), self._read_table(), self._own_state())

    def _read_table(self) -> Any:
        """The table as this layer read it: its view where numpy holds the rows (the caller may reshape its own
        array since), else the alias it took (a torch tensor's)."""
        return self._view if isinstance(self._rows, _NDARRAY) else self._table_as_read

    def _own_state(self) -> dict[str, Any]:
        """What a copy carries besides the table: attributes a subclass added (the rest follow from the table)."""
        return {name: value for name, value in self.__dict__.items() if name not in _FROM_THE_TABLE}

    def _checked_view(self) -> Any:
        """The table's view, once its memory is known to be where the view points (raises ValueError if not)."""
        for guard in self._guards:
            guard.check()
        return self._view

    @property
    def table(self) -> Any:
        """The table as the caller gave it (numpy, np.memmap, torch tensor, JAX array, cupy array, another DLPack producer or QuantizedTable)."""
        return self._table

    @property
    def format(self) -> str:
        """``"dense"``, or the block format of a quantized table (``"q8_0"``, see docs/quantized.md)."""
        return self._view.format.name if type(self._view) is QuantizedTable else "dense"

    @property
    def vocab_size(self) -> int:
        """Rows in the table."""
        return int(self._view.shape[0])

    @property
    def dim(self) -> int:
        """Values per row."""
        return int(self._view.shape[1])

    @property
    def dtype(self) -> np.dtype:
        """The dtype of results without ``dtype=``: the table's (bfloat16 and float8 via ml_dtypes), float32 for a quantized table.

        Raises:
            TypeError: a torch CUDA bfloat16 or float8 table, and ml_dtypes is not installed.
        """
        return validate.table_dtype(self._view, self._rows)

    @property
    def nbytes(self) -> int:
        """The table's size in bytes (a quantized table's rows and scales)."""
        return int(self._view.nbytes)

    @property
    def device(self) -> str:
        """``"cpu"`` or ``"cuda:N"``."""
        return device_of(validate.storage(self._view))

    def __repr__(self) -> str:
        kind = f"format={self.format!r}" if self.format != "dense" else f"dtype={self.dtype}"
        return f"Embedding(vocab_size={self.vocab_size}, dim={self.dim}, {kind}, device={self.device!r})"

    @classmethod
    def random(
        cls, vocab_size: int = 129280, dim: int = 4096, dtype: Any = "float16", seed: int = 0
    ) -> Embedding:
        """A table of random values (never zeros for floats), built in seconds.

        Floats: random sign, magnitudes in [1/64, 1/32) (an embedding's
        scale; complex: both parts so; float4 and float6 their smallest
        positive value, float8_e8m0fnu no sign); integers: uniform over their
        dtype's range; other dtypes: random bytes. See :func:`fastembed.tables.random_table`.

        Args:
            vocab_size, dim: the table's rows and width (the default is the 129,280 x 4,096 table, about 1 GiB).
            dtype: any fixed-size numpy dtype or its name (bfloat16 needs ml_dtypes).
            seed: the random generator's seed, an integer >= 0; one seed gives the same table everywhere.

        Returns:
            An Embedding over a new C-contiguous ``(vocab_size, dim)`` numpy array.

        Raises:
            TypeError: a size or seed that is not an integer; no dtype, or a dtype
                without a fixed size, with Python objects, or of sub-arrays.
            ValueError: a negative size or seed.

        Example:
            >>> import fastembed
            >>> fastembed.Embedding.random(100, 8, "float32", seed=1)([3]).shape
            (1, 8)
        """
        from .tables import random_table

        return cls(random_table(*validate.random_table_arguments(vocab_size, dim, dtype, seed)))

    @classmethod
    def from_safetensors(cls, path: str | os.PathLike, name: str | None = None) -> Embedding:
        """Memory-map one 2-D tensor of a safetensors file, read-only, zero-copy.

        Args:
            path: the ``.safetensors`` file.
            name: the tensor; None picks the token embedding by the naming
                conventions of the common model families (see docs/loading.md)
                or raises listing the candidates.

        Returns:
            An Embedding over the mapped tensor (a quantized table where :meth:`save`
            wrote one); :meth:`check_file` watches the file.

        Raises:
            FileNotFoundError: no file at `path`.
            OSError: the file cannot be read (PermissionError; a path longer than the system takes).
            ValueError: a directory, another file format, or a corrupt or hostile header.
            TypeError: BF16/F8 tensors need ml_dtypes and it is missing.

        Example:
            >>> import numpy as np, os, shutil, tempfile, fastembed
            >>> folder = tempfile.mkdtemp()
            >>> path = os.path.join(folder, "model.safetensors")
            >>> fastembed.Embedding(np.ones((5, 8), np.float16)).save(path, name="model.embed_tokens.weight")
            >>> fastembed.Embedding.from_safetensors(path).table.shape
            (5, 8)
            >>> shutil.rmtree(folder)
        """
        from .io import map_safetensors

        return cls._opened(map_safetensors(path, name))

    @classmethod
    def from_npy(cls, path: str | os.PathLike) -> Embedding:
        """Memory-map a 2-D .npy file, read-only, zero-copy.

        Args:
            path: the ``.npy`` file (a str or os.PathLike).

        Returns:
            An Embedding over the mapped array; :meth:`check_file` watches the file.

        Raises:
            FileNotFoundError: no file at `path`.
            OSError: the file cannot be read (PermissionError; a path longer than the system takes).
            ValueError: a directory, another file format, a corrupt header, not 2-D,
                or in Fortran (column-major) order, whose rows are not contiguous.

        Example:
            >>> import numpy as np, os, shutil, tempfile, fastembed
            >>> folder = tempfile.mkdtemp()
            >>> path = os.path.join(folder, "table.npy")
            >>> np.save(path, np.arange(6, dtype=np.float32).reshape(3, 2))
            >>> fastembed.Embedding.from_npy(path)([2])
            array([[4., 5.]], dtype=float32)
            >>> shutil.rmtree(folder)
        """
        from .io import map_npy_rows

        return cls._opened(map_npy_rows(path))

    @classmethod
    def from_pretrained(cls, source: Any, name: str | None = None) -> Embedding:
        """The token embedding of a checkpoint, memory-mapped read-only, zero-copy; or of an array.

        Args:
            source: a Hugging Face checkpoint directory (one ``model.safetensors``
                or shards with ``model.safetensors.index.json``: only the shard
                holding the table is mapped), an index file, a ``.safetensors``,
                ``.gguf`` or ``.npy`` file (a str, bytes or os.PathLike path), or a
                table array (used as it is).
            name: the tensor; None picks the token embedding by the naming
                conventions of the common families, confirmed by ``config.json``
                where there is one.

        Returns:
            An Embedding over the mapped tensor (:meth:`check_file` watches its
            file), or over `source` itself when it is an array.

        Raises:
            FileNotFoundError: no such path.
            OSError: the file cannot be read (PermissionError; a path longer than the system takes).
            ValueError: no checkpoint there, another file format, an ambiguous
                or missing tensor, a corrupt header; `name` with an array.
            TypeError: BF16/F8 tensors need ml_dtypes and it is missing.

        Example:
            >>> import numpy as np, fastembed
            >>> fastembed.Embedding.from_pretrained(np.ones((8, 4), np.float32)).dim
            4
        """
        if isinstance(source, bytes):
            source = os.fsdecode(source)  # a path in the file system's encoding, as os functions take it
        if not isinstance(source, (str, os.PathLike)):
            if name is not None:
                raise ValueError(f"name={name!r} picks a tensor of a checkpoint, but the source is an array, the "
                                 "table itself: pass name=None")
            return cls(source)
        from .io import open_table

        return cls._opened(open_table(source, name))

    @classmethod
    def _opened(cls, table: Any) -> Embedding:
        """An Embedding over a table the loaders mapped from a file, watching that file."""
        from .io import FileWatch

        embedding = cls(table)
        embedding._watch = FileWatch.for_table(table)
        return embedding

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, name: str | None = None) -> Embedding:
        """Memory-map one 2-D tensor of a GGUF file (v2, v3), read-only, zero-copy.

        Args:
            path: the ``.gguf`` file (a llama.cpp model).
            name: the tensor; None means ``token_embd.weight``.

        Returns:
            An Embedding over a :class:`~fastembed.formats.QuantizedTable` for the
            block types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; results
            float32 unless ``dtype=`` asks for float16 or bfloat16), or over a
            dense array for F32, F16 and BF16.

        Raises:
            FileNotFoundError: no file at `path`.
            OSError: the file cannot be read (PermissionError; a path longer than the system takes).
            ValueError: not a GGUF file, a corrupt or hostile header, a missing
                tensor, or a tensor type fastembed does not gather (named).
            TypeError: a BF16 tensor, and ml_dtypes is not installed.

        Example:
            >>> import os, shutil, tempfile, fastembed
            >>> folder = tempfile.mkdtemp()
            >>> path = os.path.join(folder, "model.gguf")
            >>> fastembed.Embedding.random(100, 64).quantize("q8_0").save(path)
            >>> emb = fastembed.Embedding.from_gguf(path)
            >>> emb.format, emb([1, 2], dtype="float16").shape
            ('q8_0', (2, 64))
            >>> shutil.rmtree(folder)
        """
        from .io import map_gguf

        return cls._opened(map_gguf(path, name))

    def save(self, path: str | os.PathLike, name: str | None = None) -> None:
        """Write the table to `path`: ``.gguf`` (float32, float16, bfloat16 and the GGUF block formats) or ``.safetensors``.

        A quantized table's safetensors file holds its rows as bytes, its row
        scales beside them and its format in the metadata; loading it back
        (:meth:`from_safetensors`, :meth:`from_pretrained`) gives the same bytes.

        Args:
            path: the file to write (replaced if it exists).
            name: the tensor's name; None: ``token_embd.weight`` in GGUF, ``weight`` in safetensors.

        Raises:
            ValueError, TypeError, OSError: as :func:`fastembed.io.save_table`; also a ValueError, as for a
                lookup, once a torch table's memory was resized in place (``resize_`` that moved or grew it).

        Example:
            >>> import os, shutil, tempfile, fastembed
            >>> emb = fastembed.Embedding.random(100, 64)
            >>> folder = tempfile.mkdtemp()
            >>> path = os.path.join(folder, "table.gguf")
            >>> emb.save(path)
            >>> bool((fastembed.Embedding.from_gguf(path)([7]) == emb([7])).all())
            True
            >>> shutil.rmtree(folder)
        """
        from .io import save_table

        save_table(path, self._checked_view(), name)

    def quantize(self, kind: Any) -> Embedding:
        """A new Embedding over this table quantized into `kind`: ``"q8_0"`` or ``"fp8_e4m3"``.

        ``q8_0`` is ggml's layout (blocks of 32 values: a float16 scale
        ``absmax / 127`` and 32 int8), byte for byte what llama.cpp writes;
        ``fp8_e4m3`` keeps one float8_e4m3fn per value and one float32 scale
        ``absmax / 448`` per row. Error bounds: docs/quantized.md. The table is
        read a few MiB of rows at a time, through float32 temporaries of a
        fixed size (a few tens of MiB, whatever the table's size); the new
        table is the only allocation that grows with it.

        Args:
            kind: ``"q8_0"`` or ``"fp8_e4m3"`` (case-insensitive), or that
                :class:`fastembed.formats.BlockFormat`.

        Returns:
            A new Embedding over a :class:`fastembed.formats.QuantizedTable`
            whose arrays belong to this table's library (numpy, torch, JAX).

        Raises:
            ValueError: an unknown kind, a kind fastembed cannot produce, a dim
                that is not a whole number of blocks, NaN/infinite values or
                values beyond float32's range; for q8_0, a block whose largest
                magnitude, rounded to float32, is 65520 x 127 = 8,321,040 or
                more (its scale, a float16, would be infinite).
            TypeError: a table that is not a float table on the host, or already quantized.

        Like a lookup, it raises ValueError once a torch table's memory was resized in place (``resize_`` that moved or grew it).

        Example:
            >>> import fastembed
            >>> emb = fastembed.Embedding.random(1000, 64).quantize("q8_0")
            >>> emb.format, emb(0).dtype
            ('q8_0', dtype('float32'))
        """
        from .formats import QuantizedTable, block_format, quantize_rows

        fmt = block_format(kind)
        view = self._checked_view()
        if type(view) is QuantizedTable or not isinstance(view, np.ndarray) or not validate.is_float_dtype(view.dtype):
            raise TypeError(f"quantize() takes a dense floating-point host table, not {self!r}")
        vocab_size, dim = view.shape
        quantize_rows(view[:0], fmt)  # the kind, then the dim, refused before anything is allocated, rows or none
        data = _host_array(self._rows, (vocab_size, fmt.row_bytes(dim)), np.dtype(np.uint8))
        scales = _host_array(self._rows, (vocab_size,), np.dtype(np.float32)) if fmt.row_scale else None
        step = max(1, (4 << 20) // (4 * dim))
        for start in range(0, vocab_size, step):
            rows, row_scales = quantize_rows(view[start : start + step], fmt)
            data[start : start + step] = rows
            if scales is not None:
                scales[start : start + step] = row_scales
        if not self._numpy:  # the new table's arrays follow this table's library, and so do its lookups' results
            data = result_like(data, self._rows)
            scales = None if scales is None else result_like(scales, self._rows)
        return Embedding(QuantizedTable(data, fmt, dim, scales))

    def check_file(self) -> None:
        """Raise if the file behind a mapped table shrank or was modified in place since it was opened.

        A lookup touching a page that a truncation removed would kill the
        process (SIGBUS); this check costs one system call, so it is left to
        the caller's rhythm (per request, per batch). It narrows the window;
        it cannot close it.

        Only a layer that a loader constructor made (:meth:`from_pretrained`,
        :meth:`from_safetensors`, :meth:`from_npy`, :meth:`from_gguf`) watches
        its file, from the moment it mapped it; ``Embedding(table)`` watches none.

        Raises:
            fastembed.io.FileChangedError: the file changed.
            ValueError: the layer was not made by a loader constructor.

        Example:
            >>> import numpy as np, os, shutil, tempfile, fastembed
            >>> folder = tempfile.mkdtemp()
            >>> path = os.path.join(folder, "table.npy")
            >>> np.save(path, np.ones((4, 8), np.float16))
            >>> emb = fastembed.Embedding.from_npy(path)
            >>> emb.check_file()  # silent while the file is as it was mapped
            >>> shutil.rmtree(folder)
        """
        if self._watch is None:
            raise ValueError("this layer watches no file: only the layers Embedding.from_pretrained (and from_safetensors, "
                             "from_npy, from_gguf) make watch the file they map, from the moment they map it; for a "
                             "table from fastembed.io.open_table use Embedding.from_pretrained(path) instead, or watch it "
                             "with fastembed.io.FileWatch.for_table(table)")
        self._watch.check()

    def to_device(self, device: int = 0) -> Embedding:
        """An Embedding over a copy of this host table on CUDA device `device` (explicit, one copy).

        Args:
            device: the CUDA device's index.

        Returns:
            A new Embedding over a cupy array (a quantized table: cupy data and scales) on that device.

        Raises:
            BackendUnavailableError: cupy or a device is missing.
            TypeError: `device` is not an int; the table is not on the host; a
                dtype cupy cannot carry (:func:`fastembed.backends.cuda_backend.to_device`).
            ValueError: no such device; a torch table's memory resized in place (``resize_`` that moved or grew it).

        Example:
            >>> import fastembed
            >>> gpu = fastembed.Embedding.random(1000, 64).to_device(0)  # doctest: +SKIP
            >>> gpu.device, gpu([1, 2]).shape  # doctest: +SKIP
            ('cuda:0', (2, 64))
        """
        from .backends import cuda_backend
        from .dispatch import BackendUnavailableError

        index = cuda_backend.checked_device_index(device)
        if self.device != "cpu":
            raise TypeError(f"to_device() copies a host table, and this one lives on {self.device}")
        reasons = cuda_backend.BACKEND.unavailable_reasons()
        if reasons:
            raise BackendUnavailableError(f"cannot move the table to cuda:{index}: {'; '.join(reasons)}")
        return Embedding(cuda_backend.to_device(self._checked_view(), index))  # a QuantizedTable moves its data and scales
