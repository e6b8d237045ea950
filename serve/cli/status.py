"""`lilo status`: the supervisor's state, whether the API answers, the trainers (asked from a child process, a Ray
driver this one kills if it takes too long) and with --tenants every tenant's usage."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import subprocess
import sys
import time

from cluster.local import ClusterError, ClusterState, answers, connect_driver, healthz, running_state
from lilo.settings import Settings
from serve.cli.options import EXIT_NOT_RUNNING, EXIT_OK, EXIT_STARTING, TRAINERS_CHILD_FLAG, settings_of

# A driver retries a cluster that does not answer for minutes, deaf to SIGTERM: the child is killed after this long.
TRAINER_QUERY_TIMEOUT_S = 20.0


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
    settings = settings_of(args)
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
    elif state.status == "starting" and not healthy:
        uptime_s = time.time() - state.started_at
        print(f"lilo is starting (pid {state.pid}, for {uptime_s:.0f} s, home {state.home}): "
              f"{silence or 'its API does not answer yet'}.")
        print(f"Ask again in a few seconds; `lilo up` writes its progress to {settings.log_file}.")
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
    if state is not None and state.status == "starting":
        return EXIT_STARTING
    return EXIT_OK if answering else EXIT_NOT_RUNNING
