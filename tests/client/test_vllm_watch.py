"""The connector's decode hears its pulls' ends from a gRPC Watch on its own sidecar where it
serves gRPC (the pulls themselves go over HTTP), against real sidecars: the same
results as over HTTP (KV in place, failures reported alike), no completion lost when a stream
loses its end or the prefill's sidecar restarts, and HTTP where gRPC is off, missing or refused."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import pytest
import torch

from kvferry.client import Client
from kvferry.client import vllm_watch
from kvferry.client.vllm_core import ConnectorConfig, Consumer, KvCache, LoadSpec, Producer, remote_params
from kvferry.demo import free_port, start_sidecar, wait_ready

from .conftest import TOKEN, Daemon, log_path, ready, spawn, stop
from .test_vllm_core import BLOCKS, config, pages, pull_leaves_while_workers_are_held, pump, released, vllm_layers

pytest.importorskip("grpc", reason="the gRPC path needs the grpc extra (pip install kvferry[grpc])")
from kvferry.client.grpc import Ending  # noqa: E402 (after the skip: needs grpcio)

ENV = {"KVFERRY_TRANSFER_TIMEOUT": "10"}


def grpc_sidecar(env: dict | None = None, **kw) -> Daemon:
    return spawn("tcp", {**ENV, **(env or {})}, extra=["--grpc-port", str(free_port())], **kw)


@pytest.fixture(scope="module")
def served():
    """A prefill-side and a decode-side sidecar, each serving gRPC beside REST."""
    a, b = grpc_sidecar(), grpc_sidecar()
    yield a, b
    stop(a, b)


@pytest.fixture(params=["http", "auto"])
def control(request) -> str:
    return request.param


def caches(prefill: Daemon, decode: Daemon, name: str, seed: int = 1):
    p_layers, d_layers = vllm_layers(seed), vllm_layers(None)
    p_cache = KvCache(Client(prefill.url, token=TOKEN), f"p-{name}", p_layers, BLOCKS)
    d_cache = KvCache(Client(decode.url, token=TOKEN), f"d-{name}", d_layers, BLOCKS)
    return p_cache, d_cache, p_layers, d_layers


def pull_once(producer: Producer, consumer: Consumer, prefill: Daemon, rid: str, src: list[int], dst: list[int]):
    producer.save(rid, src)
    pull = consumer.start(LoadSpec(f"dec-{rid}", tuple(dst), remote_params(rid, src, config(prefill))))
    assert pull.error is None, pull.error
    return pull, pump(consumer)


def test_the_sidecar_names_its_grpc_port(served):
    prefill, _ = served
    health = prefill.client.health()
    assert health["grpc_port"] > 0
    assert vllm_watch.grpc_target(prefill.url, health) == f"127.0.0.1:{health['grpc_port']}"
    assert vllm_watch.grpc_target("http://[::1]:7700", health) == f"[::1]:{health['grpc_port']}"
    assert vllm_watch.grpc_target(prefill.url, {"grpc_port": 0}) is None


def test_pulls_complete_by_either_control(served, control, monkeypatch):
    """Each pull's end comes by the Watch (auto) or the long-poll (http). Under auto a Watch that
    misses an end (its transfer announced late on a loaded machine) rightly falls back to asking
    over HTTP, so each pull may say either, but the ends come over the decode's gRPC channel."""
    from kvferry.client import vllm_core as core

    monkeypatch.setattr(core, "APPEAR", 5.0)  # the API's longest wait for the announce
    prefill, decode = served
    p_cache, d_cache, p_layers, d_layers = caches(prefill, decode, f"ok-{control}")
    producer = Producer(config(prefill), p_cache)
    consumer = Consumer(config(decode, control=control), d_cache)
    try:
        for i, (src, dst) in enumerate([([3, 9, 4, 17, 0], [20, 1, 2, 11, 5]), ([6, 7], [8, 10])]):
            _, (received, failed) = pull_once(producer, consumer, prefill, f"ok-{control}-{i}", src, dst)
            assert (received, failed) == ({f"dec-ok-{control}-{i}"}, set())
            block_dim = p_cache.layout.block_dims[0]
            assert torch.equal(pages(d_layers, dst, block_dim).view(torch.int16),
                               pages(p_layers, src, block_dim).view(torch.int16))
            entry = consumer.stats[-1]
            assert entry["control"] in (("grpc", "http") if control == "auto" else ("http",))
            assert entry["wait_seconds"] >= entry["transfer_seconds"] > 0 and entry["bytes_raw"] > 0
            assert released(producer, f"ok-{control}-{i}")
        if control == "auto":
            assert len(consumer.watches._streams) == 1 and consumer.watches.pushed() >= 1
            assert consumer.watches.pushed() == sum(e["control"] == "grpc" for e in consumer.stats)
    finally:
        consumer.close()
        producer.close()
        p_cache.close()
        d_cache.close()


