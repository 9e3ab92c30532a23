from twinspark.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TierMoveKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_SAVE: _ClassVar[TierMoveKind]
    TIER_LOAD: _ClassVar[TierMoveKind]
    TIER_SPILL: _ClassVar[TierMoveKind]
    TIER_DROP: _ClassVar[TierMoveKind]
TIER_SAVE: TierMoveKind
TIER_LOAD: TierMoveKind
TIER_SPILL: TierMoveKind
TIER_DROP: TierMoveKind

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeReply(_message.Message):
    __slots__ = ("rank", "world", "fingerprint", "settings", "num_blocks", "block_size", "num_slots", "vocab_size", "eos_token_ids", "max_model_len", "model", "instance_id", "tier_host_bytes", "tier_disk_bytes", "block_bytes", "state_bytes", "max_num_batched_tokens")
    class SettingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world: int
    fingerprint: str
    settings: _containers.ScalarMap[str, str]
    num_blocks: int
    block_size: int
    num_slots: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_model_len: int
    model: str
    instance_id: str
    tier_host_bytes: int
    tier_disk_bytes: int
    block_bytes: int
    state_bytes: int
    max_num_batched_tokens: int
    def __init__(self, rank: _Optional[int] = ..., world: _Optional[int] = ..., fingerprint: _Optional[str] = ..., settings: _Optional[_Mapping[str, str]] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_slots: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_model_len: _Optional[int] = ..., model: _Optional[str] = ..., instance_id: _Optional[str] = ..., tier_host_bytes: _Optional[int] = ..., tier_disk_bytes: _Optional[int] = ..., block_bytes: _Optional[int] = ..., state_bytes: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ...) -> None: ...

class TierListRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierEntry(_message.Message):
    __slots__ = ("key", "state", "pos", "chain", "mtime")
    KEY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    POS_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    MTIME_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    state: bool
    pos: int
    chain: bytes
    mtime: float
    def __init__(self, key: _Optional[bytes] = ..., state: _Optional[bool] = ..., pos: _Optional[int] = ..., chain: _Optional[bytes] = ..., mtime: _Optional[float] = ...) -> None: ...

class TierListReply(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[TierEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[TierEntry, _Mapping]]] = ...) -> None: ...

