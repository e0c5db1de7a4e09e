"""A TCP proxy on loopback in front of a real server (the S3 server, Redis), for faults a
test needs at an exact moment: it passes bytes both ways as they come, and on demand holds
what a client sends from the first occurrence of a pattern (the request line of one kind of
request: an S3 PUT of an index object) until released, holds every reply (a client that
stops reading), or delays replies (every one, or those of one kind: a slow server).  Nothing in the
bytes is changed."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

CHUNK = 1 << 16


class GateProxy:
    """``GateProxy(port)``: clients connect to :attr:`port` instead of the server's."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._pattern: bytes | None = None
        self._open = threading.Event()
        self._open.set()
        self._replies_open = threading.Event()
        self._replies_open.set()
        self.held = threading.Event()  # set once a client's bytes are held at the pattern
        self.reply_delay_s = 0.0
        self.delayed_replies = b""  # delay only replies that start so (b"": every one)
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def hold(self, pattern: bytes) -> None:
        """From now on, hold a client's bytes at the first ``pattern`` (and everything it
        sends after it) until :meth:`release`."""
        self.held.clear()
        self._pattern = pattern
        self._open.clear()

    def hold_replies(self) -> None:
        """From now on read nothing more from the server (its sends fill the sockets' buffers
        and then wait, as for a client that stopped reading) until :meth:`release`."""
        self._replies_open.clear()

    def release(self) -> None:
        self._pattern = None
        self._open.set()
        self._replies_open.set()

    def close(self) -> None:
        """Stop: the listener refuses connections from now on, and those open are cut."""
        self._closed = True
        self.release()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self._listener.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> GateProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._closed:
                client.close()
                return
            try:
                server = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            self._sockets += [client, server]
            threading.Thread(target=self._requests, args=(client, server), daemon=True).start()
            threading.Thread(target=self._replies, args=(server, client), daemon=True).start()

    def _requests(self, src: socket.socket, dst: socket.socket) -> None:
        tail = b""
        try:
            while data := src.recv(CHUNK):
                pattern = self._pattern
                if pattern is not None:
                    seen = tail + data
                    at = seen.find(pattern)
                    if at >= 0:
                        before = max(at - len(tail), 0)
                        dst.sendall(data[:before])
                        data = data[before:]
                        self.held.set()
                        self._open.wait()
                    tail = seen[-len(pattern) :]
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close_both(src, dst)

    def _replies(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while self._replies_open.wait() and (data := src.recv(CHUNK)):
                if self.reply_delay_s and data.startswith(self.delayed_replies):
                    time.sleep(self.reply_delay_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close_both(src, dst)


def _close_both(*sockets: socket.socket) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
