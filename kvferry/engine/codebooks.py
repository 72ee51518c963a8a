"""Codebooks: the named ones clients store (``PUT /v1/codebooks``, or calibrated on a region's
blocks), and those a codec learns from a region's own data as transfers go (``Learner``)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import torch

from kvferry import codec as codecs

from . import peer
from .blocks import Blocks
from .errors import BadRequest, NotFound, UnknownCodec
from .links import Pair
from .regions import Region

MAX_CALIBRATION_BYTES = 1 << 30  # the sample a calibration copies, at most

log = logging.getLogger("kvferry.engine")
LEARN_BYTES = 16 << 20  # a codebook learned from the data is learned from at most this much of it,
RELEARN_BYTES = 64 << 20  # or this much in a thread on a GPU (a position-aware codebook fits better)
# A codebook learned from a region's data is relearned, in a thread while transfers go on with
# it, once it is this old: KV's value distribution drifts slowly, a stale codebook costs ratio,
# never exactness, and each relearn costs the host ~1 s of a core (H200 host, 65,536 contexts).
RELEARN_SECONDS = 600.0


def codec_named(name: str) -> codecs.Codec:
    """Raises: UnknownCodec."""
    try:
        return codecs.get(name)
    except codecs.UnknownCodec as exc:
        raise UnknownCodec(str(exc)) from None


class Codebooks:
    """Named codebooks: name -> (codec, codebook, its JSON)."""

    def __init__(self) -> None:
        self.named: dict[str, tuple[str, Any, str]] = {}

    def get(self, name: str) -> tuple[str, Any, str] | None:
        return self.named.get(name)

    def put(self, name: str, codec_name: str, text: str | bytes) -> dict[str, Any]:
        """Store a codebook document for ``codec_name``. Raises: UnknownCodec, BadRequest."""
        codec = codec_named(codec_name)
        try:
            book = codec.codebook_from_json(text)
        except (codecs.CodecError, ValueError, TypeError, RecursionError, OverflowError) as exc:
            raise BadRequest(f"not a {codec_name} codebook: {type(exc).__name__}: {exc}") from None
        return self._keep(name, codec, book)

    async def calibrate(self, name: str, codec_name: str, region: Region, blocks: Blocks | list[int],
                        token_axis: int | None = None, options: dict[str, Any] | None = None) -> dict[str, Any]:
        """Calibrate a codebook on blocks of ``region`` (its axis names and ``options`` go to the
        codec) and store it. The blocks are copied here; the codec fits them in a worker thread, so
        a large sample does not hold up the transfers the event loop runs.

        Raises: InvalidBlocks, UnknownCodec, BadRequest.
        """
        codec = codec_named(codec_name)
        ids = region.resolve(blocks)
        if len(ids) * region.block_bytes > MAX_CALIBRATION_BYTES:
            raise BadRequest(f"calibrating on {len(ids)} blocks of {region.block_bytes} bytes is over "
                             f"{MAX_CALIBRATION_BYTES >> 20} MiB: name fewer blocks")
        bits = codecs.layout_by_name(region.dtype).int_dtype  # index_select lacks some float8 kernels
        sample = region.tensor.view(bits).index_select(0, ids).view(region.tensor.dtype)
        axes = region.axes

        def fit() -> Any:
            if axes:  # the stack, its first axis named: codecs that model positions see one block's
                return codec.calibrate(sample, token_axis=None if token_axis is None else token_axis + 1,
                                       axes=("block", *axes), **(options or {}))
            # no names to go by: the blocks one by one, each a sample of the block's positions
            return codec.calibrate(list(sample), token_axis=token_axis, **(options or {}))

        try:
            book = await asyncio.to_thread(fit)
        except (codecs.CodecError, TypeError, ValueError) as exc:  # TypeError: an option the codec lacks
            raise BadRequest(f"cannot calibrate {codec_name}: {exc}") from None
        return self._keep(name, codec, book)

    def json(self, name: str) -> str:
        """Raises: NotFound."""
        if name not in self.named:
            raise NotFound(f"no codebook named {name!r}")
        return self.named[name][2]

    def for_transfer(self, name: str | None) -> tuple[str, Any, str] | None:
        """The named codebook; it is used if the chosen codec is the one it is for (a transfer
        that ends up raw needs none). Raises: NotFound."""
        if name is None:
            return None  # each chunk calibrates on itself where the codec needs a codebook
        if name not in self.named:
            raise NotFound(f"no codebook named {name!r}")
        return self.named[name]

    def _keep(self, name: str, codec: codecs.Codec, book: Any) -> dict[str, Any]:
        text = book.to_json()
        self.named[name] = (codec.name, book, text)
        return {"name": name, "codec": codec.name, "digest": peer.codebook_digest(text).hex()}


class Learner:
    """Codebooks codecs learn from each region's data (``region.learned``), and their relearning
    in threads."""

    def __init__(self) -> None:
        self.active: dict[tuple[str, str], _Learning] = {}  # (region, codec) -> its learning in a thread
        self._used: dict[tuple[str, str], float] = {}  # (region, codec) -> when its last used book was learned

    def book(self, name: str, learn: Any, p: Pair) -> Any:
        """What codec ``name`` learned from the pair's region. The region's first transfer learns
        at once without the block layout; learning with it (a position-aware codec's 65,536
        contexts of a Llama-shaped block took ~1 s), and relearning from a transfer with four
        times the blocks to learn from, or after ``RELEARN_SECONDS`` from one with at least half
        of them, run in a thread while transfers use what there is."""
        region = p.region
        entry = region.learned.get(name)
        if entry is None:
            sample = _sample(p, LEARN_BYTES)
            entry = region.learned[name] = (learn(sample, None), time.monotonic(), region.layout is None,
                                            sample.shape[0])
        key = (region.name, name)
        p.fresh_book = self._used.get(key) != entry[1]
        self._used[key] = entry[1]
        learning = self.active.get(key)
        n = _sample_blocks(p, _relearn_bytes(region))
        if learning is not None:
            if n >= 4 * learning.blocks:
                learning.then(_relearn_sample(p))
        elif (not entry[2] or n >= 4 * entry[3]
              or (time.monotonic() - entry[1] > RELEARN_SECONDS and 2 * n >= entry[3])):
            self.active[key] = _Learning(self, region, name, learn, _relearn_sample(p))
        return entry[0]

    async def settled(self) -> None:
        """Wait for the codebooks being learned in threads (tests; shutdown)."""
        while self.active:
            await asyncio.gather(*(learning.task for learning in self.active.values()), return_exceptions=True)


def _relearn_bytes(region: Region) -> int:
    return RELEARN_BYTES if region.tensor.is_cuda else LEARN_BYTES


def _relearn_sample(p: Pair) -> tuple[torch.Tensor, Any]:
    """A sample to learn from in a thread, and the event its making records on a GPU (the
    thread's stream waits for it)."""
    sample = _sample(p, _relearn_bytes(p.region))
    made = None
    if sample.is_cuda:
        made = torch.cuda.Event()
        made.record(torch.cuda.current_stream(sample.device))
    return sample, made


def _sample_blocks(p: Pair, limit: int) -> int:
    return max(1, min(p.blocks_per_chunk, len(p.index), limit // max(1, p.region.block_bytes)))


def _sample(p: Pair, limit: int) -> torch.Tensor:
    """The first blocks of a pair's first chunk (at most ``limit`` bytes): what a codec that
    learns its codebook from the data learns it from, at most once per region and
    ``RELEARN_SECONDS``. Learning it per chunk cost a GPU chunk more than its encoding (H200:
    1 GiB of blocks gathered and histogrammed at 49 GB/s, encoded at 1,878)."""
    region = p.region
    bits = codecs.layout_by_name(region.dtype).int_dtype  # index_select lacks some float8 kernels
    ids = p.ids[:_sample_blocks(p, limit)]
    return region.tensor.view(bits).index_select(0, ids).view(region.tensor.dtype)


class _Learning:
    """A codec learning a region's codebook in a thread, then from the sample queued meanwhile
    (a later transfer with more blocks to learn from); the region's entry is unsettled until
    the last is learned."""

    def __init__(self, learner: Learner, region: Region, name: str, learn: Any,
                 sample: tuple[torch.Tensor, Any]):
        self.learner, self.region, self.name, self.learn = learner, region, name, learn
        self.next: tuple[torch.Tensor, Any] | None = None
        self.blocks = sample[0].shape[0]
        book, when, _, blocks = region.learned[name]
        region.learned[name] = (book, when, False, blocks)
        self.task = asyncio.get_running_loop().create_task(self._run(sample), name=f"kvferry-learn-{name}")

    def then(self, sample: tuple[torch.Tensor, Any]) -> None:
        """Learn from ``sample`` next, in place of what was queued."""
        self.next = sample
        self.blocks = max(self.blocks, sample[0].shape[0])

    def _work(self, sample: torch.Tensor, made: Any) -> Any:
        if made is not None:
            torch.cuda.current_stream(sample.device).wait_event(made)
        return self.learn(sample, self.region.layout)

    async def _run(self, sample: tuple[torch.Tensor, Any]) -> None:
        region, name = self.region, self.name
        try:
            while sample is not None:
                try:
                    book = await asyncio.to_thread(self._work, *sample)
                    region.learned[name] = (book, time.monotonic(), False, sample[0].shape[0])
                except Exception as exc:  # the codebook in use stays until the next relearn
                    log.warning("learning a %s codebook of region %r failed: %s", name, region.name, exc)
                sample, self.next = self.next, None
        finally:
            book, _, _, blocks = region.learned[name]
            region.learned[name] = (book, time.monotonic(), True, blocks)
            if self.learner.active.get((region.name, name)) is self:  # not a namesake region's
                del self.learner.active[(region.name, name)]
