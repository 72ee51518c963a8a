"""Bits flipped between two sidecars: a proxy that corrupts one byte of the
stream. The transfer fails with a typed reason, nothing corrupt is written or reported done, the
receiver counts it, and the next transfer is bit-exact."""

from __future__ import annotations

import socket
import threading

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvferry.engine import errors
from tests.conftest import bits_equal
from tests.engine.conftest import kv, spawn, stop  # noqa: F401 (kv is a fixture)

pytestmark = pytest.mark.slow


class FlippingProxy:
    """Forwards one connection to ``upstream``; flips byte ``at`` of the client → server stream."""

    def __init__(self, upstream: str, at: int):
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.at = at
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, flip: bool) -> None:
        seen = 0
        try:
            while data := source.recv(1 << 16):
                if flip and seen <= self.at < seen + len(data):
                    data = bytearray(data)
                    data[self.at - seen] ^= 0x10
                seen += len(data)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


def _errors(client) -> dict[str, float]:
    families = {f.name: f for f in text_string_to_metric_families(client.metrics())}
    return {s.labels["kind"]: s.value for s in families["kvferry_errors"].samples if s.name.endswith("_total")}


def test_a_flipped_bit_fails_the_transfer_and_writes_nothing(kv):
    a, b = spawn("tcp", {"KVFERRY_TRANSFER_TIMEOUT": "10"}), spawn("tcp", {"KVFERRY_TRANSFER_TIMEOUT": "10"})
    proxy = FlippingProxy(b.data, at=(3 << 20) + 12345)  # inside the first 4 MiB chunk's payload
    try:
        a.client.region_from_tensor("src", kv)
        b.client.create_region("dst", 60, list(kv.shape[1:]), "bfloat16")
        transfer = a.client.submit("src", range(60), proxy.address, "dst", range(60), codec="raw")
        with pytest.raises(errors.TransferFailed) as failed:
            a.client.wait(transfer, timeout=30)
        assert "CorruptPayload" in failed.value.reason or "authentication" in failed.value.reason, failed.value.reason
        incoming = b.client.transfer(transfer, wait=30)
        assert incoming["state"] == "failed" and incoming["error_kind"] == "CorruptPayload", incoming
        assert incoming["blocks_done"] < 60
        assert _errors(b.client).get("CorruptPayload", 0) >= 1
        first = torch.frombuffer(bytearray(b.client.get_block("dst", 0)), dtype=torch.uint8)
        assert not first.any()  # the corrupt first chunk never reached the blocks
        again = a.client.submit("src", range(60), b.data, "dst", range(60), codec="splitzip")
        assert a.client.wait(again, timeout=60)["state"] == "done"
        got = torch.stack([torch.frombuffer(bytearray(b.client.get_block("dst", i)), dtype=torch.bfloat16)
                           .view(kv.shape[1:]) for i in range(60)])
        assert bits_equal(got, kv)
    finally:
        proxy.close()
        stop(a, b)
