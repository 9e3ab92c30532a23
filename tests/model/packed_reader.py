"""A CPU WeightReader that tells the loader it is on CUDA, so quantized linears stay packed (test-only: on the CPU the
loader hands the model dense weights, and packing is for CUDA; Triton's interpreter computes on the CPU tensors)."""

from __future__ import annotations

from types import SimpleNamespace

from model.weights import WeightReader


class PackedReader:
    def __init__(self, reader: WeightReader) -> None:
        self._reader = reader
        self.device = SimpleNamespace(type="cuda")

    def __getattr__(self, name: str):
        return getattr(self._reader, name)
