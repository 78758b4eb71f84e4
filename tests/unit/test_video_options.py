"""The video options are named in several places besides their one table (protocol/video_request.py: OPTIONS,
the names and types every transport carries): the request both ends share (VideoRequest, the client's
VideoSource and the core's VideoInput), the HTTP JSON's VideoJson, the proto's Video message and
preprocessing's VideoOptions (the processor's options: all but frames_fps, the rate of frames given as
images). Each must name the same options, in the same order, with the same types."""

from __future__ import annotations

import dataclasses
import types
import typing

from google.protobuf.descriptor import FieldDescriptor

from encoder_service.api.http import VideoJson
from encoder_service.client.types import VideoSource
from encoder_service.core.types import VideoInput
from encoder_service.preprocessing.video import VideoOptions
from encoder_service.protocol.proto import encoder_pb2 as pb
from encoder_service.protocol.video_request import OPTIONS, VideoRequest

SOURCE_AND_ID = {"data", "frames", "url", "caller_id", "id"}  # what else describes a video
PROTO_TYPES = {FieldDescriptor.TYPE_DOUBLE: float, FieldDescriptor.TYPE_INT64: int, FieldDescriptor.TYPE_BOOL: bool}


def optional_of(annotation) -> type:
    """T of `T | None`."""
    args = typing.get_args(annotation)
    assert typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args
    return next(a for a in args if a is not type(None))


def test_the_shared_request_names_every_option_with_its_type():
    for cls in (VideoRequest, VideoSource, VideoInput):
        hints = typing.get_type_hints(cls)
        fields = [f.name for f in dataclasses.fields(cls) if f.name not in SOURCE_AND_ID]
        assert fields == list(OPTIONS), cls
        assert {name: optional_of(hints[name]) for name in fields} == OPTIONS, cls
        assert cls(fps=2.0, frames_fps=30.0).options() == {"fps": 2.0, "frames_fps": 30.0}


def test_the_http_json_names_every_option_with_its_type():
    fields = {name: f.annotation for name, f in VideoJson.model_fields.items() if name not in SOURCE_AND_ID}
    assert list(fields) == list(OPTIONS)
    assert {name: optional_of(annotation) for name, annotation in fields.items()} == OPTIONS


def test_the_proto_names_every_option_with_its_type():
    fields = [f for f in pb.Video.DESCRIPTOR.fields if f.name not in SOURCE_AND_ID]
    assert [f.name for f in fields] == list(OPTIONS)
    assert all(f.has_presence for f in fields)  # `optional`: unset is not 0
    assert {f.name: PROTO_TYPES[f.type] for f in fields} == OPTIONS


def test_the_processor_options_are_all_but_the_rate_of_given_frames():
    hints = typing.get_type_hints(VideoOptions)
    fields = [f.name for f in dataclasses.fields(VideoOptions)]
    assert fields == [name for name in OPTIONS if name != "frames_fps"]
    assert {name: optional_of(hints[name]) for name in fields} == {k: v for k, v in OPTIONS.items() if k in fields}
