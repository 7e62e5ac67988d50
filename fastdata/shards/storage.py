"""Where shards live: a local folder or any fsspec URL, read with retries. The only code that sees URLs.

``Storage(location)`` reads files *by name* under ``location``: ``read`` (a whole small file, the
index), ``read_range``/``read_ranges`` (byte ranges of a shard), ``size`` and ``fetch`` (a whole shard
to a local file, published by ``os.replace`` only once its size is right). A local folder is read with
plain ``os`` calls, so it works without fsspec; anything with a scheme (``http(s)://``, ``s3://``,
``gs://``, ``file://``, chained ``simplecache::s3://...``) goes through ``fsspec.core.url_to_fs``; plain
``http(s)://`` reads stream each reply with a cap (``_http_get``: a hostile server cannot make a read hold
more than it asked for), other file systems read through fsspec's ``cat_file``/``cat_ranges``.

Faults. Only transient errors are retried: a 5xx (and 408/429), a dropped connection, a timeout, a
read that returned fewer bytes than asked. Each retry waits ``backoff * 2**k`` seconds times a random
factor in [0.5, 1.5) (jitter, so the ranks of a job that failed together do not retry together), at
most 30 s; after ``retries`` retries a ``StorageError`` names the shard and the URL. A 404/NoSuchKey
(``ShardNotFound``) or a 403 is final at once: waiting does not make a missing file appear.

Credentials come only from where fsspec and boto look (environment, ``~/.aws``, ``storage_options``
passed by the caller); fastdata keeps none. Every message goes through ``redact``: user:password in a
URL and the values of its query parameters (a presigned URL's signature *is* the credential) are
never printed, including in the text of the underlying error, which is quoted rather than chained.
"""
from __future__ import annotations

import errno
import hashlib
import inspect
import os
import random
import re
import shutil
import sys
import time
import uuid

from fastdata.checks import check_integer, check_number

__all__ = ["Storage", "StorageError", "ShardNotFound", "ShardMismatch", "ShortRead", "redact", "check_name",
           "file_sha256"]

#: The retries' jitter: a generator of their own. Drawn from the global ``random``, a retry in a reading
#: thread would move the user's stream (and the draws of a batch transform seeded from it) by one
#: draw whenever the network hiccupped. Reseeded in a forked child, as the global one is, so that
#: workers retrying the same server do not wait in step.
_JITTER = random.Random()
os.register_at_fork(after_in_child=_JITTER.seed)

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+)://")
# user:password@ right after a scheme's //, and every query value: what a URL carries as credentials.
_USERINFO = re.compile(r"(//)[^/@\s'\"]+@")
_QUERY_VALUE = re.compile(r"([?&][^=&#\s'\"]+=)[^&#\s'\"]*")
_MAX_WAIT = 30.0


def is_local(location: str) -> bool:
    """Whether ``location`` is a path on this machine, not a URL (``scheme://``) or an fsspec chain (``::``)."""
    return "::" not in location and _SCHEME.match(location) is None


# errno values that mean "the network or the remote side failed this time" (s3fs maps an S3
# InternalError to EREMOTEIO and an unknown one to EIO).
_TRANSIENT_ERRNO = {errno.EIO, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED,
                    errno.EPIPE, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.EAGAIN,
                    getattr(errno, "EREMOTEIO", 121)}
# The local disk is full or read-only: not the storage's fault, and not helped by waiting; the cache
# handles it.
_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", 122), errno.EROFS}


def redact(text) -> str:
    """``text`` with the credentials a URL can carry removed: ``https://user:pass@host/x?sig=abc`` becomes
    ``https://host/x?sig=REDACTED``. Every query value is hidden, not a list of known names: presigned URLs
    (X-Amz-Signature, X-Amz-Credential, GCS/Azure ``sig``, ``token``) differ per cloud."""
    return _QUERY_VALUE.sub(r"\1REDACTED", _USERINFO.sub(r"\1", str(text)))


