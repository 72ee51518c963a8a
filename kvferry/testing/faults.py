"""Faults a test sidecar injects into itself, installed by its own entry point
(``python -m kvferry.testing.serve``) and never by the product: production code neither reads nor
pays for them (docs/decisions/022-test-knobs-out-of-settings.md).

Bytes flipped *on the wire* need no hook: ``tests/faults/test_corruption_on_the_wire.py`` flips
them in a real TCP proxy, and the seal refuses them. What only a hook can cause is a peer that
authenticates a frame its encoder got wrong; the receiver's codec check is the last defence then.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

CORRUPT_CHUNK = "KVFERRY_TESTING_CORRUPT_CHUNK"  # environment: chunk index whose frame a sender corrupts


def corrupt_chunk(index: int) -> None:
    """From now on this process's sender flips a byte inside the frame header of chunk ``index``
    of every transfer, before the frame is authenticated: the receiver must refuse it
    (``CorruptFrame``) and write nothing of it.

    The sidecar also stands for one on another host (a host id of its own), so that no transfer
    takes the same-host shortcut around the wire, as the peer of a remote sender could not.
    """
    from kvferry.engine import ipc, streaming

    account = streaming.Chunks._account

    def corrupting(self, t, payload, nbytes, chunk):
        if chunk == index:
            payload = payload.clone()
            payload[20] ^= 0xFF  # inside the frame's header
        return account(self, t, payload, nbytes, chunk)

    streaming.Chunks._account = corrupting
    host = os.urandom(16)
    ipc.host_id = lambda: host


def install_from_environment(environ: MutableMapping[str, str]) -> list[str]:
    """Install the faults ``environ`` names, removing their variables (the sidecar's settings
    refuse unknown ``KVFERRY_*`` variables); returns what was installed, for the log."""
    installed = []
    if CORRUPT_CHUNK in environ:
        index = int(environ.pop(CORRUPT_CHUNK))
        corrupt_chunk(index)
        installed.append(f"corrupt chunk {index}")
    return installed
