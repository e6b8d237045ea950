"""The trainer actor: one per GPU (a configured number on CPU), holding its adapters, its engine and its timing.

All torch work of a trainer happens on one thread of its own: that thread loads the base model, builds the
backend, then runs the engine's compute lane (on CPU, torch runs in parallel well only from one thread). The
actor's event loop only hands commands to the engine and awaits their futures, so it keeps answering while a batch
runs. Every trainer keeps its critical path always (``timing``) and pushes it to the cluster's timing actor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import orjson
import ray
from ray.exceptions import ActorAlreadyExistsError
from ray.util.placement_group import NODE_ID_LABEL_KEY, PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from cluster.futures_actor import FUTURES_ACTOR_NAME
from cluster.local import NAMESPACE, ClusterError
from cluster.gpu_groups import rank_bundles, rank_group_name, rank_runtime_env
from cluster.sampling.actor import sampler_name
from cluster.sampling.plane import SamplerRelay, SamplerSeat, samplers_of, trainer_gpu_share
from cluster.timing import TimingPublisher, get_timing_actor
from cluster.trainer.backend import build_backend
from cluster.trainer.config import TrainerConfig, trainer_name
from cluster.trainer.results import ResultWriter
from cluster.worker_setup import freeze_startup, lower_thread_priority
from lilo.backend.checkpoints.index import (
    CheckpointEntry, checkpoint_files, checkpoint_path, copy_checkpoint, delete_checkpoint, latest_weights,
    list_checkpoints,
    read_checkpoint_file, weights_spec,
)
from lilo.backend.paging.files import PageFile, delete_page_files, find_page_files
from lilo.backend.paging.policy import page_file_wins
from lilo.backend.types import LoadRequest, LoraSpec
from lilo.engine.commands import Command, Kind
from lilo.engine.engine import Engine
from lilo.errors import NotFoundError, TooLargeError, UnavailableError, failure_category
from lilo.futures.sequences import RecordedSample
from lilo.futures.store import Completion
from lilo.protocol.proto import encode_forward_backward_output, encode_sample_response
from lilo.settings import Settings
from lilo.timing.critical_path import BACKEND_READY, SERVING_READY
from lilo.timing.trace_observer import trace_observer

logger = logging.getLogger(__name__)

T = TypeVar("T")

@dataclasses.dataclass(frozen=True)
class Loaded:
    """What the torch thread builds before the trainer serves."""

    engine: Engine
    backend: Any  # a TorchBackend: torch is imported on the torch thread only
    publisher: TimingPublisher


# Restarted by Ray when its process dies (on another node if its own is gone); the recovery actor then fails what
# it had in flight and restores its models (cluster/recovery.py).
#
# A command's result goes one of two ways. ``run`` and ``create_model`` return it to their caller (lilo's own
# calls: a restore's load, tests). ``submit``, ``create_model_future`` and ``unload_future`` take a client's
# request id and write the result to the futures DB under it (``_report``), in batches with others'.
@ray.remote(max_restarts=-1, max_concurrency=1000)
class TrainerActor:
    def __init__(self, name: str, base_model: str, config: TrainerConfig, samplers: Sequence[str] = (),
                 ranks: int = 1) -> None:
        self.name = name
        self.base_model = base_model
        self.ranks = ranks  # more than 1: the base sharded over this actor (rank 0) and its followers
        self._peers: Any = None  # its followers (cluster.trainer.ranks.RankPeers)
        self._sampler_names = tuple(samplers)  # the vLLM sampler actors this trainer relays samples to
        self._relay: SamplerRelay | None = None
        self._incarnation = uuid.uuid4().hex  # which process this is: Ray restarts a dead trainer under the same name
        self._loading: Future[Loaded] = Future()
        self._results = ResultWriter(lambda: ray.get_actor(FUTURES_ACTOR_NAME, namespace=NAMESPACE))
        # The futures of submitted commands whose completion is already on its way to the futures DB.
        self._reported: weakref.WeakSet[Future] = weakref.WeakSet()
        self._text = TrainerText(base_model, config.model_cache_dir)
        self._torch_thread = threading.Thread(target=self._run_torch, args=(config,), name="lilo-trainer-torch",
                                              daemon=True)
        self._torch_thread.start()

    def _run_torch(self, config: TrainerConfig) -> None:
        lower_thread_priority(config.compute_nice)
        try:
            group = None
            if self.ranks > 1:
                from cluster.trainer.ranks import RankPeers

                self._peers = RankPeers(self.name, self.base_model, config, self.ranks, ray_gpus())
                group = self._peers.group
            backend = build_backend(self.name, self.base_model, config, group)
            if self._peers is not None:
                self._peers.ready()
                backend.peers = self._peers
            # One execution fills every rank's pass.
            engine = Engine(backend, trace_observer(), token_budget=backend.max_batch_tokens * self.ranks,
                            window_cap_ms=config.coalesce_window_ms, start=False)
            if self._peers is not None:
                self._peers.on_failure = engine.stop
                self._peers.watch()
            engine.timings.mark(BACKEND_READY)
            engine.start(compute_thread=False)
            publisher = TimingPublisher(engine.timings, self.name, get_timing_actor(), usage=engine.usage).start()
            freeze_startup()
            self._loading.set_result(Loaded(engine, backend, publisher))
        except BaseException as error:
            self._loading.set_exception(error)
            return
        engine.run_compute_lane()

    async def _loaded(self) -> Loaded:
        """The engine, backend and timing publisher, once the base model is loaded (raises if loading failed)."""
        loaded = await asyncio.wrap_future(self._loading)
        if self._relay is None and self._sampler_names:
            self._relay = SamplerRelay(self._sampler_names, loaded.backend.checkpoint_dir,
                                       loaded.backend.sampler_version, loaded.engine.observer)
        return loaded

    def _dispatch(self, engine: Engine, command: Command) -> Future:
        """Hand ``command`` to the engine, or, for a sample one of this trainer's vLLM samplers answers, to that
        sampler (``cluster.sampling.plane``); a sampler checkpoint's save completes once it is published to them."""
        relay = self._relay
        if relay is not None and command.kind == Kind.SAMPLE:
            sampler = relay.choose(command)
            if sampler is not None:
                return relay.relay(command, sampler, lambda: engine.submit(command))
        future = engine.submit(command)
        if relay is not None and command.kind == Kind.SAVE_WEIGHTS_FOR_SAMPLER:
            return relay.publish_after(future, command.model_id)
        return future

    async def _in_checkpoint_dir(self, function: Callable[..., T], *args: Any) -> T:
        """``function(the checkpoints' storage, *args)``, off the event loop: the checkpoint files' reads and
        writes."""
        return await asyncio.to_thread(function, (await self._loaded()).backend.checkpoints.storage, *args)

    async def describe(self) -> dict[str, Any]:
        """Its name, base model, node and whether it holds a GPU, at once (``ready`` waits for the base model to
        load): the reconciler learns from this where Ray placed a trainer it started."""
        return {"name": self.name, "base_model": self.base_model, "node_id": ray.get_runtime_context().get_node_id(),
                "gpu": bool(ray.get_gpu_ids()), "ranks": self.ranks}

    async def ready(self) -> dict[str, Any]:
        """Waits for the base model; says what this trainer serves."""
        loaded = await self._loaded()
        loaded.engine.timings.mark(SERVING_READY)
        backend = loaded.backend
        eos = backend.model.config.get_text_config().eos_token_id
        room = backend.room_by_tier()
        return {"name": self.name, "base_model": self.base_model, "ranks": self.ranks,
                "free_slots": room.total, "room": room._asdict(),
                "vocab_size": backend.vocab_size, "projections": backend.projections,
                "node_id": ray.get_runtime_context().get_node_id(),
                "gpu": bool(ray.get_gpu_ids()), "pid": os.getpid(),
                "backend_ready_s": loaded.engine.timings.gauges()[BACKEND_READY],
                "eos_token_ids": [] if eos is None else [eos] if isinstance(eos, int) else list(eos)}

    async def rank_info(self) -> list[dict[str, Any]]:
        """Each rank of this trainer: where it runs (node, pid, GPU) and what it holds (``rank_memory``), rank 0
        first; with the bytes the group exchanged so far on rank 0's (``TorchBackend.exchanged``)."""
        from cluster.trainer.ranks import rank_memory, rank_place

        backend = (await self._loaded()).backend
        own = {**rank_place(0), **rank_memory(backend), "exchanged": dict(backend.exchanged)}
        followers = await asyncio.to_thread(self._peers.ready) if self._peers is not None else []
        return [own, *followers]

    async def residency(self) -> dict[str, Any]:
        """Where each training model it holds is (``device``: a slot; ``host`` or ``disk``: paged out,
        lilo.backend.paging), its training slots, and the room left per tier (the console's overview)."""
        backend = (await self._loaded()).backend
        pages = backend.pages
        # Copies first: the compute lane adds, pages and drops models meanwhile.
        tiers = {model_id: "device" for model_id in list(backend.adapters) if backend.holds(model_id)}
        tiers.update({model_id: pages.tier_of(model_id) for model_id in [*list(pages.host), *list(pages.disk)]})
        return {"slots": backend.training_slots(), "room": backend.room_by_tier()._asdict(), "tiers": tiers}

    async def tenant_usage(self) -> dict[str, dict[str, float]]:
        """Per tenant, its share of this trainer's execute seconds and its commands run (``TenantUsage``)."""
        return (await self._loaded()).engine.usage.snapshot()

    async def sampling(self) -> dict[str, Any]:
        """Its vLLM samplers (which are ready, what each has loaded) and how many samples each engine answered,
        with the reasons the torch sampler answered the others."""
        await self._loaded()
        if self._relay is None:
            return {"samplers": [], "ready": [], "counts": {}, "loaded": {}}
        return self._relay.describe()

    async def check_sampler_checkpoint(self, path: str) -> None:
        """Raises, with a message for the client, unless ``path`` is a sampler checkpoint this trainer can load."""
        (await self._loaded()).backend.sampler_version(path)

    async def run(self, command: Command) -> Any:
        """Queue a command in its model's order and return its result (or raise its own error)."""
        engine = (await self._loaded()).engine
        return await asyncio.wrap_future(self._dispatch(engine, command))

    async def submit(self, command: Command) -> None:
        """``run`` for a client's command: its result (or error) goes to the futures DB under its request id.
        Ordering and seq conflicts raise here, at once."""
        loaded = await self._loaded()
        engine = loaded.engine
        if command.kind in (Kind.FORWARD_BACKWARD, Kind.FORWARD):
            try:
                loaded.backend.check_fits(command.payload)
            except TooLargeError as refusal:
                # Refused before it runs (413); its seq is spent all the same, so the engine fails it in its turn
                # and the model's next request does not wait for it.
                refused = dataclasses.replace(command, kind=Kind.REFUSED, payload=str(refusal), batch_key=(), tokens=0)
                self._report(command.kind, command.request_id, engine.submit(refused))
                raise
        try:
            future = self._dispatch(engine, command)
        except NotFoundError:
            if command.model_id in engine.model_ids():
                raise
            # The futures DB routed it here, so the model is placed here: this trainer restarted since, and the
            # recovery actor is restoring the model (it answers 503 from the DB once it has taken the model off).
            raise UnavailableError(
                f"Model {command.model_id!r} is not on trainer {self.name} any more (the trainer restarted), so this "
                "request did not take effect. The model is being restored from its latest save_weights checkpoint "
                "or its newer page file (steps after that copy are lost); send your next request in a few seconds, "
                "or load_state your last checkpoint first.") from None
        self._report(command.kind, command.request_id, future, recorded_prompt_of(command))

    async def submit_many(self, commands: list[Command]) -> list[Exception | None]:
        """``submit`` each of ``commands`` in order (an ingress replica's burst, in one call): for each, None, or the
        error its ``submit`` raised."""
        outcomes: list[Exception | None] = []
        for command in commands:
            try:
                await self.submit(command)
                outcomes.append(None)
            except Exception as error:
                outcomes.append(error)
        return outcomes

    async def cancel_sample(self, request_id: str) -> str:
        """Cancel a sample its client abandoned (cancel_future), on the sampler it was relayed to or in the engine;
        its future fails with CancelledByClientError. Says where it was: "running", "queued" or "none"."""
        loaded = await self._loaded()
        if self._relay is not None and self._relay.cancel(request_id):
            return "running"
        return loaded.engine.cancel_sample(request_id)

    async def create_model(self, model_id: str, spec: LoraSpec) -> str:
        """Create a model; returns its id once it is ready."""
        engine = (await self._loaded()).engine
        return await asyncio.wrap_future(engine.create_model(model_id, spec))

    async def create_model_future(self, model_id: str, spec: LoraSpec, request_id: str) -> None:
        """``create_model`` for a client: the create_model future ``request_id`` completes with ``{"model_id"}``
        when the model is ready. A model this trainer has already is left alone: it was this same creation,
        retried, whose first call reports it."""
        engine = (await self._loaded()).engine
        if model_id not in engine.model_ids():
            self._report(Kind.CREATE_MODEL, request_id, engine.create_model(model_id, spec))

    async def create_model_from_checkpoint(self, model_id: str, spec: LoraSpec, load: Command) -> None:
        """Create a model whose first command, its seq 0, is ``load`` (a load_weights of a checkpoint with
        ``spec``): the client's steps (seq 1 on) run after it. ``load``'s future completes when it has run."""
        engine = (await self._loaded()).engine
        if model_id not in engine.model_ids():  # else this same creation, retried: the load is deduplicated
            engine.create_model(model_id, spec, first_seq=0)
        await self.submit(load)

    async def restore_model(self, model_id: str, spec: LoraSpec, next_seq: int | None) -> str | None:
        """Take over a model whose trainer failed, from whichever copy of it is newer (``paging.page_file_wins``):
        its page file (its whole training state as it was paged out to disk, found in any trainer's page directory)
        or its latest save_weights checkpoint (adapter and optimizer state); a fresh adapter if it has neither.
        Its client's steps run from ``next_seq`` on (None: this engine's default, and a fresh adapter). Returns
        the page file's path or the checkpoint's tinker path, or None (a fresh adapter, or the model was here
        already: an earlier call got this far, and the recovery actor failed to record the placement). A model
        that cannot be created here (no room any more) raises, for the recovery actor to try again."""
        loaded = await self._loaded()
        engine = loaded.engine
        if model_id in engine.model_ids():
            return None
        pages_root = loaded.backend.pages.directory.parent
        mirror = loaded.backend.pages.mirror
        if mirror is not None:  # the model's page files in the storage, whichever node wrote them
            await asyncio.to_thread(mirror.pull, model_id)
        pages = await asyncio.to_thread(find_page_files, pages_root, model_id)
        latest = await self._in_checkpoint_dir(latest_weights, model_id)
        if next_seq is not None and pages and page_file_wins(pages[0].paged_at, latest and latest[1]):
            restored = await self._restore_from_page(loaded, model_id, spec, next_seq, pages)
            if restored is not None:
                return restored
        # None of its page files is its latest state: gone before the model is created here, so that none can
        # come back on a later restore.
        await asyncio.to_thread(self._delete_page_files, loaded, model_id)
        if latest is None or next_seq is None:
            await asyncio.wrap_future(engine.create_model(model_id, spec, first_seq=next_seq))
            return None
        path = latest[0].tinker_path
        # The load runs in the model's order just before the client's next step, under the seq before it.
        await self._create_for_restore(loaded, model_id, spec, next_seq - 1)
        try:
            await self.run(Command(model_id, next_seq - 1, Kind.LOAD_WEIGHTS, f"restore-{model_id}",
                                   payload=LoadRequest(path=path, optimizer=True)))
        except Exception:
            logger.exception("restoring %s from %s failed; it goes on from a fresh adapter", model_id, path)
            return None
        return path

    @staticmethod
    async def _create_for_restore(loaded: Loaded, model_id: str, spec: LoraSpec, first_seq: int) -> None:
        """Create ``model_id`` for the restore's load at ``first_seq``; until that load has run, a page-out of the
        model writes no page file a later restore would take (``TorchBackend.restoring``)."""
        loaded.backend.restoring.add(model_id)
        try:
            await asyncio.wrap_future(loaded.engine.create_model(model_id, spec, first_seq=first_seq))
        except BaseException:
            loaded.backend.restoring.discard(model_id)
            raise

    async def _restore_from_page(self, loaded: Loaded, model_id: str, spec: LoraSpec, next_seq: int,
                                 pages: Sequence[PageFile]) -> str | None:
        """Restore ``model_id`` from its newest page file (``pages[0]``), its load run under the seq before
        ``next_seq``; the file's path. None when the file does not read back whole (nothing created then), or its
        load failed (the model goes on from a fresh adapter, as after a checkpoint's failed load)."""
        from lilo.backend.paging.store import PageRestore, read_page_file  # torch: this process's torch thread has it

        try:
            state = await asyncio.to_thread(read_page_file, pages[0])
        except Exception:
            logger.exception("page file %s of %s does not read back; restoring from its checkpoint", pages[0].path,
                             model_id)
            return None
        await self._create_for_restore(loaded, model_id, spec, next_seq - 1)
        restore = PageRestore(state, tuple(page.path for page in pages))
        try:
            await self.run(Command(model_id, next_seq - 1, Kind.LOAD_WEIGHTS, f"restore-{model_id}", payload=restore))
        except Exception:
            logger.exception("restoring %s from %s failed; it goes on from a fresh adapter", model_id, pages[0].path)
            return None
        return str(pages[0].path)

    @staticmethod
    def _delete_page_files(loaded: Loaded, model_id: str, trainer: str = "*") -> None:
        """Delete ``model_id``'s page files of every trainer (or ``trainer``'s) on this node and in the storage."""
        pages = loaded.backend.pages
        delete_page_files(pages.directory.parent, model_id, trainer)
        if pages.mirror is not None:
            pages.mirror.delete_stored(model_id, trainer)

    async def watch(self, known: str | None = None) -> str:
        """This process's incarnation id, at once, when ``known`` is not it; else never returns: the recovery actor
        keeps one such call open per trainer, which fails the moment this process dies (no polling)."""
        if known != self._incarnation:
            return self._incarnation
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def unload_future(self, model_id: str, request_id: str) -> None:
        """Free the model's adapter slot once what it queued has run; the unload_model future ``request_id``
        completes with ``{"model_id"}`` then. New commands for it are refused from now on. A model this trainer
        does not hold (it restarted, and nobody restored the model yet) is unloaded at once: nothing to free."""
        loaded = await self._loaded()
        engine = loaded.engine
        if model_id in engine.model_ids():
            unloaded = engine.unload_model(model_id)
        else:  # a page file this trainer's dead incarnation left of it must not bring it back
            await asyncio.to_thread(self._delete_page_files, loaded, model_id, loaded.backend.pages.directory.name)
            unloaded = Future()
            unloaded.set_result(model_id)
        self._report(Kind.UNLOAD_MODEL, request_id, unloaded)

    # Checkpoints are read and deleted in their storage by the trainer of their run (or, when it is gone, by any:
    # with --storage every trainer reaches every checkpoint; without, those of its own node).
    async def list_checkpoints(self, runs: list[str]) -> dict[str, list[CheckpointEntry]]:
        return await self._in_checkpoint_dir(lambda directory: {run: list_checkpoints(directory, run) for run in runs})

    async def delete_checkpoint(self, run: str, checkpoint_id: str) -> None:
        await self._in_checkpoint_dir(delete_checkpoint, run, checkpoint_id)
        (await self._loaded()).backend.checkpoints.forget(checkpoint_path(run, checkpoint_id))

    async def checkpoint_files(self, path: str) -> dict[str, int]:
        """``file -> size`` of the checkpoint ``path``'s files (what its download links serve)."""
        return await self._in_checkpoint_dir(checkpoint_files, path)

    async def read_checkpoint_file(self, path: str, file: str, offset: int, length: int) -> bytes:
        """One chunk of one of its files: the API replica streams a download a chunk at a time from here, so the
        files need not be on the replica's node."""
        return await self._in_checkpoint_dir(read_checkpoint_file, path, file, offset, length)

    async def copy_checkpoint(self, source: str, destination: str) -> None:
        await self._in_checkpoint_dir(copy_checkpoint, source, destination)

    async def weights_spec(self, path: str) -> LoraSpec:
        """The LoRA spec of the weights checkpoint ``path``; raises, with a message for the client, if there is none."""
        return await self._in_checkpoint_dir(weights_spec, path)

    def _report(self, kind: Kind, request_id: str, future: Future,
                recorded_prompt: Sequence[int] | None = None) -> None:
        """Write ``future``'s result to the futures DB under ``request_id`` once it finishes: once, however often a
        retry hands the same command over (the engine gives a retry the first future)."""
        self._results.start()
        if future in self._reported:
            return
        self._reported.add(future)
        future.add_done_callback(lambda done: self._finished(kind, request_id, done, recorded_prompt))

    def _finished(self, kind: Kind, request_id: str, done: Future,
                  recorded_prompt: Sequence[int] | None = None) -> None:
        # Runs on the thread that finished the command.
        self._results.put(completion_for(kind, int(request_id), done, recorded_prompt))

    async def timing(self, model_id: str | None = None, reset: bool = False, reader: str = "") -> dict | None:
        """This trainer's critical path of one of its models (None if not here), or of all of them."""
        engine = (await self._loaded()).engine
        if model_id is not None and not await self.has_model(model_id):
            return None
        return engine.timings.snapshot(model_id, reset=reset, reader=reader)

    async def model_ids(self) -> list[str]:
        """Every model this trainer holds (a restarted trainer holds none)."""
        engine = (await self._loaded()).engine
        return sorted(engine.model_ids())

    async def has_model(self, model_id: str) -> bool:
        return model_id in (await self._loaded()).backend.adapters

    # --- text, for the OpenAI-compatible endpoint (serve/openai/): the tokenizer is where the model's files are
    async def render_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt's token ids of chat ``messages`` (the model's chat template, the assistant's turn begun)."""
        return await self._text.call("render_chat", messages)

    async def encode(self, text: str) -> list[int]:
        return await self._text.call("encode", text)

    async def detokenize(self, context: list[int], sequences: list[list[int]]) -> list[list[str]]:
        """The text each token of each sequence adds after the prompt ``context`` (lilo.backend.text.pieces)."""
        return await self._text.call("pieces", context, sequences)

    async def token_texts(self, ids: list[int]) -> list[str]:
        return await self._text.call("token_texts", ids)

    async def stop(self, save_as: str | None = None) -> list[str]:
        """Stop serving: the execution under way finishes, queued commands fail. With ``save_as``, every training
        model's adapter and optimizer state is then saved as the save_weights checkpoint of that name (replacing
        an older one), so that the next start restores each model exactly where it stopped: a paged model from
        its paged state, where it waits (no page-in). Returns the saved checkpoints' tinker paths."""
        loaded = await self._loaded()
        engine, backend = loaded.engine, loaded.backend
        loaded.publisher.stop()
        await asyncio.to_thread(engine.stop)
        if save_as is None:
            return []
        await asyncio.to_thread(self._torch_thread.join)  # the compute lane returns once its execution ends
        models = sorted(model_id for model_id in engine.model_ids() if backend.holds(model_id))
        return await asyncio.to_thread(lambda: [backend.save_now(model_id, save_as) for model_id in models])


