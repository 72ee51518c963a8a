"""Owned regions are uploaded in as few requests as the body limit allows (``PUT
/v1/regions/{name}/blocks?start=&count=``), the block routes log at DEBUG, and the access log
never keeps a query string (real daemon, token on)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvferry.api.app import AccessLog
from kvferry.client import Client
from kvferry.demo import free_port, wait_ready
from tests.engine.conftest import TOKEN, kv  # noqa: F401 (kv is a fixture)

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _puts(client) -> float:
    return sum(s.value for f in text_string_to_metric_families(client.metrics()) for s in f.samples
               if f.name == "kvferry_http_requests" and s.name.endswith("_total") and s.labels.get("method") == "PUT")


@pytest.mark.slow
def test_bulk_upload_and_a_quiet_access_log(kv, tmp_path: Path):
    block = kv[0].numel() * kv.element_size()
    port = free_port()
    environment = {k: v for k, v in os.environ.items() if not k.startswith("KVFERRY_")}
    environment.update(KVFERRY_MAX_BODY_BYTES=str(3 * block + 100), KVFERRY_TOKEN=TOKEN,
                       PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]))
    with open(tmp_path / "out.log", "w") as out:  # uvicorn's access log goes to stdout
        process = subprocess.Popen([sys.executable, "-m", "kvferry.cli", "serve", "--port", str(port), "--data-port",
                                    "0", "--transport-backend", "tcp", "--device", "cpu", "--log-level", "info"],
                                   env=environment, stdout=out, stderr=subprocess.STDOUT)
    d = Client(f"http://127.0.0.1:{port}", token=TOKEN)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(d, process)
        before = _puts(d)
        d.region_from_tensor("r", kv[:8])
        assert _puts(d) - before == 3  # 3 + 3 + 2 blocks, not 8 requests
        for i in range(8):
            assert d.get_block("r", i) == kv[i].contiguous().view(-1).view(kv_bytes()).numpy().tobytes()
        two = kv[:2].contiguous().view(-1).view(kv_bytes()).numpy().tobytes()
        for params, content, status in (
                ({"start": 7, "count": 2}, two, 400),  # past the region's end
                ({"start": 0, "count": 3}, two, 400),  # not the bytes 3 blocks need
                ({"start": 0, "count": 2}, two[:-1], 400),
                ({"start": 0, "count": 0}, b"", 422),
                ({"start": 0, "count": 4}, two * 2, 413)):  # over max_body_bytes
            response = httpx.put(f"{url}/v1/regions/r/blocks", params=params, content=content, headers=AUTH)
            assert response.status_code == status, (params, response.text)
        for i in range(8):  # none of the refused uploads wrote anything
            assert d.get_block("r", i) == kv[i].contiguous().view(-1).view(kv_bytes()).numpy().tobytes()
        response = httpx.get(f"{url}/v1/regions", params={"token": "s3cret-in-a-url"}, headers=AUTH)
        assert response.status_code == 200
    finally:
        d.close()
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
    log = (tmp_path / "out.log").read_text()
    assert '"GET /v1/regions HTTP/1.1" 200' in log  # the access log is on, at INFO
    assert "s3cret-in-a-url" not in log and "token=" not in log
    assert "/blocks" not in log  # the block routes' lines are DEBUG


def test_the_access_log_filter():
    logger = logging.getLogger("uvicorn.access")
    saved = logger.level

    def record(path: str) -> logging.LogRecord:
        return logger.makeRecord(logger.name, logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:5", "GET", path, "1.1", 200), None)

    try:
        logger.setLevel(logging.INFO)
        r = record("/v1/transfers/abc?wait=5&token=x")
        assert AccessLog().filter(r) and r.getMessage() == '127.0.0.1:5 - "GET /v1/transfers/abc HTTP/1.1" 200'
        assert not AccessLog().filter(record("/v1/regions/kv/blocks/3?x=1"))
        assert not AccessLog().filter(record("/v1/regions/kv/blocks"))
        logger.setLevel(logging.DEBUG)
        r = record("/v1/regions/kv/blocks?start=0&count=4")
        assert AccessLog().filter(r) and r.levelno == logging.DEBUG and "start" not in r.getMessage()
        r = record("/v1/regions/kv%3Fa/blocks/1")  # a "?" in a name is percent-encoded: part of the path
        assert AccessLog().filter(r) and "kv%3Fa" in r.getMessage()
    finally:
        logger.setLevel(saved)


def kv_bytes():
    import torch

    return torch.uint8
