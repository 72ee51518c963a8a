"""``kvferry demo``: two sidecars as separate processes on loopback; real KV goes from one to the
other, raw and SplitZip-compressed, and is checked bit for bit."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kvferry.client import Client, TransferFailed


_handed: set[int] = set()  # ports this process has handed out


def free_port() -> int:
    """A loopback port free now, for a child to bind: taken below the kernel's ephemeral range
    where there is one, so that no outgoing connection (which takes its local port from that
    range) can hold it by the time the child binds it, and never one handed out before."""
    low = _ephemeral_low()
    for _ in range(64):
        port = 10000 + secrets.randbelow(max(1, low - 10000)) if low > 11000 else 0
        if port in _handed:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _handed:
            _handed.add(port)
            return port
    raise RuntimeError("no free loopback port found")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


# The sidecars one process starts are one deployment: they share a peer secret, made here.
_PEER_SECRET = secrets.token_hex(16)


def start_sidecar(port: int, data_port: int, backend: str, token: str = "", extra: list[str] | None = None,
                  env: dict | None = None, device: str = "cpu", log: Path | None = None,
                  entry: str = "kvferry.cli") -> subprocess.Popen:
    """Start ``kvferry serve`` as a child process, with this process's peer secret unless ``env``
    names one; its stderr goes to a pipe, or to ``log`` for long runs (an unread pipe would
    eventually block the daemon). ``entry``: the module run (tests name one that installs faults)."""
    command = [sys.executable, "-m", entry, "serve", "--host", "127.0.0.1", "--port", str(port),
               "--data-host", "127.0.0.1", "--data-port", str(data_port), "--advertise-host", "127.0.0.1",
               "--transport-backend", backend, "--device", device, "--log-level", "warning", *(extra or [])]
    if token:
        command += ["--token", token]
    environment = dict(os.environ, **(env or {}))
    environment.setdefault("UCX_TLS", "tcp")
    environment.setdefault("KVFERRY_PEER_SECRET", _PEER_SECRET)
    environment["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), environment.get("PYTHONPATH", "")])
    stderr = open(log, "w") if log else subprocess.PIPE  # noqa: SIM115 (the child owns it)
    return subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=stderr, text=True)


def stop_sidecars(processes: list[subprocess.Popen], timeout: float = 30.0) -> None:
    """SIGTERM every sidecar (they end their transfers and exit), then kill any still there after
    ``timeout`` seconds."""
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()


def wait_ready(client: Client, process: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            output = process.stderr.read() if process.stderr else "(see its log file)"
            raise RuntimeError(f"sidecar exited: {output[-2000:]}")
        if client.ready():
            return
        time.sleep(0.1)
    raise RuntimeError("sidecar did not become ready")


def settle(client: Client, region: str, timeout: float = 30.0) -> None:
    """Wait until what the sidecar learned from ``region`` has settled (learned with the block's
    axes, in a thread after the region's first transfers), as in a sidecar that has run a while."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(entry["settled"] for entry in (client.region(region).get("learned") or {}).values()):
            return
        time.sleep(0.05)
    raise RuntimeError(f"the codebooks of region {region!r} did not settle in {timeout:.0f} s")


def until_steady(run: Callable[[], dict], limit: int = 10) -> None:
    """Call ``run`` (one ``auto`` transfer, returning its record) until ``auto``'s choice is
    steady: made from measurements (every close candidate tried), or the same codec three times
    running without a try where none is close; at most ``limit`` times. A sidecar tries close
    candidates once per peer, size and ``Policy.measured_ttl_s``, and only after its first choice
    has been measured (not on a peer's first transfer, nor a codebook's first use), so a choice
    can repeat before the tries begin: a benchmark timing then would report the tries, where a
    sidecar that has run a while makes none."""
    last, streak = None, 0
    for _ in range(limit):
        record = run()
        reason, chosen = record.get("choice_reason") or "", record.get("chosen_codec")
        if reason.startswith("measured"):
            return
        streak = 0 if reason.startswith("trying") else streak + 1 if chosen == last else 1
        last = chosen
        if streak >= 3:
            return


def load_kv(path: Path):
    """The sample's 60 K/V tensors ([3, T, 64] bf16 each: 24 tokens in the one the package ships,
    511 in the repository's) of chunk 0 as 60 blocks."""
    import numpy as np
    import torch

    z = np.load(path)
    return torch.stack([torch.from_numpy(z[f"c0_l{layer}_{kind}"].view(np.int16)).view(torch.bfloat16)
                        for layer in range(30) for kind in "kv"])


LLAMA_AXES = ("layer", "kv", "token", "head", "channel")


def llama_blocks(path: Path, blocks: int, layers: int = 32, device: str = "cpu", heads: int = 8,
                 head_dim: int = 128, block_tokens: int = 16):
    """``blocks`` paged-cache blocks ``[layers, 2, block_tokens, heads, head_dim]`` (axes
    ``LLAMA_AXES``) filled with the sample's real KV so that every position keeps what it means:
    layer l holds the sample's layer l mod 30, head h channel d the sample's head (2h + d // 64)
    mod 3 channel d mod 64, and block b the sample's tokens 16b .. 16b + 15 (both chunks, 1,022
    tokens, wrapped; the blocks repeat every 64). A flat tiling of the sample would mix layers and heads within a position,
    which a serving engine's cache never does."""
    import numpy as np
    import torch

    z = np.load(path)
    kv = torch.stack([torch.stack([torch.cat([torch.from_numpy(z[f"c{c}_l{layer}_{kind}"].view(np.int16))
                                              for c in (0, 1)], dim=1) for kind in "kv"])
                      for layer in range(30)])  # [30, 2, 3 heads, 1022 tokens, 64] int16
    src_heads = (2 * torch.arange(heads)[:, None] + torch.arange(head_dim)[None, :] // 64) % kv.shape[2]
    channels = torch.arange(head_dim) % kv.shape[4]
    period = -(-kv.shape[3] // block_tokens)  # blocks until the tokens wrap
    tokens = torch.arange(period * block_tokens) % kv.shape[3]
    layer_ids = torch.arange(layers) % kv.shape[0]
    x = kv[layer_ids][:, :, :, tokens].permute(0, 1, 3, 2, 4)  # [layers, 2, tokens, 3, 64]
    x = x[..., src_heads, channels[None, :].expand(heads, -1)]  # [layers, 2, tokens, heads, dim]
    base = x.reshape(layers, 2, period, block_tokens, heads, head_dim)
    base = base.permute(2, 0, 1, 3, 4, 5).contiguous().to(device)  # [period, layers, 2, tokens, heads, dim]
    out = torch.empty((blocks, *base.shape[1:]), dtype=torch.int16, device=device)
    for start in range(0, blocks, period):
        n = min(period, blocks - start)
        out[start:start + n] = base[:n]
    return out.view(torch.bfloat16)


def run_demo(data: Path, backend: str) -> int:
    import torch

    if not data.exists():
        print(f"KV sample {data} not found", file=sys.stderr)
        return 2
    kv = load_kv(data)
    ports = [(free_port(), free_port()) for _ in range(2)]
    processes = [start_sidecar(p, d, backend) for p, d in ports]
    try:
        prefill, decode = (Client(f"http://127.0.0.1:{p}") for p, _ in ports)
        for client, process in zip((prefill, decode), processes):
            wait_ready(client, process)
        prefill.region_from_tensor("kv", kv)
        blocks = list(range(kv.shape[0]))
        print(f"kvferry demo: {kv.shape[0]} blocks of {list(kv.shape[1:])} bf16 real KV "
              f"({kv.numel() * 2 / 1e6:.1f} MB), two sidecars on loopback ({backend} transport)\n")
        print(f"{'codec':<10}{'raw MB':>9}{'wire MB':>9}{'ratio':>8}{'seconds':>9}{'GB/s':>8}  bit-exact")
        ok = True
        peer = decode.data_address()
        for codec_name in ("raw", "splitzip"):
            region = f"kv-{codec_name}"
            decode.create_region(region, kv.shape[0], list(kv.shape[1:]), "bfloat16")
            transfer_id = prefill.submit("kv", blocks, peer, region, blocks[::-1], codec=codec_name)
            try:
                result = prefill.wait(transfer_id, timeout=120)
            except TransferFailed as exc:
                print(f"{codec_name:<10} FAILED: {exc.reason}")
                ok = False
                continue
            exact = result["state"] == "done" and all(
                decode.get_block(region, blocks[::-1][i]) == kv[i].contiguous().view(torch.uint8).numpy().tobytes()
                for i in blocks)
            ok &= exact
            seconds = result["seconds"] or float("nan")
            print(f"{codec_name:<10}{result['bytes_raw'] / 1e6:>9.2f}{result['bytes_wire'] / 1e6:>9.2f}"
                  f"{(result['ratio'] or 0):>8.3f}{seconds:>9.3f}{result['bytes_raw'] / seconds / 1e9:>8.3f}"
                  f"  {'yes' if exact else 'NO: ' + str(result.get('error'))}")
        return 0 if ok else 1
    finally:
        stop_sidecars(processes)
