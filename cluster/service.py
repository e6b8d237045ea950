"""Start and stop a lilo service: the supervisor behind `lilo up`, which starts (or joins) the Ray cluster, starts
the actors and the Serve application, serves until SIGINT or SIGTERM, and then takes down everything it started,
saving every model first so that the next start resumes it.

It says what it is doing through a ``progress`` callable and prints nothing itself. The Serve application comes in
as a callable giving a ``ServeApp`` from the caller (``serve.cli.lifecycle`` gives ``serve.deploy``): ``cluster``
must not import ``serve``. Ray, the actors' modules and the Serve app are imported only once the Ray cluster is up:
Ray reads its environment when it is imported (``cluster.local.prepare_environment``), and the Serve app takes
seconds to import, which it does while the trainers load.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import signal
import time
from typing import Callable, NoReturn, Protocol

from cluster.local import (
    NAMESPACE,
    ClusterError,
    ClusterState,
    SupervisorLock,
    check_ports_free,
    connect_existing,
    read_state,
    start_private_head,
    write_state,
)
from lilo.settings import Settings

# The save_weights checkpoint every model gets when the service stops; the next start restores models from it.
SHUTDOWN_CHECKPOINT = "lilo-shutdown"
# What `lilo down` allows the supervisor beyond the trainers' save time: removing the Serve app, stopping Ray.
STOP_MARGIN_S = 20.0

# Takes one line of progress, as it happens.
Progress = Callable[[str], None]


class ServeApp(Protocol):
    """The Serve application of the service, on the connected Ray cluster (``serve.deploy`` is one)."""

    def start(self, settings: Settings) -> None:
        """Start Serve itself (its controller and proxy), with no application yet."""

    def deploy(self, settings: Settings) -> None:
        """Start deploying it; returns before its replicas run."""

    def wait_until_healthy(self, api_url: str, timeout_s: float) -> None:
        """Return once it answers; raise ClusterError if its deploy failed, TimeoutError if it is late."""

    def undeploy(self) -> None: ...


class StopRequested(Exception):
    """Raised in the supervisor by SIGINT or SIGTERM."""


class AlreadySupervised(Exception):
    """Another supervisor holds this home's lock; ``state`` is what it recorded (None while it is starting)."""

    def __init__(self, state: ClusterState | None) -> None:
        super().__init__("another lilo supervisor holds this home")
        self.state = state


def stop_wait_s(state: ClusterState | None) -> float:
    """How long to wait for a cluster's supervisor to stop before killing what is left: its trainers' save time plus
    the rest of its shutdown."""
    return (state.stop_save_timeout_s if state is not None else 0.0) + STOP_MARGIN_S


def _raise_stop(signum: int, _frame: object) -> NoReturn:
    raise StopRequested(signal.Signals(signum).name)


def _take_stop_signals() -> None:
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)


def supervise(settings: Settings, serve_app: Callable[[], ServeApp], progress: Progress,
              on_ready: Callable[[], None]) -> bool:
    """Start (or join) the Ray cluster, deploy the service, call ``on_ready``, serve until SIGINT/SIGTERM, then take
    it all down. ``serve_app`` gives the Serve application once Ray is up. Returns True when the service stopped on
    request, False when it could not start (``progress`` said why); raises AlreadySupervised, before anything
    starts, when another supervisor holds this home."""
    lock = SupervisorLock(settings)
    if not lock.acquire():
        raise AlreadySupervised(read_state(settings))
    _take_stop_signals()
    connected = False
    try:
        check_ports_free(settings)
        state = ClusterState(
            pid=os.getpid(), status="starting", home=str(settings.home), api_url=settings.api_url,
            dashboard_url=settings.dashboard_url, gcs_address=None, started_at=time.time(),
            stop_save_timeout_s=settings.stop_save_timeout_s,
        )
        write_state(settings, state)
        if settings.ray_address is None:
            progress(f"Starting a private Ray head on 127.0.0.1 (temp dir {settings.ray_temp_dir})")
            gcs_address = start_private_head(settings)
        else:
            progress(f"Connecting to the Ray cluster at {settings.ray_address}")
            gcs_address = connect_existing(settings)
        connected = True
        # Ray's driver installs a C-level SIGTERM handler that dumps a stack and re-raises the signal, killing
        # this process half-way through its shutdown; take the signals back so the shutdown runs to the end.
        _take_stop_signals()
        progress(f"Ray is up (GCS {gcs_address})")
        start_service(settings, serve_app, progress)
        write_state(settings, dataclasses.replace(state, status="ready", gcs_address=gcs_address))
        on_ready()
        hangups: list[int] = []
        signal.signal(signal.SIGHUP, lambda signum, _frame: hangups.append(signum))
        while True:
            signal.pause()
            while hangups:
                hangups.pop()
                reload_tenants(settings, progress)
    except StopRequested as stop:
        progress(f"{stop} received; stopping")
        return True
    except (ClusterError, TimeoutError) as error:
        progress(f"error: {error}")
        return False
    finally:
        # A second Ctrl-C must not interrupt the shutdown half-way and leave processes behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if connected:
            stop_service(settings, serve_app, progress)
        settings.state_file.unlink(missing_ok=True)
        lock.release()


