"""The sampling plane, as a trainer sees it: the vLLM sampler actors it hands its samples to, and keeping the
adapters they serve as fresh as its own checkpoints.

A sample is recorded and handed to the trainer of its session as it always was (so its future, its retries and a
dead trainer's in-flight futures work as before). The trainer then relays it to one of its samplers when the sampler
answers it exactly as the torch sampler would (``vllm_unsupported`` says when not, and why: that choice is logged
per request); otherwise, while no sampler is ready (vLLM still loading), or when the sampler died under it, the
trainer's own torch sampler answers. The result reaches the futures DB through the trainer either way.

Freshness: a sampler checkpoint is published to a sampler (its PEFT files, the durable copy) right after it is
saved, before the save's future completes, so the first sample after a save finds it loaded; and before every
relayed sample the checkpoint's version (its marker file's mtime) is checked against what that sampler loaded, so a
sample never reads weights older than the last whole save, whatever the order of events.

Layout (``sampler_layout``): ``--samplers 0`` none (the torch sampler on every trainer); a fraction ``0 < F < 1``: one
sampler beside each trainer, on a share F of its GPU (the trainer takes the rest; a trainer sharded over M GPUs,
``--trainer-ranks``, shares each of its M GPUs so, its sampler's engine tensor parallel over them); a whole number
N: N samplers per base model, each on a GPU of its own, shared by that base model's trainers (for a base model
sharded over M GPUs, each on M GPUs, its engine tensor parallel over them). Without GPUs, F gives one sampler per
trainer and N gives N per base model, on CPU (tensor parallel as on GPUs).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import zlib
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import ray

from cluster.placement import named_actor
from cluster.sampling.actor import SamplerConfig, start_sampler
from lilo.backend.checkpoints.paths import TINKER_SCHEME, local_directory
from lilo.backend.types import SamplingRequest
from lilo.backend.vllm_sampler import vllm_unsupported
from lilo.engine.commands import Command
from lilo.errors import CancelledByClientError, InvalidRequestError, NotFoundError
from lilo.settings import Settings
from lilo.timing.critical_path import Observer, Operation

logger = logging.getLogger(__name__)

# How often a trainer asks a sampler that is not ready (loading, or restarting after a death) whether it is.
READY_POLL_S = 2.0
# The longest a save waits for its publication before its future completes anyway (a sample then loads the
# checkpoint itself, by the version check).
PUBLISH_WAIT_S = 10.0
# Relayed samples whose futures a retry finds again (the engine keeps as many of its own).
REMEMBERED_SAMPLES = 10_000
SAMPLER_LANE = "sampler"
# The memory of its GPU a sampler that has one to itself gives vLLM (weights and KV cache).
DEDICATED_GPU_SHARE = 0.9


@dataclasses.dataclass(frozen=True)
class SamplerSeat:
    """One sampler actor of the layout: its index (name ``lilo-sampler-<index>``), base model, share of a GPU, and
    the trainers that hand it samples."""

    index: int
    base_model: str
    num_gpus: float
    trainers: tuple[str, ...]
    # Workers its engine splits the base model over: the ranks of the trainers of a sharded base model.
    tensor_parallel: int = 1

    @property
    def in_trainer_group(self) -> bool:
        """Whether it lives in its trainer's placement group: on a share of each of a sharded trainer's GPUs."""
        return 0 < self.num_gpus < 1 and self.tensor_parallel > 1


def trainer_gpu_share(samplers: float, gpus: bool) -> float:
    """The GPU a trainer asks Ray for: all of one, less a sampler's share beside it."""
    if not gpus:
        return 0.0
    return 1.0 - samplers if 0 < samplers < 1 else 1.0


def sampler_layout(samplers: float, trainers: Sequence[tuple[str, str]], gpus: bool,
                   ranks: Mapping[str, int] | None = None) -> list[SamplerSeat]:
    """The sampler actors for ``trainers`` (name, base model) under ``--samplers`` (see the module docstring); a
    sampler of a base model that ``ranks`` shards over N devices splits it over N (tensor parallel): on N GPUs of
    its own, or on a share of each of its trainer's N."""
    ranks = ranks or {}
    if samplers <= 0:
        return []
    if samplers < 1:
        return [SamplerSeat(index, base_model, samplers if gpus else 0.0, (trainer,), ranks.get(base_model, 1))
                for index, (trainer, base_model) in enumerate(trainers)]
    seats: list[SamplerSeat] = []
    for base_model in dict.fromkeys(model for _, model in trainers):
        served_by = tuple(name for name, model in trainers if model == base_model)
        workers = ranks.get(base_model, 1)
        for _ in range(math.floor(samplers)):
            seats.append(SamplerSeat(len(seats), base_model, float(workers) if gpus else 0.0, served_by, workers))
    return seats


