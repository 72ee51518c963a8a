"""kvferry beside NIXL, same machine, same run, same KV layout: a Llama-3-8B-shaped paged cache
(blocks of ``[32, 2, 16, 8, 128]`` bf16 = 2 MiB, real KV laid out by position) moved between two processes to
random destination blocks.

    python bench/peers.py [--device cuda|cpu] [--gpus 1|2] [--backend ucxx|tcp] [--sizes 2M,64M,256M,1G,4G]
                          [--codecs raw,splitzip,auto] [--repeats 5] [--small-repeats 100] [--links 12.5,25,50]
                          [--no-nixl] [--netns 1,2] [--json FILE]

- kvferry: two real sidecars (``kvferry serve``); this process owns both caches and lends them
  (CUDA IPC on a GPU, POSIX shared memory on the CPU); one transfer per request, timed from
  submit to done (the receiver has written every block: the sender's record, which waits for the
  receiver's DONE), and from submit to the receiver's own done ("at the receiver": NIXL's rows
  time the same, the notification's arrival at the target).
- NIXL (``nixl-cu13``), driven as vLLM's NixlConnector drives it: an initiator and a target
  process, memory registered once, descriptor lists prepped once, then a WRITE of block indices
  with a notification; timed from posting to the notification's arrival at the target (one
  host, one monotonic clock). Two layouts: one descriptor per block, and vLLM's per-layer layout
  (a block is 64 descriptors of 32 KiB, one per layer and K/V, at scattered addresses).

``--links``: kvferry again with its sidecars pacing what they send to each rate (an emulated link:
no same-host shortcut), at sizes from ``--link-min-bytes``; NIXL cannot be paced, so its rows on
those links are modelled as max(its unpaced time, raw bytes / link) and say so.

``--netns RATES`` (Gbit/s; root): no loopback and no model. For each rate, two hosts made of
network namespaces (``kvferry.testing.netns``) joined by a veth cable shaped to the rate both ways
(``tc ... tbf``); kvferry's sidecars run one on each host (the destination's host has a hostname of
its own, so no same-host shortcut: every row checks its transfers crossed the wire), and NIXL's
initiator and target (when ``nixl_cu13`` imports) enter the same two namespaces and move the same
blocks over UCX's TCP transport on that cable. First, plain blocking sockets (one stream and four,
host memory, a thread each, the kernel's default buffers) show what a program that only writes to
sockets moves over that cable. Rows give p50 and p99 (nearest rank) latency; the closing table
gives raw's rate and auto's wire rate (its KV rate / its ratio) as fractions of the cable's.

``--gpus 2``: the source on GPU 0 and the destination on GPU 1 (each sidecar's device is its
region's, and sees the other), NIXL's initiator on GPU 0 and its target on GPU 1; else both on one.

Every request zeroes its destination blocks first and compares every one bit for bit after, on the
destination's device, against a copy of the source made there once (NIXL's target does the same): a
check on the source's GPU just before the next request would make its copy wait for the GPU to switch
contexts, which NIXL's initiator does not meet.
Each codec's first request is a warm-up (the sender then settles what it learned); with
``--netns`` the codecs then take turns, repeat by repeat, so that a machine whose load drifts slows
them alike; ``auto`` is
timed once its choice is steady (``demo.until_steady``: it tries a close codec once per peer,
size and 10 minutes, which a sidecar that has run a while no longer pays).
Per size: median and p90 seconds, GB/s of KV moved. Prints a table; ``--json`` writes the rows.
Both say which event loop the sidecars ran: uvloop (the daemon's dependency) wherever it imports.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import multiprocessing as mp
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BLOCK_SHAPE = (32, 2, 16, 8, 128)  # layers, K/V, tokens, heads, head dim
BLOCK_BYTES = 32 * 2 * 16 * 8 * 128 * 2
PIECES, PIECE_BYTES = 64, BLOCK_BYTES // 64  # vLLM's layout: per layer and K/V, 32 KiB a block


def _size(text: str) -> int:
    return int(float(text[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[text[-1].upper()])


def tiled_cache(blocks: int, device: str):
    """``blocks`` blocks of real KV (the package's SmolLM2 sample, each position of a block the
    same layer, K/V, head and channel of it: ``demo.llama_blocks``), the same in every process."""
    from kvferry.demo import llama_blocks

    return llama_blocks(ROOT / "tests" / "data" / "kv_smollm2_gpl3.npz", blocks, device=device)


def plan(blocks_total: int, count: int, seed: int) -> tuple[list[int], list[int]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    src = torch.randperm(blocks_total, generator=generator)[:count].tolist()
    dst = torch.randperm(blocks_total, generator=generator)[:count].tolist()
    return src, dst


def _repeats(args, size: int, link_gbps: float = 0.0) -> int:
    """Timed repeats at ``size``: one block unpaced takes at least ``--small-repeats`` (kvferry and
    NIXL alike), since the median of five sub-millisecond transfers is the warm-up's (on an H100:
    1.52 ms over 5, 0.88 ms over 6,000)."""
    return max(args.repeats, args.small_repeats) if size <= BLOCK_BYTES and not link_gbps else args.repeats


def _synchronize(args) -> None:
    import torch

    for device in {args.src_device, args.dst_device}:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)


def _event_loop() -> str:
    """The sidecars' event loop: they run on this interpreter, where uvicorn takes uvloop if it
    imports (the daemon's dependency; a sidecar without it answers each message more slowly)."""
    try:
        import uvloop
    except ImportError:
        return "asyncio's loop (uvloop is not installed)"
    return f"uvloop {uvloop.__version__}"


# ---- kvferry -----------------------------------------------------------------------------------
def _network_tls(tls: str) -> str:
    """UCX transports that only a network carries: the same-host ones (shared memory, CMA, CUDA
    IPC) would bypass the cable between the namespaces."""
    kept = [t for t in tls.split(",") if t in ("tcp", "cuda_copy")]
    return ",".join(kept if "tcp" in kept else ["tcp", *kept])


def run_kvferry(args, sizes: list[int], blocks_total: int, link_gbps: float = 0.0, net=None,
                netns_gbit: float = 0.0) -> list[dict]:
    """kvferry's rows: two sidecars on loopback (paced to ``link_gbps`` GB/s if set), or on hosts
    a and b of ``net`` (a veth cable shaped to ``netns_gbit`` Gbit/s)."""
    import torch

    from kvferry.client import Client
    from kvferry.demo import LLAMA_AXES, free_port, settle, start_sidecar, stop_sidecars, until_steady, wait_ready

    rows, keep = [], []
    lanes = {"KVFERRY_TCP_LANES": str(args.tcp_lanes)}
    if net is not None:
        env = {"KVFERRY_TRANSFER_TIMEOUT": "300", "UCX_TLS": _network_tls(args.ucx_tls), **lanes}
        sidecars = [net.sidecar(name, env=env, backend=args.backend, device=device, ready_timeout=180)
                    for name, device in zip("ab", (args.src_device, args.dst_device))]
        processes = [s.process for s in sidecars]
        sender, receiver = (Client(s.url, token=net.token, timeout=600) for s in sidecars)
    else:
        ports = [(free_port(), free_port()) for _ in range(2)]
        env = {"KVFERRY_TRANSFER_TIMEOUT": "120", "UCX_TLS": args.ucx_tls, "KVFERRY_EMULATED_LINK_GBPS": str(link_gbps),
               **lanes}
        processes = [start_sidecar(p, d, args.backend, env=env, device=device)
                     for (p, d), device in zip(ports, (args.src_device, args.dst_device))]
    try:
        if net is None:
            sender, receiver = (Client(f"http://127.0.0.1:{p}", timeout=300) for p, _ in ports)
            for client, process in zip((sender, receiver), processes):
                wait_ready(client, process, timeout=180)
        kind = "cuda_ipc" if args.device == "cuda" else "shm"
        src = tiled_cache(blocks_total, args.src_device)
        dst = torch.zeros_like(src, device=args.dst_device)
        axes = None if args.no_axes else LLAMA_AXES
        _, handle = sender.region_from_tensor("src", src, kind=kind, axes=axes)
        _, dst_handle = receiver.region_from_tensor("dst", dst, kind=kind, axes=axes)
        keep += [handle, dst_handle]
        if kind == "shm":  # the receiver writes the segment: read the blocks back from it
            dst = torch.frombuffer(dst_handle.buf, dtype=torch.bfloat16).view(blocks_total, *BLOCK_SHAPE)
        # What every transfer is checked against, on the destination's device, as NIXL's target keeps
        # it: this process then works on the destination's GPU only, and a sender's copy never waits
        # for the GPU to switch to it from this process's checks on the source's GPU.
        expected = src.to(dst.device)
        peer = receiver.data_address()
        order = {codec: i for i, codec in enumerate(args.codecs.split(","))}
        first = len(rows)
        # Over a real cable the codecs take turns, repeat by repeat, so a machine whose load drifts
        # slows them alike (what ``auto`` against raw needs); else one codec's sizes after another.
        groups = [list(order)] if net is not None else [[codec] for codec in order]
        for codecs, size in ((group, size) for group in groups for size in sizes):
            count = max(1, size // BLOCK_BYTES)
            runs = {codec: {"seconds": [], "at_receiver": [], "exact": True, "ratio": 0.0, "chosen": "", "stages": {},
                            "reason": "", "sent": {}} for codec in codecs}  # sent: id -> created (one clock)

            def once(codec: str, repeat: int) -> dict:
                src_ids, dst_ids = plan(blocks_total, count, seed=repeat * 7919 + count)
                dst.view(blocks_total, -1).index_fill_(0, torch.tensor(dst_ids, device=dst.device), 0)
                _synchronize(args)
                record = sender._call("POST", "/v1/transfers", params={"wait": 300}, json={
                    "src_region": "src", "dst_region": "dst", "src_blocks": src_ids, "dst_blocks": dst_ids,
                    "peer": peer, "codec": codec}).json()
                if record.get("state") != "done":
                    raise RuntimeError(f"kvferry {codec} {size}: {record}")
                if net is not None and ("same host" in (record.get("choice_reason") or "")
                                        or not record.get("bytes_wire")):
                    raise RuntimeError(f"kvferry {codec} {size} did not cross the cable: {record}")
                runs[codec]["exact"] &= torch.equal(_gather(dst, blocks_total, "block", dst_ids),
                                                    _gather(expected, blocks_total, "block", src_ids))
                return record

            for codec in codecs:  # warm-ups: measure what a sidecar that has run a while codes with
                once(codec, 0)
                settle(sender, "src")
                if codec == "auto":  # which has tried what auto tries once per peer and size
                    until_steady(lambda: once("auto", args.repeats + 1))
            for repeat in range(1, _repeats(args, size, link_gbps) + 1):
                for codec in codecs:
                    record, run = once(codec, repeat), runs[codec]
                    run["seconds"].append(record["seconds"])
                    for stage, at in record["stages"].items():
                        run["stages"].setdefault(stage, []).append(at)
                    run["sent"][record["id"]] = record["created"]
                    run["ratio"] = record["bytes_raw"] / max(1, record["bytes_wire"]) if record["bytes_wire"] else 1.0
                    run["chosen"] = record.get("chosen_codec") or codec
                    run["reason"] = record.get("choice_reason") or ""
            # The receiver's records, asked once (a query between transfers slows the next one).
            sent = {k: v for run in runs.values() for k, v in run["sent"].items()}
            for incoming in receiver._call("GET", "/v1/transfers",
                                           params={"direction": "in", "limit": min(10 * len(sent) + 10, 10000)}).json():
                for run in runs.values():
                    if incoming["id"] in run["sent"] and incoming["state"] == "done":
                        run["at_receiver"].append(incoming["created"] + incoming["seconds"] - run["sent"][incoming["id"]])
            for codec, run in runs.items():
                how = f"{codec}" + (f" ({run['chosen']})" if codec == "auto" else "")
                rows.append(_row("kvferry", how, count, run["seconds"], run["exact"], run["ratio"], link_gbps, netns_gbit))
                rows[-1]["stages_median_ms"] = {k: statistics.median(v) * 1e3 for k, v in run["stages"].items()}
                if run["reason"]:  # auto's, for the last repeat
                    rows[-1]["choice_reason"] = run["reason"]
                print(_line(rows[-1]), flush=True)
                if len(run["at_receiver"]) == len(run["seconds"]):
                    rows.append(_row("kvferry", how + ", at the receiver", count, run["at_receiver"], run["exact"],
                                     run["ratio"], link_gbps, netns_gbit))
                    print(_line(rows[-1]), flush=True)
        # codec by codec, then size by size, as before the repeats took turns
        rows[first:] = sorted(rows[first:], key=lambda r: order[r["how"].split()[0].rstrip(",")])
        sender.close()
        receiver.close()
    finally:
        stop_sidecars(processes)
        for handle in keep:
            if handle is not None and hasattr(handle, "unlink"):
                handle.close()
                handle.unlink()
    return rows


# ---- NIXL --------------------------------------------------------------------------------------
def _descs(base: int, blocks: int, layout: str, device_id: int):
    """(address, length, device) per descriptor: one per block, or vLLM's 64 per block."""
    import numpy as np

    if layout == "block":
        addresses = base + np.arange(blocks, dtype=np.int64) * BLOCK_BYTES
        lengths = np.full(blocks, BLOCK_BYTES, dtype=np.int64)
    else:  # piece i of block b at (i * blocks + b) * 32 KiB: descriptor index i * blocks + b
        addresses = base + np.arange(PIECES * blocks, dtype=np.int64) * PIECE_BYTES
        lengths = np.full(PIECES * blocks, PIECE_BYTES, dtype=np.int64)
    return np.stack([addresses, lengths, np.full_like(addresses, device_id)], axis=1)


def _indices(ids: list[int], blocks: int, layout: str):
    import numpy as np

    ids = np.asarray(ids, dtype=np.int32)
    if layout == "block":
        return ids
    return (np.arange(PIECES, dtype=np.int32)[:, None] * blocks + ids[None, :]).reshape(-1)


def _pieces(cache, blocks: int, layout: str, block: int):
    """Block ``block``'s bytes as the layout places them (for the bit check)."""
    flat = cache.reshape(-1).view(__import__("torch").uint8)
    if layout == "block":
        return flat[block * BLOCK_BYTES:(block + 1) * BLOCK_BYTES]
    return flat.view(PIECES, blocks, PIECE_BYTES)[:, block]


def _gather(cache, blocks: int, layout: str, ids: list[int]):
    """Blocks ``ids``' bytes as the layout places them, all at once (every block is checked)."""
    import torch

    flat = cache.reshape(-1).view(torch.uint8)
    index = torch.tensor(ids, dtype=torch.int64, device=cache.device)
    if layout == "block":
        return flat.view(blocks, BLOCK_BYTES).index_select(0, index)
    return flat.view(PIECES, blocks, PIECE_BYTES).index_select(1, index)


def _nixl_agent(name: str, cache, device: str):
    from nixl_cu13 import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    agent.register_memory(agent.get_reg_descs([cache]))
    return agent


def nixl_target(conn, args, blocks_total: int) -> None:
    import torch

    if args.dst_device.startswith("cuda:"):
        torch.cuda.set_device(args.dst_device)
    cache = tiled_cache(blocks_total, args.dst_device).zero_()
    device_id = cache.device.index or 0
    agent = _nixl_agent("target", cache, args.device)
    mem = "VRAM" if args.device == "cuda" else "DRAM"
    descs = {layout: agent.get_serialized_descs(agent.get_xfer_descs(_descs(cache.data_ptr(), blocks_total, layout,
                                                                           device_id), mem))
             for layout in ("block", "vllm")}
    conn.send((agent.get_agent_metadata(), descs))
    expected = tiled_cache(blocks_total, args.dst_device)
    while True:
        job = conn.recv()
        if job is None:
            return
        layout, tag, src_ids, dst_ids = job
        if layout == "block":
            cache.view(blocks_total, -1).index_fill_(0, torch.tensor(dst_ids, device=cache.device), 0)
        else:
            for d in dst_ids:
                _pieces(cache, blocks_total, layout, d).zero_()
        _synchronize(args)
        conn.send("ready")
        deadline = time.monotonic() + 120
        arrived = None
        while arrived is None and time.monotonic() < deadline:
            for messages in agent.get_new_notifs().values():
                if tag.encode() in messages:
                    arrived = time.perf_counter()
        _synchronize(args)
        exact = arrived is not None and torch.equal(_gather(cache, blocks_total, layout, dst_ids),
                                                    _gather(expected, blocks_total, layout, src_ids))
        conn.send((arrived, exact))


def nixl_initiator(conn, args, blocks_total: int, sizes: list[int], netns_gbit: float = 0.0) -> None:
    import torch

    if args.src_device.startswith("cuda:"):
        torch.cuda.set_device(args.src_device)
    cache = tiled_cache(blocks_total, args.src_device)
    device_id = cache.device.index or 0
    agent = _nixl_agent("initiator", cache, args.device)
    mem = "VRAM" if args.device == "cuda" else "DRAM"
    target = conn.recv()
    metadata, remote = target
    peer = agent.add_remote_agent(metadata)
    prepped = {}
    for layout in ("block", "vllm"):
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _descs(cache.data_ptr(), blocks_total, layout, device_id), mem)
        far = agent.prep_xfer_dlist(peer, agent.deserialize_descs(remote[layout]))
        prepped[layout] = (local, far)
    rows = []
    for layout in ("block", "vllm"):
        local, far = prepped[layout]
        for size in sizes:
            count = max(1, size // BLOCK_BYTES)
            seconds, posted_s, exact = [], [], True
            for repeat in range(_repeats(args, size) + 1):
                src_ids, dst_ids = plan(blocks_total, count, seed=repeat * 7919 + count)
                tag = f"{layout}-{count}-{repeat}"
                conn.send(("job", layout, tag, src_ids, dst_ids))
                assert conn.recv() == "ready"
                handle = agent.make_prepped_xfer("WRITE", local, _indices(src_ids, blocks_total, layout), far,
                                                 _indices(dst_ids, blocks_total, layout), tag.encode())
                start = time.perf_counter()
                state = agent.transfer(handle)
                while state == "PROC":
                    state = agent.check_xfer_state(handle)
                done = time.perf_counter()
                if state != "DONE":
                    raise RuntimeError(f"NIXL transfer {tag}: {state}")
                arrived, ok = conn.recv()
                agent.release_xfer_handle(handle)
                exact &= ok
                if repeat:
                    seconds.append((arrived or done) - start)
                    posted_s.append(done - start)
            row = _row("nixl", f"WRITE, {'1 desc/block' if layout == 'block' else '64 x 32 KiB/block (vLLM)'}"
                       + (", UCX tcp" if netns_gbit else ""), count, seconds, exact, 1.0, netns_gbit=netns_gbit)
            row["initiator_done_median_s"] = statistics.median(posted_s)
            rows.append(row)
            print(_line(row), flush=True)
    conn.send(("rows", rows))


def run_nixl(args, sizes: list[int], blocks_total: int, net=None, netns_gbit: float = 0.0) -> list[dict]:
    """NIXL's rows: initiator and target on this host, or in hosts a and b of ``net`` (UCX's TCP
    transport on the shaped cable)."""
    context = mp.get_context("spawn")
    to_target, target_end = context.Pipe()
    to_initiator, initiator_end = context.Pipe()
    where = ((net.hosts["a"].netns, _network_tls(args.ucx_tls)), (net.hosts["b"].netns, _network_tls(args.ucx_tls))) \
        if net is not None else (None, None)
    target = context.Process(target=_target_main, args=(target_end, args, blocks_total, where[1]))
    initiator = context.Process(target=_initiator_main, args=(initiator_end, args, blocks_total, sizes, where[0],
                                                               netns_gbit))
    target.start()
    initiator.start()
    try:
        if not to_target.poll(300):
            raise RuntimeError("the NIXL target did not start (see its traceback above)")
        to_initiator.send(to_target.recv())  # the target's metadata and descriptors
        while True:
            if not to_initiator.poll(300):
                raise RuntimeError("the NIXL initiator stalled")
            message = to_initiator.recv()
            if message[0] == "rows":
                return message[1]
            to_target.send(message[1:])  # a job
            to_initiator.send(to_target.recv())  # ready
            to_initiator.send(to_target.recv())  # (arrived, exact)
    finally:
        try:
            to_target.send(None)
        except OSError:
            pass
        for process in (initiator, target):
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


def _into(where: tuple[str, str] | None) -> None:
    """A NIXL process's first step in ``--netns`` mode: into its host's namespace, UCX on the cable."""
    if where is not None:
        import os

        from kvferry.testing import netns

        netns.enter(where[0])
        os.environ.update({"UCX_TLS": where[1], "UCX_NET_DEVICES": netns.DATA_DEV})


def _target_main(conn, args, blocks_total: int, where: tuple[str, str] | None = None) -> None:
    _into(where)
    nixl_target(conn, args, blocks_total)


def _initiator_main(conn, args, blocks_total: int, sizes: list[int], where: tuple[str, str] | None = None,
                    netns_gbit: float = 0.0) -> None:
    _into(where)
    nixl_initiator(conn, args, blocks_total, sizes, netns_gbit)


# ---- report ------------------------------------------------------------------------------------
def _row(system: str, how: str, blocks: int, seconds: list[float], exact: bool, ratio: float,
         link_gbps: float = 0.0, netns_gbit: float = 0.0) -> dict:
    median = statistics.median(seconds)
    ordered = sorted(seconds)
    return {"system": system, "how": how, "blocks": blocks, "bytes": blocks * BLOCK_BYTES, "median_s": median,
            "p90_s": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            "p99_s": ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)], "gbps": blocks * BLOCK_BYTES / median / 1e9,
            "ratio": ratio, "bit_exact": exact, "n": len(seconds), "link_gbps": link_gbps, "netns_gbit": netns_gbit}


