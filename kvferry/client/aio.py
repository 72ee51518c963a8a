"""``AsyncClient``: the asyncio twin of ``Client`` over REST, for engines whose scheduler runs an
event loop. The same calls as ``kvferry.client.grpc.GrpcClient``, so either front end serves."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

import httpx

from .handle import AsyncHandles, AsyncTransfer, awaited
from .sdk import RETRY_STATUSES, Blocks, _checked, _delete_params, _pair_json, _transfer_body


class AsyncClient(AsyncHandles):
    """Transfers, health, and the region calls a test or a small engine needs (an owned
    region's bulk upload from a tensor stays with ``Client.region_from_tensor``)."""

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 60.0, retries: int = 6):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)
        self._timeout = timeout
        self._retries = retries

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        delay = 0.05
        for _ in range(self._retries):
            response = await self._http.request(method, path, **kwargs)
            if response.status_code not in RETRY_STATUSES:
                return _checked(response, method, path)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(2.0, delay * 2)
        return _checked(await self._http.request(method, path, **kwargs), method, path)

    # ---- regions -----------------------------------------------------------------------------
    async def create_region(self, name: str, num_blocks: int, block_shape: Sequence[int], dtype: str,
                            kind: str = "owned", **kind_fields: Any) -> dict:
        body = {"name": name, "kind": kind, "num_blocks": num_blocks, "block_shape": list(block_shape),
                "dtype": dtype, **kind_fields}
        return (await self._call("POST", "/v1/regions", json=body)).json()

    async def region(self, name: str) -> dict:
        return (await self._call("GET", f"/v1/regions/{name}")).json()

    async def list_regions(self) -> list[dict]:
        return (await self._call("GET", "/v1/regions")).json()

    async def delete_region(self, name: str, force: bool = False, drain: float = 0.0) -> None:
        """As ``Client.delete_region``."""
        await self._call("DELETE", f"/v1/regions/{name}", params=_delete_params(force, drain),
                         timeout=self._timeout + drain)

    async def put_blocks(self, name: str, start: int, count: int, data: bytes) -> None:
        """As ``Client.put_blocks``."""
        await self._call("PUT", f"/v1/regions/{name}/blocks", params={"start": start, "count": count},
                         content=data, headers={"Content-Type": "application/octet-stream"})

    async def get_block(self, name: str, index: int) -> bytes:
        return (await self._call("GET", f"/v1/regions/{name}/blocks/{index}")).content

    # ---- transfers ---------------------------------------------------------------------------
    async def submit(self, src_region: str, src_blocks: Blocks, peer: str, dst_region: str, dst_blocks: Blocks,
                     codec: str = "auto", codebook: str | None = None, *, wait: float = 0,
                     references: tuple[str, str] | None = None) -> str:
        body = _pair_json((src_region, dst_region, *(references or ())), "src_region", "dst_region")
        return (await self._post(body, src_blocks, peer, dst_blocks, codec, codebook, wait))["id"]

    async def submit_regions(self, pairs: Sequence[tuple[str, ...]], src_blocks: Blocks, peer: str,
                             dst_blocks: Blocks, codec: str = "auto", codebook: str | None = None, *,
                             wait: float = 0) -> str:
        body = {"regions": [_pair_json(p) for p in pairs]}
        return (await self._post(body, src_blocks, peer, dst_blocks, codec, codebook, wait))["id"]

    async def start(self, src_region: str, src_blocks: Blocks, peer: str, dst_region: str, dst_blocks: Blocks,
                    codec: str = "auto", codebook: str | None = None, *,
                    references: tuple[str, str] | None = None) -> AsyncTransfer:
        """``submit``, answered with a typed handle (``await t.wait()``)."""
        body = _pair_json((src_region, dst_region, *(references or ())), "src_region", "dst_region")
        return self._handle(await self._post(body, src_blocks, peer, dst_blocks, codec, codebook, 0))

    async def start_regions(self, pairs: Sequence[tuple[str, ...]], src_blocks: Blocks, peer: str,
                            dst_blocks: Blocks, codec: str = "auto", codebook: str | None = None) -> AsyncTransfer:
        body = {"regions": [_pair_json(p) for p in pairs]}
        return self._handle(await self._post(body, src_blocks, peer, dst_blocks, codec, codebook, 0))

    async def _post(self, body: dict, src_blocks: Blocks, peer: str, dst_blocks: Blocks, codec: str,
                    codebook: str | None, wait: float) -> dict:
        body = _transfer_body(body, src_blocks, peer, dst_blocks, codec, codebook)
        return (await self._call("POST", "/v1/transfers", json=body, params={"wait": wait} if wait else None,
                                 timeout=self._timeout + wait)).json()

    async def transfer(self, transfer_id: str, wait: float = 0) -> dict:
        """A transfer's record (never raises for its state); ``wait``: long-poll for its end."""
        if not wait:
            return (await self._call("GET", f"/v1/transfers/{transfer_id}")).json()
        return (await self._call("GET", f"/v1/transfers/{transfer_id}", params={"wait": wait},
                                 timeout=self._timeout + wait)).json()

    async def wait(self, transfer_id: str, timeout: float = 60.0) -> dict:
        """As ``Client.wait``. Raises: TransferFailed."""
        return dict((await awaited(self._snapshot, transfer_id, timeout)).record)

    async def cancel(self, transfer_id: str) -> dict:
        return (await self._call("DELETE", f"/v1/transfers/{transfer_id}")).json()

    async def health(self) -> dict:
        return (await self._call("GET", "/v1/health")).json()

    async def data_address(self) -> str:
        return (await self.health())["data_address"]