def recorded_prompt_of(command: Command) -> Sequence[int] | None:
    """The prompt of a sample whose sequences are to be recorded (``record_stability_info``); else None."""
    if command.kind == Kind.SAMPLE and command.payload.record_stability_info:
        return command.payload.prompt
    return None


def completion_for(kind: Kind, request_id: int, done: Future,
                   recorded_prompt: Sequence[int] | None = None) -> Completion:
    """The stored result of a finished command: protobuf for forward passes and samples (as the SDK demands), JSON
    otherwise; a failure carries its message and whether the client (``user``) or the server caused it. A sample
    given ``recorded_prompt`` carries its sequences to be recorded with its result."""
    error = done.exception()
    if error is not None:
        return Completion.failure(request_id, str(error), failure_category(error), kind=kind)
    result = done.result()
    if kind in (Kind.FORWARD_BACKWARD, Kind.FORWARD):
        body = encode_forward_backward_output(result["loss_fn_outputs"], result["metrics"])
    elif kind == Kind.SAMPLE:
        body = encode_sample_response(result)
        sampled = sum(len(sequence["tokens"]) for sequence in result["sequences"])
        recorded = RecordedSample.of(recorded_prompt, result) if recorded_prompt is not None else None
        return Completion.success(request_id, body, kind=kind, recorded=recorded, sampled_tokens=sampled)
    elif kind in (Kind.CREATE_MODEL, Kind.UNLOAD_MODEL):
        body = orjson.dumps({"model_id": result, "type": kind})
    else:
        body = orjson.dumps(result)
    return Completion.success(request_id, body, kind=kind)


