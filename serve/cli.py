"""The `lilo` command: `lilo up`, `lilo status`, `lilo down`, and `lilo demo` (the main job).

`lilo up` runs a supervisor in the foreground (Ctrl-C stops everything it started); `lilo up --detach` runs the
same supervisor in the background, shows its progress until the service answers, and returns. Exit codes: 0 ok,
1 failed or refused, 2 bad usage or settings, 3 (`lilo status` only) not running, or its cluster does not answer.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

from cluster.local import (
    ClusterError,
    ClusterState,
    answers,
    check_ports_free,
    connect_driver,
    healthz,
    prepare_environment,
    read_state,
    running_state,
    stop_cluster,
)
from cluster.service import STOP_MARGIN_S, AlreadySupervised, ServeApp, stop_wait_s, supervise
from lilo.settings import Settings, SettingsError, load_settings

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_RUNNING = 0, 1, 2, 3
DETACHED_CHILD_FLAG = "--detached-child"
# `lilo status` asks the trainers from a child process, a Ray driver, which it kills after this long: a driver
# retries a cluster that does not answer for minutes, deaf to SIGTERM.
TRAINERS_CHILD_FLAG = "--trainers-child"
TRAINER_QUERY_TIMEOUT_S = 20.0


class Progress:
    """Timestamped progress lines, flushed at once so a follower of the log sees them as they happen."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self._t0

    def __call__(self, message: str) -> None:
        print(f"[lilo {self.elapsed_s:5.1f}s] {message}", flush=True)


def _parser() -> argparse.ArgumentParser:
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
                    help="padded tokens per forward/backward pass, the coalescing budget and the micro-batch size "
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
        "--base-model", dest="base_models", action="append", metavar="NAME",
        help="base model to serve; repeat for several, the first is the default",
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
    up.add_argument("--api-keys-file", type=Path, metavar="PATH",
                    help="file of API keys, one `tml-key[=tenant]` per line (default: $LILO_API_KEYS_FILE; none and "
                         "no $LILO_API_KEYS: local mode, any tml- key)")
    up.add_argument("--tenants-file", type=Path, metavar="PATH",
                    help="TOML file of each tenant's share (weight) and limits, re-read when it changes or on SIGHUP "
                         "(default: $LILO_TENANTS_FILE; none: every tenant weight 1, unlimited; docs/operations.md)")
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


def _settings(args: argparse.Namespace) -> Settings:
    fields = ("home", "http_host", "http_port", "dashboard_port", "num_cpus", "trainers", "trainer_ranks",
              "max_adapters",
              "max_rank", "sampler_slots", "samplers", "sampler_max_loras", "max_batch_tokens", "coalesce_window_ms",
              "trainer_memory_gb", "host_adapter_mb", "disk_adapter_gb",
              "base_models",
              "ray_address", "startup_timeout_s", "device", "max_body_mb", "api_keys_file", "tenants_file",
              "compute_nice", "session_timeout_s", "stop_save_timeout_s", "follow_gpus", "min_trainers",
              "max_trainers", "trainer_idle_timeout_s", "trainer_wait_s")
    return load_settings(**{name: getattr(args, name, None) for name in fields})


def _already_running_message(state: ClusterState) -> str:
    return (
        f"lilo is already running at {state.api_url} (pid {state.pid}, home {state.home}).\n"
        "Use it as it is, or stop it first with `lilo down`."
    )


def _print_ready(settings: Settings, startup_s: float, detached: bool) -> None:
    print(f"\nlilo is ready in {startup_s:.1f} s", flush=True)
    print(f"  Tinker API:  {settings.api_url}   (TINKER_BASE_URL={settings.api_url})", flush=True)
    if settings.ray_address is None:
        print(f"  Dashboard:   {settings.dashboard_url}", flush=True)
    print(f"  Home:        {settings.home}", flush=True)
    if settings.local_mode:
        print("  API keys:    local mode: any key starting with tml- (e.g. TINKER_API_KEY=tml-local)", flush=True)
    else:
        digests = settings.api_key_digests()
        print(f"  API keys:    {len(digests)} configured, {len(set(digests.values()))} tenant(s)", flush=True)
    stop_hint = "Stop it with `lilo down`." if detached else "Press Ctrl-C to stop."
    print(stop_hint, flush=True)


def _serve_app() -> ServeApp:
    """The Serve application's deployment, for the supervisor to call once Ray is up: importing it takes seconds."""
    import serve.deploy

    return serve.deploy


