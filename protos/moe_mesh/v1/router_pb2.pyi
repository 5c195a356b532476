from protos.moe_mesh.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logprobs")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ...) -> None: ...

class RouterGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ...) -> None: ...

class RouterGenerateResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "prompt_tokens", "completion_tokens", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _types_pb2.FinishReason
    prompt_tokens: int
    completion_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_types_pb2.TokenLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_types_pb2.FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_types_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class RouterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExpertPlacement(_message.Message):
    __slots__ = ("backend", "experts", "region", "precision")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    backend: str
    experts: str
    region: str
    precision: str
    def __init__(self, backend: _Optional[str] = ..., experts: _Optional[str] = ..., region: _Optional[str] = ..., precision: _Optional[str] = ...) -> None: ...

class RouterStatus(_message.Message):
    __slots__ = ("model_id", "architecture", "vocab_size", "max_model_len", "running", "waiting", "steps", "num_layers", "num_experts", "tokens_routed", "failovers", "placement", "registry_stale", "utilization", "utilization_window_s", "region", "expert_bytes", "colocated_bytes", "colocate_budget_bytes", "promotions", "demotions", "pinned_hot", "pinned_remote", "moe_layers", "remote_calls", "tokens_colocated", "hedges", "ejections", "replicas", "micro_batches_setting", "micro_batches", "ta_ms", "te_ms", "tc_ms", "kv_block_size", "kv_blocks_total", "kv_blocks_used", "kv_blocks_cached", "prefix_cache_query_tokens", "prefix_cache_hit_tokens", "preemptions")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_ROUTED_FIELD_NUMBER: _ClassVar[int]
    FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_STALE_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    EXPERT_BYTES_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COLOCATE_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PINNED_HOT_FIELD_NUMBER: _ClassVar[int]
    PINNED_REMOTE_FIELD_NUMBER: _ClassVar[int]
    MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_COLOCATED_FIELD_NUMBER: _ClassVar[int]
    HEDGES_FIELD_NUMBER: _ClassVar[int]
    EJECTIONS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_SETTING_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    TA_MS_FIELD_NUMBER: _ClassVar[int]
    TE_MS_FIELD_NUMBER: _ClassVar[int]
    TC_MS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    architecture: str
    vocab_size: int
    max_model_len: int
    running: int
    waiting: int
    steps: int
    num_layers: int
    num_experts: int
    tokens_routed: _containers.RepeatedScalarFieldContainer[int]
    failovers: int
    placement: _containers.RepeatedCompositeFieldContainer[ExpertPlacement]
    registry_stale: bool
    utilization: _containers.RepeatedScalarFieldContainer[float]
    utilization_window_s: float
    region: str
    expert_bytes: int
    colocated_bytes: int
    colocate_budget_bytes: int
    promotions: int
    demotions: int
    pinned_hot: str
    pinned_remote: str
    moe_layers: _containers.RepeatedScalarFieldContainer[int]
    remote_calls: int
    tokens_colocated: int
    hedges: int
    ejections: int
    replicas: _containers.RepeatedCompositeFieldContainer[ExpertReplica]
    micro_batches_setting: str
    micro_batches: int
    ta_ms: float
    te_ms: float
    tc_ms: float
    kv_block_size: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    preemptions: int
    def __init__(self, model_id: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., steps: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_experts: _Optional[int] = ..., tokens_routed: _Optional[_Iterable[int]] = ..., failovers: _Optional[int] = ..., placement: _Optional[_Iterable[_Union[ExpertPlacement, _Mapping]]] = ..., registry_stale: _Optional[bool] = ..., utilization: _Optional[_Iterable[float]] = ..., utilization_window_s: _Optional[float] = ..., region: _Optional[str] = ..., expert_bytes: _Optional[int] = ..., colocated_bytes: _Optional[int] = ..., colocate_budget_bytes: _Optional[int] = ..., promotions: _Optional[int] = ..., demotions: _Optional[int] = ..., pinned_hot: _Optional[str] = ..., pinned_remote: _Optional[str] = ..., moe_layers: _Optional[_Iterable[int]] = ..., remote_calls: _Optional[int] = ..., tokens_colocated: _Optional[int] = ..., hedges: _Optional[int] = ..., ejections: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[ExpertReplica, _Mapping]]] = ..., micro_batches_setting: _Optional[str] = ..., micro_batches: _Optional[int] = ..., ta_ms: _Optional[float] = ..., te_ms: _Optional[float] = ..., tc_ms: _Optional[float] = ..., kv_block_size: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., prefix_cache_query_tokens: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., preemptions: _Optional[int] = ...) -> None: ...

class ExpertReplica(_message.Message):
    __slots__ = ("backend", "transport", "fast_path", "fast_path_calls", "fast_path_fallbacks", "fallback_causes")
    class FallbackCausesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    FAST_PATH_FIELD_NUMBER: _ClassVar[int]
    FAST_PATH_CALLS_FIELD_NUMBER: _ClassVar[int]
    FAST_PATH_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_CAUSES_FIELD_NUMBER: _ClassVar[int]
    backend: str
    transport: str
    fast_path: str
    fast_path_calls: int
    fast_path_fallbacks: int
    fallback_causes: _containers.ScalarMap[str, int]
    def __init__(self, backend: _Optional[str] = ..., transport: _Optional[str] = ..., fast_path: _Optional[str] = ..., fast_path_calls: _Optional[int] = ..., fast_path_fallbacks: _Optional[int] = ..., fallback_causes: _Optional[_Mapping[str, int]] = ...) -> None: ...