def reload_tenants(settings: Settings, progress: Progress) -> None:
    """SIGHUP: the futures DB actor re-reads the tenants file now (it also does whenever the file changes)."""
    import ray

    from cluster.futures_actor import get_futures_actor

    if settings.tenants_file is None:
        progress("SIGHUP received; no tenants file to re-read (start with --tenants-file)")
        return
    error = ray.get(get_futures_actor(ledger_of(settings)).reload_tenants.remote(), timeout=30)
    progress(f"SIGHUP received; {error or f're-read the tenants file {settings.tenants_file}'}")


def ledger_of(settings: Settings) -> str:
    """What the futures DB actor opens: the --ledger URL, else the SQLite file under the home."""
    return settings.ledger if settings.ledger is not None else str(settings.futures_db)


def check_ledger(settings: Settings, progress: Progress) -> None:
    """A PostgreSQL ledger must answer from here, the node its actor runs on, before the service starts on it: else
    a ClusterError names it (without its password) and what to check."""
    if settings.ledger is None:
        return
    from lilo.futures.database import LedgerUnreachableError, open_engine, shown

    try:
        open_engine(settings.ledger, busy_timeout_ms=5000).dispose()
    except LedgerUnreachableError as error:
        raise ClusterError(str(error)) from None
    progress(f"The futures ledger is PostgreSQL: {shown(settings.ledger)}")


def check_storage(settings: Settings, progress: Progress) -> None:
    """A --storage must take a write, a read and a deletion from here before trainers save into it: else a
    ClusterError names it (without credentials) and what to check. Trainers on other nodes reach it the same way
    (the same URI, their own node's credentials)."""
    if settings.storage is None:
        return
    from lilo.storage import Storage, StorageError, redacted

    try:
        Storage(settings.storage).probe()
    except (StorageError, FileNotFoundError) as error:
        raise ClusterError(str(error)) from None
    progress(f"Checkpoints and page files are kept in {redacted(settings.storage)}")


