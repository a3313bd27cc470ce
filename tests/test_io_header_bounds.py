"""What a safetensors header may cost: bounded memory for hostile headers; real-sized headers accepted.

Memory is the growth of the peak resident set in a fresh subprocess. Time is never
measured; one test only bounds it, as a guard against a hang, far above what it takes.
"""
from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import pytest

from fastembed import io

MEASURE = """
import sys, tracemalloc
import fastembed
from fastembed import io


def peak_rss():
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None


before = peak_rss()
if before is None:
    tracemalloc.start()
try:
    io.map_safetensors(sys.argv[1])
    outcome = "opened"
except ValueError as error:
    outcome = "ValueError"
print(outcome, tracemalloc.get_traced_memory()[1] if before is None else peak_rss() - before)
"""


def peak_growth(path) -> tuple[str, int]:
    """(outcome, growth of the peak memory in bytes) of map_safetensors(path) in a fresh process.

    The peak resident set (VmHWM) where /proc exists, else the peak traced by tracemalloc.
    Not ru_maxrss: Linux carries a parent's peak across fork and exec into the child's.
    """
    out = subprocess.run([sys.executable, "-c", MEASURE, str(path)], check=True, capture_output=True, text=True).stdout
    outcome, growth = out.split()
    return outcome, int(growth)


def write(path, header: bytes, data: bytes = b"\0" * 8) -> int:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return len(header)


TABLE_ENTRY = b'"wte.weight":{"dtype":"F16","shape":[2,2],"data_offsets":[0,8]}'


def tiny_entries(count: int) -> bytes:
    """The hostile header: the table, then `count` empty tensors of about 55 bytes each."""
    return b"{" + TABLE_ENTRY + b"".join(b',"t%d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}' % i for i in range(count)) + b"}"


def test_a_header_over_the_cap_is_refused_before_it_is_read(tmp_path):
    """~1.5 million tiny entries in 84 MB (under the format's 100 MB) took 1.9 GiB to open."""
    length = write(tmp_path / "huge.safetensors", tiny_entries(1_500_000))
    assert io.MAX_HEADER_BYTES < length < 100_000_000
    with pytest.raises(ValueError, match=f"header length {length} is over fastembed's limit of {io.MAX_HEADER_BYTES}"):
        io.map_safetensors(tmp_path / "huge.safetensors")
    outcome, growth = peak_growth(tmp_path / "huge.safetensors")
    assert outcome == "ValueError" and growth < 4 * 2**20


def _filled(prefix: bytes, item: str, suffix: bytes, room: int) -> bytes:
    """prefix + as many items (item % i, comma-separated) as fit in `room` bytes + suffix."""
    parts, used, i = [], len(prefix) + len(suffix), 0
    while True:
        piece = (item % i).encode()
        if used + len(piece) + 1 > room:
            return prefix + b",".join(parts) + suffix
        parts.append(piece)
        used += len(piece) + 1
        i += 1


def _at_the_cap(kind: str) -> bytes:
    room = io.MAX_HEADER_BYTES - 200
    if kind == "entries":  # the table, then ~291,000 empty tensors of about 57 bytes each
        return _filled(b"{" + TABLE_ENTRY + b",", '"t%d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}', b"}", room)
    if kind == "metadata":  # 1.4 million tiny string pairs in __metadata__
        return _filled(b'{"__metadata__":{', '"%x":"v"', b"}," + TABLE_ENTRY + b"}", room)
    if kind == "long_name":
        return b'{"' + b"n" * (room - 80) + b'.wte.weight":{"dtype":"F16","shape":[2,2],"data_offsets":[0,8]}}'
    if kind == "nesting":  # a deep nest of lists inside one entry
        depth = (room - 100) // 2
        return b'{"wte.weight":{"dtype":"F16","shape":' + b"[" * depth + b"]" * depth + b',"data_offsets":[0,8]}}'
    if kind == "long_list":  # millions of ints in one shape
        return b'{"wte.weight":{"dtype":"F16","shape":[' + b"1," * ((room - 100) // 2) + b'2],"data_offsets":[0,8]}}'
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["entries", "metadata", "long_name", "nesting", "long_list"])
def test_a_hostile_header_at_the_cap_costs_about_twice_its_length(tmp_path, kind):
    path = tmp_path / f"{kind}.safetensors"
    length = write(path, _at_the_cap(kind))
    assert io.MAX_HEADER_BYTES - 4096 < length <= io.MAX_HEADER_BYTES
    outcome, growth = peak_growth(path)
    assert outcome == ("ValueError" if kind in ("nesting", "long_list") else "opened")
    assert growth < 2 * length + 2**20, f"{kind}: peak of {growth / 2**20:.1f} MiB for a {length / 2**20:.1f} MiB header"


def test_entries_padded_with_whitespace_open_without_backtracking(tmp_path):
    """Entries with 3,900 spaces inside their shape and a field of their own, up to the cap.

    Whitespace on both sides of the shape's last number once let the fast
    entry pattern try every split of it before the JSON parser took the
    entry: this file took about 2 minutes to open. The guard's 60 s bound is
    a hang's, far above the second or so it takes.
    """
    path = tmp_path / "padded.safetensors"
    item = '"t%d":{"dtype":"F32","shape":[0' + " " * 3900 + '],"data_offsets":[0,0],"x":1}'
    write(path, _filled(b"{" + TABLE_ENTRY + b",", item, b"}", io.MAX_HEADER_BYTES - 200))
    opened = subprocess.run([sys.executable, "-c", "import sys; from fastembed import io; print(io.map_safetensors(sys.argv[1]).shape)",
                             str(path)], check=True, capture_output=True, text=True, timeout=60)
    assert opened.stdout.split() == ["(2,", "2)"]


