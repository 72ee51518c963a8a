"""The ``kvferry`` command line. Heavy imports stay inside subcommands so ``--help`` is instant."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The real KV sample: package data, so the demo works from a plain install too.
DEFAULT_SAMPLE = Path(__file__).resolve().parent / "data" / "kv_smollm2_gpl3_small.npz"  # ships in the wheel


def main(argv: list[str] | None = None) -> int:
    from kvferry import __version__

    parser = argparse.ArgumentParser(prog="kvferry", description="kvferry: lossless, compressed KV-cache transfer sidecar for disaggregated LLM serving.")
    parser.add_argument("--version", action="version", version=f"kvferry {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("codec-demo", help="compress real (or synthetic) KV, check it round-trips bit-exactly")
    demo.add_argument("--data", type=Path, default=DEFAULT_SAMPLE,
                      help="KV sample (.npz of bf16 bit patterns); synthetic data if absent")
    demo.set_defaults(run=_codec_demo)

    cal = sub.add_parser("calibrate", help="build a codec's codebook from KV files")
    cal.add_argument("files", nargs="+", type=Path, help=".npz/.npy/.pt files")
    cal.add_argument("-o", "--output", type=Path, required=True, help="codebook JSON to write")
    cal.add_argument("--dtype", default="bfloat16",
                     help="element dtype; integer arrays of its width are read as bit patterns")
    cal.add_argument("--select", metavar="REGEX",
                     help="only arrays whose name matches, e.g. '_k$' for a K-only codebook")
    cal.add_argument("--codec", default="splitzip", help="registered codec to calibrate (default splitzip)")
    cal.add_argument("--token-axis", type=int, help="which axis of each array is the token axis")
    cal.add_argument("--axes", help="comma-separated names of each array's axes (layer, kv, token, head, channel), "
                                    "e.g. head,token,channel; arrays named ..._l<N>_<k|v> are then stacked into "
                                    "[layer, kv, ...] per name prefix (lowrank)")
    cal.add_argument("--energy", type=float, help="lowrank: fraction of each head's energy to keep (default 0.99)")
    cal.add_argument("--rank-budget", type=int, help="lowrank: total rank over all heads (instead of --energy)")
    cal.add_argument("--quantize", choices=("k8v4",), help="lowrank: quantize coefficients (8-bit K, 4-bit V)")
    cal.set_defaults(run=_calibrate)

    serve = sub.add_parser("serve", help="run the sidecar daemon (control API + data listener)")
    serve.add_argument("--config", help="YAML settings file (also KVFERRY_CONFIG)")
    serve.add_argument("--host", help="control API bind address (default 127.0.0.1; others need a token)")
    serve.add_argument("--port", help="control API port (default 7700)")
    serve.add_argument("--grpc-port", help="the control API over gRPC too, on this port (default 0: off; needs "
                                           "pip install kvferry[grpc])")
    serve.add_argument("--data-host", help="data listener bind address (default 127.0.0.1; others need a peer secret)")
    serve.add_argument("--data-port", help="data listener port (default 7701; 0 = any)")
    serve.add_argument("--advertise-host", help="address peers use for the data port")
    serve.add_argument("--token", help="bearer token for the control API (also KVFERRY_TOKEN)")
    serve.add_argument("--data-encryption", choices=("off", "on"),
                       help="encrypt KV on the wire as well as authenticate it (every sidecar must agree; default off)")
    serve.add_argument("--peer-secret", help="secret shared by all sidecars, for the data connection's handshake "
                                             "(also KVFERRY_PEER_SECRET)")
    serve.add_argument("--device", help="auto (default), cpu, cuda or cuda:N")
    serve.add_argument("--chunk-bytes",
                       help="raw KV bytes per pipeline chunk (default 0: 256 MiB on a GPU, 4 MiB on a CPU)")
    serve.add_argument("--transport-backend", choices=("auto", "ucxx", "tcp"),
                       help="data plane: ucxx (UCX: RDMA, CUDA IPC; needs a peer secret), tcp, or auto "
                            "(default: ucxx where it is installed and a peer secret is set, else tcp)")
    serve.add_argument("--tcp-lanes", help="TCP sockets per data connection this sidecar dials, 1 to 16 (default 0: 4 on a GPU, 1 on a CPU); "
                                           "large payloads spread over them, for NICs faster than one stream")
    serve.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                       help="daemon log level (default info)")
    serve.set_defaults(run=_serve)

    demo_all = sub.add_parser("demo", help="two sidecars on loopback move real KV, compressed, bit-exact")
    demo_all.add_argument("--data", type=Path, default=DEFAULT_SAMPLE, help="KV sample (.npz of bf16 bit patterns)")
    demo_all.add_argument("--backend", choices=("auto", "ucxx", "tcp"), default="tcp",
                          help="the sidecars' data plane (default tcp)")
    demo_all.set_defaults(run=_demo)

    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage, not the top level's, and the option it was meant to be
        chosen = sub.choices[args.command]
        chosen.error(f"unrecognized arguments: {' '.join(unknown)}{_did_you_mean(chosen, unknown)}")
    return args.run(args)


def _did_you_mean(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    import difflib

    options = [o for action in parser._actions for o in action.option_strings]
    hints = [(word, match[0]) for word in (u.split("=", 1)[0] for u in unknown if u.startswith("-"))
             if (match := difflib.get_close_matches(word, options, n=1, cutoff=0.7))]
    if len(hints) == 1:
        return f" (did you mean {hints[0][1]}?)"
    return f" (did you mean {', '.join(f'{m} for {w}' for w, m in hints)}?)" if hints else ""


def _gpu_index(device: str) -> int | None:
    """The CUDA device a daemon of ``device`` (a setting) runs on, or None on the CPU."""
    if device == "cpu":
        return None
    import torch

    if device.startswith("cuda:"):
        return int(device.split(":")[1])
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def _serve(args: argparse.Namespace) -> int:
    import importlib.util
    import json
    import logging
    import os

    import uvicorn

    from kvferry.engine import placement, settings as settings_module
    from kvferry.api.app import create_app

    cli = {k: v for k, v in vars(args).items() if k not in ("command", "run", "config")}
    try:
        settings = settings_module.load(cli, config_file=args.config)
        settings.check()
        if settings.grpc_port and not all(importlib.util.find_spec(m) for m in ("grpc", "grpc_health", "grpc_reflection")):
            raise ValueError(f"grpc_port: {settings.grpc_port} but the grpc extra is not installed "
                             "(pip install kvferry[grpc])")
        if settings.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ValueError(f"device: {settings.device!r} but no CUDA GPU is visible")
        placed = placement.pin(settings.cpu_affinity, _gpu_index(settings.device))
    except ValueError as exc:
        print(f"kvferry serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvferry").info("placement: %s", placed)
    logging.getLogger("kvferry").info("settings: %s", json.dumps(settings.public()))
    ucx_env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    logging.getLogger("kvferry").info("UCX environment: %s", ucx_env)
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host=settings.host, port=settings.port,
                                           log_level=settings.log_level, timeout_graceful_shutdown=10))
    server.run()
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args.data, args.backend)


def _calibrate(args: argparse.Namespace) -> int:
    import inspect

    from kvferry import codec

    from .kvfiles import load_tensors

    try:
        chosen = codec.get(args.codec)
    except codec.UnknownCodec as exc:
        print(f"kvferry calibrate: {exc}", file=sys.stderr)
        return 2
    named = [(name, t) for path in args.files for name, t in load_tensors(path, args.dtype, args.select)]
    tensors = [t for _, t in named]
    if not tensors:
        print("kvferry calibrate: no arrays matched", file=sys.stderr)
        return 2
    options = {k: v for k, v in (("energy", args.energy), ("rank_budget", args.rank_budget),
                                 ("quantize", args.quantize)) if v is not None}
    unknown = [k for k in options if k not in inspect.signature(chosen.calibrate).parameters]
    if unknown:
        print(f"kvferry calibrate: {args.codec} does not take {', '.join(unknown)}", file=sys.stderr)
        return 2
    try:
        if args.axes:
            tensors, options["axes"] = _stack_layers(named, tuple(a.strip() for a in args.axes.split(",")))
        book = chosen.calibrate(tensors, token_axis=args.token_axis, **options)
    except (codec.CodecError, ValueError) as exc:
        print(f"kvferry calibrate: {exc}", file=sys.stderr)
        return 2
    args.output.write_text(book.to_json() + "\n")
    detail = (f": coverage {book.coverage:.4%}, exponents {list(book.exponents)}"
              if isinstance(book, codec.Codebook) else f": {book.summary()}" if hasattr(book, "summary") else "")
    print(f"{args.codec} codebook from {len(named)} arrays{detail} -> {args.output}")
    return 0


def _stack_layers(named: list, axes: tuple[str, ...]) -> tuple[list, tuple[str, ...]]:
    """Per-layer K/V arrays (named ``<prefix>_l<N>_<k|v>``, the way KV dumps name them) stacked
    into one ``[layer, kv, *axes]`` tensor per prefix; arrays as they are if ``axes`` already name
    layer or kv, or if their names do not follow that pattern."""
    import re

    import torch

    pattern = re.compile(r"^(.*?)_?l(\d+)_([kv])$")
    matches = [pattern.match(name) for name, _ in named]
    if "layer" in axes or "kv" in axes or not all(matches):
        return [t for _, t in named], axes
    groups: dict[str, dict[tuple[int, int], object]] = {}
    for m, (_, t) in zip(matches, named):
        groups.setdefault(m.group(1), {})[(int(m.group(2)), "kv".index(m.group(3)))] = t
    stacked = []
    for prefix, parts in groups.items():
        layers = 1 + max(layer for layer, _ in parts)
        if len(parts) != 2 * layers:
            raise ValueError(f"arrays {prefix}_l*_k/v do not hold K and V of layers 0..{layers - 1}")
        stacked.append(torch.stack([torch.stack([parts[(layer, kv)] for kv in (0, 1)]) for layer in range(layers)]))
    return stacked, ("layer", "kv", *axes)


def _codec_demo(args: argparse.Namespace) -> int:
    import time

    import torch

    from kvferry import codec

    from .kvfiles import load_tensors

    if args.data.exists():
        arrays = dict(load_tensors(args.data, "bfloat16"))
        calib = [t for name, t in arrays.items() if name.startswith("c0_")]
        data = torch.cat([t.reshape(-1) for name, t in arrays.items() if name.startswith("c1_")])
        source = f"{args.data} (codebook calibrated on chunk 0, applied to chunk 1)"
    else:
        gen = torch.Generator().manual_seed(0)
        calib = [torch.randn(1 << 20, generator=gen).to(torch.bfloat16)]
        data = torch.randn(1 << 22, generator=gen).to(torch.bfloat16)
        source = "synthetic Gaussian data (no KV sample found)"
    print(f"kvferry codec demo on {source}, CPU reference path\n")
    print(f"{'dtype':<15}{'MB':>8}{'ratio':>8}{'escapes':>10}{'enc GB/s':>10}{'dec GB/s':>10}  bit-exact")
    ok = True
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e5m2, torch.float8_e4m3fn):
        x = data.to(dtype)
        book = codec.calibrate([t.to(dtype) for t in calib])
        start = time.perf_counter()
        frame = codec.encode(x, book)
        mid = time.perf_counter()
        y = codec.decode(frame)
        end = time.perf_counter()
        exact = torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        ok &= exact
        raw = x.numel() * x.element_size()
        header = codec.read_header(frame)
        print(f"{header.layout.name:<15}{raw / 1e6:>8.1f}{raw / frame.numel():>8.3f}{header.escapes:>10}"
              f"{raw / (mid - start) / 1e9:>10.3f}{raw / (end - mid) / 1e9:>10.3f}  {'yes' if exact else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
