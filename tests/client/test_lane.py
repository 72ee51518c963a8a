"""The control lane against real sidecar processes: transfers submitted and awaited over it are
bit-exact and answered as over HTTP (records, errors, statuses), a wrong token or a hostile
client is refused without harm to the sidecar, and a sidecar without a lane is spoken to in HTTP."""

from __future__ import annotations

import socket
import uuid

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvferry.client import Client
from kvferry.client.lane import LaneKeepAlive
from kvferry.engine import errors, lane
from tests.conftest import bits_equal
from tests.engine.conftest import TOKEN, spawn, stop

pytestmark = pytest.mark.slow


def _name() -> str:
    return f"r{uuid.uuid4().hex[:10]}"


def _counter(client: Client, family: str, method: str) -> float:
    for f in text_string_to_metric_families(client.metrics()):
        if f.name == family:
            return sum(s.value for s in f.samples if s.name.endswith("_total") and s.labels.get("method") == method)
    return 0.0


def _regions(a, b, blocks: int = 6) -> tuple[str, str, torch.Tensor]:
    data = torch.randn(blocks, 2, 512, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    special = [0x7FC0, -0x8000, 0x7F80, -0x80, 0x0001]  # NaN, -0, Inf, -Inf, a subnormal
    data.view(torch.int16)[0, 0, :5] = torch.tensor(special, dtype=torch.int16)
    src, dst = _name(), _name()
    a.client.region_from_tensor(src, data)
    b.client.create_region(dst, blocks, [2, 512], "bfloat16")
    return src, dst, data


def _read(client: Client, region: str, ids: list[int], like: torch.Tensor) -> torch.Tensor:
    raw = b"".join(client.get_block(region, i) for i in ids)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(like.dtype).view(len(ids), *like.shape[1:])


def test_transfers_are_submitted_and_awaited_over_the_lane(sidecars):
    a, b = sidecars
    src, dst, data = _regions(a, b)
    http_before = _counter(a.client, "kvferry_http_requests", "POST")
    lane_before = _counter(a.client, "kvferry_lane_requests", "POST")
    record = a.client.send(src, [0, 1, 2], b.data, dst, [5, 3, 1], codec="raw", wait=10)
    assert a.client.lane_port == a.client.health()["lane_port"] > 0
    assert record["state"] == "done" and record["blocks_done"] == 3, record
    transfer = a.client.submit(src, range(3, 6), b.data, dst, [0, 2, 4], codec="splitzip")
    assert a.client.wait(transfer, timeout=10)["state"] == "done"
    assert bits_equal(_read(b.client, dst, [5, 3, 1, 0, 2, 4], data), data)
    assert _counter(a.client, "kvferry_lane_requests", "POST") == lane_before + 2
    assert _counter(a.client, "kvferry_lane_requests", "GET") >= 1
    assert _counter(a.client, "kvferry_http_requests", "POST") == http_before  # no transfer call went over HTTP


def test_answers_and_errors_match_http(sidecars):
    a, b = sidecars
    src, dst, _ = _regions(a, b)
    over_http = Client(a.url, token=TOKEN, lane=False)
    try:
        for client in (a.client, over_http):
            with pytest.raises(errors.InvalidBlocks, match="0..5"):
                client.submit(src, [0, 9], b.data, dst, [0, 1])
            with pytest.raises(errors.NotFound):
                client.submit("nope", [0], b.data, dst, [0])
            with pytest.raises(errors.BadRequest, match="codec"):  # the model's refusal (422 on both)
                client.submit(src, [0], b.data, dst, [0], codec="NOT A CODEC")
            with pytest.raises(errors.TransferFailed, match="NotFound") as failed:
                client.send(src, [0], b.data, "missing", [0], codec="raw", wait=10)
            assert failed.value.state == "failed"
            with pytest.raises(errors.NotFound):
                client.transfer(uuid.uuid4().hex, wait=0.1)
        assert over_http.lane_port is None
        ours = a.client.send(src, [1], b.data, dst, [1], codec="raw", wait=10)
        theirs = over_http.transfer(ours["id"])
        assert {k: v for k, v in ours.items()} == theirs  # the same record, whichever way it is asked for
    finally:
        over_http.close()


def test_a_wrong_token_is_refused_before_any_request(sidecars):
    a, _ = sidecars
    port = a.client.health()["lane_port"]
    wrong = LaneKeepAlive("127.0.0.1", port, "wrong-token")
    try:
        reply = wrong.send("GET", f"/v1/transfers/{uuid.uuid4().hex}").response()
        assert reply.status_code == 401 and reply.json()["error"] == "Unauthorized"
    finally:
        wrong.close()
    with pytest.raises(errors.Unauthorized):
        Client(a.url, token="wrong-token").transfer(uuid.uuid4().hex)


def test_routes_off_the_lane_are_not_served_there(sidecars):
    a, _ = sidecars
    ours = LaneKeepAlive("127.0.0.1", a.client.health()["lane_port"], TOKEN)
    try:
        reply = ours.send("GET", "/v1/regions").response()
        assert reply.status_code == 404 and "control lane serves" in reply.json()["detail"]
        reply = ours.send("GET", f"/v1/transfers/{uuid.uuid4().hex}?wait=1&x=2").response()
        assert reply.status_code == 404
    finally:
        ours.close()


def _raw(port: int, data: bytes, hello: bool = True) -> bytes:
    """What the sidecar answers to ``data`` on a fresh connection (after a good HELLO), to its close."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        if hello:
            sock.sendall(lane.pack(0, lane.Hello(TOKEN)))
            assert sock.recv(16) == lane.pack(0, lane.Welcome())
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


@pytest.mark.parametrize("data, status", [
    (b"\x10\x00\x00\x00" + b"GET / HTTP/1.1\r\n", 400),  # not a lane frame
    ((1 << 30).to_bytes(4, "little"), 413),  # a frame over the limit: refused before it is read
    (lane.pack(1, lane.Welcome()), 400),  # a sidecar's frame from a client
    (lane.pack(1, lane.Request("POST", "/v1/transfers", b"x" * 64))[:30], None),  # cut off: just closed
])
def test_hostile_clients_are_cut_off_and_the_sidecar_goes_on(sidecars, data, status):
    a, b = sidecars
    port = a.client.health()["lane_port"]
    answer = _raw(port, data)
    if status is None:
        assert answer == b""
    else:
        tag, reply = lane.unpack(answer[4:])
        assert isinstance(reply, lane.Reply) and reply.status == status, reply
    assert _raw(port, b"") == b""  # a new connection is still welcomed (``_raw`` checks the WELCOME)
    src, dst, data_ = _regions(a, b, 2)
    assert a.client.send(src, [0, 1], b.data, dst, [1, 0], codec="raw", wait=10)["state"] == "done"


def test_a_sidecar_without_a_lane_is_spoken_to_in_http():
    a, b = spawn("tcp", {"KVFERRY_LANE_PORT": "-1"}), spawn("tcp")
    try:
        assert a.client.health()["lane_port"] is None
        src, dst, data = _regions(a, b, 2)
        assert a.client.send(src, [0, 1], b.data, dst, [1, 0], codec="raw", wait=10)["state"] == "done"
        assert a.client.lane_port is None
        assert bits_equal(_read(b.client, dst, [1, 0], data), data)
    finally:
        stop(a, b)