def sampler_config(settings: Settings) -> SamplerConfig:
    """What every sampler of a service is built with: its LoRA slots and rank as the settings say, and, beside a
    trainer, the share of the GPU ``--samplers`` gives it (a sampler of its own GPU takes most of it)."""
    share = settings.samplers if 0 < settings.samplers < 1 else DEDICATED_GPU_SHARE
    return SamplerConfig(max_loras=settings.sampler_max_loras, max_rank=settings.max_rank, device=settings.device,
                         gpu_fraction=share)


def start_seat(seat: SamplerSeat, config: SamplerConfig, node_id: str | None = None) -> ray.actor.ActorHandle:
    """Start the sampler of ``seat``: its engine split over ``seat.tensor_parallel`` workers (each on a CPU of its
    own where there is no GPU), in its trainer's placement group when it shares that group's GPUs
    (``in_trainer_group``), else on ``node_id`` when given."""
    return start_sampler(seat.index, seat.base_model,
                         dataclasses.replace(config, tensor_parallel_size=seat.tensor_parallel),
                         num_gpus=seat.num_gpus, num_cpus=seat.tensor_parallel, node_id=node_id,
                         group_of=seat.trainers[0] if seat.in_trainer_group else None)


def samplers_of(trainer: str, seats: Sequence[SamplerSeat], name_of: Callable[[int], str]) -> tuple[str, ...]:
    return tuple(name_of(seat.index) for seat in seats if trainer in seat.trainers)


