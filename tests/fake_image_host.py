"""A hostile remote image host on a real local socket, for the URL-fetching tests: `/hang` reads the request and
never answers, `/trickle` sends its response headers one byte every `trickle_s` (each byte well inside any read
timeout, the whole far beyond the fetch's deadline). Not one of our parts: a stand-in for someone else's server."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

TRICKLE = b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nX-Padding: " + b"a" * 200 + b"\r\n\r\n"


class HostileHost:
    def __init__(self, trickle_s: float = 0.5) -> None:
        self.trickle_s = trickle_s
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._clients: list[socket.socket] = []
        self.requests = 0  # requests that reached it (their headers read)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed by stop()
                return
            self._clients.append(conn)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            request = b""
            while b"\r\n\r\n" not in request:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                request += chunk
            self.requests += 1
            if request.startswith(b"GET /trickle"):
                for byte in TRICKLE:
                    if self._stop.wait(self.trickle_s):
                        return
                    conn.sendall(bytes([byte]))
            self._stop.wait()  # /hang (and a trickle that ran out): hold the connection open
        except OSError:  # the fetcher gave up and closed its end
            return

    def start(self) -> HostileHost:
        threading.Thread(target=self._serve, daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._listener.close()
        for conn in self._clients:
            conn.close()


@contextmanager
def hostile_host(trickle_s: float = 0.5) -> Iterator[HostileHost]:
    host = HostileHost(trickle_s).start()
    try:
        yield host
    finally:
        host.stop()


def wait_for_requests(host: HostileHost, count: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while host.requests < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"only {host.requests} of {count} fetches reached the host")
        time.sleep(0.05)