def start_service(settings: Settings, serve_app: Callable[[], ServeApp], progress: Progress) -> None:
    """On the connected Ray cluster: the timing and futures DB actors (failing what a previous run left
    unfinished), the trainers, the reconciler (their registry), the recovery actor and the Serve application;
    returns once the trainers it started have their base models loaded and the API answers. The Serve application
    deploys while the trainers load: each takes seconds, mostly starting processes and importing. When the trainers
    follow the GPUs (``cluster.reconciler``), the reconciler starts them as GPU nodes join, and the API answers
    before the first is ready; only CPU trainers, on a cluster with no GPU yet (``starts_cpu_trainers``), are
    started here."""
    import ray

    from cluster.futures_actor import get_futures_actor
    from cluster.reconciler import follows_gpus, scaling_config, start_reconciler, starts_cpu_trainers
    from cluster.recovery import start_recovery
    from cluster.timing import get_timing_actor
    from cluster.trainer.actor import start_trainers, wait_for_trainers

    # Serve's controller and proxy start (seconds, with the import of the app) while the rest starts; the app itself
    # is deployed only once the previous run's unfinished requests are failed (below).
    serve_starting = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lilo-serve-start")
    started_serve = serve_starting.submit(lambda: _started(serve_app(), settings))
    serve_starting.shutdown(wait=False)
    # Detached: they outlive this driver and every redeploy of the Serve app.
    get_timing_actor()
    check_ledger(settings, progress)
    check_storage(settings, progress)
    futures_db = get_futures_actor(ledger_of(settings))
    ray.get(futures_db.use_tenants_file.remote(str(settings.tenants_file) if settings.tenants_file else None))
    orphans = futures_db.fail_orphans.remote()
    follow = follows_gpus(settings)
    if follow and settings.samplers >= 1:
        raise ClusterError(f"Trainers that follow the GPUs take samplers beside them, on a share of each one's GPU: "
                           f"pass --samplers as a fraction below 1 (say 0.3), not {settings.samplers:g}.")
    trainers: list = []
    samplers: list = []
    if follow:
        gpus = int(ray.cluster_resources().get("GPU", 0))
        progress(f"Trainers follow the cluster's GPUs ({gpus} so far): one per GPU as GPU nodes join, more on demand "
                 f"up to {settings.max_trainers}, idle ones let go after {settings.trainer_idle_timeout_s:.0f} s "
                 f"(never below {settings.min_trainers})")
    if not follow or starts_cpu_trainers(settings):
        if follow:
            progress("No GPU yet: CPU trainers serve meanwhile; once GPU trainers serve, new models go to them and "
                     "each CPU trainer is let go once idle")
        seats = sampler_seats(settings)
        progress(f"Starting trainers with {settings.base_models[0]} (the first start of a model converts it once)")
        trainers = start_trainers(settings, seats)
        # After the trainers: a sampler beside a sharded trainer joins its placement group, made as it starts.
        samplers = start_samplers(settings, seats, progress)
    # No client may reach the API before the previous run's unfinished requests are failed.
    failed = ray.get(orphans)
    if failed:
        progress(f"Failed {failed} request(s) a previous run left unfinished (their clients get a message)")
    progress("Deploying the Serve application")
    app = started_serve.result()
    app.deploy(settings)
    if trainers:
        ready = wait_for_trainers(trainers, settings.startup_timeout_s)
        progress("Trainers ready: " + ", ".join(f"{info['name']} (base model loaded {info['backend_ready_s']:.1f} s "
                                                 "after its process started)" for info in ready))
        wait_for_samplers(samplers, settings.startup_timeout_s, progress)
    # After the trainers are ready: the reconciler's registry holds a trainer once it is, and the recovery actor
    # takes a placed model on no trainer of the registry for a stray to restore elsewhere.
    start_reconciler(scaling_config(settings, follow))
    recovery = start_recovery(settings.base_models, settings.session_timeout_s)
    ray.get(recovery.caught_up.remote(), timeout=settings.startup_timeout_s)
    progress(f"Waiting for {settings.api_url}/api/v1/healthz")
    app.wait_until_healthy(settings.api_url, settings.startup_timeout_s)


def _started(app: ServeApp, settings: Settings) -> ServeApp:
    app.start(settings)
    return app


def stop_service(settings: Settings, serve_app: Callable[[], ServeApp], progress: Progress) -> None:
    """Remove the Serve application, save and stop the trainers, and leave the Ray cluster: stop the private head,
    or, on a shared cluster that lives on, kill the detached actors this service started."""
    import ray

    progress("Removing the Serve application")
    try:
        serve_app().undeploy()
        save_and_stop_trainers(progress, settings.stop_save_timeout_s)
        if settings.ray_address is not None:
            from cluster.futures_actor import FUTURES_ACTOR_NAME
            from cluster.timing import TIMING_ACTOR_NAME
            from cluster.trainer.actor import remove_rank_placement_group

            for name in (TIMING_ACTOR_NAME, FUTURES_ACTOR_NAME, *trainer_names(), *sampler_names()):
                ray.kill(ray.get_actor(name, namespace=NAMESPACE))
                remove_rank_placement_group(name)
    except Exception as error:  # the cluster may already be half gone; Ray's shutdown below still runs
        progress(f"Serve shutdown failed ({error}); stopping Ray anyway")
    if settings.ray_address is None:
        progress("Stopping the private Ray head")
    ray.shutdown()
    progress("Stopped")


def trainer_names() -> list[str]:
    """The named trainers of the connected cluster, sorted."""
    from cluster.trainer.config import TRAINER_PREFIX

    return _named_actors(TRAINER_PREFIX)


def sampler_names() -> list[str]:
    """The named vLLM sampler actors of the connected cluster, sorted."""
    from cluster.sampling.actor import SAMPLER_PREFIX

    return _named_actors(SAMPLER_PREFIX)


def _named_actors(prefix: str) -> list[str]:
    import ray

    return sorted(actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
                  if actor["namespace"] == NAMESPACE and actor["name"].startswith(prefix))


