from twinspark.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_NORMAL: _ClassVar[Priority]
    PRIORITY_BACKGROUND: _ClassVar[Priority]

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_QUEUED: _ClassVar[Phase]
    PHASE_PREFILLING: _ClassVar[Phase]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_STOP: _ClassVar[FinishReason]
    FINISH_LENGTH: _ClassVar[FinishReason]
    FINISH_ABORTED: _ClassVar[FinishReason]
    FINISH_ERROR: _ClassVar[FinishReason]
PRIORITY_NORMAL: Priority
PRIORITY_BACKGROUND: Priority
PHASE_QUEUED: Phase
PHASE_PREFILLING: Phase
FINISH_STOP: FinishReason
FINISH_LENGTH: FinishReason
FINISH_ABORTED: FinishReason
FINISH_ERROR: FinishReason

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "sampling", "max_tokens", "stop_token_ids", "ignore_eos", "priority", "no_draft", "trace_context", "grammar", "logprobs", "top_logprobs", "seed_offset", "images", "min_tokens", "thinking", "prompt_logprobs")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    NO_DRAFT_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SEED_OFFSET_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    THINKING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _tensor_pb2.Tensor
    sampling: Sampling
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    priority: Priority
    no_draft: bool
    trace_context: _containers.ScalarMap[str, str]
    grammar: str
    logprobs: bool
    top_logprobs: int
    seed_offset: int
    images: _containers.RepeatedCompositeFieldContainer[Image]
    min_tokens: int
    thinking: ThinkingBudget
    prompt_logprobs: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., priority: _Optional[_Union[Priority, str]] = ..., no_draft: _Optional[bool] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., grammar: _Optional[str] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., seed_offset: _Optional[int] = ..., images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ..., min_tokens: _Optional[int] = ..., thinking: _Optional[_Union[ThinkingBudget, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class ThinkingBudget(_message.Message):
    __slots__ = ("budget", "forced_ids", "end_ids")
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    FORCED_IDS_FIELD_NUMBER: _ClassVar[int]
    END_IDS_FIELD_NUMBER: _ClassVar[int]
    budget: int
    forced_ids: _containers.RepeatedScalarFieldContainer[int]
    end_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, budget: _Optional[int] = ..., forced_ids: _Optional[_Iterable[int]] = ..., end_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("pixel_values", "grid_thw", "digest", "offset", "tokens")
    PIXEL_VALUES_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    pixel_values: _tensor_pb2.Tensor
    grid_thw: _tensor_pb2.Tensor
    digest: bytes
    offset: int
    tokens: int
    def __init__(self, pixel_values: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., grid_thw: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., digest: _Optional[bytes] = ..., offset: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("progress", "tokens", "finished", "prompt_logprobs")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    progress: Progress
    tokens: TokenChunk
    finished: Finished
    prompt_logprobs: PromptLogprobs
    def __init__(self, progress: _Optional[_Union[Progress, _Mapping]] = ..., tokens: _Optional[_Union[TokenChunk, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("start", "logprobs", "ranks", "top_ids", "top_logprobs")
    START_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    start: int
    logprobs: _tensor_pb2.Tensor
    ranks: _tensor_pb2.Tensor
    top_ids: _tensor_pb2.Tensor
    top_logprobs: _tensor_pb2.Tensor
    def __init__(self, start: _Optional[int] = ..., logprobs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., ranks: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., top_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., top_logprobs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("phase", "prefilled")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_FIELD_NUMBER: _ClassVar[int]
    phase: Phase
    prefilled: int
    def __init__(self, phase: _Optional[_Union[Phase, str]] = ..., prefilled: _Optional[int] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("ids", "logprobs", "top_ids", "top_logprobs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _tensor_pb2.Tensor
    logprobs: _tensor_pb2.Tensor
    top_ids: _tensor_pb2.Tensor
    top_logprobs: _tensor_pb2.Tensor
    def __init__(self, ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., logprobs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., top_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., top_logprobs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("reason", "prompt_tokens", "completion_tokens", "cached_tokens", "stop_token_id", "error", "queue_s", "prefill_s", "decode_s", "drafted_tokens", "accepted_tokens")
    REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    stop_token_id: int
    error: str
    queue_s: float
    prefill_s: float
    decode_s: float
    drafted_tokens: int
    accepted_tokens: int
    def __init__(self, reason: _Optional[_Union[FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., stop_token_id: _Optional[int] = ..., error: _Optional[str] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ComponentHealth(_message.Message):
    __slots__ = ("name", "alive", "detail")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    name: str
    alive: bool
    detail: str
    def __init__(self, name: _Optional[str] = ..., alive: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("block_size", "total_blocks", "free_blocks", "total_slots", "free_slots")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    total_blocks: int
    free_blocks: int
    total_slots: int
    free_slots: int
    def __init__(self, block_size: _Optional[int] = ..., total_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_slots: _Optional[int] = ..., free_slots: _Optional[int] = ...) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("healthy", "components", "pool", "running", "waiting", "max_model_len", "model", "prefix_cache_queries", "prefix_cache_hits", "tiers")
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    healthy: bool
    components: _containers.RepeatedCompositeFieldContainer[ComponentHealth]
    pool: PoolStats
    running: int
    waiting: int
    max_model_len: int
    model: str
    prefix_cache_queries: int
    prefix_cache_hits: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    def __init__(self, healthy: _Optional[bool] = ..., components: _Optional[_Iterable[_Union[ComponentHealth, _Mapping]]] = ..., pool: _Optional[_Union[PoolStats, _Mapping]] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., max_model_len: _Optional[int] = ..., model: _Optional[str] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "bytes", "capacity", "entries", "hits", "evictions", "corrupt")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    tier: str
    bytes: int
    capacity: int
    entries: int
    hits: int
    evictions: int
    corrupt: int
    def __init__(self, tier: _Optional[str] = ..., bytes: _Optional[int] = ..., capacity: _Optional[int] = ..., entries: _Optional[int] = ..., hits: _Optional[int] = ..., evictions: _Optional[int] = ..., corrupt: _Optional[int] = ...) -> None: ...