def test_a_pull_over_grpc_leaves_from_the_step(served):
    """A second pull, and the Watch of its end (a gRPC call never waits to start), leave from the
    calling thread, so the KV crosses while the worker threads are held; its end is pushed."""
    prefill, decode = served
    p_cache, d_cache, p_layers, d_layers = caches(prefill, decode, "early")
    producer = Producer(config(prefill), p_cache)
    consumer = Consumer(config(decode, control="auto"), d_cache)
    try:
        pull_leaves_while_workers_are_held(producer, consumer, prefill, decode, p_cache, p_layers, d_layers, "early")
        assert consumer.stats[-1]["control"] == "grpc"  # the held pull's end came by its Watch
    finally:
        consumer.close()
        producer.close()
        p_cache.close()
        d_cache.close()


def test_a_missing_lease_fails_alike(served, control, monkeypatch):
    """No lease: the pull is refused NotFound, and reported the same whichever way its end would come."""
    import kvferry.client.vllm_core as core

    monkeypatch.setattr(core, "LEASE_GRACE", 0.3)
    monkeypatch.setattr(core, "RELEASE_GRACE", 0.3)
    prefill, decode = served
    _, d_cache, _, d_layers = caches(prefill, decode, f"gone-{control}")
    consumer = Consumer(config(decode, control=control, load_timeout=5), d_cache)
    try:
        pull = consumer.start(LoadSpec("dec-gone", (4, 5), remote_params("never-saved", [1, 2], config(prefill))))
        assert pump(consumer) == (set(), {"dec-gone"})
        assert "NotFound" in pull.error
        assert consumer.interval.data["failures"] == {"lease_gone": 1}
        assert not torch.stack(d_layers).any()
    finally:
        consumer.close()
        d_cache.close()


def test_a_failed_transfer_is_reported_alike():
    """KV corrupted on the wire: the transfer fails, and both controls report it in the same words."""
    prefill = grpc_sidecar({"KVFERRY_TRANSFER_TIMEOUT": "5"}, corrupt_chunk=0)
    decode = grpc_sidecar({"KVFERRY_TRANSFER_TIMEOUT": "5"})
    p_cache, d_cache, _, d_layers = caches(prefill, decode, "bad")
    producer = Producer(config(prefill), p_cache)
    errors = {}
    try:
        for control in ("http", "auto"):
            consumer = Consumer(config(decode, control=control, codec="raw"), d_cache)
            pull, outcome = pull_once(producer, consumer, prefill, f"bad-{control}", list(range(12)),
                                      list(range(12, 24)))
            assert outcome == (set(), {f"dec-bad-{control}"})
            assert consumer.interval.data["failures"] == {"integrity": 1}, pull.error
            errors[control] = re.sub(r"transfer \S+ ", "transfer ID ", pull.error)
            assert not torch.stack(d_layers)[:, :, :12].any()
            consumer.close()
        assert errors["http"] == errors["auto"]
    finally:
        producer.close()
        p_cache.close()
        d_cache.close()
        stop(prefill, decode)


def lose_the_ends(monkeypatch, gate: threading.Event | None = None) -> None:
    """Every Watch of a pull's end ends without it (after ``gate`` is set, where given)."""
    def result(self):
        if gate is not None:
            assert gate.wait(30), "the test never opened the gate"
        self.cancel()
        return None
    monkeypatch.setattr(Ending, "result", result)


def test_an_end_the_stream_never_pushed_is_asked_for(served, monkeypatch):
    lose_the_ends(monkeypatch)
    prefill, decode = served
    p_cache, d_cache, _, _ = caches(prefill, decode, "lost")
    producer = Producer(config(prefill), p_cache)
    consumer = Consumer(config(decode), d_cache)
    try:
        _, outcome = pull_once(producer, consumer, prefill, "lost", [1, 2, 3], [4, 5, 6])
        assert outcome == ({"dec-lost"}, set())
        assert consumer.stats[-1]["control"] == "http" and consumer.watches.pushed() == 0
    finally:
        consumer.close()
        producer.close()
        p_cache.close()
        d_cache.close()