def _supervise(settings: Settings, detached: bool) -> int:
    """Run the service in this process (``cluster.service.supervise``), printing its progress and its banner."""
    progress = Progress()
    try:
        stopped = supervise(settings, _serve_app, progress,
                            on_ready=lambda: _print_ready(settings, progress.elapsed_s, detached))
    except AlreadySupervised as busy:
        starting = f"Another lilo is starting under {settings.home}."
        print(_already_running_message(busy.state) if busy.state else starting)
        return EXIT_FAILED
    return EXIT_OK if stopped else EXIT_FAILED


def _follow(path: Path) -> Iterator[str]:
    """Lines appended to ``path``, as they come; yields '' whenever there is nothing new."""
    offset, pending = 0, ""
    while True:
        with open(path) as log:
            log.seek(offset)
            chunk = log.read()
            offset = log.tell()
        pending += chunk
        *lines, pending = pending.split("\n")
        yield from lines
        if not lines:
            yield ""


def _progress_lines_since(log_file: Path, offset: int) -> list[str]:
    """The supervisor's progress lines (not Ray's) written to ``log_file`` after ``offset``."""
    if not log_file.exists():
        return []
    with open(log_file, errors="replace") as log:
        log.seek(offset)
        return [line for line in log.read().splitlines() if line.startswith("[lilo ")]


def up_detached(settings: Settings, argv: Sequence[str]) -> int:
    """Run the supervisor in the background, echo its progress until it is ready or fails, and return."""
    settings.home.mkdir(parents=True, exist_ok=True)
    child_argv = [arg for arg in argv if arg != "--detach"] + [DETACHED_CHILD_FLAG]
    with open(settings.log_file, "w") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "serve.cli", *child_argv],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    deadline = time.monotonic() + settings.startup_timeout_s + 60
    lines = _follow(settings.log_file)
    for line in lines:
        if line:
            print(line, flush=True)
            continue
        state = read_state(settings)
        if state is not None and state.pid == child.pid and state.status == "ready":
            # The ready banner is printed right after the state is written; let it land, then echo it.
            time.sleep(0.3)
            for rest in lines:
                if not rest:
                    return EXIT_OK
                print(rest, flush=True)
        if child.poll() is not None:
            print(f"lilo up failed (exit {child.returncode}); full log: {settings.log_file}", flush=True)
            return EXIT_FAILED
        if time.monotonic() > deadline:
            print(f"lilo up did not become ready in time; stopping it. Full log: {settings.log_file}", flush=True)
            stop_cluster(settings, child.pid)
            return EXIT_FAILED
        time.sleep(0.1)
    return EXIT_FAILED


def cmd_up(args: argparse.Namespace, argv: Sequence[str]) -> int:
    settings = _settings(args)
    settings.api_key_digests()  # a malformed keys file is refused here, before anything starts
    state = running_state(settings)
    if state is not None:
        print(_already_running_message(state))
        return EXIT_FAILED
    if args.detach:
        # Refuse here, before a background process exists; the supervisor checks again under its lock.
        try:
            check_ports_free(settings)
        except ClusterError as error:
            print(f"error: {error}")
            return EXIT_FAILED
        return up_detached(settings, argv)
    return _supervise(settings, detached=args.detached_child)


def _print_trainer_status(settings: Settings, tenants: bool) -> int:
    """`lilo status`'s child: connect as a Ray driver and print, as one JSON line, the reconciler's view of the
    trainers (``ReconcilerActor.status``; null when it cannot be asked) and with ``tenants`` every tenant's usage
    (``cluster.usage``), or the error that kept it from connecting (exit 3)."""
    import ray

    from cluster.local import NAMESPACE
    from cluster.reconciler import RECONCILER_ACTOR_NAME

    # Ray's driver prints the cluster's error messages (a node that died, say) to stdout even without its workers'
    # logs: they go to stderr here, so that stdout carries nothing but the JSON.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            connect_driver(settings)
        except Exception as error:
            answer, code = {"error": f"{type(error).__name__}: {error}"}, EXIT_NOT_RUNNING
        else:
            try:
                reconciler = ray.get_actor(RECONCILER_ACTOR_NAME, namespace=NAMESPACE)
                answer = {"trainers": ray.get(reconciler.status.remote(), timeout=10)}
            except Exception:  # the cluster is starting or stopping: status says what it can without the trainers
                answer = {"trainers": None}
            if tenants:
                answer["tenants"] = _tenant_usage(answer["trainers"])
            code = EXIT_OK
        finally:
            ray.shutdown()
    print(json.dumps(answer), flush=True)
    return code