def sampler_seats(settings: Settings) -> list:
    """The sampler actors ``--samplers`` lays out beside the trainers ``start_trainers`` starts."""
    import ray

    from cluster.sampling.plane import sampler_layout
    from cluster.trainer.actor import trainer_layout
    from cluster.trainer.config import trainer_name

    served = [(trainer_name(index), model) for index, model in enumerate(trainer_layout(settings))]
    return sampler_layout(settings.samplers, served, bool(ray.cluster_resources().get("GPU", 0)),
                          settings.model_ranks)


def start_samplers(settings: Settings, seats: list, progress: Progress) -> list:
    """Start the vLLM sampler actors of ``seats`` (they load while the trainers do); their handles."""
    if not seats:
        return []
    from cluster.sampling.actor import sampler_name, vllm_available
    from cluster.sampling.plane import sampler_config, start_seat

    if not vllm_available():
        raise ClusterError(f"--samplers {settings.samplers:g} needs vLLM, which is not installed: run "
                           "`make .venv-vllm/.installed` (CPU) or `pip install vllm` (GPU nodes), or pass --samplers 0 "
                           "to sample with the torch sampler on the trainers.")
    config = sampler_config(settings)
    progress(f"Starting {len(seats)} vLLM sampler(s): "
             + ", ".join(f"{sampler_name(seat.index)} ({seat.base_model}, {seat.num_gpus:g} GPU, for "
                         f"{'/'.join(seat.trainers)}"
                         + (f", tensor parallel over {seat.tensor_parallel}" if seat.tensor_parallel > 1 else "")
                         + (f" on a share of each of {seat.trainers[0]}'s GPUs" if seat.in_trainer_group else "")
                         + ")" for seat in seats))
    return [start_seat(seat, config) for seat in seats]


def wait_for_samplers(handles: list, timeout_s: float, progress: Progress) -> None:
    """Wait up to ``timeout_s`` for the samplers' engines; one that is late is used once ready (the trainers'
    torch samplers answer meanwhile), so a slow one never fails the start."""
    if not handles:
        return
    import ray

    calls = {handle.ready.remote(): handle for handle in handles}
    done, late = ray.wait(list(calls), num_returns=len(calls), timeout=timeout_s)
    for call in done:
        try:
            info = ray.get(call)
            progress(f"Sampler {info['name']} ready ({info['engine']}, {info['base_model']})")
        except Exception as error:
            progress(f"A sampler failed to start ({str(error).splitlines()[0]}); the torch sampler answers its "
                     "samples")
    if late:
        progress(f"{len(late)} sampler(s) not ready within {timeout_s:.0f} s; samples use the torch sampler until "
                 "they are")


def save_and_stop_trainers(progress: Progress, timeout_s: float) -> None:
    """Each trainer finishes the execution under way and saves, within ``timeout_s`` (0: no save), every model it
    holds as the checkpoint ``SHUTDOWN_CHECKPOINT`` (adapter and optimizer state), from which the next `lilo up` on
    this home restores them. The reconciler and the recovery actor go first, or the one would start trainers anew
    and the other would take the trainers' shutdown for failures to recover from."""
    import ray

    from cluster.reconciler import RECONCILER_ACTOR_NAME
    from cluster.recovery import RECOVERY_ACTOR_NAME

    for name in (RECONCILER_ACTOR_NAME, RECOVERY_ACTOR_NAME):
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE))
        except ValueError:  # not started (the startup failed before it)
            pass
    trainers = trainer_names()
    if not trainers or timeout_s == 0:
        return
    progress(f"Saving the models of {len(trainers)} trainer(s), if any, as checkpoint {SHUTDOWN_CHECKPOINT!r}")
    calls = {ray.get_actor(name, namespace=NAMESPACE).stop.remote(save_as=SHUTDOWN_CHECKPOINT): name
             for name in trainers}
    done, late = ray.wait(list(calls), num_returns=len(calls), timeout=timeout_s)
    saved = 0
    for call in done:
        try:
            saved += len(ray.get(call))
        except Exception as error:
            progress(f"{calls[call]} could not save its models ({str(error).splitlines()[0]}); the next start "
                     "restores them from their latest checkpoint")
    for call in late:
        progress(f"{calls[call]} did not finish saving within {timeout_s:.0f} s; the next start "
                 "restores its models from their latest complete checkpoint")
    if saved:
        progress(f"Saved {saved} model(s); the next `lilo up` on this home resumes each where it stopped")
