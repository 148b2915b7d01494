"""A GGUF over HTTP(S), fetched one stage's share at a time: the header by ranged GETs that grow until it parses,
then only the byte ranges of the tensors the stage reads, into a sparse cache file laid out like the original, so
the loader reads offsets from it as from a local file.

Cache: ``$PP_CACHE_DIR``, else ``$XDG_CACHE_HOME/pp_worker``, else ``~/.cache/pp_worker``. A model's files are
named after the URL's file name and a hash of (URL, size, ETag): ``NAME-KEY.gguf``, sparse, of the original's size,
``NAME-KEY.json``, the record of the byte ranges it holds (and ``NAME-KEY.json.lock``). A range is recorded once
its bytes are written and flushed, so a download cut short goes on from there at the next start (a range half
written is fetched again); a file changed on the server (another size or ETag) gets a cache of its own. Stages on
one machine share the cache: their writes are of the same bytes, and the record is merged under a lock.

Every reply's size is checked (Content-Range and Content-Length against the range asked for, then the bytes that
arrive): a mismatch is a `ModelLoadError` naming both. A transfer cut short or a 5xx is retried (``TRIES`` in all).
A server that ignores Range (200 instead of 206) gets one full download, with a warning on stderr. Standard
library only (urllib).
"""

from __future__ import annotations

import fcntl
import hashlib
import http.client
import json
import os
import re
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from pp_worker.worker.cachedir import cache_dir
from pp_worker.worker.gguf.header import GGUFHeader, HeaderTruncated, ModelLoadError, read_header

FIRST_RANGE = 1 << 14  # the header's first request; it doubles until the header parses (a vocabulary can be MBs)
CHUNK = 1 << 23  # 8 MiB: the largest request, the unit of the record (what an interruption loses) and of a retry
GAP = 1 << 12  # tensors this close are fetched in one request, the padding between them included
TRIES = 3
RETRY_S = 0.5  # the wait before the second try; doubled before each later one
TIMEOUT_S = 60.0  # per socket operation
PROGRESS_S = 1.0  # at most one `loading` event a second while downloading
Range = tuple[int, int]  # [start, end) in bytes


class _Retry(Exception):
    """A failure another try may not have: a transfer cut short, a connection refused or reset, an HTTP 5xx."""


def is_url(model: str) -> bool:
    return model.startswith(("http://", "https://"))


# ---------------------------------------------------------------- byte ranges


