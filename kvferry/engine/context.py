"""What a transfer's IO code works with: ``TransferContext``, exactly the services that the
sender (``outgoing.py``), the receiver (``incoming.py``) and the dispatch of peer messages
(``dispatch.py``) use, each typed, built once by ``engine.py``. They hold no reference back to the
engine: what they may touch is this list, so a new dependency of theirs has to show here, and
they can run over stand-ins."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvferry import codec as codecs, transport

from .blocks import Blocks, Ids
from .codebooks import Codebooks, Learner
from .driver import Driver
from .errors import BadRequest, Conflict
from .ipc import Mapper, WriteEvents
from .leases import Leases
from .links import LinkTable, Pair
from .metrics import Metrics
from .pipeline import BufferPool, CodecRunner
from .policy import Policy
from .regions import Region, RegionTable
from .settings import Settings
from .spin import Spinner
from .transfers import TransferTable


class DataPlane:
    """The data listener and the pool of connections to peers: they exist once the engine has
    started (its ``start`` sets them), after the context that carries them was built."""

    __slots__ = ("listener", "pool")

    def __init__(self) -> None:
        self.listener: transport.Listener | None = None
        self.pool: transport.Pool | None = None


@dataclass(frozen=True, slots=True)
class TransferContext:
    """The services a transfer's IO uses, each for a reason of its own."""

    settings: Settings  # timeouts, chunks in flight, limits, the emulated link
    chunk_bytes: int  # the pipeline's chunk size (``auto`` weighs a transfer in chunks)
    plane: DataPlane  # the sender's pooled connections; the receiver's posted receives and refusals
    driver: Driver  # the only way a transfer's phase changes
    links: LinkTable  # each running transfer's peer link
    transfers: TransferTable  # the receiver records admitted transfers; dispatch finds them
    regions: RegionTable  # the receiver's destinations and references
    codebooks: Codebooks  # named codebooks an announce may ask for
    learner: Learner  # codebooks a sender learns from its data (``bind``)
    policy: Policy  # ``auto``'s choice, and what it learns from each transfer
    codec: CodecRunner  # encode and decode, on the codec's stream or in a thread
    buffers: BufferPool  # receive buffers of streamed chunks
    leases: Leases  # standing same-host leases, held and lent
    mapper: Mapper  # receivers' lent memory, opened once (same-host writes)
    events: WriteEvents  # the events that end same-host writes announced while they run, both sides'
    metrics: Metrics
    spinner: Spinner  # busy-polls after a peer message (dispatch touches it)
    peer_log: transport.RateLimitedLog  # warnings a peer causes, rate-limited

    def log_peer_failure(self, message: str) -> None:
        """A warning caused by a peer, rate-limited (a peer must not be able to flood the log)."""
        self.peer_log.warn(message)

    def reference_for(self, region: Region, name: str, blocks: Blocks, checked: dict[int, Ids]) -> Region:
        """The region ``name`` as the reference of ``region``: the same blocks, layout and device,
        and neither being deleted nor quarantined (its values must be the ones the peer codes
        against). ``checked``: ``blocks`` checked so far, by the number of blocks checked
        against (a transfer's pairs share it: an announce of many pairs checks each count once).

        Raises:
            NotFound, InvalidBlocks, BadRequest, Conflict.
        """
        ref = self.regions.get(name)
        if ref is region:
            raise BadRequest(f"region {name!r} cannot be its own reference")
        if ref.closing:
            raise Conflict(f"reference region {name!r} is being deleted or quarantined")
        if (ref.dtype, ref.block_shape, ref.axes, ref.tensor.device) != (
                region.dtype, region.block_shape, region.axes, region.tensor.device):
            raise BadRequest(f"reference {name!r} holds {ref.dtype}{list(ref.block_shape)} blocks (axes {ref.axes}) on "
                             f"{ref.tensor.device}; region {region.name!r} holds {region.dtype}"
                             f"{list(region.block_shape)} (axes {region.axes}) on {region.tensor.device}")
        if ref.num_blocks not in checked:
            checked[ref.num_blocks] = Ids.of(blocks, ref.num_blocks)
        return ref

    def bind(self, codec: codecs.Codec, codebook: Any, pairs: list[Pair], *, sending: bool = True) -> None:
        """Bind ``codec`` and its codebook to each pair's block layout and reference (``pair.bound``);
        a sender without a codebook learns one from the data where the codec can (``Learner``).

        Raises:
            BadRequest: the codec needs a codebook or layout it was not given, or refuses them.
        """
        if codec.capabilities.decode_needs_codebook and codebook is None:
            raise BadRequest(f"codec {codec.name!r} needs a codebook: name one (PUT /v1/codebooks/{{name}})")
        learn = codec.learn if codec.capabilities.learns and codebook is None and sending else None
        for p in pairs:
            if p.bound_for == codec.name:
                continue
            try:
                book = codebook if learn is None else self.learner.book(codec.name, learn, p)
                p.bound = codec.bind(book, p.region.layout, None if p.reference is None else p.reference.tensor)
                p.bound_for = codec.name
            except codecs.CodecError as exc:
                raise BadRequest(f"codec {codec.name!r} cannot code region {p.region.name!r}: {exc}") from None
