"""The `twinspark` console script: one entry point, one subcommand per job.

Each subcommand lives beside the code it drives and registers itself through a `register(subparsers)` function,
so this file only lists them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (module, help) — each module defines `register(subparsers) -> None` which adds its subcommand(s) and sets
# `func` on the parser to a callable taking the parsed namespace and returning an exit code.
_COMMANDS = (
    "model.checkpoint.cli",
    "model.quantize.cli",
    "services.rank_worker.generate_cli",
    "services.rank_worker.cli",
    "services.scheduler.cli",
    "services.drafter.cli",
    "services.drafter.train_cli",
    "services.gateway.cli",
    "services.launcher.cli",
    "services.evaluate.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="twinspark", description="Serve GLM-5.3-Flash behind an OpenAI-compatible endpoint.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _COMMANDS:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    device = getattr(args, "device", None)
    if isinstance(device, str):  # every subcommand with --device: refuse a device this install cannot run, up front
        from services.common.device_check import device_problem, device_warnings

        problem = device_problem(device)
        if problem:
            print(f"twinspark {args.command}: {problem}", file=sys.stderr)
            return 2
        for warning in device_warnings(device):
            print(f"twinspark {args.command}: warning: {warning}", file=sys.stderr)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
