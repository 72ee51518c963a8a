# Generated from proto/kvferry/v1 by proto/generate.py: do not edit.
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GetHealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetHealthResponse(_message.Message):
    __slots__ = ("status", "version", "backend", "device", "data_address", "codecs", "max_body_bytes")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    MAX_BODY_BYTES_FIELD_NUMBER: _ClassVar[int]
    status: str
    version: str
    backend: str
    device: str
    data_address: str
    codecs: _containers.RepeatedScalarFieldContainer[str]
    max_body_bytes: int
    def __init__(self, status: _Optional[str] = ..., version: _Optional[str] = ..., backend: _Optional[str] = ..., device: _Optional[str] = ..., data_address: _Optional[str] = ..., codecs: _Optional[_Iterable[str]] = ..., max_body_bytes: _Optional[int] = ...) -> None: ...
