# Generated from proto/kvferry/v1 by proto/generate.py: do not edit.
from kvferry.proto.v1 import blocks_pb2 as _blocks_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransferState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_STATE_UNSPECIFIED: _ClassVar[TransferState]
    TRANSFER_STATE_QUEUED: _ClassVar[TransferState]
    TRANSFER_STATE_RUNNING: _ClassVar[TransferState]
    TRANSFER_STATE_DONE: _ClassVar[TransferState]
    TRANSFER_STATE_FAILED: _ClassVar[TransferState]
    TRANSFER_STATE_CANCELLED: _ClassVar[TransferState]

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_KIND_SNAPSHOT: _ClassVar[EventKind]
    EVENT_KIND_CHANGED: _ClassVar[EventKind]
    EVENT_KIND_NOT_FOUND: _ClassVar[EventKind]
TRANSFER_STATE_UNSPECIFIED: TransferState
TRANSFER_STATE_QUEUED: TransferState
TRANSFER_STATE_RUNNING: TransferState
TRANSFER_STATE_DONE: TransferState
TRANSFER_STATE_FAILED: TransferState
TRANSFER_STATE_CANCELLED: TransferState
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_KIND_SNAPSHOT: EventKind
EVENT_KIND_CHANGED: EventKind
EVENT_KIND_NOT_FOUND: EventKind

class RegionPair(_message.Message):
    __slots__ = ("src", "dst", "src_reference", "dst_reference")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    SRC_REFERENCE_FIELD_NUMBER: _ClassVar[int]
    DST_REFERENCE_FIELD_NUMBER: _ClassVar[int]
    src: str
    dst: str
    src_reference: str
    dst_reference: str
    def __init__(self, src: _Optional[str] = ..., dst: _Optional[str] = ..., src_reference: _Optional[str] = ..., dst_reference: _Optional[str] = ...) -> None: ...

class Transfer(_message.Message):
    __slots__ = ("id", "direction", "state", "peer", "regions", "blocks", "blocks_done", "codec", "chosen_codec", "choice_reason", "lossy", "bytes_raw", "bytes_wire", "ratio", "seconds", "stages", "error", "error_kind", "created")
    class StagesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_DONE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_CODEC_FIELD_NUMBER: _ClassVar[int]
    CHOICE_REASON_FIELD_NUMBER: _ClassVar[int]
    LOSSY_FIELD_NUMBER: _ClassVar[int]
    BYTES_RAW_FIELD_NUMBER: _ClassVar[int]
    BYTES_WIRE_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_KIND_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    id: str
    direction: str
    state: TransferState
    peer: str
    regions: _containers.RepeatedCompositeFieldContainer[RegionPair]
    blocks: int
    blocks_done: int
    codec: str
    chosen_codec: str
    choice_reason: str
    lossy: bool
    bytes_raw: int
    bytes_wire: int
    ratio: float
    seconds: float
    stages: _containers.ScalarMap[str, float]
    error: str
    error_kind: str
    created: float
    def __init__(self, id: _Optional[str] = ..., direction: _Optional[str] = ..., state: _Optional[_Union[TransferState, str]] = ..., peer: _Optional[str] = ..., regions: _Optional[_Iterable[_Union[RegionPair, _Mapping]]] = ..., blocks: _Optional[int] = ..., blocks_done: _Optional[int] = ..., codec: _Optional[str] = ..., chosen_codec: _Optional[str] = ..., choice_reason: _Optional[str] = ..., lossy: _Optional[bool] = ..., bytes_raw: _Optional[int] = ..., bytes_wire: _Optional[int] = ..., ratio: _Optional[float] = ..., seconds: _Optional[float] = ..., stages: _Optional[_Mapping[str, float]] = ..., error: _Optional[str] = ..., error_kind: _Optional[str] = ..., created: _Optional[float] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("peer", "regions", "src_blocks", "dst_blocks", "codec", "codebook", "wait", "submitter", "id")
    PEER_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    CODEBOOK_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    SUBMITTER_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    peer: str
    regions: _containers.RepeatedCompositeFieldContainer[RegionPair]
    src_blocks: _blocks_pb2.Blocks
    dst_blocks: _blocks_pb2.Blocks
    codec: str
    codebook: str
    wait: float
    submitter: str
    id: str
    def __init__(self, peer: _Optional[str] = ..., regions: _Optional[_Iterable[_Union[RegionPair, _Mapping]]] = ..., src_blocks: _Optional[_Union[_blocks_pb2.Blocks, _Mapping]] = ..., dst_blocks: _Optional[_Union[_blocks_pb2.Blocks, _Mapping]] = ..., codec: _Optional[str] = ..., codebook: _Optional[str] = ..., wait: _Optional[float] = ..., submitter: _Optional[str] = ..., id: _Optional[str] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("transfer",)
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    transfer: Transfer
    def __init__(self, transfer: _Optional[_Union[Transfer, _Mapping]] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("id", "wait", "appear")
    ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    APPEAR_FIELD_NUMBER: _ClassVar[int]
    id: str
    wait: float
    appear: float
    def __init__(self, id: _Optional[str] = ..., wait: _Optional[float] = ..., appear: _Optional[float] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("transfer",)
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    transfer: Transfer
    def __init__(self, transfer: _Optional[_Union[Transfer, _Mapping]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("transfer",)
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    transfer: Transfer
    def __init__(self, transfer: _Optional[_Union[Transfer, _Mapping]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("ids", "submitter", "follow", "since", "appear")
    IDS_FIELD_NUMBER: _ClassVar[int]
    SUBMITTER_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    APPEAR_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[str]
    submitter: str
    follow: bool
    since: float
    appear: float
    def __init__(self, ids: _Optional[_Iterable[str]] = ..., submitter: _Optional[str] = ..., follow: _Optional[bool] = ..., since: _Optional[float] = ..., appear: _Optional[float] = ...) -> None: ...

class WatchResponse(_message.Message):
    __slots__ = ("kind", "transfer")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    kind: EventKind
    transfer: Transfer
    def __init__(self, kind: _Optional[_Union[EventKind, str]] = ..., transfer: _Optional[_Union[Transfer, _Mapping]] = ...) -> None: ...

class SubmitAndWatchRequest(_message.Message):
    __slots__ = ("submit",)
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    submit: SubmitRequest
    def __init__(self, submit: _Optional[_Union[SubmitRequest, _Mapping]] = ...) -> None: ...

class SubmitAndWatchResponse(_message.Message):
    __slots__ = ("kind", "transfer")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    kind: EventKind
    transfer: Transfer
    def __init__(self, kind: _Optional[_Union[EventKind, str]] = ..., transfer: _Optional[_Union[Transfer, _Mapping]] = ...) -> None: ...
