"""CRC32C (Castagnoli), the checksum of frame headers and, optionally, of frame streams."""

from __future__ import annotations

import google_crc32c


def crc32c(data: bytes | bytearray | memoryview, initial: int = 0) -> int:
    """CRC32C of ``data``, continuing from ``initial`` (the CRC of what came before)."""
    if initial:
        return google_crc32c.extend(initial, bytes(data))
    return google_crc32c.value(bytes(data))