class TierMove(_message.Message):
    __slots__ = ("kind", "block_keys", "blocks", "state_key", "slot", "pos", "chain", "to_disk")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STATE_KEY_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    POS_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    TO_DISK_FIELD_NUMBER: _ClassVar[int]
    kind: TierMoveKind
    block_keys: _containers.RepeatedScalarFieldContainer[bytes]
    blocks: _tensor_pb2.Tensor
    state_key: bytes
    slot: int
    pos: int
    chain: bytes
    to_disk: bool
    def __init__(self, kind: _Optional[_Union[TierMoveKind, str]] = ..., block_keys: _Optional[_Iterable[bytes]] = ..., blocks: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., state_key: _Optional[bytes] = ..., slot: _Optional[int] = ..., pos: _Optional[int] = ..., chain: _Optional[bytes] = ..., to_disk: _Optional[bool] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("round", "token_ids", "starts", "lengths", "slots", "block_tables", "sample_rows", "temperature", "top_p", "top_k", "min_p", "seed", "request_ids", "checksum", "state_copies", "verify", "want_hidden", "trace_context", "mask_index", "bitmask", "logprobs_k", "prompt", "tier_moves", "images", "penalties", "score_rows", "score_ids", "score_k", "hidden_layers", "steps")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STARTS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ROWS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    STATE_COPIES_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    WANT_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MASK_INDEX_FIELD_NUMBER: _ClassVar[int]
    BITMASK_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_K_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TIER_MOVES_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    PENALTIES_FIELD_NUMBER: _ClassVar[int]
    SCORE_ROWS_FIELD_NUMBER: _ClassVar[int]
    SCORE_IDS_FIELD_NUMBER: _ClassVar[int]
    SCORE_K_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    round: int
    token_ids: _tensor_pb2.Tensor
    starts: _tensor_pb2.Tensor
    lengths: _tensor_pb2.Tensor
    slots: _tensor_pb2.Tensor
    block_tables: _tensor_pb2.Tensor
    sample_rows: _tensor_pb2.Tensor
    temperature: _tensor_pb2.Tensor
    top_p: _tensor_pb2.Tensor
    top_k: _tensor_pb2.Tensor
    min_p: _tensor_pb2.Tensor
    seed: _tensor_pb2.Tensor
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    checksum: str
    state_copies: _tensor_pb2.Tensor
    verify: _tensor_pb2.Tensor
    want_hidden: bool
    trace_context: _containers.ScalarMap[str, str]
    mask_index: _tensor_pb2.Tensor
    bitmask: _tensor_pb2.Tensor
    logprobs_k: _tensor_pb2.Tensor
    prompt: _tensor_pb2.Tensor
    tier_moves: _containers.RepeatedCompositeFieldContainer[TierMove]
    images: _containers.RepeatedCompositeFieldContainer[ImageRows]
    penalties: RowPenalties
    score_rows: _tensor_pb2.Tensor
    score_ids: _tensor_pb2.Tensor
    score_k: int
    hidden_layers: _containers.RepeatedScalarFieldContainer[int]
    steps: int
    def __init__(self, round: _Optional[int] = ..., token_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., starts: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., lengths: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., slots: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., block_tables: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., sample_rows: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., temperature: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., top_p: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., top_k: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., min_p: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., seed: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., request_ids: _Optional[_Iterable[str]] = ..., checksum: _Optional[str] = ..., state_copies: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., verify: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., want_hidden: _Optional[bool] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., mask_index: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., bitmask: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., logprobs_k: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., prompt: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., tier_moves: _Optional[_Iterable[_Union[TierMove, _Mapping]]] = ..., images: _Optional[_Iterable[_Union[ImageRows, _Mapping]]] = ..., penalties: _Optional[_Union[RowPenalties, _Mapping]] = ..., score_rows: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., score_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., score_k: _Optional[int] = ..., hidden_layers: _Optional[_Iterable[int]] = ..., steps: _Optional[int] = ...) -> None: ...

class RowPenalties(_message.Message):
    __slots__ = ("rows", "presence", "frequency", "repetition", "seen_ids", "seen_counts", "bias_ids", "bias_values", "banned_ids")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_FIELD_NUMBER: _ClassVar[int]
    SEEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    BIAS_IDS_FIELD_NUMBER: _ClassVar[int]
    BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    BANNED_IDS_FIELD_NUMBER: _ClassVar[int]
    rows: _tensor_pb2.Tensor
    presence: _tensor_pb2.Tensor
    frequency: _tensor_pb2.Tensor
    repetition: _tensor_pb2.Tensor
    seen_ids: _tensor_pb2.Tensor
    seen_counts: _tensor_pb2.Tensor
    bias_ids: _tensor_pb2.Tensor
    bias_values: _tensor_pb2.Tensor
    banned_ids: _tensor_pb2.Tensor
    def __init__(self, rows: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., presence: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., frequency: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., repetition: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., seen_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., seen_counts: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., bias_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., bias_values: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., banned_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class ImageRows(_message.Message):
    __slots__ = ("pixel_values", "grid_thw", "row", "first", "count", "digest")
    PIXEL_VALUES_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    pixel_values: _tensor_pb2.Tensor
    grid_thw: _tensor_pb2.Tensor
    row: int
    first: int
    count: int
    digest: bytes
    def __init__(self, pixel_values: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., grid_thw: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., row: _Optional[int] = ..., first: _Optional[int] = ..., count: _Optional[int] = ..., digest: _Optional[bytes] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("round", "rank", "sampled", "forward_ms", "sample_ms", "error", "accepted", "hidden", "logprobs", "top_ids", "top_logprobs", "refused", "tier_bad", "score_logprobs", "score_ranks", "score_top_ids", "score_top_logprobs", "layer_hidden")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_MS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    TIER_BAD_FIELD_NUMBER: _ClassVar[int]
    SCORE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SCORE_RANKS_FIELD_NUMBER: _ClassVar[int]
    SCORE_TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    SCORE_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LAYER_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    round: int
    rank: int
    sampled: _tensor_pb2.Tensor
    forward_ms: float
    sample_ms: float
    error: str
    accepted: _tensor_pb2.Tensor
    hidden: _tensor_pb2.Tensor
    logprobs: _tensor_pb2.Tensor
    top_ids: _tensor_pb2.Tensor
    top_logprobs: _tensor_pb2.Tensor
    refused: bool
    tier_bad: _containers.RepeatedScalarFieldContainer[bytes]
    score_logprobs: _tensor_pb2.Tensor
    score_ranks: _tensor_pb2.Tensor
    score_top_ids: _tensor_pb2.Tensor
    score_top_logprobs: _tensor_pb2.Tensor
    layer_hidden: _tensor_pb2.Tensor
    def __init__(self, round: _Optional[int] = ..., rank: _Optional[int] = ..., sampled: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., forward_ms: _Optional[float] = ..., sample_ms: _Optional[float] = ..., error: _Optional[str] = ..., accepted: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., hidden: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., logprobs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., top_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., top_logprobs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., refused: _Optional[bool] = ..., tier_bad: _Optional[_Iterable[bytes]] = ..., score_logprobs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., score_ranks: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., score_top_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., score_top_logprobs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., layer_hidden: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...