def _tenant_usage(trainers: dict | None) -> dict | None:
    """Every tenant's usage, from the futures DB actor and the ready trainers (on the child's Ray connection); None
    when the futures DB does not answer."""
    import ray

    from cluster.futures_actor import FUTURES_ACTOR_NAME
    from cluster.local import NAMESPACE
    from cluster.usage import TRAINER_ANSWER_S, merge_usage

    try:
        counted = ray.get(ray.get_actor(FUTURES_ACTOR_NAME, namespace=NAMESPACE).usage.remote(), timeout=10)
    except Exception:
        return None
    shares = []
    for trainer in (trainers or {}).get("trainers", []):
        if trainer["state"] in ("ready", "idle"):
            try:
                actor = ray.get_actor(trainer["name"], namespace=NAMESPACE)
                shares.append(ray.get(actor.tenant_usage.remote(), timeout=TRAINER_ANSWER_S))
            except Exception:  # gone or slow: its share is left out
                shares.append(None)
    return merge_usage(counted, shares)


def tenant_lines(tenants: dict) -> list[str]:
    """``lilo status --tenants``: per tenant its models, requests in flight, tokens, execute seconds and limits."""
    lines = [f"  Tenants:     {len(tenants)}"]
    for name, row in sorted(tenants.items()):
        limits = {key: value for key, value in (row.get("limits") or {}).items()
                  if value is not None and not (key == "weight" and value == 1)}
        said = ", ".join(f"{key} {value}" for key, value in limits.items()) or "no limits"
        lines.append(f"    {name}: {row.get('models', 0)} model(s), {row.get('inflight', 0)} in flight, "
                     f"{row.get('train_tokens', 0)} tokens trained, {row.get('sample_tokens', 0)} sampled, "
                     f"{row['execute_s']:.1f} s on trainers; {said}")
    return lines


def _trainer_status(settings: Settings, state: ClusterState, tenants: bool = False) -> dict:
    """``{"trainers": the reconciler's view of the trainers (None when it cannot be asked), "tenants": with
    ``tenants``, every tenant's usage}``, from a child process that this one kills if it takes too long (this process
    never imports Ray); raises ClusterError, saying so, when the cluster does not answer."""
    command = [sys.executable, "-m", "serve.cli", "status", "--home", str(settings.home), TRAINERS_CHILD_FLAG,
               *(["--tenants"] if tenants else [])]
    try:
        child = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                               timeout=TRAINER_QUERY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"its Ray cluster (GCS {state.gcs_address}) did not answer a driver within "
                           f"{TRAINER_QUERY_TIMEOUT_S:.0f} s") from None
    try:
        answer = json.loads(child.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"trainers": None}  # a child that died: status says what it can without the trainers
    if "error" in answer:
        raise ClusterError(f"its Ray cluster (GCS {state.gcs_address}) refused a driver ({answer['error']})")
    return answer


def _cluster_view(settings: Settings, state: ClusterState, tenants: bool) -> tuple[bool, dict]:
    """Whether a running cluster's API answers healthz, and ``_trainer_status``'s answer (trainers None when they
    cannot be asked or the API does not answer); raises ClusterError, saying so, when its Ray cluster does not
    answer, within seconds."""
    if state.gcs_address is not None and not answers(state.gcs_address):
        raise ClusterError(f"its Ray cluster (GCS {state.gcs_address}) does not answer: its head is gone or hangs")
    if not healthz(state.api_url):
        return False, {"trainers": None}
    return True, _trainer_status(settings, state, tenants)


def trainer_lines(status: dict) -> list[str]:
    """``lilo status``'s trainers: counts, then per node each trainer with its base model (and "on CPU" for one that
    holds no GPU, and the ranks of a sharded one), state, models and free adapter slots."""
    counts = status["counts"]
    mode = "following the cluster's GPUs" if status["follow_gpus"] else "a fixed set"
    lines = [f"  Trainers:    {counts['ready']} ready ({counts['idle']} idle), {counts['starting']} starting, "
             f"{counts['pending']} waiting for a GPU node; {status['gpus']} GPU(s) in the cluster ({mode})"]
    by_node: dict[str, list[dict]] = {}
    for trainer in status["trainers"]:
        by_node.setdefault(trainer["node_ip"] or trainer["node_id"] or "no node yet", []).append(trainer)
    for node, trainers in by_node.items():
        node_id = trainers[0]["node_id"]
        lines.append(f"    node {node}" + (f" ({node_id[:12]})" if node_id else ""))
        for trainer in trainers:
            slots = "" if trainer["free_slots"] is None else f", {trainer['free_slots']} free slot(s)"
            device = "" if trainer["gpu"] else " on CPU"
            if trainer.get("ranks", 1) > 1:
                device += f" over {trainer['ranks']} ranks ({'GPUs' if trainer['gpu'] else 'processes'})"
            lines.append(f"      {trainer['name']}: {trainer['base_model']}{device}, {trainer['state']}, "
                         f"{trainer['models']} model(s){slots}{sampler_note(trainer.get('sampling'))}")
            lines.extend(rank_line(rank) for rank in trainer.get("rank_places") or [])
    return lines


