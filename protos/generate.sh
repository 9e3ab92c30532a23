#!/usr/bin/env bash
# Regenerate the Python gRPC stubs (twinspark.v1.*_pb2*.py) next to the .proto files.
# Run from anywhere after `pip install -e ".[dev]"` (needs grpcio-tools, pinned so output is reproducible);
# tests/protos/test_stubs_fresh.py fails when the committed stubs differ from what this writes.
set -euo pipefail
cd "$(dirname "$0")"
python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. twinspark/v1/*.proto