def check_name(name) -> str:
    """``name`` if it is a safe relative file name (``train/shard-000.tar``); ValueError otherwise.

    Shard names come from an index that may be remote and is untrusted: one that is absolute, contains
    ``..``, a backslash or a NUL would read or write outside the location or the cache folder."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"shard name {name!r}: expected a non-empty relative file name such as 'shard-000.tar'")
    parts = name.split("/")
    if (name.startswith("/") or "\\" in name or "\0" in name or ":" in parts[0]
            or any(p in ("", ".", "..") for p in parts)):
        raise ValueError(f"shard name {name!r} is refused: it must be a relative path of plain components "
                         f"(no leading '/', no '..' or '.', no empty part, no backslash, no drive or scheme), "
                         f"so that it cannot name a file outside the shard folder or the cache")
    return name


class StorageError(OSError):
    """Reading a shard failed: ``.name`` (the file), ``.url`` (redacted), ``.attempts``, ``.transient``;
    ``.errno`` and ``.status`` (HTTP) of the failure, where it had one (what a caller tells the user to do
    depends on them: a 403 is not a missing file)."""

    def __init__(self, message: str, name: str | None = None, url: str | None = None, attempts: int = 1,
                 transient: bool = False, *, code: int | None = None, status: int | None = None):
        super().__init__(message)
        self.name, self.url, self.attempts, self.transient = name, url, attempts, transient
        self.errno, self.status = code, status

    def __str__(self):
        return self.args[0] if self.args else ""

    def __reduce__(self):  # survives a trip between processes (DataLoader workers, spawn)
        return (type(self), (str(self), self.name, self.url, self.attempts, self.transient))


class ShardNotFound(StorageError, FileNotFoundError):
    """The location has no such file (404, NoSuchKey, ENOENT): final, never retried."""


class ShardMismatch(StorageError):
    """The file is not the shard the index describes (another size or sha256): the location was
    re-packed or changed under the index. Final: asking again returns the same other file."""


class ShortRead(StorageError):
    """A read returned fewer (or more) bytes than asked: transient (retried), then final."""

    def __init__(self, message: str, name: str | None = None, url: str | None = None, attempts: int = 1,
                 transient: bool = True, *, expected: int | None = None, got: int | None = None):
        super().__init__(message, name, url, attempts, transient)
        self.expected, self.got = expected, got


def _status(exc) -> int | None:
    """The HTTP status an exception carries: aiohttp's ``.status``, botocore's response metadata."""
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return status
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(code, int):
            return code
    return None


def _module_types(module: str, *names: str) -> tuple:
    """Exception classes of ``module`` if it is already imported: an error of a package nobody imported
    cannot occur, so the classification never imports aiohttp or botocore itself."""
    mod = sys.modules.get(module)
    return tuple(t for t in (getattr(mod, n, None) for n in names) if isinstance(t, type)) if mod else ()


def is_transient(exc: BaseException) -> bool:
    """Whether waiting and asking again may succeed: 5xx/408/429, dropped connections, timeouts, short
    reads. A 404, a 403, a bad argument are final."""
    if isinstance(exc, StorageError):
        return exc.transient
    if isinstance(exc, PermissionError):
        return False
    if isinstance(exc, FileNotFoundError):
        # fsspec's HTTP info() reports a HEAD and a GET that both failed as FileNotFoundError, with the
        # real reason (a 500, a refused connection) as its cause.
        cause = exc.__cause__
        return cause is not None and cause is not exc and is_transient(cause)
    status = _status(exc)
    if status is None and exc.__cause__ is not None and exc.__cause__ is not exc:
        # s3fs raises S3's errors as OSErrors caused by botocore's: a 503 SlowDown is OSError(EBUSY).
        status = _status(exc.__cause__)
    if status is not None:
        return status >= 500 or status in (408, 429)
    import asyncio

    if isinstance(exc, (TimeoutError, asyncio.TimeoutError, ConnectionError)):
        return True
    transient = (_module_types("aiohttp", "ClientConnectionError", "ClientPayloadError", "ServerTimeoutError")
                 + _module_types("botocore.exceptions", "ConnectionError", "HTTPClientError"))
    if transient and isinstance(exc, transient):
        return True
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNO


def _no_credentials(exc: BaseException) -> bool:
    """Whether ``exc`` is botocore's "found no (or half the) credentials": raised before any request."""
    missing = _module_types("botocore.exceptions", "NoCredentialsError", "PartialCredentialsError",
                            "CredentialRetrievalError")
    return bool(missing) and isinstance(exc, missing)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return redact(f"{type(exc).__name__}: {text[0] if text else '(no message)'}")


