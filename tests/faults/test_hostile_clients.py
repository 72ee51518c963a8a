"""Hostile and careless clients of the control API: nothing is
read before the token is checked, no body is read past the limit, bad input is a 4xx with the
error model, never a 500; the SDK rides out 429s."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import httpx
import pytest

from kvferry.client import Client
from kvferry.engine import errors
from tests.engine.conftest import TOKEN, kv, spawn, stop  # noqa: F401 (kv is a fixture)

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def daemon():
    d = spawn("tcp", {"KVFERRY_MAX_BODY_BYTES": str(1 << 20), "KVFERRY_MAX_REGION_BYTES": str(64 << 20),
                      "KVFERRY_MAX_CONCURRENT_TRANSFERS": "2"})
    yield d
    stop(d)


def _chunked_post(port: int, path: str, headers: dict[str, str], chunks: int, chunk: bytes) -> tuple[int, bytes, int]:
    """A raw chunked POST; returns (status, body, chunks the server let us send before answering)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        s.sendall(head.encode())
        sent = 0
        s.settimeout(0.05)
        reply = b""
        for _ in range(chunks):
            try:
                s.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                sent += 1
                reply += s.recv(65536)
                if reply:
                    break
            except socket.timeout:
                continue
            except OSError:
                break
        s.settimeout(10)
        if not reply:
            try:
                s.sendall(b"0\r\n\r\n")
            except OSError:
                pass
        while b"\r\n\r\n" not in reply:
            more = s.recv(65536)
            if not more:
                break
            reply += more
        head, _, body = reply.partition(b"\r\n\r\n")
        status = int(head.split()[1])
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0)
        while len(body) < length:
            body += s.recv(65536)
    return status, body, sent


def test_chunked_body_without_a_token_is_refused_before_it_is_read(daemon):
    port = int(daemon.url.rsplit(":", 1)[1])
    status, body, sent = _chunked_post(port, "/v1/regions/x/blocks/0", {}, 200, b"\0" * 65536)
    assert status == 401 and json.loads(body)["error"] == "Unauthorized"
    assert sent < 200  # answered while the client was still sending


def test_chunked_body_over_the_limit_is_refused_unread(daemon):
    port = int(daemon.url.rsplit(":", 1)[1])
    status, body, _ = _chunked_post(port, "/v1/codebooks/big", AUTH, 64, b"\0" * 65536)  # 4 MiB > 1 MiB
    assert status == 413 and json.loads(body)["error"] == "PayloadTooLarge"
    ok = httpx.put(f"{daemon.url}/v1/codebooks/small", headers=AUTH, content=b"{}")  # small bodies still pass
    assert ok.status_code == 400


@pytest.mark.parametrize("body", [
    {"name": "huge", "num_blocks": 1024, "block_shape": [1 << 30], "dtype": "bfloat16"},
    {"name": "t", "num_blocks": True, "block_shape": [4], "dtype": "bfloat16"},
    {"name": "s", "num_blocks": 1, "block_shape": ["4"], "dtype": "bfloat16"},
    {"name": "e", "kind": "shm", "shm_name": "someone-elses-segment", "num_blocks": 1, "block_shape": [4],
     "dtype": "bfloat16"},
    {"name": "e2", "kind": "shm", "shm_name": "kvferry-../../etc", "num_blocks": 1, "block_shape": [4],
     "dtype": "bfloat16"},
])
def test_bad_regions_are_4xx_with_the_error_model(daemon, body):
    response = httpx.post(f"{daemon.url}/v1/regions", headers=AUTH, json=body)
    assert 400 <= response.status_code < 500, response.text
    assert set(response.json()) >= {"error", "detail"}
    if body["name"] == "huge":
        assert response.status_code == 413 and "max_region_bytes" in response.json()["detail"]


@pytest.mark.parametrize("text", ["[" * 100000 + "]" * 100000, '{"format": "kvferry-codebook", "version": 1, '
                                  '"dtype": "bfloat16", "exponents": [1e400]}', "\xff\xfe", "null"])
def test_bad_codebooks_are_400(daemon, text):
    response = httpx.put(f"{daemon.url}/v1/codebooks/bad", headers=AUTH, content=text.encode("utf-8", "surrogatepass"))
    assert response.status_code == 400, response.text


@pytest.mark.parametrize("name", ["x%20y", "a" * 200, "a%0Ab", "%C3%A9%E2%80%AE", ".hidden"])
def test_a_lease_names_a_region_as_a_region_is_named(daemon, name):
    """A lease taken ``of`` a region creates a view named as the path says: held to the names a
    region may have (no spaces, newlines or controls to reach the logs)."""
    httpx.post(f"{daemon.url}/v1/regions", headers=AUTH,
               json={"name": "base", "num_blocks": 2, "block_shape": [4], "dtype": "bfloat16"})
    response = httpx.put(f"{daemon.url}/v1/leases/{name}", headers=AUTH, json={"seconds": 5, "of": "base"})
    assert response.status_code == 422 and response.json()["error"] == "BadRequest", response.text
    assert [r["name"] for r in httpx.get(f"{daemon.url}/v1/regions", headers=AUTH).json()] == ["base"]
    httpx.delete(f"{daemon.url}/v1/regions/base", headers=AUTH)


