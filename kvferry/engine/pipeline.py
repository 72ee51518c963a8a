"""Running codec work for the pipelines: on the codec's own CUDA stream per direction. GPU chunks
of codecs that launch without waiting (``start_encode_blocks``) are awaited, the loop polling
between other work, so that one chunk is coded while others are sent or received; other GPU
chunks and small host ones run inline (a thread hop costs more than the work, or than launching
kernels and waiting for them), large host ones in a worker thread (so the event loop keeps the
wire busy). Every chunk's time feeds ``auto``'s speeds. And the receive buffers, reused across
chunks and transfers."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from typing import Any, Awaitable, Callable, Iterator

import torch

from kvferry import codec as codecs, transport
from kvferry.codec.staging import on_stream

from .policy import CodecSpeed, Policy
from .spin import to_its_end

# Below this many raw bytes a chunk is coded on the event loop: a thread hop costs ~50-100 µs,
# more than coding a few blocks.
INLINE_BYTES = 256 << 10
# On a GPU the loop only launches kernels and waits for them, ~0.3-0.5 ms for a whole 256 MiB
# chunk on an H200, while a hop to a worker thread that slept costs 0.15-0.35 ms each way there
# (docs/decisions/009-gpu-work-awaited-on-the-event-loop.md): GPU chunks up to this size are
# coded on the loop.
INLINE_GPU_BYTES = 256 << 20


# A same-host GPU write of at most this many bytes is waited for on the event loop: 1 GiB is
# ~0.7 ms of copy on an H200, and its two thread hops cost 0.3-0.45 ms there (peers.py, 256 MiB
# and 1 GiB raw: 1.46 -> 1.01 and 2.03 -> 1.70 ms). Writes share one stream, so others' data waits anyway.
LOOP_GPU_WRITE_BYTES = 1 << 30


def runs_now(device: torch.device, raw_bytes: int) -> bool:
    """Whether to copy ``raw_bytes`` of blocks on the event loop rather than hop to a thread: a
    GPU gather-scatter up to ``LOOP_GPU_WRITE_BYTES`` (the loop waits less than the hops would
    cost), a host one of about a millisecond (4 x ``INLINE_BYTES``)."""
    return raw_bytes <= (LOOP_GPU_WRITE_BYTES if device.type == "cuda" else INLINE_BYTES * 4)


class CodecRunner:
    """Encodes and decodes chunks for the engine; knows no codec by name."""

    def __init__(self, device: torch.device, policy: Policy, on_seconds: Callable[[str, float], None],
                 in_thread: Callable[..., Awaitable[Any]] = asyncio.to_thread, gpu_timeout: float = 30.0):
        # Codec work runs on streams of its own, one per direction: on torch's default (legacy)
        # stream it would wait for, and hold up, UCX's copies into the same GPU.
        self._streams = ({"encode": torch.cuda.Stream(device), "decode": torch.cuda.Stream(device)}
                         if device.type == "cuda" else {})
        self._policy = policy
        self._on_seconds = on_seconds
        self._in_thread = in_thread  # the engine's, which stops its loop spinning meanwhile
        self._gpu_timeout = gpu_timeout
        # Codec calls running now, and how many ever began: a call that saw neither change ran
        # alone, and only its speed is the codec's own (``Policy.observe_codec``).
        self._calls = threading.Lock()
        self._running = 0
        self._began = 0
        # Same-host writes into host memory, one at a time (each spread over torch's intra-op
        # threads): a copy bound by memory bandwidth gains nothing from another one beside it, and
        # eight senders each copying eight at once on two cores starved some copies for seconds.
        self._host_writes = asyncio.Lock()

    async def encode(self, codec: codecs.Codec, cache: torch.Tensor, ids: torch.Tensor, book: Any,
                     raw_bytes: int) -> torch.Tensor:
        if codec.capabilities.starts_blocks and cache.is_cuda:
            return await self._launched("encode", codec, raw_bytes, codec.start_encode_blocks, cache, ids, book)
        return await self._run("encode", codec, cache, raw_bytes, codec.encode_blocks, cache, ids, book)

    async def decode(self, codec: codecs.Codec, frame: torch.Tensor, cache: torch.Tensor, ids: torch.Tensor,
                     book: Any, raw_bytes: int, check: Callable[[], Callable[[], None]] | None = None) -> None:
        """Decode ``frame`` into blocks ``ids`` of ``cache``. ``check`` (a receive's ``start_check``)
        is launched on the decode's stream first and its verdict taken after the decode's wait:
        the frame's CRCs cost no wait of their own, and a mismatch fails the chunk (whose blocks
        are then not reported written)."""
        if codec.capabilities.starts_blocks and cache.is_cuda:
            await self._launched("decode", codec, raw_bytes, codec.start_decode_blocks, frame, cache, ids, book,
                                 check=check)
            return
        await self._run("decode", codec, cache, raw_bytes, codec.decode_blocks, frame, cache, ids, book, check=check)

    def encode_now(self, codec: codecs.Codec, cache: torch.Tensor, ids: torch.Tensor, book: Any,
                   raw_bytes: int) -> torch.Tensor:
        """``encode`` on the caller's thread, for a chunk of at most ``INLINE_BYTES`` (which
        ``encode`` would code inline too) from a caller that cannot await."""
        return self._timed("encode", codec, cache, raw_bytes, codec.encode_blocks, cache, ids, book)

    def decode_now(self, codec: codecs.Codec, frame: torch.Tensor, cache: torch.Tensor, ids: torch.Tensor,
                   book: Any, raw_bytes: int) -> None:
        """``decode`` on the caller's thread, likewise."""
        self._timed("decode", codec, cache, raw_bytes, codec.decode_blocks, frame, cache, ids, book)

    async def call(self, direction: str, device: torch.device, raw_bytes: int,
                   work: Callable[[torch.cuda.Stream | None], Any]) -> Any:
        """Run work that is not a codec's (a same-host write) on the direction's stream, finished
        when this returns: on this thread if it is small (``runs_now``), else on a worker's, one
        host write at a time."""
        if runs_now(device, raw_bytes):
            return self.call_now(direction, device, work)
        if device.type == "cuda":  # on one stream anyway
            return await self._in_thread(self.call_now, direction, device, work)
        async with self._host_writes:
            return await self._in_thread(self.call_now, direction, device, work)

    @contextlib.contextmanager
    def launching(self, direction: str, device: torch.device) -> Iterator[torch.cuda.Stream | None]:
        """The direction's stream (None on the host) for work launched in the block and awaited
        later; if the block raises, what it launched is over before the error goes on (a
        same-host write's lease must outlive its copy)."""
        stream = self._streams.get(direction) if device.type == "cuda" else None
        try:
            yield stream
        except BaseException:
            if stream is not None:
                with contextlib.suppress(RuntimeError):
                    stream.synchronize()
            raise

    def call_now(self, direction: str, device: torch.device, work: Callable[[torch.cuda.Stream | None], Any]) -> Any:
        """``call`` on the caller's thread. ``work`` is given the stream (None on the host) and
        launches on it itself: switching torch's current stream costs more than a one-block copy
        (~50 µs in a sidecar on an H200 host, where the copy's own call took about as much)."""
        with self.launching(direction, device) as stream:
            result = work(stream)
        if stream is not None:
            stream.synchronize()
        return result

    async def _launched(self, direction: str, codec: codecs.Codec, raw_bytes: int, start: Callable, *args: Any,
                        check: Callable[[], Callable[[], None]] | None = None) -> Any:
        """GPU work the loop awaits rather than blocks on: launched on the direction's stream (the
        check first), polled once per turn of the loop, so that UCX's progress and the other
        chunks' sends and receives run meanwhile; then its result, and the check's verdict."""
        started, alone = time.perf_counter(), self._begin()
        stream = self._streams[direction]
        with torch.cuda.stream(stream):
            verdict = check() if check is not None else None
            try:
                pending = start(*args)
            except Exception:
                if verdict is not None:
                    verdict()  # bytes that failed their CRC explain a refused frame
                raise
        try:
            if not pending.ready():  # polled to its end even if the caller is cancelled: the kernels use its regions
                await to_its_end(asyncio.ensure_future(
                    transport.until_ready(pending, timeout=self._gpu_timeout, what=f"{codec.name} {direction}")))
            try:
                with torch.cuda.stream(stream):  # a frame the GPU declined is decoded here, on this stream
                    result = pending.result()
            finally:
                if verdict is not None:
                    verdict()
        finally:
            alone = self._end(alone)
        self._observe(direction, codec, raw_bytes, time.perf_counter() - started, alone)
        return result

    async def _run(self, direction: str, codec: codecs.Codec, cache: torch.Tensor, raw_bytes: int,
                   work: Callable, *args: Any, check: Callable[[], Callable[[], None]] | None = None) -> Any:
        if raw_bytes <= (INLINE_GPU_BYTES if cache.is_cuda else INLINE_BYTES):
            return self._timed(direction, codec, cache, raw_bytes, work, *args, check=check)
        return await self._in_thread(functools.partial(self._timed, check=check), direction, codec, cache, raw_bytes,
                                     work, *args)

    def _timed(self, direction: str, codec: codecs.Codec, cache: torch.Tensor, raw_bytes: int,
               work: Callable, *args: Any, check: Callable[[], Callable[[], None]] | None = None) -> Any:
        started, alone = time.perf_counter(), self._begin()
        stream = self._streams.get(direction) if cache.is_cuda else None
        try:
            with on_stream(stream):
                verdict = check() if check is not None else None
                try:
                    result = work(*args)
                    if stream is not None:
                        stream.synchronize()  # the chunk is done (sent or written) only when its GPU work is
                finally:
                    if verdict is not None:
                        verdict()  # raises for bytes that failed their CRC, which also explain a refused frame
        finally:
            alone = self._end(alone)
        self._observe(direction, codec, raw_bytes, time.perf_counter() - started, alone)
        return result

    def _begin(self) -> int:
        """A codec call starts: its number if it starts alone, else 0."""
        with self._calls:
            self._running += 1
            self._began += 1
            return self._began if self._running == 1 else 0

    def _end(self, began: int) -> bool:
        """It ended: whether it ran alone (no other call running when it began or since)."""
        with self._calls:
            self._running -= 1
            return bool(began) and self._began == began

    def _observe(self, direction: str, codec: codecs.Codec, raw_bytes: int, seconds: float, alone: bool) -> None:
        self._on_seconds(direction, seconds)
        self._policy.observe_codec(codec.name, direction, raw_bytes, seconds, alone)

    def measure(self, candidates: list[codecs.Codec], device: torch.device, nbytes: int, chunk_bytes: int = 0) -> None:
        """Each candidate's speed on this device per pipeline chunk (``chunk_bytes``, default
        ``nbytes``), per call as the pipeline pays it: with the codebook the codec learns once, as
        ``TransferContext.bind`` does, best of three after a warm-up, at ``nbytes`` and a quarter
        of it, so that a call's fixed cost and its cost per byte extrapolate to the chunk
        (entropy's decode of 64 MiB measured a fifth of its speed on a 256 MiB chunk, all of it
        per call). The ratio is the sample's (Gaussian KV-shaped blocks) until real transfers say
        better."""
        block = (16, 8, 128)
        per_block = 16 * 8 * 128 * 2
        blocks = max(8, nbytes // per_block)
        sample = (torch.randn(blocks, *block, generator=torch.Generator().manual_seed(0)) * 0.05).to(torch.bfloat16)
        sample = sample.to(device)
        target = torch.empty_like(sample)
        chunk = chunk_bytes or blocks * per_block
        for codec in candidates:
            points = [self._time(codec, sample[:n], target) for n in (blocks, blocks // 4)]
            speed = self._policy.codecs.setdefault(codec.name, CodecSpeed())
            speed.encode_gbps = _per_chunk(chunk, [(raw, e) for raw, e, _, _ in points])
            speed.decode_gbps = _per_chunk(chunk, [(raw, d) for raw, _, d, _ in points])
            speed.ratio = points[0][0] / points[0][3]

    @staticmethod
    def _time(codec: codecs.Codec, cache: torch.Tensor, target: torch.Tensor) -> tuple[int, float, float, int]:
        """(raw bytes, encode s, decode s, frame bytes) of ``cache``'s blocks, best of three."""
        ids = torch.arange(cache.shape[0], device=cache.device)
        book = codec.bind(codec.learn(cache, None) if codec.capabilities.learns else None, None)
        encode_s, decode_s, frame = [], [], None
        for _ in range(4):
            start = time.perf_counter()
            frame = codec.encode_blocks(cache, ids, book)
            if cache.is_cuda:
                torch.cuda.synchronize(cache.device)
            middle = time.perf_counter()
            codec.decode_blocks(frame, target, ids, None)
            if cache.is_cuda:
                torch.cuda.synchronize(cache.device)
            encode_s.append(middle - start)
            decode_s.append(time.perf_counter() - middle)
        return cache.numel() * cache.element_size(), min(encode_s[1:]), min(decode_s[1:]), frame.numel()


def _per_chunk(chunk: int, points: list[tuple[int, float]]) -> float:
    """GB/s at ``chunk`` bytes a call from two (bytes, seconds) points: a fixed cost per call
    plus a cost per byte (the larger point's speed where the two do not fit that)."""
    (n1, t1), (n2, t2) = points
    per_byte = (t1 - t2) / (n1 - n2) if n1 != n2 else 0.0
    fixed = t1 - per_byte * n1
    if per_byte <= 0 or fixed < 0:
        return n1 / t1 / 1e9
    return chunk / (fixed + per_byte * chunk) / 1e9


class BufferPool:
    """Receive buffers, reused across chunks and transfers (chunk sizes repeat), up to a bound.

    A buffer goes back only after its chunk was decoded: one whose receive failed or was
    cancelled may still be written by a late payload, so it is left to the garbage collector.
    """

    def __init__(self, max_bytes: int):
        self._free: dict[tuple[str, int], list[torch.Tensor]] = {}
        self._bytes = 0
        self._max_bytes = max_bytes

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        stack = self._free.get((str(device), nbytes))
        if stack:
            self._bytes -= nbytes
            return stack.pop()
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        if self._bytes + buffer.numel() <= self._max_bytes:
            self._free.setdefault((str(buffer.device), buffer.numel()), []).append(buffer)
            self._bytes += buffer.numel()
