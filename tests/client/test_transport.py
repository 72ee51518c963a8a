"""The SDK's HTTP/1.1 transport against real sockets: kept-alive connections reused and replaced
when the server closed them, and every failure an httpx error (what callers catch)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from kvferry.client.transport import KeepAliveTransport

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


class Server:
    """A loopback server that plays ``script(connection, index)`` for each connection it accepts."""

    def __init__(self, script):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.requests: list[bytes] = []
        self._script = script
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._script, args=(self, conn, self.connections), daemon=True).start()

    def read_request(self, conn: socket.socket) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(4096)
            if not chunk:
                return data
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length:
            body += conn.recv(4096)
        self.requests.append(head + b"\r\n\r\n" + body)
        return data

    def close(self) -> None:
        self.sock.close()


def _client(server: Server, timeout: float = 2.0) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{server.port}", transport=KeepAliveTransport(), timeout=timeout)


def test_one_connection_carries_many_requests_and_their_bodies():
    def script(server, conn, _):
        while server.read_request(conn):
            conn.sendall(OK)
    server = Server(script)
    with _client(server) as client:
        for i in range(5):
            response = client.post("/v1/transfers?wait=1", json={"i": i}, headers={"Authorization": "Bearer t"})
            assert response.status_code == 200 and response.json() == {}
    assert server.connections == 1
    assert server.requests[3].startswith(b"POST /v1/transfers?wait=1 HTTP/1.1\r\n")
    assert b"\r\nauthorization: bearer t\r\n" in server.requests[3].lower()
    assert server.requests[3].endswith(b'{"i":3}')
    server.close()


def test_a_connection_the_server_closed_while_idle_is_replaced_before_use():
    def script(server, conn, _):
        server.read_request(conn)
        conn.sendall(OK)
        conn.close()  # as uvicorn does after its keep-alive timeout
    server = Server(script)
    with _client(server) as client:
        assert client.get("/a").status_code == 200
        time.sleep(0.05)
        assert client.get("/b").status_code == 200
    assert server.connections == 2 and len(server.requests) == 2  # nothing sent twice
    server.close()


def test_failures_are_httpx_errors():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens here
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", transport=KeepAliveTransport()) as client:
        with pytest.raises(httpx.ConnectError):
            client.get("/healthz")

    def silent(server, conn, _):
        server.read_request(conn)
        time.sleep(5)
    server = Server(silent)
    with _client(server, timeout=0.3) as client:
        started = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            client.get("/slow")
        assert time.monotonic() - started < 2
    server.close()

    for cut_at in (30, len(OK) - 1):  # in the headers, in the body
        def cut(server, conn, _, at=cut_at):
            server.read_request(conn)
            conn.sendall(OK[:at])
            conn.close()
        server = Server(cut)
        with _client(server) as client:
            with pytest.raises(httpx.RemoteProtocolError):
                client.get("/cut")
            with pytest.raises(httpx.RemoteProtocolError):  # and again on a fresh connection
                client.get("/cut")
        assert server.connections == 2
        server.close()
