"""The HTTP/1.1 wire of the test proxies: a parsed request, a response to write, reading one request
from a client connection and writing responses, resets and S3 error documents back. No policy: the
fault proxy decides what to send.
"""

from __future__ import annotations

import dataclasses
import http.client
import socket
import struct
import urllib.parse
from typing import BinaryIO
from xml.sax.saxutils import escape as xml_escape

#: Request line and header limits (a 4 KB key is ~12 KB once percent-encoded).
MAX_LINE = 64 * 1024
MAX_HEADERS = 200
#: Request bodies larger than this are refused (modelfs sends none; test uploads go to the server).
MAX_BODY = 1 << 30


@dataclasses.dataclass
class Request:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    @property
    def is_data_get(self) -> bool:
        return self.method == "GET" and self.header("range") is not None

    @property
    def kind(self) -> str:
        if self.method == "HEAD":
            return "heads"
        if self.method == "GET":
            if self.is_data_get:
                return "data_gets"
            query = urllib.parse.urlsplit(self.target).query
            return "lists" if "list-type=" in query or self.path_parts()[1] == "" else "gets"
        query = self.query()
        if self.method == "PUT" and "partNumber" in query:
            return "parts"  # UploadPart (and UploadPartCopy)
        if self.method == "POST" and "uploadId" in query:
            return "completes"  # CompleteMultipartUpload
        return "other"

    @property
    def operation(self) -> str:
        """The write request it is, finer than `kind` (whose "other" lumps them together): "put", "copy",
        "start" (CreateMultipartUpload), "part", "part_copy", "complete", "abort", "delete"; else `kind`."""
        query = self.query()
        copy = self.header("x-amz-copy-source") is not None
        if self.method == "PUT":
            if "partNumber" in query:
                return "part_copy" if copy else "part"
            return "copy" if copy else "put"
        if self.method == "POST":
            return "complete" if "uploadId" in query else "start" if "uploads" in query else self.kind
        if self.method == "DELETE":
            return "abort" if "uploadId" in query else "delete"
        return self.kind

    def path_parts(self) -> tuple[str, bytes]:
        """(bucket, key as raw bytes) of a path-style request."""
        path = urllib.parse.urlsplit(self.target).path
        bucket, _, key = path.lstrip("/").partition("/")
        return urllib.parse.unquote(bucket), urllib.parse.unquote_to_bytes(key)

    def query(self) -> dict[str, str]:
        pairs = urllib.parse.parse_qsl(urllib.parse.urlsplit(self.target).query, keep_blank_values=True)
        return dict(pairs)


@dataclasses.dataclass
class Response:
    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes
    content_length: int | None = None  # what the headers claim; None: len(body)


def read_request(rfile: BinaryIO, conn: socket.socket) -> Request | None:
    line = rfile.readline(MAX_LINE + 1)
    if not line:
        return None
    if len(line) > MAX_LINE or not line.endswith(b"\n"):
        raise ValueError("request line too long")
    method, target, version = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
    headers: list[tuple[str, str]] = []
    for _ in range(MAX_HEADERS):
        h = rfile.readline(MAX_LINE + 1)
        if h in (b"\r\n", b"\n", b""):
            break
        k, _, v = h.decode("latin-1").partition(":")
        headers.append((k.strip(), v.strip()))
    else:
        raise ValueError("too many headers")
    req = Request(method, target, version, headers, b"")
    if (req.header("transfer-encoding") or "").lower() == "chunked":
        raise ValueError("chunked request bodies are not supported")
    length = int(req.header("content-length") or 0)
    if length > MAX_BODY:
        raise ValueError("request body too large")
    if length:
        if (req.header("expect") or "").lower() == "100-continue":
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        req.body = rfile.read(length)
        if len(req.body) != length:
            raise ValueError("request body cut short")
    return req


def head_bytes(resp: Response, req: Request) -> bytes:
    length = resp.content_length if resp.content_length is not None else len(resp.body)
    lines = [f"HTTP/1.1 {resp.status} {resp.reason}"]
    lines += [f"{k}: {v}" for k, v in resp.headers]
    if not (100 <= resp.status < 200 or resp.status in (204, 304)):
        lines.append(f"Content-Length: {length}")
    lines.append("Connection: keep-alive")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def cut_head(head: bytes, after_bytes: int | None) -> bytes:
    """A response head (`head_bytes`) cut at the end of a line: the last whole line within its first `after_bytes`
    bytes, never before the status line's end (None: the status line alone), never with the blank line that ends the
    head. (A cut inside a line would leave http.client a shorter value it cannot tell from a whole one.)"""
    status_end = head.index(b"\r\n") + 2
    within = min(max(after_bytes or 0, status_end), len(head) - 2)
    return head[:head.rfind(b"\r\n", 0, within) + 2]


def send(conn: socket.socket, resp: Response, req: Request, body_end: int | None = None) -> bool:
    """Write a response (its body up to `body_end`); False if the client has gone."""
    body = b"" if req.method == "HEAD" else resp.body[:body_end]
    return send_raw(conn, head_bytes(resp, req) + body)


def send_raw(conn: socket.socket, data: bytes) -> bool:
    try:
        conn.sendall(data)
        return True
    except OSError:
        return False


def shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def reset(conn: socket.socket) -> None:
    """Abort the connection with a RST (SO_LINGER 0), as a crashed peer or a middlebox would."""
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    conn.close()


def error_response(status: int, code: str) -> Response:
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{xml_escape(code)}</Code>'
            f"<Message>injected by the fault proxy</Message><RequestId>fault-proxy</RequestId></Error>").encode()
    reason = http.client.responses.get(status, "Error")
    return Response(status, reason, [("Content-Type", "application/xml"), ("x-amz-request-id", "fault-proxy")],
                     body)