def nixl_on_links(rows: list[dict], links: list[float]) -> list[dict]:
    """NIXL cannot be paced: on a link of L GB/s its time is modelled as the larger of its unpaced
    time here and raw bytes / L (it moves every byte), labelled as modelled."""
    out = []
    for link in links:
        for row in rows:
            if row["system"] == "nixl" and "1 desc" in row["how"]:
                seconds = max(row["median_s"], row["bytes"] / (link * 1e9))
                out.append({**row, "how": row["how"] + " (modelled: max(unpaced, bytes / link))", "link_gbps": link,
                            "median_s": seconds, "p90_s": seconds, "gbps": row["bytes"] / seconds / 1e9})
    return out


def _exact(row: dict) -> str:
    return "–" if row.get("bytes_unchecked") else "yes" if row["bit_exact"] else "NO"


def _line(row: dict) -> str:
    size = row["bytes"]
    label = f"{size >> 30} GiB" if size >= 1 << 30 else f"{size >> 20} MiB"
    link = f"{row['link_gbps']:g} GB/s" if row.get("link_gbps") else "unpaced"
    if row.get("netns_gbit"):  # a real cable: its rate in bits, and the tail as p99
        link = f"{row['netns_gbit']:g} Gbit/s veth"
        return (f"| {row['system']} | {row['how']} | {link} | {label} | {row['median_s'] * 1e3:.1f} | "
                f"{row['p99_s'] * 1e3:.1f} | {row['gbps']:.3f} | {row['ratio']:.3f} | {_exact(row)} |")
    return (f"| {row['system']} | {row['how']} | {link} | {label} | {row['median_s'] * 1e3:.3f} | {row['p90_s'] * 1e3:.3f} | "
            f"{row['gbps']:.2f} | {row['ratio']:.3f} | {_exact(row)} |")


