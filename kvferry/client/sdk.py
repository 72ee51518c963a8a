"""The client SDK a serving engine calls: register regions (from torch tensors too), submit
transfers, wait, cancel. Imports no server code (no FastAPI, no uvicorn); errors come back as the
engine's own exception classes, and ``wait`` on a failed transfer raises ``TransferFailed``."""

from __future__ import annotations

import base64
import functools
import json
import os
import random
import struct
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import httpx

from kvferry.engine.errors import BY_NAME, EngineError, TransferFailed

from .handle import Transfer, TransferStatus, waited
from .transport import Exchange, KeepAlive, NotWarm, Reply

RETRY_STATUSES = (429, 503)  # refused for now (too many transfers, starting): worth another try
UPLOAD_BYTES = 32 << 20  # an owned region's upload: at most this much a request (and the body limit)
MAX_RENEW = 4096  # lease names one renew call may carry (the sidecar answers 422 to more)
Blocks = Sequence[int] | range | dict[str, Any]


def packed(ids: Sequence[int], count: int = 1, stride: int | None = None) -> dict[str, Any]:
    """Block ids as the API's packed form (base64 of little-endian u32; with ``count`` and
    ``stride``, each id spread over ``count`` ids ``stride`` apart): for many ids. A request's
    2 x 256 ids took 74 µs to write and validate as JSON numbers, 39 packed (``docs/decisions/006-spread-and-packed-block-ids.md``)."""
    try:
        raw = struct.pack(f"<{len(ids)}I", *ids)
    except struct.error as exc:
        raise ValueError(f"block ids are 0 to 2**32 - 1: {exc}") from None
    body: dict[str, Any] = {"packed": base64.b64encode(raw).decode()}
    if count != 1 or stride is not None:
        body.update(count=count, stride=stride)
    return body


def blocks_json(blocks: Blocks) -> list[int] | dict[str, Any]:
    """A block list as the API takes it: ids, or ``range(start, stop, step)`` as one range, or
    ``{"ranges": [{"start", "count", "stride"}]}``, ``{"ids", "count", "stride"}`` or ``packed``
    as is."""
    if isinstance(blocks, dict):
        return blocks
    if isinstance(blocks, range):
        return {"ranges": [{"start": blocks.start, "count": len(blocks), "stride": blocks.step}]}
    return [int(i) for i in blocks]


