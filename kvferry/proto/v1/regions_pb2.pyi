# Generated from proto/kvferry/v1 by proto/generate.py: do not edit.
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Region(_message.Message):
    __slots__ = ("name", "kind", "num_blocks", "block_shape", "dtype", "device", "block_bytes", "busy_transfers", "axes", "memory", "quarantined")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUSY_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    AXES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    num_blocks: int
    block_shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    device: str
    block_bytes: int
    busy_transfers: _containers.RepeatedScalarFieldContainer[str]
    axes: _containers.RepeatedScalarFieldContainer[str]
    memory: str
    quarantined: str
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., block_bytes: _Optional[int] = ..., busy_transfers: _Optional[_Iterable[str]] = ..., axes: _Optional[_Iterable[str]] = ..., memory: _Optional[str] = ..., quarantined: _Optional[str] = ...) -> None: ...

class CreateRegionRequest(_message.Message):
    __slots__ = ("name", "kind", "num_blocks", "block_shape", "dtype", "axes", "shm_name", "ipc_handle", "device", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    AXES_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    num_blocks: int
    block_shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    axes: _containers.RepeatedScalarFieldContainer[str]
    shm_name: str
    ipc_handle: str
    device: int
    offset: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., axes: _Optional[_Iterable[str]] = ..., shm_name: _Optional[str] = ..., ipc_handle: _Optional[str] = ..., device: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class CreateRegionResponse(_message.Message):
    __slots__ = ("region",)
    REGION_FIELD_NUMBER: _ClassVar[int]
    region: Region
    def __init__(self, region: _Optional[_Union[Region, _Mapping]] = ...) -> None: ...

class GetRegionRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetRegionResponse(_message.Message):
    __slots__ = ("region",)
    REGION_FIELD_NUMBER: _ClassVar[int]
    region: Region
    def __init__(self, region: _Optional[_Union[Region, _Mapping]] = ...) -> None: ...

class ListRegionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRegionsResponse(_message.Message):
    __slots__ = ("regions",)
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    def __init__(self, regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ...) -> None: ...

class DeleteRegionRequest(_message.Message):
    __slots__ = ("name", "force", "drain_seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    force: bool
    drain_seconds: float
    def __init__(self, name: _Optional[str] = ..., force: _Optional[bool] = ..., drain_seconds: _Optional[float] = ...) -> None: ...

class DeleteRegionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PutBlocksRequest(_message.Message):
    __slots__ = ("name", "start", "count", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    start: int
    count: int
    data: bytes
    def __init__(self, name: _Optional[str] = ..., start: _Optional[int] = ..., count: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutBlocksResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetBlockRequest(_message.Message):
    __slots__ = ("name", "index")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    name: str
    index: int
    def __init__(self, name: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class GetBlockResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...
