"""The recovery actor: notices a trainer's death the moment it happens and makes its clients whole again.

When a trainer's process dies (killed, out of memory), Ray restarts it, empty (on whatever node has room; a GPU
trainer on its own node); when its node leaves, a GPU trainer leaves the service with it (``cluster.reconciler``).
This actor (``lilo-recovery`` in namespace ``lilo``) keeps one never-returning ``watch`` call open per trainer of
the registry (the reconciler's, read every second, so a trainer that joins is watched at once); that call fails as
soon as the trainer dies, and then, for that trainer:

1. In one futures-DB transaction, every request handed to it that had not finished fails (category ``server``,
   with a message saying what was lost) and its models are taken off it: their new requests answer 503, which the
   SDK retries by itself.
2. Each model is placed again on a live trainer serving its base model (the restarted one included, once it is up)
   and restored there from the newer of its page file (its whole training state, when it was paged out to disk)
   and its latest ``save_weights`` checkpoint (``TrainerActor.restore_model``), or from a fresh adapter when it has
   neither, ready for its client's next seq id. Then its requests flow again, without the client restarting. (No
   trainer of its base model yet, as while a GPU cluster's trainers start: it is tried again every few seconds
   until there is.)

A trainer that left the registry (its node left, or it was let go for idleness) is watched no more once recovered.

When this actor starts (with the service, or again after its own death) it catches up: a trainer without the
models placed on it (the whole service restarted, or the trainer died while nobody watched) is recovered as above,
and so are the models on none of the service's trainers (a previous run had more, or a restore was cut short). So a
restarted service takes back every model, from the ``lilo-shutdown`` checkpoint ``lilo down`` saved. A model whose
base model the service does not serve any more is unloaded instead, with a reason its client's next request gets
(410).

It also unloads the models of sessions that sent no heartbeat for the session timeout (their client died without
closing), so that their adapter slots are not taken forever; closing a client unloads its models at once. And it
deletes checkpoints past their TTL (``cluster.checkpoint_expiry``).

In-flight requests fail rather than replay: a replay would apply them to the last checkpoint, silently skipping the
steps that had completed since, so only the client can decide how to go on.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Iterable, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.checkpoint_expiry import SWEEP_EVERY_S, sweep_expired_checkpoints
from cluster.futures_actor import FUTURES_ACTOR_NAME
from cluster.local import NAMESPACE
from cluster.placement import choose_trainer, free_slots, models_placed, named_actor, trainer_facts
from cluster.reconciler import RECONCILER_ACTOR_NAME, REGISTRY_REFRESH_S
from cluster.unloading import unload_models
from lilo.backend.paging.policy import Room
from lilo.backend.types import LoraSpec
from lilo.errors import InvalidRequestError, LiloError
from lilo.futures.store import DisplacedModel

logger = logging.getLogger(__name__)

RECOVERY_ACTOR_NAME = "lilo-recovery"
# A trainer that does not say what it serves within this time is passed over when placing a model.
ANSWER_WITHIN_S = 5.0
# How long to wait before trying again to place models no live trainer could take.
RETRY_PLACEMENT_S = 2.0
# How long an unreachable trainer may take to answer again, as the same process, before it counts as dead (its
# requests then fail, within the 30 s the faults issue allows).
UNREACHABLE_S = 15.0


def lost_message(trainer: str) -> str:
    return (f"Trainer {trainer} stopped before this request finished (its process died or its node left the "
            f"cluster), so it did not take effect. {RESTORING}")


STRAY_MESSAGE = ("The trainer this request was handed to is no longer part of the service (it restarted with fewer "
                 "trainers), so the request did not take effect.")
RESTORING = ("The model is being restored on a live trainer from its latest save_weights checkpoint, or from its "
             "page file when it was paged out to disk after that checkpoint (a fresh adapter if it has neither): steps "
             "after that copy are lost. Load your last checkpoint (load_state) to "
             "resume from it, or go on from the restored state.")


def unservable_reason(base_model: str, served: Iterable[str]) -> str:
    return (f"its base model {base_model!r} is not served here any more (this service serves "
            f"{', '.join(sorted(served))}). Start lilo with --base-model {base_model} and create a model from one "
            "of its checkpoints (create_training_client_from_state) to train it again.")


def idle_reason(idle_s: float) -> str:
    return (f"its session sent no heartbeat for {idle_s:.0f} s (its client stopped without closing), so its adapter "
            "slot was freed. Create a model from one of its checkpoints (create_training_client_from_state) to train "
            "it again.")


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=1000)
class RecoveryActor:
    def __init__(self, base_models: Sequence[str], session_timeout_s: float = 0.0) -> None:
        self._base_models = list(base_models)
        self._trainers: list[str] = []  # the registry, as last read
        self._watched: set[str] = set()
        self._session_timeout_s = session_timeout_s
        self._futures = ray.get_actor(FUTURES_ACTOR_NAME, namespace=NAMESPACE)
        self.recoveries: list[dict] = []
        self._registry_read = asyncio.Event()
        # The watches wait until the strays are taken: a model a watch displaces must not look like a stray too.
        self._strays_taken = asyncio.Event()
        # Per trainer watched: set once its catch-up (``_catch_up``) has taken off the models it lost unwatched.
        self._caught_up: dict[str, asyncio.Event] = {}
        loop = asyncio.get_event_loop()
        self._tasks = [loop.create_task(self._follow_registry()), loop.create_task(self._start()),
                       loop.create_task(self._sweep_forever())]

    async def _read_registry(self) -> list[str]:
        """The registry's trainers now (waiting while the reconciler restarts)."""
        while True:
            try:
                self._trainers = await named_actor(RECONCILER_ACTOR_NAME).trainers.remote()
                return self._trainers
            except ray.exceptions.RayActorError:
                await asyncio.sleep(RETRY_PLACEMENT_S)

    async def _follow_registry(self) -> None:
        """Watch every trainer of the registry, a joining one within REGISTRY_REFRESH_S."""
        while True:
            try:
                for name in await self._read_registry():
                    if name not in self._watched:
                        self._watched.add(name)
                        self._spawn(self._watch(name))
            except Exception:
                logger.exception("reading the trainer registry failed; trying again")
            self._registry_read.set()
            await asyncio.sleep(REGISTRY_REFRESH_S)

    def _spawn(self, coroutine) -> None:
        self._tasks = [task for task in self._tasks if not task.done()]
        self._tasks.append(asyncio.get_running_loop().create_task(coroutine))

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_EVERY_S)
            try:
                await self.sweep_expired_checkpoints()
            except Exception:
                logger.exception("the checkpoint expiry sweep failed; trying again later")

    async def sweep_expired_checkpoints(self) -> list[str]:
        """Delete the checkpoints past their TTL now (also called every SWEEP_EVERY_S); returns their paths."""
        return await sweep_expired_checkpoints(self._futures, self._trainers)

    async def _start(self) -> None:
        """First the models of sessions idle past the timeout (a previous run's abandoned clients) are unloaded,
        so that they are not restored into slots nobody will use; then the strays are recovered; then, every so
        often, idle sessions are looked for again."""
        await self._registry_read.wait()
        if self._session_timeout_s > 0:
            await self._unload_idle_sessions()
        await self._recover_strays()
        if self._session_timeout_s > 0:
            every_s = min(60.0, max(1.0, self._session_timeout_s / 4))
            while True:
                await asyncio.sleep(every_s)
                await self._unload_idle_sessions()

    async def _unload_idle_sessions(self) -> None:
        """Unload the models of sessions idle past the timeout, as their client's close would."""
        try:
            idle = await self._futures.idle_session_models.remote(self._session_timeout_s)
            if idle:
                logger.warning("unloading %d model(s) of sessions idle for over %.0f s", len(idle),
                               self._session_timeout_s)
                await unload_models(self._futures, [(model_id, tenant) for model_id, tenant, _ in idle],
                                    idle_reason(self._session_timeout_s), "its session went idle")
        except Exception:
            logger.exception("unloading the models of idle sessions failed; trying again later")

    async def _recover_strays(self) -> None:
        """On this actor's (re)start: models on none of this service's trainers (a previous run had more, or
        their restore was cut short when this actor died) are displaced and restored like a dead trainer's."""
        while True:
            try:
                displaced = await self._futures.evacuate_strays.remote(self._trainers,
                                                                       f"{STRAY_MESSAGE} {RESTORING}")
                break
            except ray.exceptions.RayActorError:
                await asyncio.sleep(RETRY_PLACEMENT_S)
        self._strays_taken.set()
        if displaced:
            logger.warning("%d model(s) are on none of this service's trainers; restoring them", len(displaced))
            await self._restore("(strays)", displaced)

    async def caught_up(self) -> None:
        """Returns once this actor has taken off their trainers the models a previous run left on none of the
        service's trainers or on a trainer that came back without them (their requests answer 503, which the SDK
        retries, until each is restored): ``lilo up`` returns only then, or its clients' first requests would reach
        trainers that do not hold their models."""
        await self._registry_read.wait()
        await self._strays_taken.wait()
        await asyncio.gather(*(self._caught_up.setdefault(name, asyncio.Event()).wait() for name in self._trainers))

    async def _watch(self, trainer: str) -> None:
        await self._strays_taken.wait()
        await self._catch_up(trainer)
        self._caught_up.setdefault(trainer, asyncio.Event()).set()
        watched: str | None = None  # the incarnation (process) of the trainer being watched; None: learn it
        while True:
            try:
                # Returns at once with the incarnation reached when it is not ``watched``, else only by failing.
                reached = await named_actor(trainer).watch.remote(watched)
                if watched is None or reached == watched:
                    watched = reached
                    continue
                cause = f"a new process, {reached}, answers for it"
            except ray.exceptions.ActorUnavailableError as unreachable:
                # Unreachable is not dead (a network blip between nodes): only another process, or none within
                # the bound, makes it a death. Evacuating a live trainer would fail its work for nothing.
                if await self._incarnation(trainer) == watched:
                    logger.warning("trainer %s was unreachable (%s) and is back; watching again", trainer,
                                   str(unreachable).splitlines()[0])
                    continue
                cause = str(unreachable).splitlines()[0]
            except ray.exceptions.RayActorError as death:
                cause = str(death).splitlines()[0]
            except Exception:
                logger.exception("watching trainer %s failed; watching again", trainer)
                await asyncio.sleep(RETRY_PLACEMENT_S)
                continue
            logger.warning("trainer %s died (%s); recovering its requests and models", trainer, cause)
            # Back to watching at once, the restore going on meanwhile: the models it puts back onto this trainer
            # land on the incarnation this next watch reaches, so a death of that one is seen too.
            await self._recover(trainer)
            if trainer not in await self._read_registry():  # it left with its node, or was let go
                self._watched.discard(trainer)
                logger.warning("trainer %s left the service; watching it no more", trainer)
                return
            watched = None

    async def _incarnation(self, trainer: str) -> str | None:
        """The incarnation answering for ``trainer`` within UNREACHABLE_S, or None."""
        try:
            return await asyncio.wait_for(named_actor(trainer).watch.remote(""), UNREACHABLE_S)
        except (asyncio.TimeoutError, ray.exceptions.RayActorError):
            return None

    async def _catch_up(self, trainer: str) -> None:
        """On this actor's (re)start: a trainer that died while nobody watched (this actor was on the node that
        left with it, say, or the whole service restarted) is up again without the models placed on it; recover
        it now."""
        while True:
            try:
                held = set(await named_actor(trainer).model_ids.remote())
                placed = {model for model, on in (await self._futures.placement.remote()).items() if on == trainer}
                break
            except ray.exceptions.RayActorError:
                if trainer not in await self._read_registry():
                    held = set()
                    placed = {model for model, on in (await self._futures.placement.remote()).items()
                              if on == trainer}
                    break
                await asyncio.sleep(RETRY_PLACEMENT_S)
        if placed - held:
            logger.warning("trainer %s lost %d model(s) while it was not watched; recovering them", trainer,
                           len(placed - held))
            await self._recover(trainer)

    async def _recover(self, trainer: str) -> None:
        """Fail the dead trainer's in-flight futures and take its models off it (retried while the futures DB
        restarts), then restore them in the background: restoring waits for free slots, and the trainer's next
        incarnation must be watched meanwhile."""
        while True:
            try:
                displaced = await self._futures.evacuate.remote(trainer, lost_message(trainer))
                break
            except ray.exceptions.RayActorError:
                await asyncio.sleep(RETRY_PLACEMENT_S)
        if displaced:
            self._spawn(self._restore(trainer, displaced))

    async def _restore(self, trainer: str, displaced: Sequence[DisplacedModel]) -> None:
        """Restore every displaced model of ``trainer``, round after round until each is placed (or unloaded,
        when no trainer serves its base model any more)."""
        restored: dict[str, tuple[str, str | None]] = {}
        unloaded: dict[str, str] = {}
        # In the history at once, filled in as models come back: one model short of a slot hides no other.
        self.recoveries.append({"trainer": trainer, "models": restored, "unloaded": unloaded})
        while True:
            try:
                await self._restore_round([m for m in displaced if m.model_id not in restored | unloaded], restored,
                                          unloaded)
            except Exception:  # the futures DB restarting, say: the models not back yet get the next round
                logger.exception("a round of restoring %s's models failed; trying again", trainer)
            if len(restored) + len(unloaded) == len(displaced):
                break
            await asyncio.sleep(RETRY_PLACEMENT_S)  # a trainer may restart or free a slot meanwhile

    async def _restore_round(self, models: Sequence[DisplacedModel], restored: dict, unloaded: dict) -> None:
        """Place and restore each model on the live trainer with the most room serving its base model, asking the
        trainers once for the round (a dead one would cost a timeout per model); ``restored`` gains, per model
        restored, its trainer and the checkpoint it was restored from (None: a fresh adapter). A model whose base
        model the service does not serve, or whose record holds no valid LoRA config, is unloaded,
        saying why: ``unloaded`` gains it."""
        facts = await trainer_facts(self._trainers, ANSWER_WITHIN_S)
        placed = await models_placed(self._futures)
        for model in models:
            try:
                spec = LoraSpec.from_config(model.lora_config)
            except InvalidRequestError as error:  # a record no trainer could ever restore
                await self._unload(model, f"its record cannot be restored: {error}", unloaded)
                continue
            if model.base_model not in self._base_models:
                await self._unload(model, unservable_reason(model.base_model, self._base_models), unloaded)
                continue
            try:
                trainer = choose_trainer(free_slots(facts, model.base_model), placed)
                checkpoint = await named_actor(trainer).restore_model.remote(model.model_id, spec, model.next_seq)
                await self._futures.place_model.remote(model.model_id, trainer)
            except (LiloError, ray.exceptions.RayActorError) as error:
                logger.warning("cannot restore model %s yet (%s); retrying in %.0f s", model.model_id,
                               str(error).splitlines()[0], RETRY_PLACEMENT_S)
                continue
            facts[trainer]["room"] = Room(**facts[trainer]["room"]).less_one()._asdict()
            placed[trainer] = placed.get(trainer, 0) + 1
            restored[model.model_id] = (trainer, checkpoint)
            logger.warning("model %s restored on %s from %s", model.model_id, trainer, checkpoint or "a fresh adapter")

    async def _unload(self, model: DisplacedModel, reason: str, unloaded: dict) -> None:
        """Give up on restoring ``model``: unload it, so that its client's next request says ``reason`` (410)."""
        await self._futures.mark_unloaded.remote(model.model_id, reason)
        unloaded[model.model_id] = reason
        logger.warning("model %s unloaded: %s", model.model_id, reason)

    async def history(self) -> list[dict]:
        """Each recovery so far (one under way included, its models listed as they come back): the trainer that
        died, per model where it went and from which checkpoint, and the models unloaded instead."""
        return self.recoveries


def start_recovery(base_models: Sequence[str], session_timeout_s: float = 0.0) -> ray.actor.ActorHandle:
    """The cluster's recovery actor, watching the reconciler's trainers, which serve ``base_models`` (and unloading
    the models of sessions idle for ``session_timeout_s``; 0: never), on this driver's node (the head, with the
    futures DB actor), so that a worker node leaving does not take it along; if it dies anyway, it catches up on
    restart."""
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=True)
    return RecoveryActor.options(name=RECOVERY_ACTOR_NAME, namespace=NAMESPACE, lifetime="detached",
                                 get_if_exists=True, scheduling_strategy=here).remote(list(base_models),
                                                                                      session_timeout_s)
