"""`fastdeploy-r3` command line: `fastdeploy-r3 serve --model DIR [flags]`."""

from __future__ import annotations

import argparse

from fastdeploy_r3.entrypoints.openai.api_server import make_arg_parser, serve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fastdeploy-r3", description="MoE serving with Rollout Routing Replay")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser("serve", help="start the OpenAI-compatible server")
    make_arg_parser(serve_parser)
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(args)


if __name__ == "__main__":
    main()