def restartable(rest: int, data: int, grpc: int) -> Daemon:
    log = log_path(rest)
    process = start_sidecar(rest, data, "tcp", token=TOKEN, env=ENV, extra=["--grpc-port", str(grpc)], log=log)
    return ready(f"http://127.0.0.1:{rest}", process, log)


def test_a_prefill_sidecar_restart_loses_no_completion(served, monkeypatch):
    """A transfer ends, its end is not pushed and the prefill's sidecar dies: the waiting pull
    learns from the decode's own sidecar, over HTTP, that the KV arrived. The restarted sidecar
    takes the next pulls, and their ends are pushed again."""
    _, decode = served
    ports = (free_port(), free_port(), free_port())
    prefill = restartable(*ports)
    p_cache, d_cache, p_layers, d_layers = caches(prefill, decode, "restart")
    producer = Producer(config(prefill), p_cache)
    consumer = Consumer(config(decode), d_cache)
    try:
        pull_once(producer, consumer, prefill, "before", [1], [2])  # the channel is up
        ended = Ending.result
        gate = threading.Event()
        lose_the_ends(monkeypatch, gate)
        producer.save("lost", [3, 4])
        pull = consumer.start(LoadSpec("dec-lost", (5, 6), remote_params("lost", [3, 4], config(prefill))))
        deadline = time.monotonic() + 20
        while not pull.transfer_ids or decode.client.transfer(pull.transfer_ids[0])["state"] != "done":
            assert time.monotonic() < deadline, "the transfer did not arrive"
            time.sleep(0.01)
        assert consumer.poll() == (set(), set())  # its end was not pushed: the pull still waits
        prefill.kill()
        gate.set()
        assert pump(consumer) == ({"dec-lost"}, set())
        block_dim = p_cache.layout.block_dims[0]
        assert torch.equal(pages(d_layers, [5, 6], block_dim).view(torch.int16),
                           pages(p_layers, [3, 4], block_dim).view(torch.int16))

        monkeypatch.setattr(Ending, "result", ended)
        producer.close()
        p_cache.client.close()
        prefill = restartable(*ports)
        p_cache = KvCache(Client(prefill.url, token=TOKEN), "p-restart", p_layers, BLOCKS)
        producer = Producer(config(prefill), p_cache)
        controls = []
        for i in range(10):  # the channel dials the sidecar again within 2 s; meanwhile pulls go over HTTP
            _, outcome = pull_once(producer, consumer, prefill, f"after-{i}", [7, 8], [9, 10])
            assert outcome == ({f"dec-after-{i}"}, set())
            assert released(producer, f"after-{i}")
            controls.append(consumer.stats[-1]["control"])
            if controls[-1] == "grpc":
                break
            time.sleep(0.5)
        assert controls[-1] == "grpc", controls
        assert sum(stream.asked for stream in consumer.watches._streams.values()) >= 1
    finally:
        consumer.close()
        producer.close()
        p_cache.close()
        d_cache.close()
        stop(prefill)


def test_the_watch_asks_the_decode_sidecar_with_the_decode_token(served, monkeypatch):
    """The prefill sidecars take another token (``remote_token``) than the decode's own: the Watch,
    on the decode's own sidecar, carries the decode's token, so the ends are still pushed."""
    from kvferry.client import vllm_core as core

    monkeypatch.setattr(core, "APPEAR", 5.0)
    _, decode = served
    other, rest, data = "prefill-token-456", free_port(), free_port()
    log = log_path(rest)
    process = start_sidecar(rest, data, "tcp", token=other, env=ENV, log=log)
    url = f"http://127.0.0.1:{rest}"
    prefill = Daemon(url, Client(url, token=other), process, log=log)
    wait_ready(prefill.client, process)
    p_config = ConnectorConfig(url=url, token=other)
    p_layers, d_layers = vllm_layers(1), vllm_layers(None)
    p_cache = KvCache(Client(url, token=other), "p-tokens", p_layers, BLOCKS)
    d_cache = KvCache(Client(decode.url, token=TOKEN), "d-tokens", d_layers, BLOCKS)
    producer = Producer(p_config, p_cache)
    consumer = Consumer(config(decode, remote_token=other, control="auto"), d_cache)
    try:
        for i in range(3):
            producer.save(f"tok-{i}", [1 + i, 5 + i])
            pull = consumer.start(LoadSpec(f"dec-tok-{i}", (10 + i, 15 + i), remote_params(f"tok-{i}", [1 + i, 5 + i],
                                                                                         p_config)))
            assert pump(consumer) == ({f"dec-tok-{i}"}, set()), pull.error
            block_dim = p_cache.layout.block_dims[0]
            assert torch.equal(pages(d_layers, [10 + i, 15 + i], block_dim).view(torch.int16),
                               pages(p_layers, [1 + i, 5 + i], block_dim).view(torch.int16))
        assert consumer.watches.pushed() >= 1
    finally:
        consumer.close()
        producer.close()
        p_cache.close()
        d_cache.close()
        stop(prefill)


