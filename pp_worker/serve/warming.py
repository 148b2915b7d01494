"""pp-serve's answer while its stages load and compile: every request gets a 503, ``/health`` ``{"status":
"warming"}`` and the rest OpenAI's error shape, so a client or a supervisor polling the port knows the server is
on its way rather than seeing a connection that hangs. A thread answers on the bound socket until the stages are
ready; then the HTTP app takes the same socket over.
"""

from __future__ import annotations

import json
import select
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

HEAD_LIMIT = 1 << 16  # bytes of a request's head read before answering (its body is never needed)


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
    path = head.split(b" ", 2)[1].decode(errors="replace") if head.count(b" ") >= 2 else ""
    if path.split("?")[0] == "/health":
        body = {"status": "warming"}
    else:
        body = {"error": {"message": "the model is loading and compiling; try again shortly (GET /health says when)",
                          "type": "server_error", "param": None, "code": "warming_up"}}
    data = json.dumps(body).encode()
    try:
        conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 5\r\n"
                     b"Connection: close\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    except OSError:
        pass
    finally:
        conn.close()


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
