"""The reconciler: the registry of the service's trainers, and, on a GPU cluster, the actor that makes the trainers
follow the GPUs.

The reconciler (``lilo-reconciler`` in namespace ``lilo``, detached, on the head beside the futures DB and recovery
actors) keeps the one list of trainers the ingress, placement and recovery read: a trainer is in it once it is
ready (its base model loaded) and leaves it when its node leaves or it is let go. On (re)start it adopts every
trainer the cluster has by name, so a restarted reconciler loses nothing.

Following the GPUs (``Settings.follow_gpus``), every ``RECONCILE_EVERY_S`` it also:

1. starts one trainer per GPU (per N GPUs for a base model sharded over N, ``--trainer-ranks``: its ranks a
   placement group on that node) on every live node with GPUs no trainer holds, pinned to that node (base models
   dealt out in turn), and forgets (kills) the trainers whose node left: the recovery actor restores their models
   on the trainers that are left;
2. on demand (``request_trainer``: every trainer of a base model was full), starts one more trainer that needs a
   GPU (N GPUs of one node) and is pinned nowhere: a pending actor (placement group), which Ray's autoscaler turns
   into a node, up to ``max_trainers``;
3. lets go of trainers that held no model for ``idle_timeout_s``, never below ``min_trainers``: each first leaves
   the registry, and is stopped ``RELEASE_GRACE_S`` later if still no model was placed on it meanwhile. Its GPUs
   are left free (not refilled), so that the autoscaler can take the idle node back.

On an existing cluster (``--address``) the trainers follow the GPUs unless ``--trainers`` (or whole-GPU
``--samplers``) fixes them. Where that cluster has no GPU yet and its `ray up` config brings none (GPU nodes, if
any, are added by hand), the service also starts CPU trainers at deploy, as ``start_trainers`` does on a CPU
machine, so that it trains at once: they keep the models they hold, new models go to GPU trainers once one serves
their base model, and then each CPU trainer is let go once idle (``cluster.scaling.trainers_to_release``).

Without following (a private head, or ``--trainers``) the trainers are those ``start_trainers`` started, as
before. The decisions are the pure functions of ``cluster.scaling``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import ray
import yaml
from ray.actor import ActorHandle
from ray.util import metrics
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.futures_actor import FUTURES_ACTOR_NAME
from cluster.local import NAMESPACE
from cluster.placement import models_placed, named_actor
from cluster.scaling import GpuNode, Seat, config_has_gpu_workers, may_request_trainer, trainers_to_release, \
    trainers_to_start
from cluster.sampling.actor import SamplerConfig, sampler_name
from cluster.sampling.plane import SamplerSeat, sampler_config, start_seat, trainer_gpu_share
from cluster.timing import get_timing_actor
from cluster.trainer.actor import remove_rank_placement_group, start_trainer
from cluster.trainer.config import TRAINER_PREFIX, TrainerConfig, trainer_name
from lilo.settings import Settings

logger = logging.getLogger(__name__)

RECONCILER_ACTOR_NAME = "lilo-reconciler"
RECONCILE_EVERY_S = 1.0
# How stale an ingress replica's copy of the registry may be: a new trainer takes models within this.
REGISTRY_REFRESH_S = 1.0
# A trainer let go leaves the registry this long before it stops: every ingress has stopped placing on it by then.
RELEASE_GRACE_S = 2 * REGISTRY_REFRESH_S + 1.0
# How long a (re)started reconciler waits for a trainer it adopts to say what it serves.
ADOPT_WITHIN_S = 10.0
# How long `lilo status` waits for a trainer to say what its samplers answered or where its ranks run (a dying one
# would hold it up).
STATUS_WITHIN_S = 2.0
# Where `ray up` leaves the cluster's config on the head.
RAY_UP_CONFIG = Path("~/ray_bootstrap_config.yaml")


@dataclasses.dataclass(frozen=True)
class ScalingConfig:
    """What the reconciler is built with, from the settings once."""

    base_models: tuple[str, ...]
    trainer: TrainerConfig
    follow_gpus: bool
    min_trainers: int
    max_trainers: int
    idle_timeout_s: float
    # --samplers as a GPU share (0: none): each trainer it starts gets a vLLM sampler on that share of its GPU.
    sampler_share: float = 0.0
    sampler: SamplerConfig | None = None
    # GPUs a trainer of each base model spans (--trainer-ranks): 1 where not named.
    ranks: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def ranks_of(self, base_model: str) -> int:
        return self.ranks.get(base_model, 1)


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=1000)
class ReconcilerActor:
    def __init__(self, config: ScalingConfig) -> None:
        self._config = config
        self._seats: dict[str, Seat] = {}
        self._handles: dict[str, ActorHandle] = {}
        self._free_slots: dict[str, int] = {}
        self._releasing: set[str] = set()
        self._left_free: dict[str, int] = {}  # node -> GPUs left free by a release, not refilled
        self._pinned: set[str] = set()  # trainers started for a node's GPU (not by demand)
        self._next_index = 0
        self._gpus = 0
        self._joined_at: dict[str, float] = {}  # node -> when the reconciler first saw it (for the timeline)
        self._ready_at: dict[str, float] = {}  # trainer -> when it became ready
        self.timeline: list[dict[str, Any]] = []
        self._adopted = asyncio.Event()
        self._futures = ray.get_actor(FUTURES_ACTOR_NAME, namespace=NAMESPACE)
        self._gauge = metrics.Gauge("lilo_trainers", "Trainers of the service by state", ("state",))
        self._tasks = [asyncio.get_event_loop().create_task(self._run())]

    async def _run(self) -> None:
        try:
            await self._adopt()
        finally:
            self._adopted.set()
        while True:
            try:
                await self._reconcile()
            except Exception:
                logger.exception("a reconcile round failed; trying again")
            await asyncio.sleep(RECONCILE_EVERY_S)

    async def _adopt(self) -> None:
        """Take in every trainer the cluster has by name (started at deploy, or before this actor restarted)."""
        named = await asyncio.to_thread(ray.util.list_named_actors, all_namespaces=True)
        names = sorted(actor["name"] for actor in named
                       if actor["namespace"] == NAMESPACE and actor["name"].startswith(TRAINER_PREFIX))
        indices = [int(name[len(TRAINER_PREFIX):]) for name in names if name[len(TRAINER_PREFIX):].isdigit()]
        self._next_index = max(indices, default=-1) + 1
        adopted = [self._spawn(self._follow(name, ray.get_actor(name, namespace=NAMESPACE), None))
                   for name in names]
        if adopted:
            await asyncio.wait(adopted, timeout=ADOPT_WITHIN_S)

    def _spawn(self, coroutine: Any) -> asyncio.Task:
        self._tasks = [task for task in self._tasks if not task.done()]
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.append(task)
        return task

    async def _follow(self, name: str, handle: ActorHandle, base_model: str | None) -> None:
        """Follow one trainer from its start to ready: it is in the registry from then on."""
        self._handles[name] = handle
        try:
            where = await handle.describe.remote()
            if name not in self._handles:  # forgotten meanwhile (its node left)
                return
            self._place_seat(name, where["base_model"], where["node_id"], where["gpu"], where.get("ranks", 1))
            if base_model is not None and self._config.sampler_share:  # one this reconciler started
                self._start_sampler_beside(name, base_model, where["node_id"], where.get("ranks", 1))
            info = await handle.ready.remote()
        except ray.exceptions.RayActorError as error:
            logger.warning("trainer %s did not start (%s); forgetting it", name, str(error).splitlines()[0])
            self._forget(name)
            return
        if name in self._seats:
            self._seats[name] = dataclasses.replace(self._seats[name], ready=True, idle_since=time.time())
            self._free_slots[name] = info["free_slots"]
            self._ready_at[name] = time.monotonic()
            self._note("trainer_ready", name, self._seats[name].node_id)
            logger.warning("trainer %s is ready on node %s (%s)", name, info["node_id"], info["base_model"])

    def _place_seat(self, name: str, base_model: str, node_id: str, gpu: bool, ranks: int = 1) -> None:
        if name not in self._pinned and self._left_free.get(node_id, 0) > 0:
            # A demanded trainer took GPUs an idle one had left free.
            self._left_free[node_id] = max(0, self._left_free[node_id] - ranks)
        self._seats[name] = Seat(name, base_model, node_id, ready=False, gpu=gpu, ranks=ranks)

    def _forget(self, name: str) -> None:
        for table in (self._seats, self._handles, self._free_slots, self._ready_at):
            table.pop(name, None)
        self._releasing.discard(name)
        self._pinned.discard(name)

    def _start(self, base_model: str, node_id: str | None) -> str:
        index, self._next_index = self._next_index, self._next_index + 1
        name = trainer_name(index)
        share, ranks = self._config.sampler_share, self._config.ranks_of(base_model)
        handle = start_trainer(index, base_model, self._config.trainer, num_gpus=trainer_gpu_share(share, True),
                               num_cpus=1, node_id=node_id, samplers=(sampler_name(index),) if share else (),
                               ranks=ranks)
        if node_id is not None:
            self._pinned.add(name)
        self._seats[name] = Seat(name, base_model, node_id, ready=False, ranks=ranks)
        self._spawn(self._follow(name, handle, base_model))
        self._note("trainer_started", name, node_id)
        logger.warning("starting trainer %s for %s on %s", name, base_model, node_id or "a GPU the autoscaler adds")
        return name

    def _note(self, event: str, trainer: str, node_id: str | None) -> None:
        joined = self._joined_at.get(node_id or "")
        self.timeline.append({"event": event, "trainer": trainer, "node_id": node_id, "at": time.time(),
                              "since_node_joined_s": None if joined is None else time.time() - joined})
        del self.timeline[:-256]

    async def _reconcile(self) -> None:
        nodes = [node for node in await asyncio.to_thread(ray.nodes) if node.get("Alive")]
        alive = {node["NodeID"] for node in nodes}
        now = time.time()
        for node_id in alive - self._joined_at.keys():
            self._joined_at[node_id] = now
        gpu_nodes = [GpuNode(node["NodeID"], int(node.get("Resources", {}).get("GPU", 0))) for node in nodes]
        gpu_nodes = [node for node in gpu_nodes if node.gpus > 0]
        self._gpus = sum(node.gpus for node in gpu_nodes)
        await self._count_models(now)
        if self._config.follow_gpus:
            self._drop_departed(alive)
            seats = list(self._seats.values())
            for node_id, base_model in trainers_to_start(gpu_nodes, seats, self._config.base_models,
                                                        self._left_free, self._config.ranks):
                self._start(base_model, node_id)
            for name in trainers_to_release([s for s in self._seats.values() if s.name not in self._releasing],
                                            now, self._config.idle_timeout_s, self._config.min_trainers):
                self._releasing.add(name)
                self._spawn(self._release(name))
        await self._publish_counts(now)

    async def _count_models(self, now: float) -> None:
        placed = await models_placed(self._futures)
        for name, seat in list(self._seats.items()):
            if not seat.ready:
                continue
            models = placed.get(name, 0)
            idle_since = (seat.idle_since or now) if models == 0 else None
            self._seats[name] = dataclasses.replace(seat, models=models, idle_since=idle_since)
        facts = await asyncio.gather(*(self._free_slots_of(name) for name in self.ready_names()))
        self._free_slots.update({name: free for name, free in facts if free is not None})

    async def _free_slots_of(self, name: str) -> tuple[str, int | None]:
        try:
            return name, (await asyncio.wait_for(self._handles[name].ready.remote(), 5.0))["free_slots"]
        except (asyncio.TimeoutError, ray.exceptions.RayActorError, KeyError):
            return name, None

    def _drop_departed(self, alive: set[str]) -> None:
        """Trainers whose node left: out of the registry, and killed so that Ray does not keep them pending for a
        node that will not come back (the recovery actor restores their models elsewhere)."""
        for name, seat in list(self._seats.items()):
            if seat.node_id is not None and seat.node_id not in alive:
                logger.warning("trainer %s left with its node %s", name, seat.node_id)
                self._kill(name)
                self._note("trainer_left", name, seat.node_id)
                self._forget(name)
        for node_id in list(self._left_free):
            if node_id not in alive:
                del self._left_free[node_id]

    def _start_sampler_beside(self, trainer: str, base_model: str, node_id: str, ranks: int) -> None:
        """The trainer's vLLM sampler, on its node, on the share of its GPU the trainer left (Ray knows the trainer's
        node only once it is placed: a trainer started on demand waited for the autoscaler's node); beside a trainer
        of several ranks, on the share of each of its GPUs, its engine tensor parallel over them."""
        index = int(trainer[len(TRAINER_PREFIX):])
        start_seat(SamplerSeat(index, base_model, self._config.sampler_share, (trainer,), ranks), self._config.sampler,
                   node_id)
        logger.warning("starting sampler %s beside trainer %s", sampler_name(index), trainer)

    def _kill(self, name: str) -> None:
        """Kill a trainer, and the sampler beside it if it has one."""
        _kill_actor(name, lambda: self._handles[name])
        if self._config.sampler_share:
            sampler = sampler_name(int(name[len(TRAINER_PREFIX):]))
            _kill_actor(sampler, lambda: ray.get_actor(sampler, namespace=NAMESPACE))

    async def _release(self, name: str) -> None:
        """Let go of an idle trainer: out of the registry first, then stopped once no ingress places on it."""
        await asyncio.sleep(RELEASE_GRACE_S)
        if (await models_placed(self._futures)).get(name, 0) or name not in self._seats:
            self._releasing.discard(name)  # a model came meanwhile: it stays
            return
        seat = self._seats[name]
        logger.warning("trainer %s held no model for %.0f s; letting it go", name, self._config.idle_timeout_s)
        self._kill(name)
        self._note("trainer_released", name, seat.node_id)
        self._forget(name)
        if seat.gpu and seat.node_id is not None:
            self._left_free[seat.node_id] = self._left_free.get(seat.node_id, 0) + seat.ranks

    async def _publish_counts(self, now: float) -> None:
        counts = self.counts()
        for state, value in counts.items():
            self._gauge.set(value, {"state": state})
        try:
            await get_timing_actor().set_cluster_gauges.remote({f"trainers.{state}": float(value)
                                                                for state, value in counts.items()})
        except ray.exceptions.RayActorError:
            pass

    def counts(self) -> dict[str, int]:
        seats = list(self._seats.values())
        return {"starting": sum(not s.ready and s.node_id is not None for s in seats),
                "pending": sum(s.node_id is None for s in seats),
                "ready": sum(s.ready for s in seats),
                "idle": sum(s.ready and s.models == 0 for s in seats)}

    def ready_names(self) -> list[str]:
        return sorted(name for name, seat in self._seats.items() if seat.ready and name not in self._releasing)

    async def trainers(self) -> list[str]:
        """The registry: the ready trainers, sorted (at a (re)start, once the cluster's trainers are adopted)."""
        await self._adopted.wait()
        return self.ready_names()

    async def registry(self) -> dict[str, Any]:
        """What an ingress replica caches: the ready trainers, how many are on their way, the cluster's GPUs."""
        await self._adopted.wait()
        counts = self.counts()
        return {"trainers": self.ready_names(), "starting": counts["starting"] + counts["pending"],
                "gpus": self._gpus, "follow_gpus": self._config.follow_gpus}

    async def request_trainer(self, base_model: str) -> bool:
        """Every trainer of ``base_model`` is full (or there is none): ask for one more, pinned nowhere, so that
        Ray's autoscaler adds a GPU node when no node has one free. True when a trainer of it is on its way."""
        await self._adopted.wait()
        if not self._config.follow_gpus or base_model not in self._config.base_models:
            return False
        seats = list(self._seats.values())
        if any(seat.base_model == base_model and not seat.ready for seat in seats):
            return True
        # One that got ready just now is not in every ingress's copy of the registry yet: that copy, not the
        # cluster, is full (it refreshes within REGISTRY_REFRESH_S).
        if any(seat.base_model == base_model and time.monotonic() - self._ready_at.get(seat.name, -math.inf)
               < 2 * REGISTRY_REFRESH_S for seat in seats):
            return True
        if not may_request_trainer(base_model, seats, self._config.max_trainers):
            return False
        self._start(base_model, None)
        return True

    async def status(self) -> dict[str, Any]:
        """Per node, its trainers with their base model, state, whether each holds a GPU, models and free slots
        (``lilo status``)."""
        await self._adopted.wait()
        nodes = {node["NodeID"]: node for node in await asyncio.to_thread(ray.nodes) if node.get("Alive")}
        ready = self.ready_names()
        sampling = dict(await asyncio.gather(*(self._ask(name, "sampling") for name in ready)))
        sharded = [name for name in ready if self._seats[name].ranks > 1]
        rank_places = dict(await asyncio.gather(*(self._ask(name, "rank_info") for name in sharded)))
        trainers = []
        for name, seat in sorted(self._seats.items()):
            state = ("leaving" if name in self._releasing else "pending" if seat.node_id is None
                     else "starting" if not seat.ready else "idle" if seat.models == 0 else "ready")
            node = nodes.get(seat.node_id or "", {})
            trainers.append({"name": name, "base_model": seat.base_model, "state": state, "gpu": seat.gpu,
                             "ranks": seat.ranks,
                             "node_id": seat.node_id, "node_ip": node.get("NodeManagerAddress"), "models": seat.models,
                             "free_slots": self._free_slots.get(name), "sampling": sampling.get(name),
                             "rank_places": _places(rank_places.get(name), nodes)})
        return {"follow_gpus": self._config.follow_gpus, "gpus": self._gpus, "counts": self.counts(),
                "trainers": trainers}

    async def _ask(self, name: str, method: str) -> tuple[str, Any]:
        """A ready trainer's answer to a status query (``sampling``, ``rank_info``); None when it did not say in
        time."""
        try:
            return name, await asyncio.wait_for(getattr(self._handles[name], method).remote(), STATUS_WITHIN_S)
        except (asyncio.TimeoutError, ray.exceptions.RayActorError, KeyError):
            return name, None

    async def history(self) -> list[dict[str, Any]]:
        """Trainers started, ready, left and let go, with when, and how long after their node joined."""
        return self.timeline


def _places(ranks: list[dict] | None, nodes: dict[str, dict]) -> list[dict] | None:
    """Where each rank of a sharded trainer runs (rank, node address, pid, GPU ids) and the base bytes it holds."""
    if ranks is None:
        return None
    return [{"rank": rank["rank"], "node_ip": nodes.get(rank["node_id"], {}).get("NodeManagerAddress"),
             "node_id": rank["node_id"], "pid": rank["pid"], "gpu_ids": rank.get("gpu_ids", []),
             "base_bytes": rank["base_bytes"]} for rank in ranks]


def _kill_actor(name: str, handle: Callable[[], ActorHandle]) -> None:
    try:
        ray.kill(handle(), no_restart=True)
    except Exception as error:  # gone already
        logger.info("%s could not be killed (%s)", name, error)
    remove_rank_placement_group(name)


def scaling_config(settings: Settings, follow_gpus: bool) -> ScalingConfig:
    share = settings.samplers if follow_gpus and 0 < settings.samplers < 1 else 0.0
    return ScalingConfig(tuple(settings.base_models), TrainerConfig.from_settings(settings), follow_gpus,
                         settings.min_trainers, settings.max_trainers, settings.trainer_idle_timeout_s,
                         sampler_share=share, sampler=sampler_config(settings) if share else None,
                         ranks=settings.model_ranks)


def start_reconciler(config: ScalingConfig) -> ActorHandle:
    """The cluster's reconciler, on this driver's node (the head), so that a worker node leaving does not take it
    along; if it dies anyway, it adopts the trainers again on restart."""
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=True)
    return ReconcilerActor.options(name=RECONCILER_ACTOR_NAME, namespace=NAMESPACE, lifetime="detached",
                                   get_if_exists=True, scheduling_strategy=here).remote(config)