class SamplerRelay:
    """A trainer's samplers: which are ready, what each has loaded, and the relay of one sample to one of them.

    Lives on the trainer actor's event loop. ``checkpoint_version`` (the backend's ``sampler_version``) and
    ``checkpoint_dir`` say where a checkpoint's files are and when they were last written whole; ``observer`` gets
    each relayed sample's timing (phases ``sample.vllm`` and ``sample.publish``), as the engine's lanes report theirs.
    """

    def __init__(self, names: Sequence[str], checkpoint_dir: Path, checkpoint_version: Callable[[str], int],
                 observer: Observer, clock: Callable[[], float] = time.monotonic) -> None:
        self.names = tuple(names)
        self._checkpoint_dir = checkpoint_dir
        self._version = checkpoint_version
        self._observer = observer
        self._clock = clock
        self._ready: set[str] = set()
        self._context: int | None = None  # the samplers' max_model_len (one base model, one engine config)
        self._loaded: dict[str, dict[str, int]] = {name: {} for name in self.names}  # sampler -> path -> version
        self._publishing: dict[tuple[str, str], asyncio.Lock] = {}
        self._relayed: OrderedDict[str, Future] = OrderedDict()
        self._running: dict[str, ray.ObjectRef] = {}  # request id -> its call on a sampler, while it runs
        self._relaying: set[str] = set()  # request ids relayed here and not finished
        self._cancelled: set[str] = set()  # cancelled while no call of theirs ran (their adapter was publishing)
        self.counts: dict[str, int] = {}  # which engine answered how many samples, and why torch did
        self._watchers = [asyncio.get_running_loop().create_task(self._watch(name)) for name in self.names]

    async def _watch(self, name: str) -> None:
        """Mark ``name`` ready once it answers ``ready`` (its engine loaded), and again after it restarted. Why it is
        not ready is logged when that changes, not on every poll: an engine that cannot load the base model (a family
        vLLM does not run on this device) never becomes ready."""
        reported = None
        while True:
            if name not in self._ready:
                try:
                    info = await named_actor(name).ready.remote()
                    self._context = info.get("max_model_len")
                    self._loaded[name] = {}  # a (re)started sampler holds nothing yet
                    self._ready.add(name)
                    reported = None
                    logger.info("sampler %s is ready; samples it can answer go to it", name)
                except (ValueError, ray.exceptions.RayActorError) as error:
                    reason = str(error).splitlines()[0]
                    if reason != reported:
                        reported = reason
                        logger.warning("sampler %s is not ready (%s); the torch sampler answers meanwhile", name,
                                       reason)
            await asyncio.sleep(READY_POLL_S)

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def choose(self, command: Command[SamplingRequest]) -> str | None:
        """The sampler for this sample, or None (the torch sampler answers it; why is logged): one that has its
        checkpoint loaded if any, else one picked by the checkpoint (or, for the bare base model, the session)."""
        reason = vllm_unsupported(command.payload, self._context)
        if reason is None and not self._ready:
            reason = "no sampler is ready yet"
        if reason is not None:
            self._count(f"torch: {reason}")
            logger.info("sample %s goes to the torch sampler: %s", command.request_id, reason)
            return None
        self._count("vllm")
        ready = sorted(self._ready)
        key = _adapter_key(command)
        holding = [name for name in ready if key is not None and key in self._loaded[name]]
        return _picked_by(command.model_id, holding or ready)

    def relay(self, command: Command[SamplingRequest], sampler: str,
              fallback: Callable[[], Future]) -> Future:
        """Sample ``command`` on ``sampler``; should the sampler die under it, on ``fallback`` (the engine) instead.
        A retry handed over again gets the first future."""
        known = self._relayed.get(command.request_id)
        if known is not None:
            return known
        future: Future = Future()
        self._relayed[command.request_id] = future
        while len(self._relayed) > REMEMBERED_SAMPLES:
            self._relayed.popitem(last=False)
        self._observer.begin(Operation(command.model_id, command.request_id, command.kind, self._clock(),
                                       command.tenant, command.tokens, command.trace))
        # The relay's to cancel from now on, before its task first runs (a cancel may be queued ahead of it).
        self._relaying.add(command.request_id)
        asyncio.get_running_loop().create_task(self._sample(command, sampler, fallback, future))
        return future

    async def _sample(self, command: Command[SamplingRequest], sampler: str, fallback: Callable[[], Future],
                      future: Future) -> None:
        key = _adapter_key(command)
        t0 = self._clock()
        try:
            if key is not None:
                try:
                    await self._fresh(sampler, key, command.model_id, "publish:sample")
                except InvalidRequestError as error:  # vLLM cannot take this adapter (its rank, say): torch can
                    self._count("torch: vLLM could not load the adapter")
                    logger.info("sample %s goes to the torch sampler: %s", command.request_id, error)
                    self._fall_back(command, fallback, future)
                    return
            t1 = self._clock()
            outcome = await self._sample_on(sampler, command, key)
            if isinstance(outcome, NotFoundError) and key is not None:
                # The sampler lost the adapter (it restarted since this trainer last looked): publish, once more.
                self._loaded[sampler].pop(key, None)
                await self._fresh(sampler, key, command.model_id, "publish:sample")
                outcome = await self._sample_on(sampler, command, key)
            if isinstance(outcome, Exception):
                raise outcome
            self._observer.span(command.model_id, "vllm:sample", f"{SAMPLER_LANE}:{sampler}", t1, self._clock(),
                                request_ids=[command.request_id], n=1, ok=True)
            future.set_result(outcome)
        except ray.exceptions.RayActorError as error:
            self._ready.discard(sampler)
            self._count("torch: the sampler died")
            logger.warning("sampler %s died under sample %s (%s); the torch sampler answers it", sampler,
                           command.request_id, str(error).splitlines()[0])
            self._fall_back(command, fallback, future)
        except Exception as error:  # its own error (an unknown checkpoint, bad input): the client's answer
            self._observer.span(command.model_id, "vllm:sample", f"{SAMPLER_LANE}:{sampler}", t0, self._clock(),
                                request_ids=[command.request_id], n=1, ok=False)
            if isinstance(error, ray.exceptions.TaskCancelledError):  # ``cancel``: vLLM stopped generating it
                error = CancelledByClientError.of_sample(command.request_id)
            future.set_exception(error)
        finally:
            self._relaying.discard(command.request_id)
            self._cancelled.discard(command.request_id)

    def _fall_back(self, command: Command, fallback: Callable[[], Future], future: Future) -> None:
        """The torch sampler answers ``command`` instead, unless its client cancelled it meanwhile."""
        if command.request_id in self._cancelled:
            future.set_exception(CancelledByClientError.of_sample(command.request_id))
        else:
            _chain(fallback(), future)

    async def _sample_on(self, sampler: str, command: Command[SamplingRequest], key: str | None) -> Any:
        """The sampler's outcome for ``command``: its result or its own error; raises TaskCancelledError once
        ``cancel`` cancelled it; CancelledByClientError when ``cancel`` came before the call."""
        if command.request_id in self._cancelled:
            raise CancelledByClientError.of_sample(command.request_id)
        call = named_actor(sampler).sample.remote([command.payload], [key], [command.trace])
        self._running[command.request_id] = call
        try:
            [outcome] = await call
            return outcome
        finally:
            self._running.pop(command.request_id, None)

    def cancel(self, request_id: str) -> bool:
        """Cancel a relayed sample its client abandoned: the sampler's call is cancelled, so vLLM aborts its
        generation (asyncio cancellation in the sampler's actor), and its future fails. One still publishing its
        adapter (a LoRA load can take seconds) fails instead of starting. False: none is relayed here (it finished,
        or the torch sampler answers it)."""
        call = self._running.get(request_id)
        if call is not None:
            ray.cancel(call)
            return True
        if request_id in self._relaying:
            self._cancelled.add(request_id)
            return True
        return False

    async def _fresh(self, sampler: str, path: str, model_id: str, span: str) -> None:
        """Make ``sampler`` hold the latest whole version of the sampler checkpoint ``path``; a load it needed is
        timed as ``span`` of ``model_id``."""
        lock = self._publishing.setdefault((sampler, path), asyncio.Lock())
        async with lock:
            version = await asyncio.to_thread(self._version, path)
            if self._loaded[sampler].get(path) == version:
                return
            t0 = self._clock()
            await named_actor(sampler).publish.remote(path, str(local_directory(self._checkpoint_dir, path)))
            self._loaded[sampler][path] = version
            self._observer.span(model_id, span, f"{SAMPLER_LANE}:{sampler}", t0, self._clock(), n=1, ok=True)

    def publish_after(self, saved: Future, model_id: str) -> Future:
        """``saved`` (a save_weights_for_sampler's future), completing only once its checkpoint is published to the
        sampler its samples will go to (or PUBLISH_WAIT_S passed: a later sample then loads it itself)."""
        published: Future = Future()
        loop = asyncio.get_running_loop()

        def done(_: Future) -> None:
            loop.call_soon_threadsafe(lambda: loop.create_task(self._publish_saved(saved, model_id, published)))

        saved.add_done_callback(done)
        return published

    async def _publish_saved(self, saved: Future, model_id: str, published: Future) -> None:
        if saved.exception() is None and self._ready:
            path = saved.result()["path"]
            sampler = _picked_by(path, sorted(self._ready))
            try:
                await asyncio.wait_for(self._fresh(sampler, path, model_id, "publish:save_weights_for_sampler"),
                                       PUBLISH_WAIT_S)
            except Exception as error:  # the save itself succeeded: its client gets it, samples load it later
                logger.warning("publishing %s to %s failed (%s); its first sample loads it", path, sampler,
                               str(error).splitlines()[0] if str(error) else type(error).__name__)
        _chain(saved, published)

    def describe(self) -> dict[str, Any]:
        return {"samplers": list(self.names), "ready": sorted(self._ready), "counts": dict(self.counts),
                "loaded": {name: sorted(paths) for name, paths in self._loaded.items()}}


def _adapter_key(command: Command[SamplingRequest]) -> str | None:
    """The sampler checkpoint a sample reads (a tinker path), or None for the bare base model."""
    if command.payload.base_only or not command.model_id.startswith(TINKER_SCHEME):
        return None
    return command.model_id


def _picked_by(key: str, pool: Sequence[str]) -> str:
    """One of ``pool`` by ``key``: the same key picks the same sampler, so a save and its samples meet on one."""
    return pool[zlib.crc32(key.encode()) % len(pool)]


def _chain(source: Future, target: Future) -> None:
    def copy(done: Future) -> None:
        error = done.exception()
        if error is not None:
            target.set_exception(error)
        else:
            target.set_result(done.result())

    source.add_done_callback(copy)
