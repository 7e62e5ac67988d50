"""Servers the shard tests start on 127.0.0.1: an HTTP file server with Range support and injected
faults, and moto's S3 server. Each is a context manager that stops its server (and wakes any request
it is delaying) on exit, so no test leaves a thread or a port behind.
"""
from __future__ import annotations

import contextlib
import os
import socket
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Faults:
    """What the HTTP server does wrong, counted over the requests (GET and HEAD) it receives.

    ``fail_first`` requests get ``status`` (500); the ``drop_first`` GETs after them send their headers
    and half the body, then close the connection; ``short_first`` GETs answer a valid 206 for only the
    first half of the range asked; every request waits ``delay`` seconds first (``delay_first``: only
    that many). A count of -1 means every request. ``stall``: every GET sends half its body, waits that
    many seconds (a download in progress, its file open), then sends the rest. ``trickle``: every GET
    sends its body in 10 pieces over that many seconds (a slow link whose bytes keep coming).
    """

    fail_first: int = 0
    status: int = 500
    drop_first: int = 0
    short_first: int = 0
    delay: float = 0.0
    delay_first: int = -1
    stall: float = 0.0
    trickle: float = 0.0


@dataclass
class HTTPShardServer:
    """A folder served over HTTP; ``requests`` lists ``(method, path, range header)`` as received."""

    root: str
    faults: Faults = field(default_factory=Faults)
    requests: list = field(default_factory=list)
    url: str = ""

    def __post_init__(self):
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._seen = {"fail": 0, "drop": 0, "short": 0, "delay": 0}

    def count(self, path_suffix: str = "", method: str | None = None) -> int:
        """Requests whose path ends with ``path_suffix`` (and whose method is ``method``)."""
        with self._lock:
            return sum(1 for m, p, _ in self.requests if p.endswith(path_suffix) and method in (None, m))

    def _take(self, kind: str, limit: int) -> bool:
        """Whether this request gets fault ``kind`` (the first ``limit`` that reach it do)."""
        with self._lock:
            if limit == -1 or self._seen[kind] < limit:
                self._seen[kind] += 1
                return True
            return False


def _handler(server: HTTPShardServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"   # one request per connection: a dropped connection is one request

        def log_message(self, *args):    # the tests count requests; stderr stays quiet
            pass

        def do_HEAD(self):
            self._serve(body=False)

        def do_GET(self):
            self._serve(body=True)

        def _serve(self, body: bool):
            rng = self.headers.get("Range")
            path = self.path.split("?", 1)[0]
            with server._lock:
                server.requests.append((self.command, path, rng))
            f = server.faults
            if f.delay and server._take("delay", f.delay_first):
                if server._stop.wait(f.delay):
                    return
            if f.fail_first and server._take("fail", f.fail_first):
                return self._send_status(f.status)
            local = os.path.join(server.root, *[p for p in path.split("/") if p])
            if ".." in path.split("/") or not os.path.isfile(local):
                return self._send_status(404)
            with open(local, "rb") as fh:
                data = fh.read()
            size, start, end, partial = len(data), 0, len(data), False
            if rng:
                spec = rng.strip().removeprefix("bytes=")
                first, _, last = spec.partition("-")
                if first == "":
                    start, end = max(0, size - int(last)), size
                else:
                    start, end = int(first), (min(size, int(last) + 1) if last else size)
                if start >= size or end <= start:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                partial = True
            if body and f.short_first and server._take("short", f.short_first):
                end = start + max(1, (end - start) // 2)      # a consistent, shorter answer
            chunk = data[start:end]
            self.send_response(206 if partial else 200)
            if partial:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            self.send_header("Content-Length", str(len(chunk)))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Type", "application/octet-stream")
            self.end_headers()
            if not body:
                return
            if f.drop_first and server._take("drop", f.drop_first):
                self.wfile.write(chunk[: len(chunk) // 2])
                self.wfile.flush()
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)
                return
            if f.stall:
                self.wfile.write(chunk[: len(chunk) // 2])
                self.wfile.flush()
                if server._stop.wait(f.stall):
                    return
                chunk = chunk[len(chunk) // 2:]
            if f.trickle:
                step = max(1, -(-len(chunk) // 10))
                for k in range(0, len(chunk), step):
                    self.wfile.write(chunk[k:k + step])
                    self.wfile.flush()
                    if server._stop.wait(f.trickle / 10):
                        return
                return
            self.wfile.write(chunk)

        def _send_status(self, status: int):
            message = f"injected {status}\n".encode() if status != 404 else b"not found\n"
            self.send_response(status)
            self.send_header("Content-Length", str(len(message)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(message)

    return Handler


@contextlib.contextmanager
def http_server(root, faults: Faults | None = None):
    """Serve folder ``root`` on 127.0.0.1 (a free port) for the duration of the block."""
    server = HTTPShardServer(str(root), faults or Faults())
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(server))
    httpd.daemon_threads = True
    server.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server._stop.set()          # delayed requests return at once
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


S3_KEYS = {"key": "testing", "secret": "testing"}


@contextlib.contextmanager
def s3_server(bucket: str | None = None, files: dict | None = None):
    """moto's S3 server on 127.0.0.1 with ``bucket`` holding ``files`` ({key: bytes}); yields
    ``(s3://bucket URL, storage_options)`` for s3fs. Credentials are moto's dummies."""
    import logging

    from conftest import require

    s3fs = require("s3fs")   # missing: skips naming the 'shards' extra, or fails in CI
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)   # one log line per request otherwise

    # moto keeps buckets in process-wide state: a fresh name per server, so tests do not see each other's.
    bucket = bucket or f"shards-{uuid.uuid4().hex[:12]}"
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        # No region_name: s3fs would send it as the bucket's LocationConstraint, which us-east-1 refuses.
        options = {"client_kwargs": {"endpoint_url": f"http://{host}:{port}"}, **S3_KEYS}
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
        fs.mkdir(bucket)
        for key, data in (files or {}).items():
            fs.pipe_file(f"{bucket}/{key}", data)
        yield f"s3://{bucket}", options
    finally:
        server.stop()
