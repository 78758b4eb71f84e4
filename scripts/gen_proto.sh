#!/usr/bin/env bash
# Regenerates the committed gRPC stubs from proto/encoder.proto.
#   scripts/gen_proto.sh [OUT_DIR]   (default: encoder_service/protocol/proto)
# tests/unit/test_proto.py runs this into a temporary directory and compares bytes, so the committed stubs can't
# drift from the .proto. The stubs check the grpcio / protobuf versions at import: regenerating with a newer
# grpcio-tools raises the minimum runtime versions (keep pyproject's pins in step).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/encoder_service/protocol/proto}"
python="${PYTHON:-$root/.venv/bin/python}"
mkdir -p "$out"
"$python" -m grpc_tools.protoc -I "$root/proto" \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" "$root/proto/encoder.proto"
# protoc writes a top-level `import encoder_pb2`; the stubs live in a package, so import relatively.
# (-i.bak + rm: the one in-place form GNU and BSD sed both accept)
sed -i.bak 's/^import encoder_pb2 as encoder__pb2$/from . import encoder_pb2 as encoder__pb2/' "$out/encoder_pb2_grpc.py"
rm -f "$out/encoder_pb2_grpc.py.bak"
grep -q '^from \. import encoder_pb2 as encoder__pb2$' "$out/encoder_pb2_grpc.py"
