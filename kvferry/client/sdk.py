"""The client SDK a serving engine calls: register regions (from torch tensors too), submit
transfers, wait, cancel. Errors come back as the service's own exception classes."""

from __future__ import annotations

import base64
import time
from typing import Any

import httpx

from kvferry.engine.errors import BY_NAME, ServiceError


class Client:
    """Synchronous client of one sidecar's control API."""

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 60.0):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            try:
                body = response.json()
                cls = BY_NAME.get(body.get("error"), ServiceError)
                detail = body.get("detail")
            except ValueError:
                cls, detail = ServiceError, response.text
            raise cls(f"{response.status_code} {method} {path}: {detail}")
        return response

    # ---- regions -----------------------------------------------------------------------------
    def create_region(self, name: str, num_blocks: int, block_shape: list[int], dtype: str,
                      kind: str = "owned", **kind_fields: Any) -> dict:
        body = {"name": name, "kind": kind, "num_blocks": num_blocks, "block_shape": list(block_shape),
                "dtype": dtype, **kind_fields}
        return self._call("POST", "/v1/regions", json=body).json()

    def region_from_tensor(self, name: str, tensor, kind: str = "owned") -> tuple[dict, Any]:
        """Register a region shaped like ``tensor`` (blocks along dim 0) holding its contents.

        ``owned``: the sidecar allocates and the blocks are uploaded; ``shm``: a POSIX shared
        memory segment is created, filled and mapped by the sidecar (keep the returned handle
        alive; close and unlink it when done); ``cuda_ipc``: the sidecar maps ``tensor`` itself,
        no copy (same GPU host). Returns (region description, handle or None).
        """
        import torch

        dtype = str(tensor.dtype).removeprefix("torch.")
        shape = list(tensor.shape)
        if kind == "owned":
            info = self.create_region(name, shape[0], shape[1:], dtype)
            raw = tensor.contiguous().view(-1).view(torch.uint8).cpu().view(shape[0], -1)
            for i in range(shape[0]):
                self.put_block(name, i, raw[i].numpy().tobytes())
            return info, None
        if kind == "shm":
            from multiprocessing import shared_memory

            nbytes = tensor.numel() * tensor.element_size()
            shm = shared_memory.SharedMemory(create=True, size=max(1, nbytes))
            view = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)
            view.copy_(tensor.contiguous().view(-1).view(torch.uint8).cpu())
            del view
            return self.create_region(name, shape[0], shape[1:], dtype, kind="shm", shm_name=shm.name), shm
        if kind == "cuda_ipc":
            return self.create_region(name, shape[0], shape[1:], dtype, kind="cuda_ipc", **cuda_ipc_handle(tensor)), None
        raise ValueError(f"unknown region kind {kind!r}")

    def region(self, name: str) -> dict:
        return self._call("GET", f"/v1/regions/{name}").json()

    def delete_region(self, name: str) -> None:
        self._call("DELETE", f"/v1/regions/{name}")

    def put_block(self, name: str, index: int, data: bytes) -> None:
        self._call("PUT", f"/v1/regions/{name}/blocks/{index}", content=data,
                   headers={"Content-Type": "application/octet-stream"})

    def get_block(self, name: str, index: int) -> bytes:
        return self._call("GET", f"/v1/regions/{name}/blocks/{index}").content

    # ---- transfers ---------------------------------------------------------------------------
    def submit(self, src_region: str, src_blocks: list[int], peer: str, dst_region: str,
               dst_blocks: list[int], codec: str = "auto", codebook: str | None = None) -> str:
        body = {"src_region": src_region, "src_blocks": list(src_blocks), "peer": peer,
                "dst_region": dst_region, "dst_blocks": list(dst_blocks), "codec": codec}
        if codebook:
            body["codebook"] = codebook
        return self._call("POST", "/v1/transfers", json=body).json()["id"]

    def transfer(self, transfer_id: str, wait: float = 0) -> dict:
        return self._call("GET", f"/v1/transfers/{transfer_id}", params={"wait": wait} if wait else None).json()

    def wait(self, transfer_id: str, timeout: float = 60.0) -> dict:
        """Long-poll until the transfer is done, failed or cancelled (or ``timeout`` passes)."""
        deadline = time.monotonic() + timeout
        while True:
            step = max(0.0, min(60.0, deadline - time.monotonic()))
            state = self.transfer(transfer_id, wait=step) if step else self.transfer(transfer_id)
            if state["state"] in ("done", "failed", "cancelled") or time.monotonic() >= deadline:
                return state

    def transfers(self, state: str | None = None, direction: str | None = None) -> list[dict]:
        params = {k: v for k, v in (("state", state), ("direction", direction)) if v}
        return self._call("GET", "/v1/transfers", params=params).json()

    def cancel(self, transfer_id: str) -> dict:
        return self._call("DELETE", f"/v1/transfers/{transfer_id}").json()

    # ---- codebooks and health ------------------------------------------------------------------
    def put_codebook(self, name: str, codebook_json: str) -> dict:
        return self._call("PUT", f"/v1/codebooks/{name}", content=codebook_json).json()

    def calibrate(self, name: str, region: str, blocks: list[int]) -> dict:
        return self._call("POST", f"/v1/codebooks/{name}/calibrate", json={"region": region, "blocks": blocks}).json()

    def ready(self) -> bool:
        try:
            return self._http.get("/readyz").status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self) -> str:
        return self._call("GET", "/metrics").text


def cuda_ipc_handle(tensor) -> dict:
    """What a ``cuda_ipc`` region needs to map ``tensor`` in another process on the same GPU:
    the IPC handle of the allocation holding it (CUDA hands out handles per allocation, so the
    base is looked up with cuMemGetAddressRange) and the tensor's offset into it."""
    import ctypes

    import cupy

    if not tensor.is_cuda or not tensor.is_contiguous():
        raise ValueError("cuda_ipc needs a contiguous CUDA tensor")
    pointer = tensor.data_ptr()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    status = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                                                  ctypes.c_uint64(pointer))
    if status != 0:
        raise RuntimeError(f"cuMemGetAddressRange failed with CUDA error {status}")
    with cupy.cuda.Device(tensor.device.index):
        handle = cupy.cuda.runtime.ipcGetMemHandle(base.value)
    return {"ipc_handle": base64.b64encode(bytes(handle)).decode(), "offset": pointer - base.value,
            "device": tensor.device.index}
