"""A synthetic S3 directory for the fault proxy: a set of keys under one prefix that it lists
(ListObjectsV2, paginated, url-encoded or not) and serves (HEAD, ranged GET with If-Match) itself, with
deterministic bodies (`synthetic_body`). Keys may be any bytes, valid UTF-8 or not. A body is computed a
range at a time (`synthetic_range`), so objects may be far larger than memory (a 6 GiB shard costs nothing
until read); a GET without a range of one larger than WHOLE_GET_MAX is refused.
"""

from __future__ import annotations

import hashlib
import urllib.parse
from collections.abc import Iterable
from xml.sax.saxutils import escape as xml_escape

from fsmount.testing.http_wire import Request, Response, error_response

#: ListObjectsV2 page size when the client does not ask for less (S3's maximum).
LIST_PAGE_MAX = 1000
#: Bodies are made of blocks this long, each its own function of the key and its index.
BLOCK = 4096
#: The largest object a GET without a range gets whole.
WHOLE_GET_MAX = 64 * 1024 * 1024


def synthetic_range(key: bytes, size: int, lo: int, hi: int) -> bytes:
    """Bytes [lo, hi) of a key served by `serve_directory` (cut to `size`): block i (BLOCK bytes) is
    shake_256(key, i), so a byte read from the wrong offset, even 1 byte off, is never the right one."""
    hi = min(hi, size)
    if lo >= hi:
        return b""
    first, last = lo // BLOCK, (hi - 1) // BLOCK
    blocks = b"".join(hashlib.shake_256(key + b"\0" + i.to_bytes(8, "little")).digest(BLOCK)
                      for i in range(first, last + 1))
    return blocks[lo - first * BLOCK:hi - first * BLOCK]


def synthetic_body(key: bytes, size: int) -> bytes:
    """The whole body of a key served by `serve_directory`."""
    return synthetic_range(key, size, 0, size)


class SyntheticDirectory:
    """Keys (bytes, sorted as S3 sorts: by UTF-8 bytes) that the proxy lists and serves itself."""

    def __init__(self, bucket: str, prefix: bytes, names: Iterable[bytes], size: int):
        self.bucket = bucket
        self.prefix = prefix
        self.size = size
        self.keys = sorted({prefix + n for n in names})
        self._key_set = set(self.keys)
        self._pages: dict[tuple[bytes, bytes], list[tuple[bool, bytes]]] = {}

    def holds(self, key: bytes) -> bool:
        return key in self._key_set

    def answers_listing(self, prefix: bytes) -> bool:
        return prefix.startswith(self.prefix)

    def etag(self, key: bytes) -> str:
        # Any stable value will do: clients compare ETags, they never recompute them.
        return '"' + hashlib.md5(key + b"\0" + str(self.size).encode()).hexdigest() + '"'

    def entries(self, prefix: bytes, delimiter: bytes) -> list[tuple[bool, bytes]]:
        """(is_common_prefix, key or prefix) in listing order, memoised per (prefix, delimiter)."""
        cached = self._pages.get((prefix, delimiter))
        if cached is not None:
            return cached
        out: list[tuple[bool, bytes]] = []
        seen: set[bytes] = set()
        for key in self.keys:
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix):]
            if delimiter and delimiter in rest:
                common = prefix + rest[:rest.index(delimiter) + len(delimiter)]
                if common not in seen:
                    seen.add(common)
                    out.append((True, common))
            else:
                out.append((False, key))
        out.sort(key=lambda e: e[1])
        self._pages[(prefix, delimiter)] = out
        return out


def list_response(d: SyntheticDirectory, query: dict[str, str]) -> Response:
    prefix = query.get("prefix", "").encode("utf-8", "surrogateescape")
    delimiter = query.get("delimiter", "").encode("utf-8", "surrogateescape")
    encode = query.get("encoding-type") == "url"
    max_keys = max(0, min(LIST_PAGE_MAX, int(query.get("max-keys") or LIST_PAGE_MAX)))
    token = query.get("continuation-token")
    start = int(token.removeprefix("synthetic-")) if token else 0
    entries = d.entries(prefix, delimiter)
    page = entries[start:start + max_keys]
    truncated = start + max_keys < len(entries)

    def text(raw: bytes) -> str:
        if encode:
            return urllib.parse.quote(raw, safe="/")
        return xml_escape(raw.decode("utf-8", "replace"))

    parts = ['<?xml version="1.0" encoding="UTF-8"?>\n'
             '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">',
             f"<Name>{xml_escape(d.bucket)}</Name><Prefix>{text(prefix)}</Prefix>",
             f"<KeyCount>{len(page)}</KeyCount><MaxKeys>{max_keys}</MaxKeys>"]
    if delimiter:
        parts.append(f"<Delimiter>{text(delimiter)}</Delimiter>")
    if encode:
        parts.append("<EncodingType>url</EncodingType>")
    parts.append(f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>")
    if token:
        parts.append(f"<ContinuationToken>{xml_escape(token)}</ContinuationToken>")
    if truncated:
        parts.append(f"<NextContinuationToken>synthetic-{start + max_keys}</NextContinuationToken>")
    for is_prefix, raw in page:
        if is_prefix:
            parts.append(f"<CommonPrefixes><Prefix>{text(raw)}</Prefix></CommonPrefixes>")
        else:
            parts.append(f"<Contents><Key>{text(raw)}</Key><LastModified>2026-01-01T00:00:00.000Z</LastModified>"
                         f"<ETag>{xml_escape(d.etag(raw))}</ETag><Size>{d.size}</Size>"
                         "<StorageClass>STANDARD</StorageClass></Contents>")
    parts.append("</ListBucketResult>")
    return Response(200, "OK", [("Content-Type", "application/xml")], "".join(parts).encode())


def object_response(d: SyntheticDirectory, key: bytes, req: Request) -> Response:
    etag = d.etag(key)
    if_match = req.header("if-match")
    if if_match is not None and if_match not in ("*", etag):
        return error_response(412, "PreconditionFailed")
    headers: list[tuple[str, str]] = [("ETag", etag), ("Last-Modified", "Thu, 01 Jan 2026 00:00:00 GMT"),
                                      ("Accept-Ranges", "bytes"), ("Content-Type", "application/octet-stream")]
    if req.method == "HEAD":
        return Response(200, "OK", headers, b"", d.size)
    byte_range = parse_range(req.header("range"), d.size)
    if byte_range is None:
        if d.size > WHOLE_GET_MAX:
            return error_response(400, "InvalidRequest")
        return Response(200, "OK", headers, synthetic_body(key, d.size))
    lo, hi = byte_range
    headers.append(("Content-Range", f"bytes {lo}-{hi - 1}/{d.size}"))
    return Response(206, "Partial Content", headers, synthetic_range(key, d.size, lo, hi))


def parse_range(value: str | None, size: int) -> tuple[int, int] | None:
    """[lo, hi) of a single `bytes=a-b` range, clipped to the size; None: no (usable) range."""
    if not value or not value.startswith("bytes=") or "," in value:
        return None
    first, _, last = value[len("bytes="):].partition("-")
    if not first:
        return None
    lo = int(first)
    hi = min(size, int(last) + 1) if last else size
    return (lo, hi) if lo < hi else None