@pytest.mark.parametrize("shape", ["[\t3 , 4\n]", "[ 3,4]", "[3 ,4 ]"])
def test_whitespace_anywhere_in_a_shape_is_read(tmp_path, shape):
    path = tmp_path / "spaced.safetensors"
    table = '"wte.weight":{"dtype":"F16","shape":' + shape + ',"data_offsets":[0,24]}'
    write(path, ("{" + table + ',"scalar":{"dtype":"F16","shape":[ ],"data_offsets":[24,26]}}').encode(), b"\0" * 26)
    assert io.map_safetensors(path, "wte.weight").shape == (3, 4)
    assert io.scan_safetensors_header(path).entries["scalar"].shape == ()


def test_a_zip_whose_directory_lists_a_million_members_is_named_at_little_cost(tmp_path):
    """A file the safetensors loader is given that is a zip archive (a PyTorch checkpoint, say) is named by its
    first member; its directory, which here lists 1,000,000 members in 51 MB, once cost 470 MiB to read."""
    members = 1_000_000
    path = tmp_path / "pytorch_model.bin"
    entry = b"PK\x01\x02" + struct.pack("<HHHHHHIIIHHHHHII", 20, 20, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0, 0, 0, 0, 0)
    directory = b"".join(entry + b"%08x" % i for i in range(members))
    start = 30
    path.write_bytes(b"PK\x03\x04" + b"\0" * 26 + directory
                     + b"PK\x06\x06" + struct.pack("<QHHIIQQQQ", 44, 45, 45, 0, 0, members, members, len(directory), start)
                     + b"PK\x06\x07" + struct.pack("<IQI", 0, start + len(directory), 1)
                     + b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0))
    with pytest.raises(ValueError, match="is a zip archive"):
        io.map_safetensors(path)
    outcome, growth = peak_growth(path)
    assert outcome == "ValueError" and growth < 16 * 2**20, f"peak of {growth / 2**20:.1f} MiB"


def deepseek_v3_header() -> tuple[dict, int]:
    """The header of DeepSeek-V3's 91,985 tensors (names, dtypes and shapes of its architecture) in one file."""
    layers, experts, hidden, inter, moe_inter, vocab = 62, 256, 7168, 18432, 2048, 129280  # 61 layers + the MTP layer
    tensors = {"model.embed_tokens.weight": ("BF16", [vocab, hidden]), "model.norm.weight": ("BF16", [hidden]),
               "lm_head.weight": ("BF16", [vocab, hidden])}

    def linear(name, rows, cols):
        tensors[name + ".weight"] = ("F8_E4M3", [rows, cols])
        tensors[name + ".weight_scale_inv"] = ("F32", [-(-rows // 128), -(-cols // 128)])

    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        for name, rows, cols in [("q_a_proj", 1536, hidden), ("q_b_proj", 24576, 1536), ("kv_a_proj_with_mqa", 576, hidden),
                                 ("kv_b_proj", 32768, 512), ("o_proj", hidden, 16384)]:
            linear(f"{prefix}.self_attn.{name}", rows, cols)
        for name, size in [("self_attn.q_a_layernorm", 1536), ("self_attn.kv_a_layernorm", 512),
                           ("input_layernorm", hidden), ("post_attention_layernorm", hidden)]:
            tensors[f"{prefix}.{name}.weight"] = ("BF16", [size])
        if layer < 3:
            for name, rows, cols in [("gate_proj", inter, hidden), ("up_proj", inter, hidden), ("down_proj", hidden, inter)]:
                linear(f"{prefix}.mlp.{name}", rows, cols)
            continue
        tensors[f"{prefix}.mlp.gate.weight"] = ("BF16", [experts, hidden])
        tensors[f"{prefix}.mlp.gate.e_score_correction_bias"] = ("F32", [experts])
        for expert in [f"experts.{k}" for k in range(experts)] + ["shared_experts"]:
            for name, rows, cols in [("gate_proj", moe_inter, hidden), ("up_proj", moe_inter, hidden), ("down_proj", hidden, moe_inter)]:
                linear(f"{prefix}.mlp.{expert}.{name}", rows, cols)
    itemsize = {"BF16": 2, "F8_E4M3": 1, "F32": 4}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = itemsize[dtype] * int(np.prod(shape))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    return header, offset


def test_all_of_deepseek_v3_in_one_file_fits_under_the_cap(tmp_path):
    """The cap leaves room for a real checkpoint's whole header, far above any single shard's."""
    header, data_size = deepseek_v3_header()
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(header) == 91_985 and 12_000_000 < len(text) < io.MAX_HEADER_BYTES
    path = tmp_path / "deepseek-v3-one-file.safetensors"
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(text)) + text)
        try:
            handle.truncate(8 + len(text) + data_size)  # sparse: 685 GB of holes
        except OSError as error:
            pytest.skip(f"this filesystem cannot hold a sparse 685 GB file: {error}")
    table = io.map_safetensors(path)
    assert table.shape == (129280, 7168) and table.offset == 8 + len(text)