def start_trainer(index: int, base_model: str, config: TrainerConfig, *, num_gpus: float = 0,
                  num_cpus: float = 1, node_id: str | None = None, samplers: Sequence[str] = (),
                  ranks: int = 1) -> ray.actor.ActorHandle:
    """A named trainer (``lilo-trainer-<index>`` in namespace ``lilo``), one GPU each when GPUs exist. With
    ``node_id`` it lives on that node only: Ray restarts it there if its process dies, and it dies with the node
    (the reconciler starts trainers on the nodes that are left or join). With ``ranks`` > 1 it spans that many
    GPUs (CPUs without GPUs) of one node (``node_id``'s, when given): a placement group of one bundle per rank, the
    trainer in the first. An index whose trainer is still running is refused (ActorAlreadyExistsError)."""
    name = trainer_name(index)
    # Before the group: making it removes the group of an earlier trainer of this name, and what runs in it.
    _refuse_taken_name(name)
    # SPREAD: trainers go to different nodes while there are nodes to go to (GPU trainers spread by their GPU).
    strategy: Any = "SPREAD" if node_id is None else NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    runtime_env: dict[str, Any] | None = None
    group: PlacementGroup | None = None
    if ranks > 1:
        group = rank_placement_group(name, ranks, num_gpus, node_id)
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
        runtime_env = rank_runtime_env(num_gpus)
    try:
        return TrainerActor.options(name=name, namespace=NAMESPACE, num_gpus=num_gpus, num_cpus=num_cpus,
                                    lifetime="detached", scheduling_strategy=strategy,
                                    runtime_env=runtime_env).remote(name, base_model, config, tuple(samplers), ranks)
    except Exception:  # the name taken since the check, say: a group without its trainer would hold GPUs for ever
        if group is not None:  # this start's own group only: one found by name may be a trainer's that runs
            remove_placement_group(group)
        raise


