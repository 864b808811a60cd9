"""The safetensors header parser against files written by the safetensors library, and fuzzing with the
library as the oracle.

The fuzz tests hold our parser to the library on every blob (`check_against_library`): a blob we accept,
the library accepts with the same tensors at the same offsets (and the dtype and shape it reads agree
with our size check); a blob the library rejects, we reject with `SafetensorsError`. Nothing else ever
comes out of our parser. The differences allowed are the deliberate ones, each named below
(`stricter_on_purpose`, `lenient_on_purpose`) and each shown by an example in
`test_known_differences_from_the_library`.
"""

from __future__ import annotations

import json
import math
import random
import re
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, currently_in_test_context, event, given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError, deserialize, safe_open
from safetensors.numpy import save, save_file

from fsmount.safetensors import DTYPE_SIZES, LENGTH_PREFIX, SUB_BYTE_DTYPES, Layout, SafetensorsError, parse_header

U64_MAX = 2**64 - 1
SUB_BYTE_BITS = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


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


def test_every_dtype_the_library_knows_is_known() -> None:
    """A file of any dtype the library reads gets model streaming (F8_E4M3FNUZ and F8_E5M2FNUZ, AMD's FP8
    checkpoints, once did not). The library names its dtypes when it refuses one it does not know."""
    header = json.dumps({"a": {"dtype": "NOT_A_DTYPE", "shape": [1], "data_offsets": [0, 1]}}).encode()
    with pytest.raises(SafetensorError) as info:
        deserialize(struct.pack("<Q", len(header)) + header + b"\0")
    known = re.findall(r"`([A-Z0-9_]+)`", str(info.value).split("expected one of", 1)[1])
    assert len(known) > 10 and set(known) == set(DTYPE_SIZES)
    for dtype in set(known) - SUB_BYTE_DTYPES:
        header = json.dumps({"a": {"dtype": dtype, "shape": [2, 3], "data_offsets": [0, 6 * DTYPE_SIZES[dtype]]}})
        blob = make(json.loads(header), 6 * DTYPE_SIZES[dtype])
        assert dict(deserialize(blob))["a"]["shape"] == [2, 3]
        assert parse_header(blob, len(blob)).tensors[0].end == len(blob)


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
    (make({"a": {"dtype": [1], "shape": [4], "data_offsets": [0, 4]}}, 4), "unknown dtype"),
    (make({"a": {"dtype": {"x": 1}, "shape": [4], "data_offsets": [0, 4]}}, 4), "unknown dtype"),
])
def test_malformed_headers_are_rejected(blob: bytes, why: str) -> None:
    with pytest.raises(SafetensorsError, match=why):
        parse_header(blob, len(blob))


