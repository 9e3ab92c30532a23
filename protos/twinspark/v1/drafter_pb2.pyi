from twinspark.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftSequence(_message.Message):
    __slots__ = ("request_id", "tokens", "max_draft", "hidden", "hidden_start")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_START_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens: _tensor_pb2.Tensor
    max_draft: int
    hidden: _tensor_pb2.Tensor
    hidden_start: int
    def __init__(self, request_id: _Optional[str] = ..., tokens: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., max_draft: _Optional[int] = ..., hidden: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., hidden_start: _Optional[int] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[DraftSequence]
    def __init__(self, sequences: _Optional[_Iterable[_Union[DraftSequence, _Mapping]]] = ...) -> None: ...

class ProposeReply(_message.Message):
    __slots__ = ("drafts",)
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    drafts: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
    def __init__(self, drafts: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ...) -> None: ...
