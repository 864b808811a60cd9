"""safetensors header parsing and validation, for planning the model streaming of the data region.

Pure functions over bytes: they never do I/O and never raise anything but `SafetensorsError`; a bad
header only means "no model streaming", never a failed read.
"""

from __future__ import annotations

import dataclasses
import json
import reprlib

# The format's own limit (safetensors rejects headers of 100 MB or more).
MAX_HEADER_LEN = 100_000_000
LENGTH_PREFIX = 8
# Bytes of dtype per element, for checking that data_offsets agree with shape (safetensors' dtypes).
# Every dtype of safetensors 0.8 (a file with any other gets no model streaming; the library rejects it).
DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "F8_E4M3FNUZ": 1,
               "F8_E5M2FNUZ": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
               "I64": 8, "U64": 8, "F64": 8, "C64": 8, "F4": 1, "F6_E2M3": 1, "F6_E3M2": 1}
SUB_BYTE_DTYPES = {"F4", "F6_E2M3", "F6_E3M2"}
# How much of a tensor's name, dtype or shape a rejection quotes. Quoted whole, the shape of a 6 MB header (3
# million dimensions) made a 9 MB log line, and the daemon keeps each reason (streaming.NOT_STREAMED_KEPT of them).
QUOTED_CHARS = 100
_QUOTE = reprlib.Repr()
_QUOTE.maxstring = _QUOTE.maxother = _QUOTE.maxlong = QUOTED_CHARS
_QUOTE.maxlist = _QUOTE.maxdict = 8
_QUOTE.maxlevel = 2


class SafetensorsError(ValueError):
    """The bytes are not a valid safetensors header."""


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    start: int  # absolute file offsets
    end: int


@dataclasses.dataclass(frozen=True)
class Layout:
    header_len: int
    data_start: int
    tensors: tuple[Tensor, ...]  # sorted by offset

    @property
    def data_end(self) -> int:
        return self.tensors[-1].end if self.tensors else self.data_start


def header_length(prefix: bytes, file_size: int) -> int:
    """N from the first 8 bytes, checked against the limits and the file size."""
    if len(prefix) < LENGTH_PREFIX or file_size < LENGTH_PREFIX:
        raise SafetensorsError("file too short for a safetensors header")
    n = int.from_bytes(prefix[:LENGTH_PREFIX], "little")
    if n < 2 or n >= MAX_HEADER_LEN:
        raise SafetensorsError(f"header length {n} out of range")
    if LENGTH_PREFIX + n > file_size:
        raise SafetensorsError(f"header length {n} exceeds file size {file_size}")
    return n


def parse_header(data: bytes, file_size: int) -> Layout:
    """Validate `data` (the first 8 + N bytes of a file of `file_size` bytes) as a safetensors header."""
    n = header_length(data, file_size)
    raw = data[LENGTH_PREFIX:LENGTH_PREFIX + n]
    if len(raw) < n:
        raise SafetensorsError("header truncated")
    if raw[:1] != b"{":
        raise SafetensorsError("header does not start with '{'")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise SafetensorsError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise SafetensorsError("header is not a JSON object")
    data_start = LENGTH_PREFIX + n
    tensors = []
    for name, entry in header.items():
        if name == "__metadata__":
            # null is none (the library takes it: an Option), as an absent one is.
            if entry is not None and (not isinstance(entry, dict) or not all(isinstance(v, str)
                                                                              for v in entry.values())):
                raise SafetensorsError("__metadata__ must map strings to strings")
            continue
        tensors.append(_tensor(name, entry, data_start))
    tensors.sort(key=lambda t: (t.start, t.end))
    position = data_start
    for t in tensors:
        if t.start != position:
            raise SafetensorsError(f"tensor {_quoted(t.name)} leaves a hole or overlaps at offset {t.start}")
        position = t.end
    if position != file_size:
        raise SafetensorsError(f"data ends at {position}, file size is {file_size}")
    return Layout(n, data_start, tuple(tensors))


def _quoted(value: object) -> str:
    """repr(value), cut to QUOTED_CHARS, without building the whole repr (reprlib: a list's first elements, a
    string's ends)."""
    text = _QUOTE.repr(value)
    return text if len(text) <= QUOTED_CHARS else text[:QUOTED_CHARS - 3] + "..."


def _tensor(name: str, entry: object, data_start: int) -> Tensor:
    if not isinstance(entry, dict):
        raise SafetensorsError(f"tensor {_quoted(name)}: entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise SafetensorsError(f"tensor {_quoted(name)}: unknown dtype {_quoted(dtype)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise SafetensorsError(f"tensor {_quoted(name)}: bad shape")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise SafetensorsError(f"tensor {_quoted(name)}: bad data_offsets")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise SafetensorsError(f"tensor {_quoted(name)}: data_offsets out of order")
    size = end - begin
    # Multiplied only while the product is within the tensor's bytes: a hostile shape of 100,000 dimensions of
    # 2**62 (a 2 MB header) grew one bigint by 62 bits per dimension, quadratic, ~20 s of CPU to reject (10 MB:
    # ~8 min). A zero dimension makes any product 0, so it is looked for first.
    elements = 0 if 0 in shape else 1
    if elements:
        for d in shape:
            elements *= d
            if elements > size:
                break  # more elements than bytes already: the check below fails, as with the whole product
    # Sub-byte dtypes pack elements in ways that vary by version; only byte dtypes are size-checked.
    if dtype not in SUB_BYTE_DTYPES and size != elements * DTYPE_SIZES[dtype]:
        raise SafetensorsError(f"tensor {_quoted(name)}: {size} bytes for shape {_quoted(shape)} of {dtype}")
    return Tensor(name, data_start + begin, data_start + end)