class Client:
    """Synchronous client of one sidecar's control API."""

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 60.0, retries: int = 6,
                 shm_prefix: str = "kvferry-"):
        """``retries``: how often a 429 or 503 is tried again (exponential backoff with jitter,
        0.05 s doubling to 2 s); ``shm_prefix``: the sidecar's ``shm_prefix`` setting."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        url = urlsplit(base_url)
        if url.scheme == "http" and url.hostname:  # the lean client (``transport.py``); httpx for TLS
            self._lean: KeepAlive | None = KeepAlive(url.hostname, url.port or 80, headers)
            self._prefix = quote(url.path.rstrip("/"), safe="/%")  # as given: percent-encoded already
            self._http: httpx.Client | None = None
        else:
            self._lean, self._prefix = None, ""
            self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)
        self._timeout = timeout
        self._retries = retries
        self._shm_prefix = shm_prefix

    def close(self) -> None:
        if self._lean is not None:
            self._lean.close()
        if self._http is not None:
            self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, *, params: dict[str, Any] | None = None, json: Any = None,
              content: bytes | str | None = None, headers: dict[str, str] | None = None,
              timeout: float | None = None) -> Reply:
        """One API call (retried while refused for now); the engine's error classes raised back."""
        delay = 0.05
        for _ in range(self._retries):
            response = self._send(method, path, params, json, content, headers, timeout)
            if response.status_code not in RETRY_STATUSES:
                break
            time.sleep(delay * (0.5 + random.random()))  # jitter: retries of many clients spread out
            delay = min(2.0, delay * 2)
        else:
            response = self._send(method, path, params, json, content, headers, timeout)
        return _checked(response, method, path)

    def _send(self, method: str, path: str, params: dict[str, Any] | None, body: Any, content: bytes | str | None,
              headers: dict[str, str] | None, timeout: float | None) -> Reply:
        if self._lean is None:
            response = self._http.request(method, path, params=params, json=body, content=content, headers=headers,
                                          timeout=self._timeout if timeout is None else timeout)
            return Reply(response.status_code, response.headers, response.content)
        return self._start(method, path, params, body, content, headers, timeout).response()

    def _start(self, method: str, path: str, params: dict[str, Any] | None, body: Any, content: bytes | str | None,
               headers: dict[str, str] | None, timeout: float | None, warm_only: bool = False) -> Exchange:
        """Write a request on the lean client; the exchange reads its answer. ``warm_only``: as
        ``KeepAlive.send``'s."""
        timeout = self._timeout if timeout is None else timeout
        headers = dict(headers or {})
        if body is not None:
            content = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
            headers.setdefault("Content-Type", "application/json")
        data = content.encode() if isinstance(content, str) else content or b""
        target = self._prefix + quote(path, safe="/")
        if params:
            target += "?" + urlencode(params)
        return self._lean.send(method, target, data, headers, timeout, warm_only)

    # ---- regions -----------------------------------------------------------------------------
    def create_region(self, name: str, num_blocks: int, block_shape: Sequence[int], dtype: str,
                      kind: str = "owned", **kind_fields: Any) -> dict:
        body = {"name": name, "kind": kind, "num_blocks": num_blocks, "block_shape": list(block_shape),
                "dtype": dtype, **kind_fields}
        return self._call("POST", "/v1/regions", json=body).json()

    def region_from_tensor(self, name: str, tensor, kind: str = "owned",
                           axes: Sequence[str] | None = None) -> tuple[dict, Any]:
        """Register a region shaped like ``tensor`` (blocks along dim 0) holding its contents.

        ``owned``: the sidecar allocates and the blocks are uploaded; ``shm``: a POSIX shared
        memory segment is created, filled and mapped by the sidecar (keep the returned handle
        alive; close and unlink it when done); ``cuda_ipc``: the sidecar maps ``tensor`` itself,
        no copy (same GPU host). ``axes`` names the block dimensions (codecs that model KV by
        position need kv/head/channel). Returns (region description, handle or None).
        """
        import torch

        named = {"axes": list(axes)} if axes is not None else {}
        dtype = str(tensor.dtype).removeprefix("torch.")
        shape = list(tensor.shape)
        if kind == "owned":
            info = self.create_region(name, shape[0], shape[1:], dtype, **named)
            raw = tensor.contiguous().view(-1).view(torch.uint8).cpu().view(shape[0], -1)
            # As many blocks a request as the sidecar's body limit takes (an older one, which
            # does not say, takes one).
            limit = self.health().get("max_body_bytes", 0)
            per = max(1, min(limit, UPLOAD_BYTES) // max(1, raw.shape[1]))
            for start in range(0, shape[0], per):
                if per == 1:
                    self.put_block(name, start, raw[start].numpy().tobytes())
                else:
                    run = raw[start:start + per]
                    self.put_blocks(name, start, run.shape[0], run.numpy().tobytes())
            return info, None
        if kind == "shm":
            from multiprocessing import shared_memory

            nbytes = tensor.numel() * tensor.element_size()
            shm = shared_memory.SharedMemory(name=f"{self._shm_prefix}{uuid.uuid4().hex}", create=True,
                                             size=max(1, nbytes))
            os.fchmod(shm._fd, 0o660)  # the sidecar may run as another user of the pod's group
            view = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)
            view.copy_(tensor.contiguous().view(-1).view(torch.uint8).cpu())
            del view
            return self.create_region(name, shape[0], shape[1:], dtype, kind="shm", shm_name=shm.name, **named), shm
        if kind == "cuda_ipc":
            from .memory import cuda_ipc_handle

            return self.create_region(name, shape[0], shape[1:], dtype, kind="cuda_ipc", **cuda_ipc_handle(tensor),
                                      **named), None
        raise ValueError(f"unknown region kind {kind!r}")

    def region(self, name: str) -> dict:
        return self._call("GET", f"/v1/regions/{name}").json()

    def list_regions(self) -> list[dict]:
        return self._call("GET", "/v1/regions").json()

    def delete_region(self, name: str, force: bool = False, drain: float = 0.0) -> None:
        """Delete region ``name``. ``force``: a quarantined one too; ``drain``: wait up to this many
        seconds (at most 300) for the transfers in progress that use it to end, new ones refused
        meanwhile, rather than a Conflict at once."""
        self._call("DELETE", f"/v1/regions/{name}", params=_delete_params(force, drain), timeout=self._timeout + drain)

    # ---- leases ------------------------------------------------------------------------------
    def lease(self, name: str, seconds: float, ttl: float | None = None, of: str | None = None) -> dict:
        """Lease region ``name`` (the sidecar deletes it ``seconds`` from now unless renewed, and
        ``ttl`` seconds after it was taken at the latest), or extend the lease. ``of``: create
        ``name`` first as a view of region ``of`` (its memory under the lease's name)."""
        return self.lease_later(name, seconds, ttl, of).result()

    def lease_later(self, name: str, seconds: float, ttl: float | None = None, of: str | None = None,
                    warm_only: bool = False) -> Answer:
        """``lease``, split as ``send_later`` is: asked now, its record read later, on any thread."""
        body: dict[str, Any] = {"seconds": seconds}
        if ttl is not None:
            body["ttl"] = ttl
        if of is not None:
            body["of"] = of
        return self._later(("PUT", f"/v1/leases/{name}", None, body, None, None, self._timeout), warm_only)

    def renew_leases(self, names: Sequence[str], seconds: float) -> dict:
        """A heartbeat: ``{"renewed": [...], "missing": [...]}``, in calls of at most ``MAX_RENEW`` names."""
        names, answer = list(names), {"renewed": [], "missing": []}
        for start in range(0, len(names), MAX_RENEW):
            part = self._call("POST", "/v1/leases/renew", json={"names": names[start:start + MAX_RENEW],
                                                                "seconds": seconds}).json()
            for key in answer:
                answer[key].extend(part.get(key, ()))
        return answer

    def leases(self, after: int = -1, wait: float = 0.0) -> dict:
        """``{"generation": g, "leases": {name: {...}}}``; with ``wait``, answered once the
        generation passed ``after`` or ``wait`` seconds passed (a long-poll)."""
        return self._call("GET", "/v1/leases", params={"after": after, "wait": wait},
                          timeout=self._timeout + wait).json()

    def put_block(self, name: str, index: int, data: bytes) -> None:
        self._call("PUT", f"/v1/regions/{name}/blocks/{index}", content=data,
                   headers={"Content-Type": "application/octet-stream"})

    def put_blocks(self, name: str, start: int, count: int, data: bytes) -> None:
        """Overwrite blocks ``start`` to ``start + count - 1`` with ``data``, their raw bytes
        concatenated (at most the sidecar's ``max_body_bytes``), in one request."""
        self._call("PUT", f"/v1/regions/{name}/blocks", params={"start": start, "count": count}, content=data,
                   headers={"Content-Type": "application/octet-stream"})

    def get_block(self, name: str, index: int) -> bytes:
        return self._call("GET", f"/v1/regions/{name}/blocks/{index}").content

    # ---- transfers ---------------------------------------------------------------------------
    def submit(self, src_region: str, src_blocks: Blocks, peer: str, dst_region: str, dst_blocks: Blocks,
               codec: str = "auto", codebook: str | None = None, *, wait: float = 0,
               references: tuple[str, str] | None = None) -> str:
        """Send ``src_blocks`` of ``src_region`` to ``dst_blocks`` of the peer's ``dst_region``;
        ``peer`` is the receiving sidecar's data address (its ``data_address()``). ``references``:
        (sender's, receiver's) regions of predictor KV, for ``codec="predictive"``. Returns the id."""
        body = _pair_json((src_region, dst_region, *(references or ())), "src_region", "dst_region")
        return self._post(body, src_blocks, peer, dst_blocks, codec, codebook, wait)["id"]

    def send(self, src_region: str, src_blocks: Blocks, peer: str, dst_region: str, dst_blocks: Blocks,
             codec: str = "auto", *, wait: float) -> dict:
        """``submit`` and wait up to ``wait`` seconds for the end in the same HTTP call (one round
        trip where a submit and a long-poll would take two); returns the transfer's record, which is
        still ``queued`` or ``running`` if ``wait`` passed first."""
        body = _pair_json((src_region, dst_region), "src_region", "dst_region")
        return self._post(body, src_blocks, peer, dst_blocks, codec, None, wait)

    def send_later(self, src_region: str, src_blocks: Blocks, peer: str, dst_region: str, dst_blocks: Blocks,
                   codec: str = "auto", *, wait: float, transfer_id: str | None = None,
                   warm_only: bool = False) -> Answer:
        """``send``, split: the request leaves now, on this thread, and ``Answer.result`` reads the
        record later, on any thread. An engine's step sends its pulls without a hop to a thread,
        whose wake-up then overlaps the transfer. ``transfer_id``: the id to give it (32 hex
        digits), so that the receiver can be asked for it at once (``transfer_later``).
        ``warm_only``: sent only on a connection already open, at once (an engine's step), else
        ``NotWarm`` and nothing sent.

        Raises:
            httpx.HTTPError: the request could not be sent (``result`` raises the rest).
        """
        body = _transfer_body(_pair_json((src_region, dst_region), "src_region", "dst_region"), src_blocks, peer,
                              dst_blocks, codec, None)
        if transfer_id is not None:
            body["id"] = transfer_id
        call = ("POST", "/v1/transfers", {"wait": wait}, body, None, None, self._timeout + wait)
        return self._later(call, warm_only)

    def transfer_later(self, transfer_id: str, wait: float, appear: float = 0, warm_only: bool = False) -> Answer:
        """``transfer``'s long-poll, split as ``send_later`` is: asked now, its record read later
        (a receiver asked for a transfer before the sender's answer names it: ``appear``)."""
        params = {"wait": wait, "appear": appear} if appear else {"wait": wait}
        call = ("GET", f"/v1/transfers/{transfer_id}", params, None, None, None, self._timeout + wait)
        return self._later(call, warm_only)

    def _later(self, call: tuple, warm_only: bool) -> Answer:
        if self._lean is None:
            if warm_only:
                raise NotWarm("no lean connection to keep warm (https): sent from a thread that may wait")
            return Answer(self, call, None)
        return Answer(self, call, self._start(*call, warm_only=warm_only))

    def submit_regions(self, pairs: Sequence[tuple[str, ...]], src_blocks: Blocks, peer: str, dst_blocks: Blocks,
                       codec: str = "auto", codebook: str | None = None, *, wait: float = 0) -> str:
        """One transfer of the same blocks of several (source, destination) region pairs, e.g.
        every layer of a request; a pair may name its references too: (src, dst, src_ref, dst_ref)."""
        body = {"regions": [_pair_json(p) for p in pairs]}
        return self._post(body, src_blocks, peer, dst_blocks, codec, codebook, wait)["id"]

    def start(self, src_region: str, src_blocks: Blocks, peer: str, dst_region: str, dst_blocks: Blocks,
              codec: str = "auto", codebook: str | None = None, *,
              references: tuple[str, str] | None = None) -> Transfer:
        """``submit``, answered with a typed handle (``t.wait()``, ``t.cancel()``, ``t.status``)."""
        body = _pair_json((src_region, dst_region, *(references or ())), "src_region", "dst_region")
        return self._handle(self._post(body, src_blocks, peer, dst_blocks, codec, codebook, 0))

    def start_regions(self, pairs: Sequence[tuple[str, ...]], src_blocks: Blocks, peer: str, dst_blocks: Blocks,
                      codec: str = "auto", codebook: str | None = None) -> Transfer:
        """``submit_regions``, answered with a typed handle."""
        body = {"regions": [_pair_json(p) for p in pairs]}
        return self._handle(self._post(body, src_blocks, peer, dst_blocks, codec, codebook, 0))

    def handle(self, transfer_id: str) -> Transfer:
        """A handle on a transfer started elsewhere (its record fetched now). Raises: NotFound."""
        return self._handle(self.transfer(transfer_id))

    def _handle(self, record: dict) -> Transfer:
        return Transfer(TransferStatus.from_record(record), self._snapshot,
                        lambda transfer_id: TransferStatus.from_record(self.cancel(transfer_id)))

    def _snapshot(self, transfer_id: str, wait: float) -> TransferStatus:
        return TransferStatus.from_record(self.transfer(transfer_id, wait))

    def _post(self, body: dict, src_blocks: Blocks, peer: str, dst_blocks: Blocks, codec: str,
              codebook: str | None, wait: float) -> dict:
        """The transfer's record as ``POST /v1/transfers`` answers it (at its end or after ``wait``).
        Waiting for its end, a transfer the receiver refused as overloaded (nothing written) is
        sent again, like a 429, with backoff."""
        call = functools.partial(self._call, "POST", "/v1/transfers",
                                 json=_transfer_body(body, src_blocks, peer, dst_blocks, codec, codebook),
                                 params={"wait": wait} if wait else None, timeout=self._timeout + wait)
        return _again_while_overloaded(call, self._retries) if wait else call().json()

    def transfer(self, transfer_id: str, wait: float = 0, appear: float = 0) -> dict:
        """A transfer's record (never raises for its state); ``wait``: long-poll up to that many
        seconds for its end (the read timeout stretches by as much); ``appear``: first wait up to
        that long for a transfer a peer is about to announce to this sidecar (NotFound if none came).

        Raises: NotFound."""
        if not wait:
            return self._call("GET", f"/v1/transfers/{transfer_id}").json()
        params = {"wait": wait, "appear": appear} if appear else {"wait": wait}
        return self._call("GET", f"/v1/transfers/{transfer_id}", params=params, timeout=self._timeout + wait).json()

    def wait(self, transfer_id: str, timeout: float = 60.0) -> dict:
        """The transfer's record once done.

        Raises:
            TransferFailed: it failed or was cancelled (``reason`` from the sidecar), or is not
            done within ``timeout`` seconds.
        """
        return dict(waited(self._snapshot, transfer_id, timeout).record)

    def transfers(self, state: str | None = None, direction: str | None = None) -> list[dict]:
        params = {k: v for k, v in (("state", state), ("direction", direction)) if v}
        return self._call("GET", "/v1/transfers", params=params).json()

    def cancel(self, transfer_id: str) -> dict:
        return self._call("DELETE", f"/v1/transfers/{transfer_id}").json()

    # ---- codebooks and health ------------------------------------------------------------------
    def put_codebook(self, name: str, codebook_json: str, codec: str = "splitzip") -> dict:
        return self._call("PUT", f"/v1/codebooks/{name}", content=codebook_json, params={"codec": codec}).json()

    def calibrate(self, name: str, region: str, blocks: Blocks, codec: str = "splitzip",
                  token_axis: int | None = None, **options: Any) -> dict:
        """Calibrate codebook ``name`` on blocks of a region; ``options`` are the codec's (lowrank:
        ``energy=0.99``)."""
        body = {"region": region, "blocks": blocks_json(blocks), "codec": codec, "token_axis": token_axis,
                "options": options}
        return self._call("POST", f"/v1/codebooks/{name}/calibrate", json=body).json()

    def health(self) -> dict:
        return self._call("GET", "/v1/health").json()

    def data_address(self) -> str:
        """Where peers send to this sidecar (``host:port``)."""
        return self.health()["data_address"]

    def ready(self) -> bool:
        try:
            return self._send("GET", "/readyz", None, None, None, None, None).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self) -> str:
        return self._call("GET", "/metrics").text