def follows_gpus(settings: Settings) -> bool:
    """Whether the trainers follow the GPUs: as set, else on an existing cluster (--address), whose GPU nodes may
    come and go, unless --trainers or whole-GPU --samplers fix the layout."""
    if settings.follow_gpus is not None:
        return settings.follow_gpus
    return settings.ray_address is not None and settings.trainers is None and settings.samplers < 1


def starts_cpu_trainers(settings: Settings) -> bool:
    """Whether a service that follows the GPUs by default (no --follow-gpus given) also starts CPU trainers at
    deploy: its cluster has no GPU now and its `ray up` config has no GPU workers (which would join after the
    head), so nothing would train until someone adds a GPU node by hand. --follow-gpus waits for GPU nodes."""
    if settings.follow_gpus is not None or ray.cluster_resources().get("GPU", 0) > 0:
        return False
    try:
        return not config_has_gpu_workers(yaml.safe_load(RAY_UP_CONFIG.expanduser().read_text()) or {})
    except (OSError, yaml.YAMLError):
        return True


class TrainerDirectory:
    """The registry as one ingress replica sees it: read from the reconciler at most every REGISTRY_REFRESH_S, so
    a new trainer takes models within about a second and a request costs no extra call."""

    def __init__(self) -> None:
        self._registry: dict[str, Any] | None = None
        self._read_at = float("-inf")
        self._lock = asyncio.Lock()

    async def registry(self) -> dict[str, Any]:
        if time.monotonic() - self._read_at >= REGISTRY_REFRESH_S:
            async with self._lock:
                if time.monotonic() - self._read_at >= REGISTRY_REFRESH_S:
                    try:
                        known = set(self._registry["trainers"]) if self._registry is not None else set()
                        self._registry = await named_actor(RECONCILER_ACTOR_NAME).registry.remote()
                        self._read_at = time.monotonic()
                        if known - set(self._registry["trainers"]):
                            # A trainer left, and a new one may take its name later: look names up afresh rather
                            # than keep a cached handle to the dead actor.
                            named_actor.cache_clear()
                    except ray.exceptions.RayActorError:
                        if self._registry is None:  # restarting: the last copy serves meanwhile
                            raise
        assert self._registry is not None
        return self._registry

    async def names(self) -> Sequence[str]:
        return (await self.registry())["trainers"]

    async def request_trainer(self, base_model: str) -> bool:
        return await named_actor(RECONCILER_ACTOR_NAME).request_trainer.remote(base_model)
