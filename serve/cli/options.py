"""The `lilo` command's options, exit codes and the settings they give.

Exit codes: 0 ok, 1 failed or refused, 2 bad usage or settings, 3 (`lilo status` only) not running, or its cluster
does not answer.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster.service import STOP_MARGIN_S
from lilo.settings import COMPRESS_BODIES, Settings, load_settings

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_RUNNING, EXIT_STARTING = 0, 1, 2, 3, 4
DETACHED_CHILD_FLAG = "--detached-child"
# `lilo status` asks the trainers from a child process, a Ray driver (serve.cli.status).
TRAINERS_CHILD_FLAG = "--trainers-child"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lilo", description="Run the lilo multi-LoRA training service.")
    commands = parser.add_subparsers(dest="command", required=True)

    def add_home(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--home", help="state directory of this cluster (default: $LILO_HOME or ~/.lilo)")

    up = commands.add_parser("up", help="start the service on a private local Ray cluster (or --address)")
    add_home(up)
    up.add_argument("--host", dest="http_host", help="address the HTTP API listens on (default 127.0.0.1)")
    up.add_argument("--port", dest="http_port", type=int, help="HTTP API port (default 8000)")
    up.add_argument("--dashboard-port", type=int, help="Ray dashboard port (default 8265)")
    up.add_argument("--num-cpus", type=int, help="CPUs the local Ray head offers (default: all)")
    up.add_argument("--trainers", type=int, help="trainer actors (default: one per GPU, or one without GPUs)")
    up.add_argument("--trainer-ranks",
                    help="devices per trainer, the base model sharded over them (one GPU each; on CPU one process "
                         "each): N, or N,MODEL=N,... per base model (default 1)")
    up.add_argument("--max-adapters", type=int, help="adapter slots per trainer: models it holds at once (default 16)")
    up.add_argument("--max-rank", type=int,
                    help="largest LoRA rank a model may have; every adapter slot holds memory for this rank "
                         "(default 32)")
    up.add_argument("--sampler-slots", type=int,
                    help="further slots per trainer for sampler checkpoints only (default 2)")
    up.add_argument("--samplers", type=float,
                    help="vLLM sampler actors: 0 none (the torch sampler, default), a fraction F < 1 one beside each "
                         "trainer on F of its GPU, a whole number N that many per base model")
    up.add_argument("--sampler-max-loras", type=int,
                    help="adapters each vLLM sampler holds loaded at once (default 8)")
    up.add_argument("--max-batch-tokens", type=int,
                    help="tokens a forward/backward pass computes (packed: real tokens), the coalescing budget "
                         "(default: sized by each trainer from its device's free memory and the base model)")
    up.add_argument("--coalesce-window-ms", type=float,
                    help="longest a pass waits for the next steps of clients stepping in rhythm with it, never more "
                         "than a quarter of the pass; 0: none (default 100)")
    up.add_argument("--trainer-memory-gb", type=float,
                    help="the most memory a trainer process may take; past it the pass that asked fails with a "
                         "message (default: CPU trainers 0.8 of their node's memory, GPU trainers no cap; 0: none)")
    up.add_argument("--host-adapter-mb", type=int,
                    help="host memory per trainer for models paged out of their slots (default: 1/16 of the node's)")
    up.add_argument("--disk-adapter-gb", type=float,
                    help="disk under the home per trainer for models paged out of host memory (default 16)")
    up.add_argument(
        "--base-model", dest="base_models", action="append", metavar="NAME[=PATH]",
        help="base model to serve (a registered name, a model directory, a hub id; NAME=PATH serves the directory "
             "PATH under the name NAME, e.g. the hub id clients ask for); repeat for several, the first is the default",
    )
    up.add_argument(
        "--address", dest="ray_address",
        help="deploy onto this existing Ray cluster (\"auto\" on a `ray up` head) instead of starting one",
    )
    up.add_argument("--follow-gpus", action=argparse.BooleanOptionalAction, default=None,
                    help="trainers follow the cluster's GPUs: one per GPU as GPU nodes join, more on demand, idle ones "
                         "let go (default: on with --address unless --trainers is given; on a cluster with no GPU "
                         "yet, CPU trainers serve until GPU trainers do, which --follow-gpus given skips)")
    up.add_argument("--min-trainers", type=int,
                    help="following the GPUs: never let idle trainers go below this many (default 1)")
    up.add_argument("--max-trainers", type=int,
                    help="following the GPUs: ask the autoscaler for trainers up to this many (default 8)")
    up.add_argument("--trainer-idle-timeout", type=float, dest="trainer_idle_timeout_s", metavar="SECONDS",
                    help="following the GPUs: stop a trainer that held no model this long; 0: never (default 600)")
    up.add_argument("--trainer-wait", type=float, dest="trainer_wait_s", metavar="SECONDS",
                    help="following the GPUs: how long a create_model that found every trainer full waits for the "
                         "one more it asked for, before its 429 (default 30)")
    up.add_argument("--device", help="where trainers compute: auto (CUDA when a trainer has a GPU), cpu or cuda")
    up.add_argument("--compute-nice", type=int,
                    help="how much nicer the trainers' compute threads run, 0-19: steps yield the CPU to the "
                         "API (default 10)")
    up.add_argument("--session-timeout", type=float, dest="session_timeout_s", metavar="SECONDS",
                    help="unload the models of a session that sent no heartbeat for this long (its client died "
                         "without closing); 0: never (default 3600)")
    up.add_argument("--stop-save-timeout", type=float, dest="stop_save_timeout_s", metavar="SECONDS",
                    help="how long the trainers may take, when the service stops, to save every model they hold so "
                         "the next start resumes it; 0: no save (default 40)")
    up.add_argument("--max-body-mb", type=int, help="largest request body the API accepts, in MB (default 64)")
    up.add_argument("--compress-bodies", choices=COMPRESS_BODIES,
                    help="whether SDK clients zstd-compress forward_backward bodies: auto (clients on other "
                         "machines only), always or never (default auto)")
    up.add_argument("--api-keys-file", type=Path, metavar="PATH",
                    help="file of API keys, one `tml-key[=tenant]` per line (default: $LILO_API_KEYS_FILE; none and "
                         "no $LILO_API_KEYS: local mode, any tml- key)")
    up.add_argument("--tenants-file", type=Path, metavar="PATH",
                    help="TOML file of each tenant's share (weight) and limits, re-read when it changes or on SIGHUP "
                         "(default: $LILO_TENANTS_FILE; none: every tenant weight 1, unlimited; docs/operations.md)")
    up.add_argument("--storage", metavar="URI",
                    help="where checkpoints and page files are kept: s3://bucket/prefix, gs://bucket/prefix or a "
                         "directory every node mounts (default: $LILO_STORAGE, else the home on each trainer's node)")
    up.add_argument("--image-dir", dest="image_dirs", action="append", type=Path, metavar="DIR",
                    help="a directory whose images requests may point at (image_asset_pointer chunks, OpenAI "
                         "image_url file:// URLs); repeat for several (default: $LILO_IMAGE_DIRS, else none)")
    up.add_argument("--ledger", metavar="URL",
                    help="the futures ledger: postgresql://user@host/db (default: $LILO_LEDGER, else SQLite "
                         "under the home)")
    up.add_argument("--timeout", dest="startup_timeout_s", type=float, help="seconds to wait for readiness")
    up.add_argument("--detach", action="store_true", help="return once the service answers; stop with `lilo down`")
    up.add_argument(DETACHED_CHILD_FLAG, action="store_true", help=argparse.SUPPRESS)

    status = commands.add_parser("status", help="report the running cluster")
    add_home(status)
    status.add_argument("--json", action="store_true", help="print the state as JSON")
    status.add_argument("--tenants", action="store_true",
                        help="also each tenant's usage (tokens, execute seconds, models, in flight) and limits")
    status.add_argument(TRAINERS_CHILD_FLAG, action="store_true", help=argparse.SUPPRESS)

    down = commands.add_parser("down", help="stop the running cluster and every process it started")
    add_home(down)
    down.add_argument("--timeout", type=float,
                      help="seconds to wait before killing what is left (default: the cluster's --stop-save-timeout "
                           f"plus {STOP_MARGIN_S:.0f}, 60 by default)")

    demo = commands.add_parser("demo", help="four SDK clients fine-tune four adapters at once (starts lilo if needed)")
    add_home(demo)
    demo.add_argument("--steps", type=int, default=25, help="training steps per client (default 25)")
    demo.add_argument("--base-model", dest="demo_base_model", default=None, metavar="NAME",
                      help="base model to fine-tune (default SmolLM2-135M-Instruct; needs a chat tokenizer)")
    demo.add_argument("--learning-rate", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    demo.add_argument("--keep", action="store_true", help="leave a cluster the demo started running afterwards")
    return parser


def settings_of(args: argparse.Namespace) -> Settings:
    fields = ("home", "http_host", "http_port", "dashboard_port", "num_cpus", "trainers", "trainer_ranks",
              "max_adapters",
              "max_rank", "sampler_slots", "samplers", "sampler_max_loras", "max_batch_tokens", "coalesce_window_ms",
              "trainer_memory_gb", "host_adapter_mb", "disk_adapter_gb",
              "base_models",
              "ray_address", "startup_timeout_s", "device", "max_body_mb", "compress_bodies", "api_keys_file",
              "tenants_file",
              "compute_nice", "session_timeout_s", "stop_save_timeout_s", "follow_gpus", "min_trainers",
              "max_trainers", "trainer_idle_timeout_s", "trainer_wait_s", "storage", "ledger", "image_dirs")
    return load_settings(**{name: getattr(args, name, None) for name in fields})