# -- the library as the oracle -------------------------------------------------------------------


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where blobs the library accepted are written for `safe_open` (module scope: hypothesis reruns a
    test many times within one fixture instance)."""
    return tmp_path_factory.mktemp("safetensors") / "blob.safetensors"


def library_layout(blob: bytes, scratch: Path) -> dict[str, tuple[int, int, str, list[int]]] | None:
    """What the library reads from a whole file: {name: (start, end, dtype, shape)} with absolute offsets,
    or None if it rejects the file. `deserialize` gives each tensor's bytes but not where they are;
    `offset_keys` gives the names in offset order, and the library accepts only tensors that tile the data
    region, so the offsets are the running sums of the byte counts in that order."""
    try:
        tensors = dict(deserialize(blob))
    except SafetensorError:
        return None
    scratch.write_bytes(blob)
    with safe_open(scratch, framework="numpy") as f:
        order = f.offset_keys()
    assert sorted(order) == sorted(tensors)
    position = LENGTH_PREFIX + int.from_bytes(blob[:LENGTH_PREFIX], "little")
    out = {}
    for name in order:
        t = tensors[name]
        out[name] = (position, position + len(t["data"]), t["dtype"], t["shape"])
        position += len(t["data"])
    assert position == len(blob)
    return out


def stricter_on_purpose(header: bytes, error: SafetensorsError) -> bool:
    """Headers the library accepts and we reject on purpose: one that does not begin with '{' (the format says it
    MUST; the library skips leading whitespace). (`"__metadata__": null` was one; the library reads it as no
    metadata, and so does this parser now: a file `safe_open` loads was not streamed.)"""
    message = str(error)
    if message == "header does not start with '{'":
        return header[:1].isspace()
    return False


class _Object(dict):
    """A JSON object that remembers the keys it had more than once (json keeps the last value)."""

    repeated: set[str]


class _NegativeZero(int):
    pass


def _json_parts(value: object) -> Iterator[object]:
    yield value
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _json_parts(v)
    elif isinstance(value, list):
        for v in value:
            yield from _json_parts(v)


def lenient_on_purpose(header: bytes) -> bool:
    """Headers we accept and the library rejects, on purpose (a header we accept only plans a prefetch of
    byte ranges that tile the file, so accepting more costs nothing):
    - a tensor of a sub-byte dtype: we do not check its byte count (packing varies between versions);
    - what Python's json reads and serde_json refuses: lone surrogate escapes; a field given twice in a
      tensor entry, a tensor name given twice (json keeps the last entry; the library also checks the
      ones before it), or `__metadata__` given twice; NaN, Infinity and numbers beyond a double anywhere;
      in a shape or data_offsets, integers beyond u64 or written -0, and shapes whose element count
      (times the dtype's bits) overflows u64 on the way."""
    special: list[str] = []

    def pairs(items: list[tuple[str, object]]) -> _Object:
        obj = _Object(items)
        keys = [k for k, _ in items]
        obj.repeated = {k for k in keys if keys.count(k) > 1}
        return obj

    def parse_int(text: str) -> int:
        return _NegativeZero(0) if text.startswith("-") and int(text) == 0 else int(text)

    def parse_float(text: str) -> float:
        if math.isinf(float(text)):
            special.append(text)
        return float(text)

    doc = json.loads(header, object_pairs_hook=pairs, parse_int=parse_int, parse_float=parse_float,
                     parse_constant=lambda text: special.append(text) or float(text))
    assert isinstance(doc, _Object)
    if special or doc.repeated:
        return True
    for part in _json_parts(doc):
        if isinstance(part, str) and any(0xD800 <= ord(c) <= 0xDFFF for c in part):
            return True
    for name, entry in doc.items():
        if name == "__metadata__" or not isinstance(entry, _Object):
            continue
        if entry.get("dtype") in SUB_BYTE_DTYPES or entry.repeated & {"dtype", "shape", "data_offsets"}:
            return True
        numbers = [x for field in ("shape", "data_offsets") if isinstance(entry.get(field), list)
                   for x in entry[field] if isinstance(x, int)]
        if any(isinstance(x, _NegativeZero) or x > U64_MAX for x in numbers):
            return True
        shape, dtype = entry.get("shape"), entry.get("dtype")
        if isinstance(shape, list) and all(isinstance(d, int) for d in shape) and dtype in DTYPE_SIZES:
            running = 8 * DTYPE_SIZES[dtype]
            for d in shape:
                running *= d
                if running > U64_MAX:
                    return True
    return False


def check_against_library(blob: bytes, scratch: Path) -> Layout | None:
    """Our parser on a whole file, held to the library (see the module docstring). Our layout, or None."""
    try:
        ours: Layout | SafetensorsError = parse_header(blob, len(blob))  # nothing but SafetensorsError
    except SafetensorsError as exc:
        ours = exc
    lib = library_layout(blob, scratch)
    header = blob[LENGTH_PREFIX:LENGTH_PREFIX + int.from_bytes(blob[:LENGTH_PREFIX], "little")]
    if currently_in_test_context():  # how often each case comes up: pytest --hypothesis-show-statistics
        event(f"ours {'rejects' if isinstance(ours, SafetensorsError) else 'accepts'}, "
              f"the library {'rejects' if lib is None else 'accepts'}")
    if isinstance(ours, SafetensorsError):
        assert lib is None or stricter_on_purpose(header, ours), f"we reject ({ours}) what the library accepts"
        return None
    if lib is None:
        assert lenient_on_purpose(header), f"we accept what the library rejects: {header[:300]!r}"
        return ours
    assert {t.name: (t.start, t.end) for t in ours.tensors} == {n: (s, e) for n, (s, e, _, _) in lib.items()}
    assert ours.data_start == LENGTH_PREFIX + ours.header_len and ours.data_end == len(blob)
    for name, (start, end, dtype, shape) in lib.items():
        assert dtype in DTYPE_SIZES, name
        if dtype not in SUB_BYTE_DTYPES:
            assert end - start == math.prod(shape) * DTYPE_SIZES[dtype], name
    return ours


NUMPY_DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "float16", "int32", "uint32", "float32", "int64",
                "uint64", "float64"]


