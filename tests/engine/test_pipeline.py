"""Where the pipeline codes a chunk: on the event loop for small host chunks and for GPU chunks up
to ``INLINE_GPU_BYTES`` (launching kernels and waiting costs less than a hop to a thread that
slept), in a worker thread for large host chunks; the frames are the same either way."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from kvferry import codec as codecs
from kvferry.engine import pipeline
from kvferry.engine.policy import Policy


def _where(device: str, blocks: int, block_elems: int) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """Encode ``blocks`` blocks with SplitZip through a CodecRunner; which threads coded, and the
    frame beside the codec's own."""
    cache = (torch.randn(blocks, block_elems, generator=torch.Generator().manual_seed(blocks)) * 0.05) \
        .to(torch.bfloat16).to(device)
    ids = torch.arange(blocks - 1, -1, -1, device=device)
    splitzip = codecs.get("splitzip")
    book = splitzip.learn(cache[:4])
    seen = []

    class Spying:
        """SplitZip, noting the thread that codes."""

        name = "splitzip"

        def encode_blocks(self, *args):
            seen.append("loop" if threading.get_ident() == loop_thread else "worker")
            return splitzip.encode_blocks(*args)

    loop_thread = 0

    async def main():
        nonlocal loop_thread
        loop_thread = threading.get_ident()
        runner = pipeline.CodecRunner(torch.device(device), Policy(), lambda direction, s: None)
        return await runner.encode(Spying(), cache, ids, book, cache.numel() * 2)

    frame = asyncio.run(main())
    return seen, frame, splitzip.encode_blocks(cache, ids, book)


def test_host_chunks_are_coded_inline_when_small_and_in_a_worker_when_large():
    seen, frame, expected = _where("cpu", 8, 1024)  # 16 KiB
    assert seen == ["loop"] and torch.equal(frame, expected)
    seen, frame, expected = _where("cpu", 64, 8192)  # 1 MiB
    assert seen == ["worker"] and torch.equal(frame, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_chunks_are_coded_on_the_loop_up_to_their_limit():
    seen, frame, expected = _where("cuda", 512, 65536)  # 64 MiB
    assert seen == ["loop"] and torch.equal(frame, expected)
    blocks = pipeline.INLINE_GPU_BYTES // (2 * 65536) + 16
    seen, frame, expected = _where("cuda", blocks, 65536)
    assert seen == ["worker"] and torch.equal(frame, expected)