@pytest.mark.parametrize("name", ["bad%0A"])
def test_a_codebook_name_ends_where_the_name_ends(daemon, name):
    document = '{"format": "kvferry-codebook", "version": 1, "dtype": "bfloat16"}'
    response = httpx.put(f"{daemon.url}/v1/codebooks/{name}", headers=AUTH, content=document.encode())
    assert response.status_code == 400 and "name" in response.json()["detail"], response.text


@pytest.mark.parametrize("ids", [[True], ["1"], [1.5], [-1]])
def test_block_ids_are_strict(daemon, ids):
    response = httpx.post(f"{daemon.url}/v1/transfers", headers=AUTH, json={
        "src_region": "a", "dst_region": "b", "src_blocks": ids, "dst_blocks": [0], "peer": "127.0.0.1:1"})
    assert response.status_code == 422 and response.json()["error"] == "BadRequest"


def test_the_transfer_routes_fast_lane_answers_as_fastapi_does(daemon):
    """``POST /v1/transfers`` and ``GET /v1/transfers/{id}`` are served before FastAPI's router
    (``api.app.Lane``); what the lane does not take goes on to FastAPI: the same errors either way."""
    body = {"src_region": "nope", "dst_region": "b", "src_blocks": [0], "dst_blocks": [0], "peer": "127.0.0.1:1"}
    json_type = {**AUTH, "Content-Type": "application/json"}
    for params in ({}, {"wait": 1}):  # the lane: the engine's own error
        response = httpx.post(f"{daemon.url}/v1/transfers", headers=AUTH, params=params, json=body)
        assert response.status_code == 404 and response.json()["error"] == "NotFound", response.text
    for content in (b"{not json", b'{"peer": "127.0.0.1:1"}', json.dumps({**body, "extra": [True]}).encode()[:-3]):
        response = httpx.post(f"{daemon.url}/v1/transfers", headers=json_type, content=content)
        assert response.status_code == 422 and response.json()["error"] == "BadRequest", response.text
    for query in ("wait=301", "wait=-1", "wait=nan", "wait=abc", "wait=1&wait=2", "other=1"):
        response = httpx.post(f"{daemon.url}/v1/transfers?{query}", headers=AUTH, json=body)
        expected = 404 if query in ("other=1", "wait=1&wait=2") else 422  # FastAPI: unknown keys ignored, the last wait
        assert response.status_code == expected and set(response.json()) >= {"error", "detail"}, (query, response.text)
    response = httpx.get(f"{daemon.url}/v1/transfers/{'0' * 32}", headers=AUTH, params={"wait": 0.01})
    assert response.status_code == 404 and response.json()["error"] == "NotFound"
    response = httpx.get(f"{daemon.url}/v1/transfers/{'0' * 32}", params={"wait": "x"}, headers=AUTH)
    assert response.status_code == 422
    assert httpx.get(f"{daemon.url}/v1/transfers/{'0' * 32}").status_code == 401  # Guard stands before the lane


def test_openapi_documents_security_and_every_error(daemon):
    schema = httpx.get(f"{daemon.url}/openapi.json").json()
    assert "HTTPBearer" in schema["components"]["securitySchemes"]
    statuses = set(schema["paths"]["/v1/transfers"]["post"]["responses"])
    assert {"400", "401", "404", "409", "413", "422", "429", "502"} <= statuses
    assert httpx.get(f"{daemon.url}/docs").status_code == 404  # no Swagger UI from a CDN


def test_a_calibration_does_not_hold_up_the_sidecar(daemon):
    """A codebook calibrated on 64 MiB of blocks takes seconds of CPU: it runs beside the event
    loop, which answers meanwhile (the health check comes back before the calibration does)."""
    daemon.client.create_region("sample", 4096, [2, 16, 128], "bfloat16")
    finished = {}

    def calibrate():
        response = httpx.post(f"{daemon.url}/v1/codebooks/big/calibrate", headers=AUTH, timeout=120,
                              json={"codec": "lowrank", "region": "sample", "blocks": {"ranges": [{"start": 0, "count": 4096}]}})
        finished["calibrate"] = (time.monotonic(), response.status_code)

    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            calibrating = pool.submit(calibrate)
            time.sleep(0.3)
            assert httpx.get(f"{daemon.url}/healthz", timeout=60).status_code == 200
            answered = time.monotonic()
            calibrating.result()
        assert finished["calibrate"][1] == 200
        assert answered < finished["calibrate"][0]
    finally:
        daemon.client.delete_region("sample")


def test_the_sdk_rides_out_429s(daemon, kv):
    peer = spawn("tcp")
    try:
        daemon.client.region_from_tensor("src429", kv[:8])
        peer.client.create_region("dst429", 8, list(kv.shape[1:]), "bfloat16")
        target = peer.client.data_address()

        def one(i: int) -> str:
            with Client(daemon.url, token=TOKEN) as c:
                return c.wait(c.submit("src429", [i % 8], target, "dst429", [i % 8], codec="raw"), timeout=60)["state"]

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            states = list(pool.map(one, range(24)))
        assert states == ["done"] * 24  # at most 2 in progress at once: the rest waited their turn
        with pytest.raises(errors.NotFound):
            daemon.client.region("nope")
    finally:
        stop(peer)
