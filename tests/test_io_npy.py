"""map_npy on corrupt headers: every failure a ValueError naming the file (fuzzed)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastembed
from fastembed import io


def npy_bytes(header: str, data: bytes = b"\0" * 32) -> bytes:
    """A version 1.0 .npy file with this header dictionary text, padded as numpy pads it."""
    encoded = header.encode("latin1")
    encoded += b" " * ((64 - (10 + len(encoded) + 1) % 64) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(encoded).to_bytes(2, "little") + encoded + data


@pytest.mark.parametrize(
    "header, words",
    [
        # numpy's parser raised OverflowError, then tokenize.TokenError, for these.
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999, 4), }", "truncated .npy"),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 4), '''", "corrupt header.*TokenError"),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 4", "corrupt header.*TokenError"),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (-2, 4), }", "corrupt header"),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (2**62, 4), }", "corrupt header"),
        ("{'descr': [1], 'fortran_order': False, 'shape': (2, 4), }", "corrupt header"),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (20, 4), }", "truncated .npy.*320 bytes"),
    ],
)
def test_corrupt_npy_headers_raise_value_error_naming_the_file(tmp_path, header, words):
    path = tmp_path / "corrupt.npy"
    path.write_bytes(npy_bytes(header))
    with pytest.raises(ValueError, match=words) as caught:
        io.map_npy(path)
    assert str(path) in str(caught.value)


def test_a_valid_handmade_header_maps(tmp_path):
    path = tmp_path / "ok.npy"
    data = np.arange(8, dtype="<f4").reshape(2, 4)
    path.write_bytes(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 4), }", data.tobytes()))
    table = io.map_npy(path)
    assert isinstance(table, np.memmap) and not table.flags.writeable
    np.testing.assert_array_equal(table, data)


def test_fortran_order_and_versions_2_and_3_map_like_np_load(tmp_path):
    table = np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4))
    np.save(tmp_path / "f.npy", table)
    mapped = io.map_npy(tmp_path / "f.npy")
    assert mapped.flags.f_contiguous and np.array_equal(mapped, table)
    for version in ((2, 0), (3, 0)):
        path = tmp_path / f"v{version[0]}.npy"
        with open(path, "wb") as handle:
            np.lib.format.write_array(handle, table, version=version)
        assert np.array_equal(io.map_npy(path), table)


def test_a_version_3_header_keeps_its_utf8_field_names(tmp_path):
    table = np.zeros((3, 4), [("名", "<f4")])
    with open(tmp_path / "v3.npy", "wb") as handle:
        np.lib.format.write_array(handle, table, version=(3, 0))
    assert io.map_npy(tmp_path / "v3.npy").dtype == table.dtype


def test_an_unknown_format_version_is_refused(tmp_path):
    path = tmp_path / "v9.npy"
    path.write_bytes(b"\x93NUMPY\x09\x07" + npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 4), }")[8:])
    with pytest.raises(ValueError, match="format version 9.7"):
        io.map_npy(path)


def test_a_huge_header_length_is_refused_before_the_header_is_read(tmp_path):
    import tracemalloc

    path = tmp_path / "huge.npy"
    claimed = 512 * 2**20
    with open(path, "wb") as handle:  # a sparse file: the claimed header is there, as zeros
        handle.write(b"\x93NUMPY\x02\x00" + claimed.to_bytes(4, "little"))
        handle.truncate(12 + claimed + 64)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=f"a header of {claimed} bytes; at most 10000 are read"):
            io.map_npy(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20


def _valid_npy() -> bytes:
    import io as stdio

    buffer = stdio.BytesIO()
    np.save(buffer, np.arange(24, dtype=np.float16).reshape(6, 4))
    return buffer.getvalue()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    flips=st.lists(st.tuples(st.integers(0, 127), st.integers(0, 255)), max_size=6),
    inserts=st.lists(st.tuples(st.integers(10, 127), st.binary(min_size=1, max_size=8)), max_size=2),
    cut=st.one_of(st.none(), st.integers(0, 200)),
)
def test_fuzzed_npy_headers_only_give_value_errors(tmp_path, flips, inserts, cut):
    """Byte flips and insertions in the header (the first 128 bytes), and truncation."""
    content = bytearray(_valid_npy())
    for position, value in flips:
        content[position] = value
    for position, chunk in inserts:
        content[position:position] = chunk
    if cut is not None:
        content = content[:cut]
    path = tmp_path / "fuzz.npy"
    path.write_bytes(bytes(content))
    try:
        table = fastembed.Embedding.from_npy(path).table
    except ValueError as error:
        assert str(path) in str(error)
        return
    assert table.ndim == 2 and table.nbytes <= len(content)
    fastembed.lookup(np.ascontiguousarray(table[:1]), [0])


def test_a_fortran_order_file_is_refused_as_a_table_naming_the_file_and_the_rewrite(tmp_path):
    values = np.random.default_rng(2).standard_normal((64, 100)).astype(np.float32)
    path = tmp_path / "transposed.npy"
    np.save(path, values.T)  # np.save writes a transposed array in Fortran order
    for open_it in (fastembed.Embedding.from_npy, fastembed.Embedding.from_pretrained, io.open_table):
        with pytest.raises(ValueError, match="Fortran.*rewrite it once") as caught:
            open_it(path)
        assert str(path) in str(caught.value)
    code = str(caught.value).split("row-major order: ", 1)[1]
    exec(code, {"np": np, "path": str(path)})  # noqa: S102 - the message's own rewrite, on this test's file
    np.testing.assert_array_equal(fastembed.Embedding.from_npy(path)(np.arange(100)), values.T)


def test_a_sub_array_dtype_is_refused_as_not_2d(tmp_path):
    path = tmp_path / "sub.npy"
    data = np.random.default_rng(3).standard_normal((5, 12)).astype("<f4")
    path.write_bytes(npy_bytes("{'descr': ('<f4', (1,)), 'fortran_order': False, 'shape': (5, 12), }", data.tobytes()))
    for open_it in (io.map_npy, io.open_table, fastembed.Embedding.from_npy):
        with pytest.raises(ValueError, match=r"sub-array type.*float32 of shape \(1,\)") as caught:
            open_it(path)
        assert str(path) in str(caught.value)


def test_a_path_whose_fspath_gives_bytes_opens_and_is_watched(tmp_path):
    import os

    path = tmp_path / "t.npy"
    table = np.random.default_rng(4).standard_normal((30, 8)).astype(np.float32)
    np.save(path, table)

    class BytesPath:
        def __fspath__(self) -> bytes:
            return os.fsencode(path)

    for open_it in (fastembed.Embedding.from_npy, fastembed.Embedding.from_pretrained):
        emb = open_it(BytesPath())
        emb.check_file()  # watched: the mapped array names the file
        np.testing.assert_array_equal(emb([3, 1]), table[[3, 1]])
    np.save(path, table + 1)
    with pytest.raises(io.FileChangedError):
        emb.check_file()


def test_a_dtype_without_bytes_is_a_value_error_naming_the_file(tmp_path):
    from numpy.lib import format as npy_format

    path = tmp_path / "empty-items.npy"
    with open(path, "wb") as handle:
        npy_format.write_array_header_1_0(handle, {"descr": "|S0", "fortran_order": False, "shape": (10, 4)})
    with pytest.raises(ValueError, match="empty-items.npy.*no bytes per value"):
        fastembed.Embedding.from_npy(path)