@settings(max_examples=100, deadline=None)
@given(tensors=st.dictionaries(st.text(min_size=1, max_size=8),
                               st.tuples(st.sampled_from(NUMPY_DTYPES), st.lists(st.integers(0, 4), max_size=3)),
                               max_size=6),
       metadata=st.none() | st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3))
def test_files_the_library_writes_parse_to_the_library_layout(scratch: Path, tensors: dict,
                                                              metadata: dict | None) -> None:
    arrays = {name: np.arange(math.prod(shape), dtype=np.uint8).astype(dtype).reshape(shape)
              for name, (dtype, shape) in tensors.items()}
    blob = save(arrays, metadata=metadata)
    # safetensors 0.8 writes '{},"__metadata__":{}}' for no tensors and empty metadata, which it cannot read.
    assume(arrays or metadata != {})
    layout = check_against_library(blob, scratch)
    assert layout is not None and {t.name for t in layout.tensors} == set(arrays)


@settings(max_examples=300, deadline=None)
@given(blob=st.binary(max_size=300), size=st.integers(min_value=0, max_value=1 << 40))
def test_fuzz_only_our_error_comes_out(scratch: Path, blob: bytes, size: int) -> None:
    try:
        layout = parse_header(blob, size)  # `blob` as the head of a file of `size` bytes
    except SafetensorsError:
        pass
    else:  # the tensors tile the data region, up to the end of the file
        position = layout.data_start
        for t in layout.tensors:
            assert t.start == position
            position = t.end
        assert position == layout.data_end == size
    check_against_library(blob, scratch)  # `blob` as a whole file


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_fuzz_mutated_real_headers(scratch: Path, data: st.DataObject) -> None:
    blob = bytearray(save({"a": np.zeros((3, 4), np.float32), "b": np.ones(7, np.int16)}))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] = data.draw(st.integers(0, 255))
    layout = check_against_library(bytes(blob), scratch)
    if layout is not None:
        assert layout.data_end == len(blob)


JSON_SCALARS = st.none() | st.booleans() | st.integers(-3, 2**64 + 1) | st.floats(width=16) | st.text(max_size=3)
ODD_DTYPES = ["F8_E4M3FNUZ", "F8_E5M2FNUZ", "ZZ", "f32", ""]


def fault(draw: st.DrawFn, *kinds: str) -> str | None:
    """One of `kinds` one time in 4, else None: about a third of the blobs are valid."""
    return draw(st.sampled_from(kinds)) if draw(st.integers(0, 3)) == 0 else None