def _again_while_overloaded(call: Callable[[], Reply], retries: int, named: bool = False) -> dict:
    """The record ``call`` (a submit that waits for the end) answers; a transfer the receiver
    refused as overloaded (it had too many incoming transfers, and nothing was written) is sent
    again, like a 429, with jittered backoff, but for one ``named`` by its caller: its id names
    the failed record now, and is not reused."""
    delay = 0.05
    for _ in range(retries):
        try:
            return call().json()
        except TransferFailed as exc:
            if exc.kind != "Overloaded" or named:
                raise
        time.sleep(delay * (0.5 + random.random()))
        delay = min(2.0, delay * 2)
    return call().json()


class Answer:
    """The answer of a call sent now and read later (``Client.send_later``, ``transfer_later``,
    ``lease_later``), read once by ``result``."""

    def __init__(self, client: Client, call: tuple, exchange: Exchange | None):
        self._client, self._call, self._exchange = client, call, exchange
        self._read = False

    def result(self) -> dict:
        """The answer's JSON (a transfer's record as ``Client.send`` returns it; a lease's as ``lease``).

        Raises:
            EngineError (its subclasses, by the sidecar's answer), httpx.HTTPError.
        """
        if self._read:
            raise RuntimeError("this answer was read already (reading it again would send the transfer again)")
        self._read = True
        exchange, self._exchange = self._exchange, None
        method, path = self._call[:2]
        if exchange is not None:
            reply = exchange.response()
            if reply.status_code not in RETRY_STATUSES:
                try:
                    return _checked(reply, method, path).json()
                except TransferFailed as exc:
                    if exc.kind != "Overloaded" or "id" in (self._call[3] or {}):  # as _again_while_overloaded
                        raise
        params, body, _, _, timeout = self._call[2:]  # refused for now, or no lean client: as ``send``
        client = self._client
        return _again_while_overloaded(
            functools.partial(client._call, method, path, params=params, json=body, timeout=timeout), client._retries,
            named="id" in (body or {}))

    def cancel(self) -> None:
        """Never read it (a long-poll no longer wanted): its connection is closed, not reused."""
        self._read = True
        exchange, self._exchange = self._exchange, None
        if exchange is not None:
            exchange.abandon()


