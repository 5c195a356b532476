from protos.moe_mesh.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExpertForwardRequest(_message.Message):
    __slots__ = ("model_id", "weights_checksum", "layer", "expert_ids", "token_counts", "hidden")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    weights_checksum: str
    layer: int
    expert_ids: _containers.RepeatedScalarFieldContainer[int]
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    hidden: _tensor_pb2.Tensor
    def __init__(self, model_id: _Optional[str] = ..., weights_checksum: _Optional[str] = ..., layer: _Optional[int] = ..., expert_ids: _Optional[_Iterable[int]] = ..., token_counts: _Optional[_Iterable[int]] = ..., hidden: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class ExpertForwardResponse(_message.Message):
    __slots__ = ("output", "service_seconds")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SERVICE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    output: _tensor_pb2.Tensor
    service_seconds: float
    def __init__(self, output: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., service_seconds: _Optional[float] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("model_id", "weights_checksum", "experts", "dtype", "hidden_size", "fast_paths", "region", "stats", "max_message_bytes", "precision", "device")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    FAST_PATHS_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    weights_checksum: str
    experts: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.ExpertKey]
    dtype: _tensor_pb2.DType
    hidden_size: int
    fast_paths: _containers.RepeatedScalarFieldContainer[str]
    region: str
    stats: ExpertStats
    max_message_bytes: int
    precision: str
    device: str
    def __init__(self, model_id: _Optional[str] = ..., weights_checksum: _Optional[str] = ..., experts: _Optional[_Iterable[_Union[_tensor_pb2.ExpertKey, _Mapping]]] = ..., dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., hidden_size: _Optional[int] = ..., fast_paths: _Optional[_Iterable[str]] = ..., region: _Optional[str] = ..., stats: _Optional[_Union[ExpertStats, _Mapping]] = ..., max_message_bytes: _Optional[int] = ..., precision: _Optional[str] = ..., device: _Optional[str] = ...) -> None: ...

class ExpertStats(_message.Message):
    __slots__ = ("forward_calls", "groups", "batches", "tokens")
    FORWARD_CALLS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    forward_calls: int
    groups: int
    batches: int
    tokens: int
    def __init__(self, forward_calls: _Optional[int] = ..., groups: _Optional[int] = ..., batches: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...