def test_a_sidecar_without_grpc_is_pulled_over_http(sidecars):
    prefill, decode = sidecars  # REST only
    p_cache, d_cache, _, _ = caches(prefill, decode, "rest-only")
    producer = Producer(config(prefill), p_cache)
    consumer = Consumer(config(decode), d_cache)
    try:
        _, outcome = pull_once(producer, consumer, prefill, "rest-only", [1, 2], [3, 4])
        assert outcome == ({"dec-rest-only"}, set())
        assert consumer.stats[-1]["control"] == "http" and consumer.watches._streams == {}
    finally:
        consumer.close()
        producer.close()
        p_cache.close()
        d_cache.close()


def test_without_grpcio_the_connector_pulls_over_http(served, monkeypatch):
    monkeypatch.setattr(vllm_watch, "grpc_available", lambda: False)
    prefill, decode = served
    p_cache, d_cache, _, _ = caches(prefill, decode, "no-grpcio")
    producer = Producer(config(prefill), p_cache)
    consumer = Consumer(config(decode), d_cache)
    try:
        _, outcome = pull_once(producer, consumer, prefill, "no-grpcio", [1, 2], [3, 4])
        assert outcome == ({"dec-no-grpcio"}, set())
        assert consumer.stats[-1]["control"] == "http" and consumer.watches._streams == {}
    finally:
        consumer.close()
        producer.close()
        p_cache.close()
        d_cache.close()


def test_the_connector_imports_without_grpcio():
    code = ("import sys; sys.modules['grpc'] = None\n"
            "from kvferry.client import vllm_core, vllm_watch\n"
            "assert not vllm_watch.grpc_available()\n"
            "assert vllm_core.ConnectorConfig.load({'control': 'http'}).control == 'http'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_the_control_setting_is_checked():
    from kvferry.client.vllm_core import ConnectorConfig

    assert ConnectorConfig.load({}, {}).control == "auto"
    assert ConnectorConfig.load(None, {"KVFERRY_CONNECTOR_CONTROL": "http"}).control == "http"
    with pytest.raises(ValueError, match="control"):
        ConnectorConfig.load({"control": "grpc-only"}, {})


def test_pulls_refused_by_an_overloaded_receiver_are_sent_again(control):
    """The decode's sidecar takes one incoming transfer at a time: of pulls started together, those
    it refuses as overloaded (nothing written) are sent again, over either control, and all land."""
    prefill = grpc_sidecar()
    decode = grpc_sidecar({"KVFERRY_MAX_INCOMING_TRANSFERS": "1"})
    try:
        p_cache, d_cache, p_layers, d_layers = caches(prefill, decode, f"busy-{control}")
        producer = Producer(config(prefill), p_cache)
        consumer = Consumer(config(decode, control=control), d_cache)
        moves = [([3, 9], [20, 1]), ([4, 17], [2, 11]), ([0, 6], [5, 8]), ([7, 10], [12, 13])]
        for i, (src, _) in enumerate(moves):
            producer.save(f"busy-{control}-{i}", src)
        for i, (src, dst) in enumerate(moves):
            pull = consumer.start(LoadSpec(f"dec-busy-{control}-{i}", tuple(dst),
                                           remote_params(f"busy-{control}-{i}", src, config(prefill))))
            assert pull.error is None, pull.error
        received: set[str] = set()
        deadline = time.monotonic() + 60
        while len(received) < len(moves) and time.monotonic() < deadline:
            done, failed = pump(consumer, timeout=60)
            assert not failed, failed
            received |= done
        assert received == {f"dec-busy-{control}-{i}" for i in range(len(moves))}
        block_dim = p_cache.layout.block_dims[0]
        for src, dst in moves:
            assert torch.equal(pages(d_layers, dst, block_dim).view(torch.int16),
                               pages(p_layers, src, block_dim).view(torch.int16))
        producer.close()
        consumer.close()
    finally:
        stop(prefill, decode)
