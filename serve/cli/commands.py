"""The `lilo` command: `lilo up`, `lilo status`, `lilo down`, and `lilo demo` (the main job); each command's
work is in its own module (serve.cli.lifecycle, serve.cli.status, serve.cli.demo)."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from cluster.local import prepare_environment, running_state, stop_cluster
from cluster.service import stop_wait_s
from lilo.settings import SettingsError
from serve.cli.lifecycle import cmd_down, cmd_up, up_detached
from serve.cli.options import EXIT_FAILED, EXIT_OK, EXIT_USAGE, build_parser, settings_of
from serve.cli.status import cmd_status


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the demo against the running cluster, or start one for it (and stop it after, unless --keep)."""
    from serve.cli.demo import run_demo

    settings = settings_of(args)
    state = running_state(settings)
    if state is None:
        print("Starting lilo for the demo (`lilo down` stops it; --keep leaves it running after the demo).", flush=True)
        base = ["--base-model", args.demo_base_model] if args.demo_base_model else []
        code = up_detached(settings, ["up", *(["--home", args.home] if args.home else []), *base])
        if code != EXIT_OK:
            return code
    try:
        run_demo(settings.api_url, home=settings.home, base_model=args.demo_base_model or settings.base_models[0],
                 steps=args.steps, learning_rate=args.learning_rate)
        return EXIT_OK
    except KeyboardInterrupt:
        print("Interrupted.", flush=True)
        return EXIT_FAILED
    except Exception as error:  # a failed client or an unreachable service: say so, then clean up
        print(f"The demo failed: {error}", flush=True)
        return EXIT_FAILED
    finally:
        started_here = state is None
        if started_here and not args.keep:
            ours = running_state(settings)
            print("Stopping the lilo cluster the demo started...", flush=True)
            stop_cluster(settings, ours.pid if ours else None, timeout_s=stop_wait_s(ours))


def main(argv: Sequence[str] | None = None) -> int:
    # First of all, before any command imports Ray: Ray reads its environment when it is imported, and without
    # this one takes the machine's first non-loopback address for its own and looks for the loopback-only cluster
    # there, for minutes. Every command gets it, and every process one starts.
    prepare_environment()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        if args.command == "up":
            return cmd_up(args, argv)
        if args.command == "status":
            return cmd_status(args)
        if args.command == "demo":
            return cmd_demo(args)
        return cmd_down(args)
    except SettingsError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