@st.composite
def headers(draw: st.DrawFn) -> bytes:
    """Whole files whose headers are nearly right: tensors laid out one after the other, with now and then
    a wrong dtype, shape, byte count, offset, field or name, odd metadata, stray bytes around the JSON, a
    wrong header length or a data region a byte off."""
    entries: list[tuple[str, object]] = []
    position = 0
    for i in range(draw(st.integers(0, 4))):
        bad = fault(draw, "dtype", "shape", "nbytes", "start", "offsets", "fields", "entry", "name")
        dtype = draw(st.sampled_from(ODD_DTYPES) | JSON_SCALARS) if bad == "dtype" \
            else draw(st.sampled_from(sorted(DTYPE_SIZES)))
        shape = draw(JSON_SCALARS | st.lists(JSON_SCALARS | st.integers(-2, 2), max_size=3)) if bad == "shape" \
            else draw(st.lists(st.integers(0, 5), max_size=3))
        if isinstance(shape, list) and all(type(d) is int for d in shape):
            elements = math.prod(shape)
        else:
            elements = 1
        if dtype in SUB_BYTE_BITS:
            nbytes = (elements * SUB_BYTE_BITS[dtype] + 7) // 8
        else:
            nbytes = elements * (DTYPE_SIZES.get(dtype, 1) if isinstance(dtype, str) else 1)
        nbytes = max(0, nbytes)  # a negative dimension
        if bad == "nbytes":
            nbytes = max(0, nbytes + draw(st.sampled_from([-1, 1])))
        start = max(0, position + draw(st.sampled_from([-2, -1, 1]))) if bad == "start" else position
        offsets: object = [start, start + nbytes]
        if bad == "offsets":
            offsets = draw(st.sampled_from([[start + nbytes, start], [float(start), float(start + nbytes)],
                                            [start, start + nbytes, 0]]) | JSON_SCALARS)
        entry: object = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
        if bad == "fields":
            if draw(st.booleans()):
                del entry[draw(st.sampled_from(["dtype", "shape", "data_offsets"]))]  # type: ignore[attr-defined]
            else:
                entry["extra"] = draw(JSON_SCALARS)  # type: ignore[index]
        elif bad == "entry":
            entry = draw(JSON_SCALARS)
        name = draw(st.sampled_from(["t0", "", "\u00e9", "__metadata__"])) if bad == "name" else f"t{i}"
        entries.append((name, entry))
        position = start + nbytes
    bad = fault(draw, "metadata", "not-an-object", "before", "after", "length", "data")
    if draw(st.integers(0, 3)) == 0 or bad == "metadata":
        metadata = draw(st.dictionaries(st.text(max_size=2), st.text(max_size=2), max_size=2))
        if bad == "metadata":
            metadata = draw(JSON_SCALARS | st.dictionaries(st.text(max_size=2), JSON_SCALARS, min_size=1, max_size=2))
        entries.insert(draw(st.integers(0, len(entries))), ("__metadata__", metadata))
    # Written by hand, so a name given twice stays twice in the text.
    raw = ("{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in entries) + "}").encode()
    if bad == "not-an-object":
        raw = json.dumps(draw(JSON_SCALARS | st.lists(JSON_SCALARS, max_size=2))).encode()
    elif bad == "before":
        raw = draw(st.sampled_from([b" ", b"\n", b"x"])) + raw
    elif bad == "after":
        raw += draw(st.sampled_from([b"  ", b"\0", b"}"]))
    length = len(raw) + draw(st.sampled_from([-1, 1, 10**9])) if bad == "length" else len(raw)
    data_len = max(0, position + draw(st.sampled_from([-1, 1]))) if bad == "data" else position
    # Up to KBs, so not drawn byte by byte; a huge shape gets a file far too short for it.
    data = random.Random(draw(st.integers(0, 2**32))).randbytes(min(data_len, 1 << 16))
    return struct.pack("<Q", max(0, length)) + raw + data


@settings(max_examples=800, deadline=None)
@given(headers())
def test_fuzz_headers_against_the_library(scratch: Path, blob: bytes) -> None:
    check_against_library(blob, scratch)


def entry(dtype: object, shape: object, offsets: object) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


