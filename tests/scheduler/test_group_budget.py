"""The step budget is one value the group agrees on: a real rank reports the budget it sized its memory for in its
Describe reply, and a real scheduler started with a larger --max-num-batched-tokens refuses to start, saying why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc

from services.rank_worker.distributed import free_port
from twinspark.v1 import rank_pb2, rank_pb2_grpc

TWINSPARK = str(Path(sys.executable).parent / "twinspark")


def test_a_scheduler_with_a_larger_budget_than_the_ranks_refuses_to_start(tiny_default, tmp_path):
    port = free_port()
    with open(tmp_path / "rank0.log", "w") as log:
        rank = subprocess.Popen([TWINSPARK, "serve-rank", "--model", str(tiny_default), "--rank", "0", "--world", "1",
                                 "--master-port", str(free_port()), "--host", "127.0.0.1", "--port", str(port),
                                 "--num-blocks", "64", "--block-size", "16", "--num-slots", "4",
                                 "--max-num-batched-tokens", "96"], stdout=log, stderr=subprocess.STDOUT)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=120)
        described = rank_pb2_grpc.RankWorkerStub(channel).Describe(rank_pb2.DescribeRequest(), timeout=60)
        assert described.max_num_batched_tokens == 96
        scheduler = subprocess.run([TWINSPARK, "serve-scheduler", "--ranks", f"127.0.0.1:{port}", "--host",
                                    "127.0.0.1", "--port", str(free_port()), "--max-num-batched-tokens", "128",
                                    "--startup-timeout", "60"], capture_output=True, text=True, timeout=120)
        assert scheduler.returncode == 2, scheduler.stderr
        assert "--max-num-batched-tokens 128 is more than the 96 the ranks sized their memory for" in scheduler.stderr
    finally:
        rank.kill()
        rank.wait()
