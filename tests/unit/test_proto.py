"""The committed gRPC stubs are exactly what scripts/gen_proto.sh makes from proto/encoder.proto."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STUBS = ROOT / "encoder_service" / "protocol" / "proto"
GENERATED = ("encoder_pb2.py", "encoder_pb2.pyi", "encoder_pb2_grpc.py")


def test_regenerating_changes_nothing(tmp_path):
    # grpcio-tools is a test dependency (pyproject's `test` extra): missing, this fails instead of skipping.
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True, env=env,
                   timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(GENERATED)
    tools = importlib.metadata.version("grpcio-tools")
    for name in GENERATED:
        fresh, committed = (tmp_path / name).read_bytes(), (STUBS / name).read_bytes()
        # A different grpcio-tools also changes the bytes (its version is written into the stubs).
        assert fresh == committed, (f"{name} differs from what scripts/gen_proto.sh makes with grpcio-tools "
                                    f"{tools}: regenerate and commit, or use the tools version the stubs name")


def test_stubs_import_as_a_package():
    # The generated grpc module must import its messages relatively (it lives inside encoder_service).
    from encoder_service.protocol.proto import encoder_pb2, encoder_pb2_grpc

    assert encoder_pb2_grpc.EncoderStub is not None
    assert encoder_pb2.DESCRIPTOR.package == "encoder.v1"
    assert set(encoder_pb2.DESCRIPTOR.services_by_name["Encoder"].methods_by_name) == {
        "Encode", "Fetch", "Metadata", "Release"}