def merge(ranges: Iterable[Range], gap: int = 0) -> list[Range]:
    """Sorted, non-empty, with the ranges that overlap, touch or lie within ``gap`` bytes of each other joined."""
    out: list[list[int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def missing(ranges: list[Range], have: list[Range]) -> list[Range]:
    """The parts of ``ranges`` that ``have`` does not cover (both merged)."""
    out = []
    for a, b in ranges:
        for c, d in have:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
        if a < b:
            out.append((a, b))
    return out


def pieces(ranges: list[Range], size: int) -> list[Range]:
    """Each range cut into consecutive pieces of at most ``size`` bytes."""
    return [(s, min(s + size, b)) for a, b in ranges for s in range(a, b, size)]


# ---------------------------------------------------------------- the file


class RemoteFile:
    """The GGUF at ``url`` and its cache file: `open` checks the file on the server and parses its header, `ensure`
    makes any byte ranges present. ``emit(kind, **fields)`` gets the `loading` events of a download."""

    def __init__(self, url: str, emit: Callable[..., None] = lambda kind, **fields: None, cache: Path | None = None):
        self.url, self.emit, self.cache = url, emit, cache or cache_dir()
        self.size, self.etag = 0, ""  # set by `open`: the file's size and version on the server
        self.path = self._record = Path()
        self.have: list[Range] = []  # the byte ranges the cache file holds

    def open(self) -> GGUFHeader:
        """The header, parsed from the cache file (with ``ensure``: this object's), fetched as far as needed."""
        self._tries(self._first, "the first bytes")
        while True:
            available = self.have[0][1] if self.have and self.have[0][0] == 0 else 0
            try:
                header = read_header(self.path, available)
                break
            except HeaderTruncated as e:
                if e.needed > self.size:  # a header that reads past the file: malformed or truncated
                    raise ModelLoadError(f"{e} (the cache of {self.url})") from None
                self._fetch(missing([(available, min(self.size, max(2 * available, e.needed)))], self.have))
            except ModelLoadError as e:
                raise ModelLoadError(f"{e} (the cache of {self.url})") from None
        header.ensure = self.ensure
        return header

    def ensure(self, ranges: list[Range]) -> None:
        """Make the bytes of ``ranges`` present, fetching what the cache lacks (ranges within ``GAP`` of each other
        in one request); `loading` events report the bytes fetched, ``bytes_done`` of ``bytes_total``, at most one a
        second and one at the end."""
        want = merge(ranges)
        if missing(want, self.have):
            self._reload()  # another stage on this machine may have fetched some meanwhile
            self._fetch(missing(merge(want, GAP), self.have), progress=True)

    # --- requests

    def _first(self) -> None:
        """The first bytes: the file's size and version, hence its cache; a server without Range sends it all."""
        with self._get(0, FIRST_RANGE) as r:
            if r.status == 206:
                start, end, size = _content_range(r, self.url)
                if (start, end) != (0, min(FIRST_RANGE, size)):
                    raise ModelLoadError(f"{self.url}: asked for bytes 0-{FIRST_RANGE - 1}, the server sent "
                                         f"{start}-{end - 1} of {size}")
                self._attach(size, _etag(r))
                if missing([(0, end)], self.have):
                    self._write(r, 0, end)
            elif r.status == 200:
                self._whole(r)
            else:
                raise ModelLoadError(f"{self.url}: HTTP {r.status} to a Range request (expected 206 or 200)")

    def _fetch(self, ranges: list[Range], progress: bool = False) -> None:
        todo = pieces(ranges, CHUNK)
        total, done, shown = sum(b - a for a, b in todo), 0, 0.0
        for a, b in todo:
            if progress and time.monotonic() - shown >= PROGRESS_S:
                shown = time.monotonic()
                self.emit("loading", bytes_done=done, bytes_total=total)
            self._tries(lambda a=a, b=b: self._fetch_one(a, b), f"bytes {a}-{b - 1}")
            done += b - a
        if progress and todo:
            self.emit("loading", bytes_done=done, bytes_total=total)

    def _fetch_one(self, a: int, b: int) -> None:
        with self._get(a, b) as r:
            if r.status != 206:
                raise ModelLoadError(f"{self.url}: asked for bytes {a}-{b - 1}, got HTTP {r.status} instead of 206 "
                                     f"(the file changed on the server, or it stopped serving ranges)")
            if _content_range(r, self.url) != (a, b, self.size) or _etag(r) not in ("", self.etag):
                raise ModelLoadError(f"{self.url}: asked for bytes {a}-{b - 1} of {self.size} (ETag {self.etag!r}), "
                                     f"the server sent {r.headers.get('Content-Range')!r} (ETag {_etag(r)!r}): not "
                                     f"what was asked for; if the file changed on the server, start again to fetch "
                                     f"the new one")
            self._write(r, a, b)

    def _get(self, a: int, b: int) -> http.client.HTTPResponse:
        """The response to a GET of bytes [a, b); a 4xx is a ModelLoadError, a failure worth retrying a _Retry."""
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={a}-{b - 1}", "User-Agent": "pp_worker",
                                                            "Accept-Encoding": "identity"})
        try:
            r = urllib.request.urlopen(request, timeout=TIMEOUT_S)
        except urllib.error.HTTPError as e:
            if e.code >= 500 or e.code == 429:
                raise _Retry(f"HTTP {e.code} {e.reason}") from None
            raise ModelLoadError(f"could not fetch {self.url}: HTTP {e.code} {e.reason}") from None
        except (OSError, http.client.HTTPException) as e:  # URLError: refused, no route, no such host; a timeout
            raise _Retry(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from None
        return r

    def _tries(self, work: Callable[[], None], what: str) -> None:
        for attempt in range(TRIES):
            try:
                return work()
            except _Retry as e:
                failure = e
            if attempt + 1 < TRIES:
                time.sleep(RETRY_S * 2 ** attempt)
        then = f"what was fetched is kept in {self.path}, and the next start goes on from there" if self.size else \
            "a local .gguf path works too"
        raise ModelLoadError(f"could not fetch {what} of {self.url}: {failure} ({TRIES} tries); {then}")

    # --- the cache

    def _attach(self, size: int, etag: str) -> None:
        """The cache files of this (URL, size, ETag): created (the data file sparse, of the file's size) if new."""
        self.size, self.etag = size, etag
        key = hashlib.sha256(f"{self.url}\n{size}\n{etag}".encode()).hexdigest()[:16]
        name = re.sub(r"[^A-Za-z0-9._-]", "_", Path(urllib.parse.urlparse(self.url).path).stem)[:80] or "model"
        self.cache.mkdir(parents=True, exist_ok=True)
        self.path, self._record = self.cache / f"{name}-{key}.gguf", self.cache / f"{name}-{key}.json"
        with self._locked():
            if not self.path.exists():
                self._record.unlink(missing_ok=True)  # a record without its data file records nothing
            with open(self.path, "ab") as f:
                if f.tell() < size:
                    f.truncate(size)  # a hole: no disk space until the bytes arrive
            self.have = self._read_record()

    def _write(self, r: http.client.HTTPResponse, a: int, b: int) -> None:
        """The body of ``r`` (bytes [a, b) of the file) into the cache file, flushed to disk, then recorded."""
        length = r.headers.get("Content-Length")
        if length is not None and length.strip() != str(b - a):
            raise ModelLoadError(f"{self.url}: bytes {a}-{b - 1} are {b - a} bytes, the server announced {length}")
        with open(self.path, "r+b") as f:
            f.seek(a)
            _copy(r, f, b - a)
            f.flush()
            os.fsync(f.fileno())
        self._note([(a, b)])

    def _whole(self, r: http.client.HTTPResponse) -> None:
        """A server that ignores Range: the whole body into a new file that then replaces the cache file (unless
        the cache holds the whole file already)."""
        length = (r.headers.get("Content-Length") or "").strip()
        size = int(length) if length.isdigit() else None
        if size is not None:
            self._attach(size, _etag(r))
            if not missing([(0, size)], self.have):
                return
        if size is None or size > FIRST_RANGE:  # not merely a file shorter than the first range, sent whole
            print(f"pp_worker: {self.url} ignores Range requests (HTTP 200 to one): downloading the whole file "
                  f"({size if size is not None else 'unknown'} bytes) instead of this stage's share",
                  file=sys.stderr, flush=True)
        self.cache.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=self.cache, prefix=".download-", delete=False) as f:
            try:
                got = _copy(r, f, size, lambda n: self.emit("loading", bytes_done=n, bytes_total=size or n))
                f.flush()
                os.fsync(f.fileno())
            except BaseException:
                os.unlink(f.name)
                raise
        if size is None:
            self._attach(got, _etag(r))
        os.replace(f.name, self.path)
        self._note([(0, got)])

    def _reload(self) -> None:
        with self._locked():
            self.have = merge(self.have + self._read_record())

    def _note(self, ranges: list[Range]) -> None:
        """Record ``ranges`` as present, merged with what other stages recorded meanwhile (atomically replaced)."""
        with self._locked():
            self.have = merge(self.have + self._read_record() + ranges)
            record = {"url": self.url, "size": self.size, "etag": self.etag, "have": self.have}
            tmp = self._record.with_name(self._record.name + ".tmp")
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self._record)

    def _read_record(self) -> list[Range]:
        try:
            record = json.loads(self._record.read_text())
            if (record["url"], record["size"], record["etag"]) == (self.url, self.size, self.etag):
                return merge((int(a), int(b)) for a, b in record["have"] if 0 <= a <= b <= self.size)
        except (OSError, ValueError, KeyError, TypeError):  # none yet, or unreadable: nothing is known to be there
            pass
        return []

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self._record.with_name(self._record.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield


def _copy(r: http.client.HTTPResponse, f: BinaryIO, n: int | None,
          progress: Callable[[int], None] | None = None) -> int:
    """Exactly ``n`` bytes of ``r``'s body (all of it when None) into ``f``; the number copied. A body that ends
    early, or a connection that fails, is a _Retry; one that goes on past ``n`` a ModelLoadError."""
    got, shown = 0, time.monotonic()
    while n is None or got < n:
        try:
            block = r.read(1 << 20 if n is None else min(1 << 20, n - got))
        except (OSError, http.client.HTTPException) as e:
            raise _Retry(f"the transfer failed after {got} bytes ({type(e).__name__}: {e})") from None
        if not block:
            if n is None:
                return got
            raise _Retry(f"the transfer ended after {got} of {n} bytes")
        f.write(block)
        got += len(block)
        if progress and time.monotonic() - shown >= PROGRESS_S:
            shown = time.monotonic()
            progress(got)
    if r.read(1):
        raise ModelLoadError(f"{r.url}: the server sent more than the {n} bytes it announced")
    return got


def _content_range(r: http.client.HTTPResponse, url: str) -> tuple[int, int, int]:
    """(start, end, size) of a 206's ``Content-Range: bytes START-LAST/SIZE``, end exclusive."""
    value = r.headers.get("Content-Range") or ""
    m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", value.strip())
    if not m or int(m[1]) > int(m[2]) or int(m[2]) >= int(m[3]):
        raise ModelLoadError(f"{url}: a 206 reply without a usable Content-Range (got {value!r:.80})")
    return int(m[1]), int(m[2]) + 1, int(m[3])


def _etag(r: Any) -> str:
    """The file's version as the server names it: its ETag, else its Last-Modified date ("" when neither)."""
    return r.headers.get("ETag") or r.headers.get("Last-Modified") or ""
