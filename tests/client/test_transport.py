"""The SDK's HTTP/1.1 client against real sockets: kept-alive connections reused and replaced
when the server closed them, bodies whole or an error, and every failure an httpx error (what
callers catch)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from kvferry.client import Client
from kvferry.engine import errors
from kvferry.client.transport import KeepAlive, NotWarm

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


class _Plain:
    """``KeepAlive`` with ``get`` (the SDK's own calls check statuses, which these tests do not)."""

    def __init__(self, port: int, timeout: float = 2.0):
        self.lean, self.timeout = KeepAlive("127.0.0.1", port), timeout

    def get(self, target: str):
        return self.lean.request("GET", target, timeout=self.timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.lean.close()


def _client(server: Server, timeout: float = 2.0) -> _Plain:
    return _Plain(server.port, timeout)


def test_one_connection_carries_many_requests_and_their_bodies():
    def script(server, conn, _):
        while server.read_request(conn):
            conn.sendall(OK)
    server = Server(script)
    with Client(f"http://127.0.0.1:{server.port}/", token="t", timeout=2) as client:
        for i in range(5):
            response = client._call("POST", "/v1/transfers", params={"wait": 1}, json={"i": i})
            assert response.status_code == 200 and response.json() == {}
    assert server.connections == 1
    assert server.requests[3].startswith(b"POST /v1/transfers?wait=1 HTTP/1.1\r\n")
    head = server.requests[3].lower()
    assert b"\r\nauthorization: bearer t\r\n" in head and f"\r\nhost: 127.0.0.1:{server.port}\r\n".encode() in head
    assert b"\r\ncontent-type: application/json\r\n" in head and b"\r\ncontent-length: 7\r\n" in head
    assert server.requests[3].endswith(b'{"i":3}')
    server.close()


def test_paths_are_percent_encoded_and_headers_cannot_be_injected():
    def script(server, conn, _):
        while server.read_request(conn):
            conn.sendall(OK)
    server = Server(script)
    with Client(f"http://127.0.0.1:{server.port}/pre%20fix", timeout=2) as client:
        client._call("GET", "/v1/regions/a b?c\r\nX: y")
    assert server.requests[0].startswith(b"GET /pre%20fix/v1/regions/a%20b%3Fc%0D%0AX%3A%20y HTTP/1.1\r\n")
    server.close()
    with pytest.raises(ValueError, match="would break the request"):
        Client("http://127.0.0.1:1", token="t\r\nX-Evil: 1")


def test_chunked_bodies_are_read_whole_and_interim_responses_skipped():
    chunked = (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"3;ext=1\r\n{\"a\r\n5\r\n\": 1}\r\n0\r\nTrailer: x\r\n\r\n")

    def script(server, conn, _):
        while server.read_request(conn):
            conn.sendall(chunked)
    server = Server(script)
    with _client(server) as client:
        for _ in range(2):
            reply = client.get("/chunked")
            assert reply.status_code == 200 and reply.json() == {"a": 1}
            assert reply.headers["transfer-encoding"] == "chunked"
    assert server.connections == 1
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
    with _Plain(port) as client:
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

    for cut_at in (10, 30, len(OK) - 1):  # in the status line, in the headers, in the body
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

    for bad in (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nno length",
                b"SMTP ready\r\n\r\n", b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"):
        def broken(server, conn, _, reply=bad):
            server.read_request(conn)
            conn.sendall(reply)
            conn.close()
        server = Server(broken)
        with _client(server) as client:
            with pytest.raises(httpx.RemoteProtocolError):
                client.get("/broken")
        server.close()



def _reply(status: str, body: bytes) -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body


def test_a_request_sent_now_is_answered_later_on_another_thread():
    """``Client.send_later``: the request is at the server before ``result`` is called, the answer
    is read on another thread (a 503 tried again, an error raised as the engine's class), and the
    connection goes back for the next request, whichever thread sends it."""
    answers = [_reply("503 Service Unavailable", b'{"error":"Overloaded","detail":"starting"}'),
               _reply("200 OK", b'{"id":"t","state":"done"}'),
               _reply("404 Not Found", b'{"error":"NotFound","detail":"no region named \'lease\'"}')]

    def script(server, conn, _):
        while server.read_request(conn):
            conn.sendall(answers[len(server.requests) - 1])
    server = Server(script)
    with Client(f"http://127.0.0.1:{server.port}", timeout=2) as client:
        answer = client.send_later("lease", [1, 2], "127.0.0.1:9", "cache", [3, 4], codec="raw", wait=5)
        deadline = time.monotonic() + 2
        while not server.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(server.requests) == 1 and server.requests[0].startswith(b"POST /v1/transfers?wait=5 HTTP/1.1")
        results = []
        reader = threading.Thread(target=lambda: results.append(answer.result()))
        reader.start()
        reader.join(5)
        assert results == [{"id": "t", "state": "done"}] and len(server.requests) == 2
        with pytest.raises(RuntimeError, match="read already"):
            answer.result()  # never a second transfer
        with pytest.raises(errors.NotFound, match="no region named"):
            client.send_later("lease", [1], "127.0.0.1:9", "cache", [3], wait=5).result()
    assert server.connections == 1
    server.close()


def test_warm_only_sends_on_an_open_connection_or_nothing():
    """``warm_only`` (an engine's step) never connects: with no idle connection nothing is sent;
    with one, the request goes on it and its answer is read later with the call's own timeout."""
    def script(server, conn, _):
        with conn:
            while server.read_request(conn):
                time.sleep(0.3)  # longer than a warm write may take: the read has its own timeout
                conn.sendall(OK)

    server = Server(script)
    try:
        with _client(server) as client:
            with pytest.raises(NotWarm):
                client.lean.send("GET", "/cold", timeout=2.0, warm_only=True)
            assert server.connections == 0 and server.requests == []
            assert client.get("/first").json() == {}  # opens the connection, left idle
            exchange = client.lean.send("GET", "/warm", timeout=2.0, warm_only=True)
            assert exchange.response().json() == {} and server.connections == 1
            assert [r.split(b" ")[1] for r in server.requests] == [b"/first", b"/warm"]
    finally:
        server.close()


def test_warm_only_over_https_is_refused_not_sent():
    client = Client("https://127.0.0.1:9", timeout=1)
    try:
        with pytest.raises(NotWarm):
            client.send_later("kv", [0], "127.0.0.1:1", "kv", [1], wait=0, warm_only=True)
        with pytest.raises(NotWarm):
            client.transfer_later("0" * 32, wait=1, warm_only=True)
    finally:
        client.close()
