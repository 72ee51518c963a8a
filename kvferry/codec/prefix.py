"""The 7 bytes every frame starts with, whatever its codec: magic ``b"KVFZ"``, u16 format version,
u8 codec id (FORMAT.md). This module is the one that packs and checks them; each codec's header
goes on from byte 7 with its own fields, and ``registry.codec_of`` dispatches on the codec id."""

from __future__ import annotations

import struct
from collections.abc import Collection

import torch

from .errors import CorruptFrame

MAGIC = b"KVFZ"
_PREFIX = struct.Struct("<4sHB")
SIZE = _PREFIX.size
CODEC_ID_AT = 6
assert SIZE == CODEC_ID_AT + 1 == 7


def pack(version: int, codec_id: int) -> bytes:
    """The prefix of a frame of format ``version`` written by codec ``codec_id``."""
    return _PREFIX.pack(MAGIC, version, codec_id)


def check_magic(head: bytes) -> None:
    """Raises: CorruptFrame: ``head`` does not start with the magic."""
    magic = bytes(head[:4])
    if magic != MAGIC:
        raise CorruptFrame(f"bad magic {magic!r}, expected {MAGIC!r}")


def check_frame(frame: torch.Tensor) -> None:
    """Raises: CorruptFrame: ``frame`` is not a 1-D uint8 tensor long enough to hold a codec id."""
    if not isinstance(frame, torch.Tensor) or frame.dtype != torch.uint8 or frame.dim() != 1:
        raise CorruptFrame("a frame is a 1-D torch.uint8 tensor")
    if frame.numel() < SIZE:
        raise CorruptFrame(f"frame of {frame.numel()} bytes has no codec id")


def codec_id(head: bytes) -> int:
    """The codec id of a frame starting with ``head`` (``SIZE`` bytes at least), magic checked.

    Raises:
        CorruptFrame: wrong magic.
    """
    check_magic(head)
    return head[CODEC_ID_AT]


def parse(head: bytes, *, version: int, codec_ids: Collection[int] | None = None, name: str | None = None) -> int:
    """The codec id of ``head`` (``SIZE`` bytes at least) after checking, in this order, the magic,
    that the codec id is one of ``codec_ids`` (unless None: a caller that checks it later) and the
    version; ``name`` names the format in the errors.

    Raises:
        CorruptFrame: with the first reason found.
    """
    magic, found_version, found_id = _PREFIX.unpack_from(bytes(head[:SIZE]))
    check_magic(magic)
    if codec_ids is not None and found_id not in codec_ids:
        ids = sorted(codec_ids)
        expected = f"the {name} codec's {ids[0]}" if len(ids) == 1 else f"a {name} codec's ({', '.join(map(str, ids))})"
        raise CorruptFrame(f"codec id {found_id} is not {expected}")
    if found_version != version:
        what = f"{name} format" if name else "format"
        raise CorruptFrame(f"unsupported {what} version {found_version} (this build reads {version})")
    return found_id


class Body(struct.Struct):
    """A codec's header up to its CRC: the prefix, then the codec's own fields (a little-endian
    ``struct`` format without its byte-order character). Codecs ``write`` and ``read`` it; as a
    ``struct.Struct`` it packs and unpacks every field, prefix included (for tools that rewrite
    headers)."""

    def __init__(self, fields: str) -> None:
        super().__init__(_PREFIX.format + fields)

    def write(self, version: int, codec_id: int, *fields: object) -> bytes:
        return self.pack(MAGIC, version, codec_id, *fields)

    def read(self, body: bytes, *, version: int, codec_ids: Collection[int] | None = None,
             name: str | None = None) -> tuple[int, tuple]:
        """(codec id, the codec's fields) of ``body`` (``size`` bytes), the prefix checked as
        ``parse`` does.

        Raises:
            CorruptFrame: the prefix fails its checks.
        """
        codec = parse(body, version=version, codec_ids=codec_ids, name=name)
        return codec, self.unpack(body)[3:]