def run_local(args, sizes: list[int], blocks_total: int) -> list[dict]:
    """Both systems on one host: unpaced, then kvferry paced on ``--links`` with NIXL modelled there."""
    links = [float(x) for x in args.links.split(",")] if args.links else []
    rows = [] if args.no_kvferry else run_kvferry(args, sizes, blocks_total)
    if not args.no_kvferry:
        for link in links:  # emulated links: the sidecars pace what they send
            rows += run_kvferry(args, [s for s in sizes if s >= args.link_min_bytes], blocks_total, link)
    if not args.no_nixl:
        nixl = run_nixl(args, sizes, blocks_total)
        modelled = [r for r in nixl_on_links(nixl, links) if r["bytes"] >= args.link_min_bytes]
        for row in modelled:
            print(_line(row), flush=True)
        rows += nixl + modelled
    return rows


def sockets_on_cable(net, size: int, gbit: float, streams: tuple[int, ...] = (1, 4), count: int = 3) -> list[dict]:
    """What plain blocking sockets move over the cable, host memory (``transport_bench.py``'s raw
    roles, a thread per stream): the program a user might write instead."""
    bench = str(Path(__file__).resolve().parent / "transport_bench.py")
    a, b = net.hosts["a"], net.hosts["b"]
    rows = []
    for n in streams:
        common = ["--size", str(size), "--count", str(count), "--lanes", str(n), "--host", b.data_ip]
        server = subprocess.Popen(b.command([sys.executable, bench, "--role", "raw-server", *common]),
                                  stdout=subprocess.PIPE, text=True)
        try:
            port = json.loads(server.stdout.readline())["port"]
            sent = subprocess.run(a.command([sys.executable, bench, "--role", "raw-send", "--port", str(port), *common]),
                                  capture_output=True, text=True, timeout=600, check=True)
            server.wait(timeout=60)
        finally:
            server.kill()
        seconds = json.loads(sent.stdout.strip().splitlines()[-1])["seconds"] / count
        rows.append(_row("sockets", f"raw TCP, {n} stream{'s' if n > 1 else ''}, host memory", max(1, size // BLOCK_BYTES),
                         [seconds], True, 1.0, netns_gbit=gbit) | {"bytes_unchecked": True})
        print(_line(rows[-1]), flush=True)
    return rows


def run_netns(args, sizes: list[int], blocks_total: int, rates: list[float]) -> list[dict]:
    """Both systems over a real cable at each rate (Gbit/s), then how ``auto`` fared against raw."""
    from kvferry.testing import netns

    if why := netns.unavailable():
        raise SystemExit(f"--netns: {why}")
    nixl = not args.no_nixl and importlib.util.find_spec("nixl_cu13") is not None
    if not args.no_nixl and not nixl:
        print("(NIXL rows left out: nixl_cu13 does not import here)\n", flush=True)
    rows = []
    for gbit in rates:
        with contextlib.closing(netns.Network(("a", "b"))) as net:
            net.shape_all(gbit * 1000)
            rows += sockets_on_cable(net, max(sizes), gbit)
            if not args.no_kvferry:
                rows += run_kvferry(args, sizes, blocks_total, net=net, netns_gbit=gbit)
            if nixl:
                rows += run_nixl(args, sizes, blocks_total, net=net, netns_gbit=gbit)
    print("\n| link | size | auto chose | auto p50 / raw p50 | raw / link | auto's wire / link |\n"
          "|---|---:|---|---:|---:|---:|")
    for gbit in rates:
        for size in sizes:
            same = [r for r in rows if r["system"] == "kvferry" and r["netns_gbit"] == gbit and r["bytes"] == max(
                1, size // BLOCK_BYTES) * BLOCK_BYTES and not r["how"].endswith("at the receiver")]
            raw = next((r for r in same if r["how"] == "raw"), None)
            auto = next((r for r in same if r["how"].startswith("auto")), None)
            if raw and auto:
                link = gbit / 8
                print(f"| {gbit:g} Gbit/s | {_line(raw).split(' | ')[3]} | {auto['how'][6:-1]} | "
                      f"{auto['median_s'] / raw['median_s']:.3f} | {raw['gbps'] / link:.3f} | "
                      f"{auto['gbps'] / auto['ratio'] / link:.3f} |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gpus", type=int, choices=(1, 2), default=1, help="two: source and destination on two GPUs")
    parser.add_argument("--backend", default="ucxx", help="kvferry's transport: ucxx or tcp")
    parser.add_argument("--ucx-tls", default="tcp,cuda_copy,cuda_ipc")
    parser.add_argument("--tcp-lanes", type=int, default=0, help="kvferry's sockets per link over tcp (0: its default)")
    parser.add_argument("--sizes", default="2M,64M,256M,1G,4G")
    parser.add_argument("--codecs", default="raw,splitzip,auto")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--small-repeats", type=int, default=100, help="repeats of one block, unpaced")
    parser.add_argument("--links", default="", help="emulated links in GB/s for kvferry (e.g. 12.5,25,50)")
    parser.add_argument("--link-min-bytes", type=_size, default="1G", help="sizes run on emulated links")
    parser.add_argument("--no-nixl", action="store_true")
    parser.add_argument("--netns", default="",
                        help="real shaped links in Gbit/s (e.g. 1,2): two namespaces joined by a veth; root only")
    parser.add_argument("--no-axes", action="store_true",
                        help="register the regions without naming their axes (codecs then model channels only)")
    parser.add_argument("--no-kvferry", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sizes = [_size(s) for s in args.sizes.split(",")]
    two = args.device == "cuda" and args.gpus == 2
    args.src_device, args.dst_device = ("cuda:0", "cuda:1") if two else (args.device, args.device)
    blocks_total = max(max(1, s // BLOCK_BYTES) for s in sizes) + 8
    device_name = "CPU"
    if args.device == "cuda":
        import torch

        device_name = torch.cuda.get_device_name()
    rates = [float(x) for x in args.netns.split(",")] if args.netns else []
    where = "two hosts (network namespaces) joined by a shaped veth" if rates else "two processes on one host"
    loop = _event_loop()
    print(f"kvferry vs NIXL, {time.strftime('%Y-%m-%d')}, {device_name}, {where}, "
          f"{'two GPUs' if two else 'one ' + ('GPU' if args.device == 'cuda' else 'CPU')}; "
          f"blocks {list(BLOCK_SHAPE)} bf16 (2 MiB), real KV by position (`demo.llama_blocks`); sidecars on {loop}"
          f"\n`{' '.join(sys.argv)}`\n")
    if rates:
        print("| system | how | link | size | p50 ms | p99 ms | GB/s of KV | ratio | bit-exact |\n"
              "|---|---|---|---:|---:|---:|---:|---:|---|")
        rows = run_netns(args, sizes, blocks_total, rates)
    else:
        print("| system | how | link | size | median ms | p90 ms | GB/s | ratio | bit-exact |\n"
              "|---|---|---|---:|---:|---:|---:|---:|---|")
        rows = run_local(args, sizes, blocks_total)
    if args.json:
        args.json.write_text(json.dumps({"device": device_name, "host": platform.node(), "command": " ".join(sys.argv),
                                         "date": time.strftime("%Y-%m-%d"), "event_loop": loop, "rows": rows}, indent=1))
    return 0 if all(r["bit_exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
