"""What a block's dimensions mean, for codecs that model KV by position (K vs V, head, channel).

A region registers its block shape with axis names (``RegionSpec.axes``); the engine turns them
into a ``BlockLayout`` and hands it to ``Codec.bind`` with the codebook, so a codec can refuse a
layout it cannot handle before anything is sent. Known names: ``layer``, ``kv`` (index 0 = K,
1 = V), ``token``, ``head``, ``channel`` (the head dimension). Other names are allowed and mean
nothing to the codecs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import CodebookMismatch

AXIS_NAMES = ("layer", "kv", "token", "head", "channel")


@dataclass(frozen=True)
class BlockLayout:
    """A block's shape and the name of each of its dimensions (the block axis itself excluded)."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.axes):
            raise CodebookMismatch(f"{len(self.axes)} axis names for a block of {len(self.shape)} dimensions")
        if len(set(self.axes)) != len(self.axes):
            raise CodebookMismatch(f"axis names repeat: {list(self.axes)}")
        if "kv" in self.axes and self.shape[self.axes.index("kv")] != 2:
            raise CodebookMismatch(f"the kv axis has {self.shape[self.axes.index('kv')]} entries, not 2 (K, V)")

    @classmethod
    def of(cls, shape: Sequence[int], axes: Sequence[str] | None) -> BlockLayout | None:
        """The layout of blocks of ``shape`` named ``axes``, or None when the axes are not named."""
        return None if axes is None else cls(tuple(int(d) for d in shape), tuple(axes))

    def index(self, name: str) -> int | None:
        """Position of the axis called ``name`` in the block, or None."""
        return self.axes.index(name) if name in self.axes else None

    def size(self, name: str) -> int:
        """Entries along the axis called ``name`` (1 when the block has no such axis)."""
        i = self.index(name)
        return 1 if i is None else self.shape[i]

    def require(self, *names: str, codec: str) -> tuple[int, ...]:
        """Positions of the named axes; ``CodebookMismatch`` naming ``codec`` if one is missing."""
        missing = [n for n in names if n not in self.axes]
        if missing:
            raise CodebookMismatch(f"{codec} needs the block's {', '.join(missing)} axis named "
                                   f"(block axes: {list(self.axes)})")
        return tuple(self.axes.index(n) for n in names)
