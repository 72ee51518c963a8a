"""OpenAPI fuzzing: schemathesis drives a real daemon over HTTP from its
own ``/openapi.json`` — examples, boundary values and random inputs, a bounded number per
operation, with and without the token. No answer may be a 5xx, undocumented, of an undocumented
content type or outside its documented schema, and no operation may ignore a missing token."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.engine.conftest import TOKEN, spawn, stop

pytest.importorskip("schemathesis")
pytestmark = pytest.mark.slow

CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_schema_conformance", "response_headers_conformance", "ignored_auth")


@pytest.mark.parametrize("seed", [1, 2])
def test_no_5xx_and_no_schema_violation(seed):
    daemon = spawn("tcp")
    try:
        result = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "run", f"{daemon.url}/openapi.json",
             "-H", f"Authorization: Bearer {TOKEN}", "--checks", ",".join(CHECKS), "--max-examples", "25",
             "--phases", "examples,coverage,fuzzing", "--seed", str(seed), "--request-timeout", "20",
             "--workers", "1", "--no-color",
             # The leases' long-poll answers after up to ``wait`` seconds by design: a fuzzer's
             # random generation and wait would only time it out. Its bad input is tested in
             # tests/client (the lease book's own tests).
             "--exclude-operation-id", "list_leases_v1_leases_get"],
            capture_output=True, text=True, timeout=600)
        report = result.stdout[-6000:] + result.stderr[-2000:]
        assert result.returncode == 0, report
        generated = re.search(r"(\d+) generated, (\d+) passed", result.stdout)
        assert generated and int(generated[1]) >= 500 and generated[1] == generated[2], report
        assert daemon.client.ready()  # and the daemon still serves
    finally:
        stop(daemon)
