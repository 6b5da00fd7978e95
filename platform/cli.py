"""The `pdserve` console script: one subcommand per job, `--help` on each.

Each subcommand's work lives in the module that owns it; this file only parses arguments and
hands over, so `pdserve --help` stays cheap (heavy imports happen inside the handlers).
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Disaggregated LLM serving on Ray: prefill and decode pools, prefix-aware routing, "
                    "UCX KV transfer.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    from pdserve.engine import cli as engine_cli
    engine_cli.register(sub)
    from pdserve.bench import cli as bench_cli
    bench_cli.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
