# Generated from proto/kvferry/v1 by proto/generate.py: do not edit.
from kvferry.proto.v1 import blocks_pb2 as _blocks_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Codebook(_message.Message):
    __slots__ = ("name", "codec", "digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    codec: str
    digest: str
    def __init__(self, name: _Optional[str] = ..., codec: _Optional[str] = ..., digest: _Optional[str] = ...) -> None: ...

class PutCodebookRequest(_message.Message):
    __slots__ = ("name", "codec", "document")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    codec: str
    document: str
    def __init__(self, name: _Optional[str] = ..., codec: _Optional[str] = ..., document: _Optional[str] = ...) -> None: ...

class PutCodebookResponse(_message.Message):
    __slots__ = ("codebook",)
    CODEBOOK_FIELD_NUMBER: _ClassVar[int]
    codebook: Codebook
    def __init__(self, codebook: _Optional[_Union[Codebook, _Mapping]] = ...) -> None: ...

class GetCodebookRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetCodebookResponse(_message.Message):
    __slots__ = ("document",)
    DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    document: str
    def __init__(self, document: _Optional[str] = ...) -> None: ...

class CalibrateRequest(_message.Message):
    __slots__ = ("name", "region", "blocks", "codec", "token_axis", "options_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    TOKEN_AXIS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    region: str
    blocks: _blocks_pb2.Blocks
    codec: str
    token_axis: int
    options_json: str
    def __init__(self, name: _Optional[str] = ..., region: _Optional[str] = ..., blocks: _Optional[_Union[_blocks_pb2.Blocks, _Mapping]] = ..., codec: _Optional[str] = ..., token_axis: _Optional[int] = ..., options_json: _Optional[str] = ...) -> None: ...

class CalibrateResponse(_message.Message):
    __slots__ = ("codebook",)
    CODEBOOK_FIELD_NUMBER: _ClassVar[int]
    codebook: Codebook
    def __init__(self, codebook: _Optional[_Union[Codebook, _Mapping]] = ...) -> None: ...
