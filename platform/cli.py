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
                    "KV transfer over TCP or UCX.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    from pdserve.engine import cli as engine_cli
    engine_cli.register(sub)
    from pdserve.bench import cli as bench_cli
    bench_cli.register(sub)
    from pdserve.telemetry import cli as status_cli
    status_cli.register(sub)
    from pdserve.simulate import cli as simulate_cli
    simulate_cli.register(sub)
    _register_serve(sub)
    _register_config(sub)
    return parser


def _register_serve(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="serve the OpenAI-compatible API on Ray Serve (prefill + decode pools)",
                       description="Start (or join) Ray, deploy pdserve from CONFIG (default: the embedded tiny-CPU "
                                   "config: tiny-llama generated on first use, one prefill and one decode replica) "
                                   "and serve until Ctrl-C.")
    s.add_argument("config", nargs="?", help="a ServeConfig YAML file, e.g. configs/tiny-cpu.yaml")
    s.add_argument("--host", help="HTTP bind address (default 127.0.0.1)")
    s.add_argument("--port", type=int, help="HTTP port (default 8000)")
    s.add_argument("--address", help="join this Ray cluster (e.g. auto) instead of starting a local one")
    s.set_defaults(handler=_serve)
    c = sub.add_parser("serve-config", help="print the Ray Serve config YAML for a pdserve config",
                       description="Print what `serve deploy` and KubeRay's serveConfigV2 take for CONFIG.")
    c.add_argument("config", nargs="?", help="a ServeConfig YAML file (default: the embedded config)")
    c.set_defaults(handler=_serve_config)


def _register_config(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("config", help="check pdserve config files",
                       description="Work with pdserve config files (the YAML `pdserve serve`, `serve-config` and "
                                   "the Helm chart's `config` value take).")
    actions = c.add_subparsers(dest="action", metavar="ACTION", required=True)
    v = actions.add_parser("validate", help="check configs and explain every error",
                           description="Check each FILE as a pdserve config. Every error is listed with its field "
                                       "path and what the field is for; a valid file gets a summary of its pools, "
                                       "replicas, parallelism and resources. Exit status 1 when any file has errors.")
    v.add_argument("files", nargs="+", metavar="FILE", help="a pdserve config YAML, e.g. configs/tiny-cpu.yaml")
    v.set_defaults(handler=_config_validate)


def _config_validate(args) -> int:
    from pdserve.config_check import validate_text

    all_valid = True
    for path in args.files:
        try:
            text = open(path, encoding="utf-8").read()
        except OSError as e:
            print(f"{path}: cannot read it ({e.strerror})", file=sys.stderr)
            all_valid = False
            continue
        is_valid, report = validate_text(text, path)
        print(report, file=sys.stdout if is_valid else sys.stderr)
        all_valid &= is_valid
    return 0 if all_valid else 1


def _serve(args) -> int:
    from pdserve.app import load_config
    from pdserve.errors import AddressUnavailableError, ConfigError
    from pdserve.launch import serve_forever

    try:
        serve_forever(load_config(args.config, host=args.host, port=args.port), args.address)
    except (AddressUnavailableError, ConfigError) as e:
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 1
    return 0


def _serve_config(args) -> int:
    import yaml

    from pdserve.app import load_config, serve_config
    from pdserve.errors import ConfigError

    try:
        config = load_config(args.config)
    except ConfigError as e:
        print(f"pdserve serve-config: {e}", file=sys.stderr)
        return 1
    print(yaml.safe_dump(serve_config(config), sort_keys=False), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
