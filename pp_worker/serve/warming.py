"""pp-serve's answer while its stages load and compile: every request gets a 503, ``/health`` ``{"status":
"warming"}`` and the rest OpenAI's error shape, so a client or a supervisor polling the port knows the server is
on its way rather than seeing a connection that hangs. A browser asking for the chat page (``GET /`` accepting
``text/html``) gets a loading page instead (``static/loading.html``, still a 503), which reloads itself until the
chat page answers. A thread answers on the bound socket until the stages are ready; then the HTTP app takes the same
socket over.
"""

from __future__ import annotations

import json
import select
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HEAD_LIMIT = 1 << 16  # bytes of a request's head read before answering (its body is never needed)
LOADING_PAGE = (Path(__file__).resolve().parent / "static" / "loading.html").read_bytes()
# the page runs nothing and loads nothing; its one inline style block is ours, never anything a request brought
LOADING_HEADERS = (b"Content-Type: text/html; charset=utf-8\r\nContent-Security-Policy: default-src 'none'; "
                   b"style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'\r\n"
                   b"X-Content-Type-Options: nosniff\r\nReferrer-Policy: no-referrer\r\nCache-Control: no-store\r\n")


def _answer(conn: socket.socket) -> None:
    conn.settimeout(2.0)
    head = b""
    try:
        while b"\r\n\r\n" not in head and len(head) < HEAD_LIMIT:
            chunk = conn.recv(4096)
            if not chunk:
                break
            head += chunk
    except OSError:
        pass
    if not head:  # a browser's spare connection, opened ahead of a request: an answer would be taken for the next one's
        conn.close()
        return
    headers, data = _reply(head)
    try:
        conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\n" + headers + b"Retry-After: 5\r\nConnection: close\r\n"
                     b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    except OSError:
        pass
    finally:
        conn.close()


def _reply(head: bytes) -> tuple[bytes, bytes]:
    """The headers (Content-Type on) and body that answer a request whose head is ``head``."""
    lines = head.split(b"\r\n")
    path = lines[0].split(b" ", 2)[1].decode(errors="replace").split("?")[0] if lines[0].count(b" ") >= 2 else ""
    accept = b",".join(line.split(b":", 1)[1] for line in lines[1:] if line.lower().startswith(b"accept:"))
    if path == "/" and b"text/html" in accept.lower():  # a browser opening the chat page
        return LOADING_HEADERS, LOADING_PAGE
    if path == "/health":
        body: dict[str, object] = {"status": "warming"}
    else:
        body = {"error": {"message": "the model is loading and compiling; try again shortly (GET /health says when)",
                          "type": "server_error", "param": None, "code": "warming_up"}}
    return b"Content-Type: application/json\r\n", json.dumps(body).encode()


@contextmanager
def warming(sock: socket.socket) -> Iterator[None]:
    """Answer every request on ``sock`` with a 503 (see the module docstring) for the duration of the block."""
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not select.select([sock], [], [], 0.2)[0]:
                continue
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, OSError):
                continue
            _answer(conn)

    sock.setblocking(False)
    thread = threading.Thread(target=serve, name="pp-serve-warming", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        sock.setblocking(True)
