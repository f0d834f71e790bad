"""A TCP forwarder in front of a real server (the moto S3 server) that a test can cut for a while: an outage as
clients see one. While cut, its port refuses connections and every open connection is reset; afterwards it
listens on the same port again. Threads only; :meth:`OutageProxy.close` stops them all."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time


class OutageProxy:
    """``127.0.0.1:<port>`` forwarding to ``target`` (host, port). ``url`` is what clients use."""

    def __init__(self, target: tuple[str, int], port: int = 0) -> None:
        self.target = target
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._closed = False
        self._listener = self._listen(port)
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.outages: list[tuple[float, float]] = []  # (start, end) wall-clock seconds
        self._end_now = threading.Event()
        self._accepting = threading.Thread(target=self._accept_loop, name="outage-proxy", daemon=True)
        self._accepting.start()

    @staticmethod
    def _listen(port: int) -> socket.socket:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(64)
        listener.settimeout(0.2)
        return listener

    def _accept_loop(self) -> None:
        while not self._closed:
            with self._lock:
                listener = self._listener
            if listener is None:
                time.sleep(0.05)
                continue
            try:
                client, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                if self._listener is None:  # cut while connecting
                    _reset(client)
                    _reset(upstream)
                    continue
                self._conns.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def cut(self, seconds: float) -> None:
        """Refuse and reset every connection for ``seconds`` (blocking), then serve again on the same port."""
        self._serve_after(self._begin(), seconds)

    def cut_in_background(self, seconds: float) -> threading.Thread:
        """The same, returning once the outage has begun (every connection refused from now on); its end in a
        thread (returned)."""
        start = self._begin()
        thread = threading.Thread(target=self._serve_after, args=(start, seconds), name="outage", daemon=True)
        thread.start()
        return thread

    def end(self) -> None:
        """End the outage in progress now (a test that waits for a client to give up, not for a fixed time)."""
        self._end_now.set()

    def _begin(self) -> float:
        start = time.time()
        self._end_now.clear()
        self._drop()
        return start

    def _serve_after(self, start: float, seconds: float) -> None:
        self._end_now.wait(max(0.0, start + seconds - time.time()))
        with self._lock:
            self._listener = self._listen(self.port)
        self.outages.append((start, time.time()))

    def close(self) -> None:
        self._closed = True
        self._drop()
        self._accepting.join(timeout=5)

    def _drop(self) -> None:
        """Stop listening and reset every open connection."""
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, set()
        if listener is not None:
            listener.close()
        for conn in conns:
            _reset(conn)


def _reset(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0), as a vanished endpoint looks to the client."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()
