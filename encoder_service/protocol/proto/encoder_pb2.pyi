from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Image(_message.Message):
    __slots__ = ("data", "url", "caller_id")
    DATA_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    CALLER_ID_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    url: str
    caller_id: str
    def __init__(self, data: _Optional[bytes] = ..., url: _Optional[str] = ..., caller_id: _Optional[str] = ...) -> None: ...

class Frames(_message.Message):
    __slots__ = ("images",)
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, images: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Video(_message.Message):
    __slots__ = ("data", "frames", "url", "caller_id", "fps", "num_frames", "sample_frames", "min_pixels", "max_pixels", "frames_fps")
    DATA_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    CALLER_ID_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MIN_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FPS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    frames: Frames
    url: str
    caller_id: str
    fps: float
    num_frames: int
    sample_frames: bool
    min_pixels: int
    max_pixels: int
    frames_fps: float
    def __init__(self, data: _Optional[bytes] = ..., frames: _Optional[_Union[Frames, _Mapping]] = ..., url: _Optional[str] = ..., caller_id: _Optional[str] = ..., fps: _Optional[float] = ..., num_frames: _Optional[int] = ..., sample_frames: _Optional[bool] = ..., min_pixels: _Optional[int] = ..., max_pixels: _Optional[int] = ..., frames_fps: _Optional[float] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("images", "wait", "return_embeddings", "videos")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    RETURN_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    VIDEOS_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[Image]
    wait: bool
    return_embeddings: bool
    videos: _containers.RepeatedCompositeFieldContainer[Video]
    def __init__(self, images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ..., wait: _Optional[bool] = ..., return_embeddings: _Optional[bool] = ..., videos: _Optional[_Iterable[_Union[Video, _Mapping]]] = ...) -> None: ...

class ImageInfo(_message.Message):
    __slots__ = ("id", "grid_thw", "num_tokens", "row_width", "hidden_size", "layout", "dtype", "cached", "owner")
    ID_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROW_WIDTH_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    id: str
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    row_width: int
    hidden_size: int
    layout: str
    dtype: str
    cached: bool
    owner: str
    def __init__(self, id: _Optional[str] = ..., grid_thw: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., row_width: _Optional[int] = ..., hidden_size: _Optional[int] = ..., layout: _Optional[str] = ..., dtype: _Optional[str] = ..., cached: _Optional[bool] = ..., owner: _Optional[str] = ...) -> None: ...

class VideoInfo(_message.Message):
    __slots__ = ("id", "video_grid_thw", "num_tokens", "tokens_per_group", "num_frames", "sampled_fps", "second_per_grid_t", "group_timestamps", "row_width", "hidden_size", "layout", "dtype", "cached", "owner")
    ID_FIELD_NUMBER: _ClassVar[int]
    VIDEO_GRID_THW_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_GROUP_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FPS_FIELD_NUMBER: _ClassVar[int]
    SECOND_PER_GRID_T_FIELD_NUMBER: _ClassVar[int]
    GROUP_TIMESTAMPS_FIELD_NUMBER: _ClassVar[int]
    ROW_WIDTH_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    id: str
    video_grid_thw: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    tokens_per_group: int
    num_frames: int
    sampled_fps: float
    second_per_grid_t: float
    group_timestamps: _containers.RepeatedScalarFieldContainer[float]
    row_width: int
    hidden_size: int
    layout: str
    dtype: str
    cached: bool
    owner: str
    def __init__(self, id: _Optional[str] = ..., video_grid_thw: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., tokens_per_group: _Optional[int] = ..., num_frames: _Optional[int] = ..., sampled_fps: _Optional[float] = ..., second_per_grid_t: _Optional[float] = ..., group_timestamps: _Optional[_Iterable[float]] = ..., row_width: _Optional[int] = ..., hidden_size: _Optional[int] = ..., layout: _Optional[str] = ..., dtype: _Optional[str] = ..., cached: _Optional[bool] = ..., owner: _Optional[str] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("images", "embeddings", "videos")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    VIDEOS_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[ImageInfo]
    embeddings: _containers.RepeatedScalarFieldContainer[bytes]
    videos: _containers.RepeatedCompositeFieldContainer[VideoInfo]
    def __init__(self, images: _Optional[_Iterable[_Union[ImageInfo, _Mapping]]] = ..., embeddings: _Optional[_Iterable[bytes]] = ..., videos: _Optional[_Iterable[_Union[VideoInfo, _Mapping]]] = ...) -> None: ...

class FetchItem(_message.Message):
    __slots__ = ("id", "offset")
    ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    id: str
    offset: int
    def __init__(self, id: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("items", "start", "end", "shm", "max_message_bytes", "pickup")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PICKUP_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[FetchItem]
    start: int
    end: int
    shm: ShmTarget
    max_message_bytes: int
    pickup: bool
    def __init__(self, items: _Optional[_Iterable[_Union[FetchItem, _Mapping]]] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., shm: _Optional[_Union[ShmTarget, _Mapping]] = ..., max_message_bytes: _Optional[int] = ..., pickup: _Optional[bool] = ...) -> None: ...

class ShmTarget(_message.Message):
    __slots__ = ("name", "offset", "by_position")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    by_position: bool
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., by_position: _Optional[bool] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("id", "position", "row_start", "row_end")
    ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    ROW_END_FIELD_NUMBER: _ClassVar[int]
    id: str
    position: int
    row_start: int
    row_end: int
    def __init__(self, id: _Optional[str] = ..., position: _Optional[int] = ..., row_start: _Optional[int] = ..., row_end: _Optional[int] = ...) -> None: ...

class FetchHeader(_message.Message):
    __slots__ = ("version", "dtype", "row_width", "layout", "num_rows", "segments", "shm_bytes", "pickup_token", "pickup_port")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROW_WIDTH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    SHM_BYTES_FIELD_NUMBER: _ClassVar[int]
    PICKUP_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PICKUP_PORT_FIELD_NUMBER: _ClassVar[int]
    version: int
    dtype: str
    row_width: int
    layout: str
    num_rows: int
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    shm_bytes: int
    pickup_token: str
    pickup_port: int
    def __init__(self, version: _Optional[int] = ..., dtype: _Optional[str] = ..., row_width: _Optional[int] = ..., layout: _Optional[str] = ..., num_rows: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., shm_bytes: _Optional[int] = ..., pickup_token: _Optional[str] = ..., pickup_port: _Optional[int] = ...) -> None: ...

class FetchChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: FetchHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[FetchHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released", "invalid")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    INVALID_FIELD_NUMBER: _ClassVar[int]
    released: int
    invalid: _containers.RepeatedCompositeFieldContainer[InvalidId]
    def __init__(self, released: _Optional[int] = ..., invalid: _Optional[_Iterable[_Union[InvalidId, _Mapping]]] = ...) -> None: ...

class InvalidId(_message.Message):
    __slots__ = ("id", "reason")
    ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    id: str
    reason: str
    def __init__(self, id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class MetadataRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MetadataResponse(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...
