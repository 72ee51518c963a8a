"""Where the pipeline codes a chunk: GPU chunks of codecs that launch without waiting are awaited
while the loop runs; on the event loop for small host chunks and for other GPU chunks up
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
from tests.conftest import LoopTurns


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
        """SplitZip, noting the thread that codes (it declares no launching, so every chunk goes
        through ``encode_blocks``)."""

        name = "splitzip"
        capabilities = codecs.Capabilities(lossless=True, standalone=True)

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


@pytest.mark.parametrize("blocks, block_elems", [(8, 1024), (64, 8192)])  # inline, and in a worker
def test_a_deferred_check_is_started_before_the_decode_and_its_verdict_wins(blocks, block_elems):
    """``decode(check=...)``: the check starts before the codec's work and its verdict is taken
    after; a failed verdict is the error, even when the codec refused the frame too."""
    from kvferry import transport

    cache = (torch.randn(blocks, block_elems, generator=torch.Generator().manual_seed(1)) * 0.05).to(torch.bfloat16)
    ids = torch.arange(blocks)
    splitzip = codecs.get("splitzip")
    frame = splitzip.encode_blocks(cache, ids, None)
    order: list[str] = []

    def check(fails: bool):
        def start():
            order.append("start")

            def verdict():
                order.append("verdict")
                if fails:
                    raise transport.CorruptPayload("bytes failed their CRC32C")
            return verdict
        return start

    async def decode(data: torch.Tensor, fails: bool) -> torch.Tensor:
        out = torch.zeros_like(cache)
        runner = pipeline.CodecRunner(torch.device("cpu"), Policy(), lambda direction, s: None)
        await runner.decode(splitzip, data, out, ids, None, cache.numel() * 2, check=check(fails))
        return out

    assert torch.equal(asyncio.run(decode(frame, False)).view(torch.int16), cache.view(torch.int16))
    assert order == ["start", "verdict"]
    with pytest.raises(transport.CorruptPayload):
        asyncio.run(decode(frame, True))
    broken = frame.clone()
    broken[20] ^= 0xFF  # the header: the codec refuses it, but the failed CRC is what is reported
    with pytest.raises(transport.CorruptPayload):
        asyncio.run(decode(broken, True))
    with pytest.raises(codecs.CodecError):
        asyncio.run(decode(broken, False))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_chunks_of_launching_codecs_are_awaited_while_the_loop_runs():
    """SplitZip launches its GPU work and the loop awaits it: another task runs meanwhile, the
    frame and the decoded blocks are the codec's own, and a failed check still wins."""
    from kvferry import transport

    cache = (torch.randn(512, 65536, generator=torch.Generator().manual_seed(2)) * 0.05).to(torch.bfloat16).cuda()
    ids = torch.arange(511, -1, -1, device="cuda")
    splitzip = codecs.get("splitzip")
    book = splitzip.learn(cache[:4])

    async def main(fails: bool):
        runner = pipeline.CodecRunner(torch.device("cuda"), Policy(), lambda direction, s: None)
        async with LoopTurns() as loop:
            await asyncio.sleep(0)
            with torch.cuda.stream(runner._streams["encode"]):
                torch.cuda._sleep(50_000_000)  # the encode's stream busy a while before it
            frame = await runner.encode(splitzip, cache, ids, book, cache.numel() * 2)
            out = torch.zeros_like(cache)

            def check():
                def verdict():
                    if fails:
                        raise transport.CorruptPayload("bytes failed their CRC32C")
                return verdict

            await runner.decode(splitzip, frame, out, ids, book, cache.numel() * 2, check=check)
        return frame, out, loop.turns

    frame, out, turns = asyncio.run(main(False))
    assert turns > 0
    assert torch.equal(frame, splitzip.encode_blocks(cache, ids, book))
    assert torch.equal(out.view(torch.int16), cache.view(torch.int16))
    with pytest.raises(transport.CorruptPayload):
        asyncio.run(main(True))
