# Generated from proto/kvferry/v1 by proto/generate.py: do not edit.
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Blocks(_message.Message):
    __slots__ = ("ids", "ranges", "spread", "packed")
    IDS_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    SPREAD_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    ids: BlockIds
    ranges: BlockRanges
    spread: SpreadIds
    packed: PackedIds
    def __init__(self, ids: _Optional[_Union[BlockIds, _Mapping]] = ..., ranges: _Optional[_Union[BlockRanges, _Mapping]] = ..., spread: _Optional[_Union[SpreadIds, _Mapping]] = ..., packed: _Optional[_Union[PackedIds, _Mapping]] = ...) -> None: ...

class BlockIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockRange(_message.Message):
    __slots__ = ("start", "count", "stride")
    START_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    start: int
    count: int
    stride: int
    def __init__(self, start: _Optional[int] = ..., count: _Optional[int] = ..., stride: _Optional[int] = ...) -> None: ...

class BlockRanges(_message.Message):
    __slots__ = ("ranges",)
    RANGES_FIELD_NUMBER: _ClassVar[int]
    ranges: _containers.RepeatedCompositeFieldContainer[BlockRange]
    def __init__(self, ranges: _Optional[_Iterable[_Union[BlockRange, _Mapping]]] = ...) -> None: ...

class SpreadIds(_message.Message):
    __slots__ = ("ids", "count", "stride")
    IDS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    count: int
    stride: int
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., count: _Optional[int] = ..., stride: _Optional[int] = ...) -> None: ...

class PackedIds(_message.Message):
    __slots__ = ("ids", "count", "stride")
    IDS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    ids: bytes
    count: int
    stride: int
    def __init__(self, ids: _Optional[bytes] = ..., count: _Optional[int] = ..., stride: _Optional[int] = ...) -> None: ...