def _refuse_taken_name(name: str) -> None:
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return
    raise ActorAlreadyExistsError(f"a trainer named {name} is running: stop it first, or start this one under "
                                  "another index")


def rank_placement_group(trainer: str, ranks: int, gpus: float, node_id: str | None = None) -> PlacementGroup:
    """The placement group of a sharded trainer (``<trainer>-ranks``, detached like the trainer), on ``node_id``
    only when given (it then dies with that node): a pending one is what asks the autoscaler for a node with
    ``ranks`` GPUs. One left by an earlier trainer of that name goes."""
    remove_rank_placement_group(trainer)
    on_node = None if node_id is None else [{NODE_ID_LABEL_KEY: node_id}] * ranks
    return placement_group(rank_bundles(ranks, gpus), strategy="STRICT_PACK", name=rank_group_name(trainer),
                           lifetime="detached", bundle_label_selector=on_node)


def existing_rank_placement_group(trainer: str) -> PlacementGroup | None:
    """The placement group named for ``trainer``, or None (a trainer of one rank has none)."""
    try:
        return ray.util.get_placement_group(rank_group_name(trainer))
    except ValueError:
        return None


def remove_rank_placement_group(trainer: str) -> None:
    """Free the GPUs (CPUs) a sharded trainer's placement group holds, once the trainer is gone for good; none
    is fine."""
    group = existing_rank_placement_group(trainer)
    if group is not None:
        remove_placement_group(group)