class Storage:
    """Files under one location, read with bounded retries.

    Args:
        location: a local folder, or an fsspec URL (``https://host/data``, ``s3://bucket/prefix``,
            ``gs://...``, ``file:///...``, ``simplecache::s3://...``).
        retries: how many times a transient failure is retried (0: never).
        backoff: the first wait in seconds; it doubles per retry, times a random factor in [0.5, 1.5).
        timeout: seconds a connection may take to open, and a read may wait for the next bytes, before
            it counts as a (transient) failure. Not a limit on a whole download: a big shard over a slow
            link takes as long as it takes while bytes keep coming. HTTP and S3; other file systems use
            their own settings from ``storage_options``.
        storage_options: passed to fsspec (credentials, ``client_kwargs={"endpoint_url": ...}``, ...).
            They are used, never printed.
    """

    def __init__(self, location, *, retries: int = 5, backoff: float = 0.5, timeout: float = 60.0,
                 storage_options: dict | None = None):
        self.retries = check_integer("Storage: retries", retries, minimum=0)
        self.backoff = check_number("Storage: backoff (seconds)", backoff, minimum=0)
        self.timeout = check_number("Storage: timeout (seconds)", timeout, above=0)
        self.location = os.fspath(location) if isinstance(location, os.PathLike) else str(location)
        self.storage_options = dict(storage_options or {})
        self.is_local = is_local(self.location)
        self._fs = self._root = None
        self._pid = None
        if self.is_local and not os.path.isdir(self.location):
            # A file there is most often the pack's index.json, given in place of its folder. Another file
            # (a copy of an index, a shard) is not what that folder's index.json describes: say what is read.
            folder = os.path.dirname(self.location) or "."
            if os.path.basename(self.location) == "index.json":
                what = f"is a file, not a folder: give the folder that holds it: '{folder}'"
            elif os.path.isfile(self.location):
                what = ("is a file, not a folder: a shard location is the folder `python -m fastdata pack` wrote, "
                        f"whose index.json is read ('{folder}' has " +
                        ("one)" if os.path.isfile(os.path.join(folder, "index.json")) else "none)"))
            else:
                what = "is not a folder"
            raise ShardNotFound(f"shard location '{self.location}' {what}", url=self.location)
        if not self.is_local:
            self._filesystem()   # an unknown scheme or a missing package is said now, not at the first read

    def __repr__(self):
        return f"Storage({redact(self.location)!r})"

    def __getstate__(self):
        # The file system holds a session and an event loop thread: each process builds its own.
        state = self.__dict__.copy()
        state["_fs"] = state["_root"] = state["_pid"] = None
        return state

    # -- names and URLs --------------------------------------------------------------------------

    def url(self, name: str) -> str:
        """The redacted address of ``name``: what messages print."""
        return redact(self._path(name) if self.is_local else self._join(self.location, name))

    def local_path(self, name: str) -> str | None:
        """``name``'s path when the location is a local folder (it can be read in place), else None."""
        return self._path(name) if self.is_local else None

    def _path(self, name: str) -> str:
        return os.path.join(self.location, *check_name(name).split("/"))

    @staticmethod
    def _join(base: str, name: str) -> str:
        # A location's query (an Azure SAS or CDN token for the folder) goes after each file's name:
        # appended to it, the name would land inside the token and every request would miss.
        path, mark, query = base.partition("?") if "://" in base else (base, "", "")
        return path.rstrip("/") + "/" + check_name(name) + mark + query

    def _filesystem(self):
        """(fs, root) for this process: fsspec's loop thread and HTTP session do not survive a fork."""
        if self._fs is not None and self._pid == os.getpid():
            return self._fs, self._root
        scheme = (_SCHEME.match(self.location.split("::")[-1]) or _SCHEME.match(self.location)).group(1).lower()
        try:
            import fsspec
            from fsspec.core import url_to_fs
        except ImportError:
            raise ImportError(f"shard location '{redact(self.location)}' is a URL, which is read through "
                              f"fsspec, and fsspec is not installed: pip install fastdata[shards] (fsspec, "
                              f"aiohttp for http(s)://, s3fs for s3://; gcsfs for gs://)") from None
        options = self._options(scheme)
        try:
            fs, root = url_to_fs(self.location, **options)
        except (ImportError, ValueError) as e:   # no such protocol, or its package is missing
            known = ", ".join(sorted(fsspec.available_protocols())[:16])
            package = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "http": "aiohttp",
                       "https": "aiohttp", "az": "adlfs", "abfs": "adlfs"}.get(scheme)
            hint = f"pip install {package}" if package else "install the package that provides it"
            raise ImportError(f"shard location '{redact(self.location)}': fsspec cannot open {scheme}:// "
                              f"URLs ({_describe(e)}); {hint} (pip install fastdata[shards] installs "
                              f"fsspec, aiohttp and s3fs); fsspec knows {known}, ...") from None
        if scheme in ("s3", "s3a") and isinstance(getattr(fs, "retries", None), int):
            fs.retries = 1   # s3fs's own loop: one try (see _options)
        self._fs, self._root, self._pid = fs, root.rstrip("/"), os.getpid()
        return fs, self._root

    def _options(self, scheme: str) -> dict:
        """storage_options plus this Storage's timeout where the file system takes one and the caller
        set none: aiohttp's defaults wait 5 minutes for a stalled read, botocore's a minute."""
        options = dict(self.storage_options)
        if scheme in ("http", "https"):
            try:
                import aiohttp
            except ImportError:   # fsspec itself comes with torch: this is the first import to fail
                raise ImportError(f"shard location '{redact(self.location)}' is an {scheme}:// URL, which fsspec "
                                  f"reads through aiohttp, and aiohttp is not installed: pip install "
                                  f"fastdata[shards] (fsspec, aiohttp, s3fs)") from None
            client = dict(options.get("client_kwargs") or {})
            client.setdefault("timeout", aiohttp.ClientTimeout(total=None, sock_connect=self.timeout,
                                                               sock_read=self.timeout))
            options["client_kwargs"] = client
        elif scheme in ("s3", "s3a"):
            config = dict(options.get("config_kwargs") or {})
            config.setdefault("connect_timeout", self.timeout)
            config.setdefault("read_timeout", self.timeout)
            # Our loop is the one that retries (``retries``, with its backoff): botocore's retries (4 more)
            # and s3fs's (5 tries, _filesystem) inside each of our attempts made a down endpoint cost
            # 50 connections and about a minute per attempt instead of one.
            config.setdefault("retries", {"total_max_attempts": 1})
            options["config_kwargs"] = config
            options.setdefault("skip_instance_cache", True)   # our own instance: its retries are set below
        return options

    def _remote(self, name: str):
        fs, root = self._filesystem()
        return fs, self._join(root, name)

    # -- retries ---------------------------------------------------------------------------------

    def _retry(self, what: str, name: str, attempt, subject: str | None = None):
        """``attempt()`` until it succeeds, a final error, or ``retries`` retries; errors name the file as
        ``subject`` (default ``shard 'NAME'``: the index, read here too, is not a shard)."""
        check_name(name)
        subject = subject or f"shard '{name}'"
        started = time.monotonic()
        error: Exception
        for k in range(self.retries + 1):
            try:
                return attempt()
            except OSError as e:
                if e.errno in _DISK_FULL:
                    raise          # the local disk: the caller (the cache) evicts or says how much is needed
                error = e
            except Exception as e:  # noqa: BLE001 - every file system has its own error types; classified below
                error = e
            transient = is_transient(error)
            if isinstance(error, StorageError) and not transient:
                raise error        # already names the shard and the URL
            if not transient or k >= self.retries:
                attempts = k + 1
                tail = (f" (after {attempts} attempts over {time.monotonic() - started:.1f} s)" if transient
                        else " (not retried: a missing file or a refused request does not change by waiting)")
                detail = _describe(error)
                if detail.endswith("(no message)") and isinstance(error, TimeoutError):
                    # fsspec's FSTimeoutError carries no text: say which limit ran out.
                    detail = f"{type(error).__name__}: no answer or no bytes for {self.timeout:g} s (timeout=)"
                if _no_credentials(error):
                    detail += (" (no credentials were found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                               "AWS_PROFILE or ~/.aws/credentials, or pass storage_options={'key': ..., "
                               "'secret': ...}; storage_options={'anon': True} reads a public bucket)")
                message = f"cannot {what} {subject} at {self.url(name)}: {detail}{tail}"
                # from None: the original error's text and traceback can carry the unredacted URL.
                if isinstance(error, ShortRead):
                    raise ShortRead(message, name, self.url(name), attempts, transient,
                                    expected=error.expected, got=error.got) from None
                cls = ShardNotFound if isinstance(error, FileNotFoundError) and not transient else StorageError
                code = error.errno if isinstance(error, OSError) and isinstance(error.errno, int) else None
                if code is None and (isinstance(error, PermissionError) or _no_credentials(error)):
                    # s3fs's AccessDenied carries no errno; botocore's "no credentials" is no OSError at
                    # all: both are a refusal (check the credentials), not a missing or broken file.
                    code = errno.EACCES
                raise cls(message, name, self.url(name), attempts, transient, code=code,
                          status=_status(error) or _status(error.__cause__)) from None
            wait = min(_MAX_WAIT, self.backoff * 2 ** k) * (0.5 + _JITTER.random())
            time.sleep(wait)

    def _short(self, name: str, expected: int, got: int, what: str = "read") -> ShortRead:
        more = "more" if got > expected else "fewer"
        return ShortRead(f"{what} of shard '{name}' returned {more} bytes than asked: expected {expected}, "
                         f"got {got}", name, self.url(name), expected=expected, got=got)

    # -- reads -----------------------------------------------------------------------------------

    def read(self, name: str, *, subject: str | None = None) -> bytes:
        """The whole file ``name`` (meant for small files: the index); errors call it ``subject``
        (default ``shard 'NAME'``)."""
        def attempt():
            if self.is_local:
                with open(self._path(name), "rb") as f:
                    data = f.read(MAX_READ_BYTES + 1)   # at most that much held: not a whole disk image
            else:
                fs, path = self._remote(name)
                if not _plain_http(fs):
                    return fs.cat_file(path)
                data = _http_read(fs, path, None)[0]
            if len(data) > MAX_READ_BYTES:
                raise ValueError(f"the file is larger than {MAX_READ_BYTES:,} bytes "
                                 f"(shards.storage.MAX_READ_BYTES), the most read whole")
            return data
        return self._retry("read", name, attempt, subject)

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``name``; exactly ``end - start`` of them or an error."""
        return self.read_ranges(name, [(start, end)])[0]

    def read_ranges(self, name: str, ranges) -> list[bytes]:
        """Bytes ``[start, end)`` of ``name`` for each range, in one call (concurrent requests on async
        file systems such as HTTP and S3). All ranges are retried together when one fails."""
        ranges = [(int(s), int(e)) for s, e in ranges]
        for s, e in ranges:
            if s < 0 or e < s:
                raise ValueError(f"shard '{name}': byte range ({s}, {e}) is not a range [start, end) with "
                                 f"0 <= start <= end")
        if not ranges:
            return []

        # Empty ranges are not asked for: s3fs answers an empty Range ("bytes=10-9") with the whole file.
        wanted = [(s, e) for s, e in ranges if e > s]

        def attempt():
            if not wanted:
                out = []
            elif self.is_local:
                with open(self._path(name), "rb") as f:
                    out = [os.pread(f.fileno(), e - s, s) for s, e in wanted]
            else:
                fs, path = self._remote(name)
                starts, ends = [s for s, _ in wanted], [e for _, e in wanted]
                if _plain_http(fs):   # streamed with a cap (_http_get): fsspec reads each reply whole
                    out = _http_read(fs, path, wanted)
                else:
                    kwargs = {"on_error": "raise"} if _takes(fs.cat_ranges, "on_error") else {}
                    out = fs.cat_ranges([path] * len(wanted), starts, ends, **kwargs)
            for (s, e), data in zip(wanted, out):
                if isinstance(data, BaseException):   # a file system without on_error returns errors as values
                    raise data
                if len(data) != e - s:
                    raise self._short(name, e - s, len(data), f"range [{s}, {e})")
            return dict(zip(wanted, out))
        got = self._retry("read", name, attempt)
        return [got.get((s, e), b"") for s, e in ranges]

    def size(self, name: str) -> int:
        """The size of ``name`` in bytes."""
        def attempt():
            if self.is_local:
                return os.path.getsize(self._path(name))
            fs, path = self._remote(name)
            size = fs.info(path).get("size")
            if size is None:
                raise StorageError(f"the server reports no size for shard '{name}' at {self.url(name)} "
                                   f"(no Content-Length)", name, self.url(name))
            return int(size)
        return self._retry("find the size of", name, attempt)

    def fetch(self, name: str, dest, *, size: int | None = None, sha256: str | None = None) -> str:
        """Download the whole file ``name`` to ``dest`` and return ``dest``.

        The bytes go to ``dest.tmp-<pid>-<random>`` first and are published by ``os.replace`` only once
        the file has the size it must have (``size``, else ``self.size(name)``) and, when ``sha256`` is
        given, that digest: a dropped or interrupted download never leaves a file under the final name,
        and a short one is retried. A file of another digest is a ``ShardMismatch`` (not retried: the
        location holds another shard than the index says). A full local disk (ENOSPC) is raised as the
        OSError it is, for the caller to free space.
        """
        dest = os.fspath(dest)
        expected = self.size(name) if size is None else int(size)
        tmp = f"{dest}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"

        def attempt():
            try:
                if self.is_local:
                    shutil.copyfile(self._path(name), tmp)
                else:
                    fs, path = self._remote(name)
                    fs.get_file(path, tmp)
                got = os.path.getsize(tmp)
                if got != expected:
                    raise self._short(name, expected, got, "download")
                if sha256 is not None:
                    digest = file_sha256(tmp)
                    if digest != sha256:
                        raise ShardMismatch(f"shard '{name}' at {self.url(name)} is not the shard its index "
                                            f"describes: its sha256 is {digest[:16]}..., the index says "
                                            f"{sha256[:16]}... (the location was re-packed or changed after "
                                            f"the index was read: open it again)", name, self.url(name))
            except BaseException:
                _unlink(tmp)
                raise
            os.replace(tmp, dest)
            return dest
        return self._retry("download", name, attempt)


#: The most ``read`` takes of one whole file, local or over HTTP (the index: about 40 bytes a sample).
MAX_READ_BYTES = 2**31
#: Concurrent range requests of one ``read_ranges`` call over HTTP (fsspec's cat_ranges takes 128).
_HTTP_BATCH = 64
_HTTP_PIECE = 2**20


def _plain_http(fs) -> bool:
    """Whether ``fs`` is fsspec's aiohttp file system (not a cache chained in front of it)."""
    module = sys.modules.get("fsspec.implementations.http")
    return module is not None and type(fs) is getattr(module, "HTTPFileSystem", None)


async def _http_get(fs, url: str, start: int | None, end: int, cap: int) -> bytes:
    """Up to ``cap + 1`` bytes of ``url`` (of ``[start, end)`` when ``start`` is given), read a piece at
    a time. fsspec's ``_cat_file`` reads the whole reply before anyone checks its length: a server that
    ignores Range answers a sample's range with the whole shard, and a gzip ``Content-Encoding`` (which
    aiohttp inflates) turns a few kB on the wire into any size. Here the bytes are asked unencoded and
    taken as sent, an encoded reply or a 200 to a range not from 0 is refused, and the read stops one
    byte past ``cap``, so the caller's length check says "more bytes than asked" with bounded memory."""
    kw = dict(fs.kwargs)
    headers = dict(kw.pop("headers", None) or {})
    headers["Accept-Encoding"] = "identity"
    if start is not None:
        headers["Range"] = f"bytes={start}-{end - 1}"
    session = await fs.set_session()
    async with session.get(fs.encode_url(url), headers=headers, auto_decompress=False, **kw) as r:
        if r.status == 404:   # as fsspec's own reads say it: a missing file, not retried
            raise FileNotFoundError(url)
        r.raise_for_status()   # aiohttp's ClientResponseError carries the status is_transient reads
        encoding = r.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise ValueError(f"the server sent the bytes {encoding}-encoded though asked for them as they are "
                             f"(Accept-Encoding: identity); serve the files without compression")
        limit = cap + 1
        if start is not None and r.status != 206:
            if start:
                raise ValueError(f"the server ignored the byte range asked (HTTP {r.status} instead of 206 Partial "
                                 f"Content): it does not serve ranges; serve the files from one that does")
            limit = cap   # the file from its first byte: the range asked is its beginning
        out = bytearray()
        while len(out) < limit:
            piece = await r.content.read(min(_HTTP_PIECE, limit - len(out)))
            if not piece:
                break
            out += piece
    return bytes(out)


def _http_read(fs, url: str, ranges: list[tuple[int, int]] | None) -> list[bytes]:
    """``_http_get`` of the whole file (``ranges`` None, capped at ``MAX_READ_BYTES``) or of each range,
    concurrently in batches, on fsspec's event loop."""
    import asyncio

    from fsspec.asyn import sync

    if ranges is None:
        return [sync(fs.loop, _http_get, fs, url, None, 0, MAX_READ_BYTES)]

    async def batch(part):
        return await asyncio.gather(*(_http_get(fs, url, s, e, e - s) for s, e in part))
    return [data for k in range(0, len(ranges), _HTTP_BATCH)
            for data in sync(fs.loop, batch, ranges[k:k + _HTTP_BATCH])]


def file_sha256(path, fd: int | None = None) -> str:
    """The sha256 (hex) of the file at ``path``, or of the open descriptor ``fd`` (read with ``pread``,
    so its offset is untouched), in 1 MiB blocks."""
    h = hashlib.sha256()
    own = fd is None
    if fd is None:
        fd = os.open(path, os.O_RDONLY)
    try:
        offset = 0
        while True:
            block = os.pread(fd, 2**20, offset)
            if not block:
                return h.hexdigest()
            h.update(block)
            offset += len(block)
    finally:
        if own:
            os.close(fd)


def _takes(method, keyword: str) -> bool:
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    return keyword in params


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