def _checked(response: Reply | httpx.Response, method: str, path: str) -> Reply | httpx.Response:
    """The response, or the engine's error class raised back (by the name in the body)."""
    if response.status_code < 400:
        return response
    try:
        body = response.json()
        cls = BY_NAME.get(body.get("error"), EngineError)
        detail = body.get("detail")
    except (ValueError, AttributeError):
        body, cls, detail = {}, EngineError, response.text
    if cls is TransferFailed:
        raise TransferFailed(str(detail), body.get("state", "failed"), body.get("kind"))
    raise cls(f"{response.status_code} {method} {path}: {detail}")


def _delete_params(force: bool, drain: float) -> dict[str, str]:
    params = {"force": "true"} if force else {}
    if drain:
        params["drain"] = repr(float(drain))
    return params


def _pair_json(pair: Sequence[str], src: str = "src", dst: str = "dst") -> dict:
    """(src, dst) or (src, dst, src_reference, dst_reference) as the API's fields."""
    if len(pair) not in (2, 4):
        raise ValueError(f"a region pair is (src, dst) or (src, dst, src_reference, dst_reference), not {pair!r}")
    body = {src: pair[0], dst: pair[1]}
    if len(pair) == 4:
        body.update(src_reference=pair[2], dst_reference=pair[3])
    return body


def _transfer_body(body: dict, src_blocks: Blocks, peer: str, dst_blocks: Blocks, codec: str,
                   codebook: str | None) -> dict:
    body.update(peer=peer, src_blocks=blocks_json(src_blocks), dst_blocks=blocks_json(dst_blocks), codec=codec)
    if codebook:
        body["codebook"] = codebook
    return body
