"""The committed gRPC stubs are exactly what protos/generate.sh produces from the .proto files."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

PROTOS = Path(__file__).resolve().parents[2] / "protos"


def test_generated_stubs_are_fresh(tmp_path):
    work = tmp_path / "protos"
    shutil.copytree(PROTOS, work, ignore=shutil.ignore_patterns("*_pb2*.py*", "__pycache__"))
    env_path = str(Path(sys.executable).parent)
    subprocess.run(["bash", str(work / "generate.sh")], check=True, env={"PATH": env_path + ":/usr/bin:/bin"})
    generated = sorted(p.relative_to(work) for p in work.rglob("*_pb2*.py*"))
    assert generated, "generate.sh produced nothing"
    stale = [str(p) for p in generated if (work / p).read_bytes() != (PROTOS / p).read_bytes()]
    missing = [str(p) for p in generated if not (PROTOS / p).exists()]
    assert not stale and not missing, f"stubs out of date ({stale + missing}): run protos/generate.sh and commit"
