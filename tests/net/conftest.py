"""Hosts as network namespaces on this machine (``kvferry.testing.netns``), real ``kvferry serve``
daemons in them, real TCP between them over veth links that can be shaped, cut and made lossy.
The test process reaches each daemon's REST API over a control link of its own (never shaped or
cut). Root only: skipped, with the reason, where namespaces cannot be made."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import pytest
import torch

from kvferry.testing import netns
from tests.conftest import KV_SAMPLE

_WHY_NOT = netns.unavailable()


@pytest.fixture(scope="session", autouse=True)
def _namespaces_work() -> None:
    """Skip every test here, saying why, where namespaces cannot be made (set up before the
    module fixtures that build networks)."""
    if _WHY_NOT:
        pytest.skip(f"real-network tests: {_WHY_NOT}")


def _factory() -> Iterator[Callable[..., netns.Network]]:
    made: list[netns.Network] = []

    def make(*names: str) -> netns.Network:
        try:
            made.append(netns.Network(names or ("a", "b")))
        except netns.Unavailable as exc:
            pytest.skip(f"real-network tests: {exc}")
        return made[-1]

    try:
        yield make
    finally:
        for network in made:
            network.close()


@pytest.fixture
def networks() -> Iterator[Callable[..., netns.Network]]:
    """Make networks (``networks("a", "b")``); each is closed (daemons stopped, namespaces and
    links deleted) when the test ends, passed or failed."""
    yield from _factory()


@pytest.fixture(scope="module")
def module_networks() -> Iterator[Callable[..., netns.Network]]:
    """``networks`` for a module's shared hosts: closed when the module ends."""
    yield from _factory()


@pytest.fixture(scope="session")
def kv() -> torch.Tensor:
    """The package's real KV sample: 60 blocks of [3, 511, 64] bf16 (196 KiB each)."""
    from kvferry.demo import load_kv

    return load_kv(KV_SAMPLE)


def fill(sidecar: netns.Sidecar, region: str, blocks: int, block_shape: Sequence[int], seed: int) -> torch.Tensor:
    """An owned bf16 region of random bit patterns on ``sidecar``; returns what it holds."""
    generator = torch.Generator().manual_seed(seed)
    content = torch.randint(-32768, 32768, (blocks, *block_shape), dtype=torch.int32, generator=generator)
    content = content.to(torch.int16).view(torch.bfloat16)
    sidecar.client.region_from_tensor(region, content)
    return content


def blocks_of(sidecar: netns.Sidecar, region: str, ids: Sequence[int], block_shape: Sequence[int]) -> torch.Tensor:
    """The region's blocks ``ids`` as the daemon holds them now (read back over its REST API)."""
    return torch.stack([torch.frombuffer(bytearray(sidecar.client.get_block(region, i)), dtype=torch.bfloat16)
                        .view(*block_shape) for i in ids])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


def over_the_wire(record: dict) -> None:
    """The transfer crossed the data network: bytes on the wire, no same-host shortcut."""
    assert record["bytes_wire"] > 0 and "same host" not in (record.get("choice_reason") or ""), record


def on_a_cable(net: netns.Network, kv: torch.Tensor, rate_mbit: float, env: Mapping[str, str],
               backend: str = "tcp") -> tuple[netns.Sidecar, netns.Sidecar, torch.Tensor]:
    """Sidecars on a and b over their cable shaped to ``rate_mbit``, a holding 240 blocks (47 MB)
    of real KV in region ``src``, b a region ``dst`` for them: (a, b, the KV)."""
    net.shape_all(rate_mbit)
    a, b = net.sidecar("a", env, backend=backend), net.sidecar("b", env, backend=backend)
    big = kv.repeat(4, 1, 1, 1)
    a.client.region_from_tensor("src", big)
    b.client.create_region("dst", big.shape[0], list(big.shape[1:]), "bfloat16")
    return a, b, big