def rank_line(rank: dict) -> str:
    """``rank 1: node 10.0.0.5, pid 4242, GPU 3, 8210.5 MB of base weights`` for one rank of a sharded trainer."""
    gpus = f"GPU {','.join(rank['gpu_ids'])}" if rank["gpu_ids"] else "CPU"
    return (f"        rank {rank['rank']}: node {rank['node_ip'] or rank['node_id'][:12]}, pid {rank['pid']}, {gpus}, "
            f"{rank['base_bytes'] / 2**20:.1f} MB of base weights")


def sampler_note(sampling: dict | None) -> str:
    """``, samplers lilo-sampler-0 (ready): 12 samples on vLLM, 3 on torch`` for a trainer with vLLM samplers."""
    if not sampling or not sampling["samplers"]:
        return ""
    states = ", ".join(f"{name} ({'ready' if name in sampling['ready'] else 'not ready'})"
                       for name in sampling["samplers"])
    counts = sampling["counts"]
    on_torch = sum(count for what, count in counts.items() if what != "vllm")
    return f", samplers {states}: {counts.get('vllm', 0)} samples on vLLM, {on_torch} on torch"


def cmd_status(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if args.trainers_child:
        return _print_trainer_status(settings, args.tenants)
    state = running_state(settings)
    healthy, view, silence = False, {"trainers": None}, None
    if state is not None:
        try:
            healthy, view = _cluster_view(settings, state, args.tenants)
        except ClusterError as error:
            silence = str(error)
    answering = state is not None and silence is None
    trainers, tenants = view["trainers"], view.get("tenants")
    if args.json:
        details = dataclasses.asdict(state) if state else {}
        print(json.dumps({"running": state is not None, "answering": answering, "healthy": healthy, **details,
                          "trainers": trainers, **({"tenants": tenants} if args.tenants else {}),
                          "error": silence}))
    elif state is None:
        print(f"lilo is not running (home {settings.home}). Start it with `lilo up`.")
    elif silence is not None:
        print(f"lilo does not answer: its supervisor runs (pid {state.pid}, home {state.home}), but {silence}.")
        print("Stop what is left of it with `lilo down`, then start it again with `lilo up`.")
    else:
        uptime_s = time.time() - state.started_at
        print(f"lilo is {state.status} (pid {state.pid}, up {uptime_s:.0f} s)")
        print(f"  Tinker API:  {state.api_url}   healthz: {'ok' if healthy else 'not answering'}")
        print(f"  Dashboard:   {state.dashboard_url}")
        print(f"  Home:        {state.home}")
        for line in trainer_lines(trainers) if trainers else []:
            print(line)
        for line in tenant_lines(tenants) if tenants else []:
            print(line)
    return EXIT_OK if answering else EXIT_NOT_RUNNING


def cmd_down(args: argparse.Namespace) -> int:
    settings = _settings(args)
    state = running_state(settings)
    started = time.monotonic()
    if state is None:
        strays = stop_cluster(settings, None)
        print(f"No lilo cluster is running under {settings.home}; nothing to stop.")
        if strays:
            print(f"Killed {len(strays)} leftover process(es) of an earlier cluster that was not stopped: {strays}")
        return EXIT_OK
    print(f"Stopping lilo (pid {state.pid}) and every process it started...", flush=True)
    log_size = settings.log_file.stat().st_size if settings.log_file.exists() else 0
    timeout_s = args.timeout if args.timeout is not None else stop_wait_s(state)
    killed = stop_cluster(settings, state.pid, timeout_s=timeout_s)
    # A detached supervisor reports its shutdown (the models it saved) to its log: pass that on.
    for line in _progress_lines_since(settings.log_file, log_size):
        print(line, flush=True)
    if killed:
        print(f"Killed {len(killed)} process(es) that did not stop within {timeout_s:.0f} s: {killed}")
    print(f"Stopped in {time.monotonic() - started:.1f} s.")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the demo against the running cluster, or start one for it (and stop it after, unless --keep)."""
    from serve.demo import run_demo

    settings = _settings(args)
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
    args = _parser().parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