@pytest.mark.parametrize("header, data_len, we_accept", [
    pytest.param(b" " + json.dumps({"a": entry("U8", [2], [0, 2])}).encode(), 2, False, id="leading-space"),
    pytest.param(json.dumps({"a": entry("F4", [2], [0, 2])}).encode(), 2, True, id="sub-byte-size-unchecked"),
    pytest.param(b'{"\\ud800": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}', 0, True,
                 id="lone-surrogate"),
    pytest.param(b'{"a": {"dtype": "U8", "shape": [2], "shape": [2], "data_offsets": [0, 2]}}', 2, True,
                 id="field-twice"),
    pytest.param(b'{"a": {"dtype": "ZZ", "shape": [2], "data_offsets": [0, 2]}, '
                 b'"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}', 2, True, id="tensor-twice"),
    pytest.param(b'{"a": {"dtype": "U8", "shape": [-0], "data_offsets": [0, 0]}}', 0, True, id="minus-zero"),
    pytest.param(b'{"a": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0], "x": NaN}}', 0, True, id="nan"),
    pytest.param(json.dumps({"a": entry("U8", [2**40, 2**40, 0], [0, 0])}).encode(), 0, True,
                 id="shape-overflows-u64"),
])
def test_known_differences_from_the_library(scratch: Path, header: bytes, data_len: int, we_accept: bool) -> None:
    """Each difference `check_against_library` allows, on one example. The library does take the other side
    (safetensors 0.8): once it no longer does, that allowance can go."""
    blob = struct.pack("<Q", len(header)) + header + b"\0" * data_len
    assert (check_against_library(blob, scratch) is not None) == we_accept
    assert (library_layout(blob, scratch) is not None) != we_accept, "the library agrees with us now"


def test_null_metadata_is_no_metadata_as_the_library_reads_it() -> None:
    header = json.dumps({"a": entry("U8", [2], [0, 2]), "__metadata__": None}).encode()
    blob = struct.pack("<Q", len(header)) + header + b"\0\0"
    assert [t.name for t in parse_header(blob, len(blob)).tensors] == ["a"]


# -- hostile headers ---------------------------------------------------------------------------------


def test_a_shape_of_many_huge_dimensions_is_rejected_in_linear_time() -> None:
    """A 2 MB header of one shape of 100,000 dimensions of 2**62: its whole product took ~20 s to build (quadratic
    in the header); multiplied only until it exceeds the tensor's bytes, it is rejected in milliseconds."""
    import time

    blob = make({"t": {"dtype": "U8", "shape": [2**62] * 100_000, "data_offsets": [0, 1]}}, 1)
    started = time.perf_counter()
    with pytest.raises(SafetensorsError, match="bytes for shape"):
        parse_header(blob, len(blob))
    assert time.perf_counter() - started < 2


@pytest.mark.parametrize("shape,size,accepted", [
    ([2**62, 2**62, 0], 0, True),  # a zero dimension after huge ones: 0 elements
    ([0, 2**62], 0, True),
    ([3, 5, 7], 105, True),
    ([3, 5, 7], 104, False),
    ([2**62, 2**62, 0], 1, False),
])
def test_the_size_check_agrees_with_the_whole_product(shape: list[int], size: int, accepted: bool) -> None:
    blob = make({"t": {"dtype": "U8", "shape": shape, "data_offsets": [0, size]}}, size)
    if accepted:
        assert parse_header(blob, len(blob)).data_end == len(blob)
    else:
        with pytest.raises(SafetensorsError, match="bytes for shape"):
            parse_header(blob, len(blob))


@pytest.mark.parametrize("header", [
    {"t": {"dtype": "U8", "shape": [0] * 500_000, "data_offsets": [0, 1]}},  # its shape quoted
    {"t" * 500_000: {"dtype": "U8", "shape": [2], "data_offsets": [0, 1]}},  # its name
    {"t" * 500_000: []},
    {"t": {"dtype": [["x" * 1000] * 30] * 30, "shape": [1], "data_offsets": [0, 1]}},  # its dtype
], ids=["shape", "name", "entry", "dtype"])
def test_a_rejection_quotes_a_hostile_name_dtype_or_shape_cut_short(header: dict) -> None:
    """The daemon logs the reason and keeps it (streaming.NOT_STREAMED_KEPT of them): quoted whole, a shape of 3
    million dimensions made a 9 MB log line."""
    blob = make(header, 1)
    with pytest.raises(SafetensorsError) as rejected:
        parse_header(blob, len(blob))
    assert len(str(rejected.value)) < 300, str(rejected.value)[:300]
