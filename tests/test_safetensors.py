"""The safetensors header parser against files written by the safetensors library, and a fuzz."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save, save_file

from fsmount.safetensors import SafetensorsError, parse_header


def parse_file(path: Path):  # noqa: ANN201
    data = path.read_bytes()
    return parse_header(data, len(data)), data


@pytest.mark.parametrize("dtypes", [["float32"], ["float16", "int8", "float64", "uint16", "int64", "bool"]])
def test_offsets_match_the_library(tmp_path: Path, dtypes: list[str]) -> None:
    rng = np.random.default_rng(0)
    tensors = {}
    for i in range(12):
        dt = dtypes[i % len(dtypes)]
        shape = (i + 1, 3) if i % 3 else (0,) if i == 0 else (5,)
        tensors[f"layer.{i}.w"] = rng.integers(0, 2, size=shape).astype(dt)
    path = tmp_path / "m.safetensors"
    save_file(tensors, path, metadata={"format": "np", "note": "x"})
    layout, data = parse_file(path)
    assert {t.name for t in layout.tensors} == set(tensors)
    for t in layout.tensors:
        assert data[t.start:t.end] == tensors[t.name].tobytes()
    assert layout.data_end == len(data)
    assert [t.start for t in layout.tensors] == sorted(t.start for t in layout.tensors)


def test_unpadded_header_and_empty_file_of_tensors() -> None:
    header = json.dumps({"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]}}).encode()
    blob = struct.pack("<Q", len(header)) + header + b"xyz"
    layout = parse_header(blob, len(blob))
    assert layout.tensors[0].start == 8 + len(header)
    header = b'{"__metadata__":{"k":"v"}}'
    blob = struct.pack("<Q", len(header)) + header
    assert parse_header(blob, len(blob)).tensors == ()


def make(header: dict, data_len: int, n: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if n is None else n) + raw + b"\0" * data_len


@pytest.mark.parametrize("blob,why", [
    (struct.pack("<Q", 10**9) + b"{}", "out of range"),
    (struct.pack("<Q", 50) + b"{}", "exceeds file size"),
    (struct.pack("<Q", 4) + b"nope", "start with"),
    (struct.pack("<Q", 4) + b"{xx}", "not JSON"),
    (make({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
           "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, 6), "overlaps"),
    (make({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, 10), "data ends"),
    (make({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 40]}}, 40), "bytes for shape"),
    (make({"a": {"dtype": "ZZ", "shape": [4], "data_offsets": [0, 4]}}, 4), "unknown dtype"),
    (make({"a": {"dtype": "U8", "shape": [4], "data_offsets": [4, 0]}}, 4), "out of order"),
    (make({"__metadata__": {"k": 1}}, 0), "__metadata__"),
    (make([], 0), "start with"),
])
def test_malformed_headers_are_rejected(blob: bytes, why: str) -> None:
    with pytest.raises(SafetensorsError, match=why):
        parse_header(blob, len(blob))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.integers(min_value=0, max_value=1 << 40))
def test_fuzz_only_our_error_comes_out(blob: bytes, size: int) -> None:
    try:
        parse_header(blob, size)
    except SafetensorsError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_fuzz_mutated_real_headers(data: st.DataObject) -> None:
    blob = bytearray(save({"a": np.zeros((3, 4), np.float32), "b": np.ones(7, np.int16)}))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] = data.draw(st.integers(0, 255))
    try:
        layout = parse_header(bytes(blob), len(blob))
    except SafetensorsError:
        return
    assert layout.data_end == len(blob)
