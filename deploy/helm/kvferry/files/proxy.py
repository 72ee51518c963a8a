"""The P/D proxy for vLLM's OpenAI API: each request goes to a prefill instance with
``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``, then to a decode instance
with the ``kv_transfer_params`` the prefill answered (where its KV lease is); the decode's answer
is returned as it comes, streamed when the client asked for a stream.

    python examples/vllm-pd/proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Several ``--prefill``/``--decode`` URLs are used round robin.
"""

from __future__ import annotations

import argparse
import itertools
import json

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


def create_app(prefills: list[str], decodes: list[str], timeout: float = 600.0) -> FastAPI:
    app = FastAPI(title="kvferry P/D proxy")
    next_prefill, next_decode = itertools.cycle(prefills), itertools.cycle(decodes)
    http = httpx.AsyncClient(timeout=timeout)

    async def relay(path: str, request: Request) -> Response:
        body = await request.json()
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        # the client's own kv_transfer_params (e.g. {"kvferry_codec": "raw"}) go to the prefill
        first = dict(body, max_tokens=1, stream=False,
                     kv_transfer_params={**(body.get("kv_transfer_params") or {}), "do_remote_decode": True,
                                         "do_remote_prefill": False})
        first.pop("stream_options", None)
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        prefill = await http.post(f"{next(next_prefill)}{path}", json=first, headers=headers)
        if prefill.status_code != 200:
            return Response(prefill.content, status_code=prefill.status_code, media_type="application/json")
        params = prefill.json().get("kv_transfer_params")
        if not params:
            return JSONResponse({"error": "the prefill returned no kv_transfer_params: is it started with "
                                          "the KvferryConnector as kv_producer?"}, status_code=502)
        second = dict(body, kv_transfer_params=params)
        url = f"{next(next_decode)}{path}"
        if not body.get("stream"):
            decode = await http.post(url, json=second, headers=headers)
            return Response(decode.content, status_code=decode.status_code, media_type="application/json")
        upstream = await http.send(http.build_request("POST", url, json=second, headers=headers), stream=True)

        async def chunks():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(chunks(), status_code=upstream.status_code, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await relay("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await relay("/v1/chat/completions", request)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok", "prefill": prefills, "decode": decodes}

    @app.on_event("shutdown")
    async def close() -> None:
        await http.aclose()

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", action="append", required=True, help="a prefill vLLM's base URL")
    parser.add_argument("--decode", action="append", required=True, help="a decode vLLM's base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    uvicorn.run(create_app(args.prefill, args.decode), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