def ray_gpus() -> float:
    """The GPUs Ray gave this process (a share of one, for a trainer beside a vLLM sampler)."""
    return ray.get_runtime_context().get_assigned_resources().get("GPU", 0.0)


def start_trainers(settings: Settings, seats: Sequence[SamplerSeat] = ()) -> list[ray.actor.ActorHandle]:
    """The cluster's trainers for ``settings``, started: each loads its base model meanwhile (``wait_for_trainers``).
    Each serves one base model: with GPUs, one trainer per GPU, the GPUs dealt out over the configured base models
    in turn; on CPU, ``settings.trainers`` (default 1) per base model. ``seats``: the sampler actors of
    ``trainer_layout``'s layout, which each trainer relays its samples to."""
    gpus = bool(ray.cluster_resources().get("GPU", 0))
    config = TrainerConfig.from_settings(settings)
    return [start_trainer(index, model, config, num_gpus=trainer_gpu_share(settings.samplers, gpus), num_cpus=1,
                          samplers=samplers_of(trainer_name(index), seats, sampler_name),
                          ranks=settings.ranks_of(model))
            for index, model in enumerate(trainer_layout(settings))]


def wait_for_trainers(handles: Sequence[ray.actor.ActorHandle], timeout_s: float) -> list[dict[str, Any]]:
    """What each of ``handles`` serves (``TrainerActor.ready``), once every one has its base model loaded."""
    try:
        return ray.get([handle.ready.remote() for handle in handles], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        gpus = bool(ray.cluster_resources().get("GPU", 0))
        raise ClusterError(
            f"{len(handles)} trainer(s) were not ready within {timeout_s:.0f} s. Each needs "
            f"{'1 GPU' if gpus else '1 CPU'} of the cluster's resources ({ray.cluster_resources()}); give the "
            "cluster more (--num-cpus), start fewer (--trainers), or allow more time (--timeout).") from None


def trainer_layout(settings: Settings) -> list[str]:
    """The base model of each trainer ``start_trainers`` starts, by index."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    models = settings.base_models
    if gpus:  # by default as many as the GPUs hold, a trainer of N ranks taking N
        count = max(settings.trainers or max(1, gpus // settings.most_ranks), len(models))
        return [models[index % len(models)] for index in range(count)]
    return [model for model in models for _ in range(settings.trainers or 1)]


class TrainerText:
    """A trainer's ``lilo.backend.text.ModelText``, loaded on first use, its calls made on one thread of its own:
    off the actor's event loop, and never two at once (a fast tokenizer must not be used by two threads at once)."""

    def __init__(self, base_model: str, model_cache_dir: Path | None) -> None:
        self._base_model = base_model
        self._model_cache_dir = model_cache_dir
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lilo-trainer-text")
        self._text: Any = None

    def _call(self, method: str, *args: Any) -> Any:
        if self._text is None:
            from lilo.backend.models import model_directory
            from lilo.backend.text import ModelText

            self._text = ModelText.load(model_directory(self._base_model, self._model_cache_dir), self._base_model)
        return getattr(self._text, method)(*args)

    async def call(self, method: str, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._call, method, *args)
