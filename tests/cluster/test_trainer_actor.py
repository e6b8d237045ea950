"""A trainer actor on the real local cluster: its own torch thread, a real tiny model, and its timing served over
HTTP by the trainer that owns the model."""

import os
import sys
import threading
import uuid
from pathlib import Path

import httpx
import pytest
import ray

from cluster.futures_actor import FUTURES_ACTOR_NAME
from cluster.local import NAMESPACE
from cluster.trainer.actor import start_trainer
from cluster.trainer.config import TrainerConfig, trainer_name
from cluster.worker_setup import lower_thread_priority
from helpers import AUTH, eventually, fresh_actor_index, stop_trainer, train_input
from lilo.backend.types import AdamParams, LoraSpec, SaveRequest
from lilo.engine.commands import Command, Kind
from lilo.errors import SaturatedError, UnavailableError
from lilo.settings import load_settings


@pytest.fixture(scope="module")
def trainer(ray_driver, tmp_path_factory):
    index = fresh_actor_index()
    config = TrainerConfig(max_adapters=4, max_rank=8, sampler_slots=2, device="auto", compute_nice=0,
                           checkpoint_dir=tmp_path_factory.mktemp("checkpoints"),
                           model_cache_dir=tmp_path_factory.mktemp("models"))
    actor = start_trainer(index, "lilo/tiny-llama", config)
    try:
        yield actor, ray.get(actor.ready.remote(), timeout=300)
    finally:
        stop_trainer(actor)


def test_a_trainer_trains_its_models_on_its_own_torch_thread(trainer):
    actor, info = trainer
    assert info["base_model"] == "lilo/tiny-llama" and info["vocab_size"] == 1000
    model_id = f"m-{uuid.uuid4().hex[:8]}"
    assert ray.get(actor.create_model.remote(model_id, LoraSpec(rank=4, seed=0))) == model_id
    first = ray.get(actor.run.remote(Command(model_id, 1, Kind.FORWARD_BACKWARD, f"{model_id}:1",
                                             payload=train_input(1), tokens=32)))
    ray.get(actor.run.remote(Command(model_id, 2, Kind.OPTIM_STEP, f"{model_id}:2",
                                     payload=AdamParams(learning_rate=1e-2))))
    again = ray.get(actor.run.remote(Command(model_id, 3, Kind.FORWARD_BACKWARD, f"{model_id}:3",
                                             payload=train_input(1), tokens=32)))
    assert again["metrics"]["loss:sum"] < first["metrics"]["loss:sum"]


def test_a_placed_models_timing_is_answered_by_its_trainer(trainer, local_cluster):
    actor, info = trainer
    model_id = f"m-{uuid.uuid4().hex[:8]}"
    ray.get(actor.create_model.remote(model_id, LoraSpec(rank=4, seed=0)))
    futures = ray.get_actor(FUTURES_ACTOR_NAME, namespace=NAMESPACE)
    ray.get(futures.add_model.remote(model_id, "lilo/tiny-llama", {"rank": 4}))
    ray.get(futures.place_model.remote(model_id, info["name"]))
    ray.get(actor.run.remote(Command(model_id, 1, Kind.FORWARD_BACKWARD, f"{model_id}:1", payload=train_input(2),
                                     tokens=32)))
    url = f"{local_cluster.api_url}/api/v1/timing"
    # Straight from the trainer: no push interval in between, and the trainer's own gauges.
    body = httpx.get(url, params={"model_id": model_id, "reset": "true", "reader": "test"}, headers=AUTH).json()
    assert body["phases"]["forward_backward.execute"]["count"] == 1
    assert body["phases"]["accept.execute"]["count"] == 1
    assert {"trainer.backend_ready_s", "trainer.serving_ready_s", "trainer.first_model_ready_s"} <= set(body["gauges"])
    again = httpx.get(url, params={"model_id": model_id, "reset": "true", "reader": "test"}, headers=AUTH).json()
    assert again["phases"]["forward_backward.execute"]["count"] == 0


def thread_niceness(pid: int) -> dict[int, int]:
    """Each thread's niceness, from /proc (field 19 of its stat line, counted after the command's parentheses)."""
    found = {}
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        found[int(stat.parent.name)] = int(fields[16])
    return found


@pytest.mark.skipif(sys.platform != "linux", reason="niceness is per thread on Linux only")
def test_a_served_trainer_computes_on_a_nicer_thread_than_its_control_plane(ray_driver):
    # The session cluster runs with the defaults: Ray's workers at niceness 0 (not Ray's 15), compute threads +10.
    info = ray.get(ray.get_actor(trainer_name(0), namespace=NAMESPACE).ready.remote(), timeout=60)
    niceness = thread_niceness(info["pid"])
    assert niceness[info["pid"]] == 0  # the process's main thread: its RPCs
    assert sorted(set(niceness.values())) == [0, 10]


@pytest.mark.skipif(sys.platform != "linux", reason="niceness is per thread on Linux only")
def test_lowering_a_threads_priority_leaves_the_others_alone():
    seen = {}

    def compute() -> None:
        lower_thread_priority(7)
        seen["mine"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    thread = threading.Thread(target=compute)
    thread.start()
    thread.join()
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen["mine"] == min(19, before + 7)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


def test_a_command_for_a_model_the_trainer_does_not_hold_is_retryable(trainer):
    # What a trainer that restarted gets for a model the futures DB still places on it, until the recovery actor
    # has taken the model off: a 503 (the SDK retries it), not a 404 telling the client to create the model.
    actor, _ = trainer
    command = Command("m-never-here", 1, Kind.FORWARD_BACKWARD, "1", payload=train_input(3))
    with pytest.raises(UnavailableError, match="is not on trainer .* any more"):
        ray.get(actor.submit.remote(command), timeout=60)


def test_restoring_a_model_is_refused_without_a_free_slot_and_changes_nothing_when_repeated(trainer):
    actor, _ = trainer
    spec = LoraSpec(rank=4, seed=0)
    model_id = f"m-{uuid.uuid4().hex[:8]}"
    ray.get(actor.create_model.remote(model_id, spec))
    saved = ray.get(actor.run.remote(Command(model_id, 1, Kind.SAVE_WEIGHTS, f"{model_id}:1",
                                             payload=SaveRequest("kept"))))
    # The recovery actor asking again for a model this trainer restored already (it failed to record the
    # placement): nothing happens, and the model goes on in its own order.
    assert ray.get(actor.restore_model.remote(model_id, spec, 7), timeout=60) is None
    ray.get(actor.run.remote(Command(model_id, 2, Kind.FORWARD_BACKWARD, f"{model_id}:2", payload=train_input(2),
                                     tokens=32)))
    # Taken off, its slot filled by others: a restore from its checkpoint has nowhere to go, and says so, instead
    # of recording the model as placed here while the trainer does not hold it.
    ray.get(actor.unload_future.remote(model_id, str(2**40)))
    eventually(lambda: not ray.get(actor.has_model.remote(model_id)), f"{model_id} unloaded", every_s=0.2)
    fillers = [f"f-{uuid.uuid4().hex[:8]}" for _ in range(ray.get(actor.ready.remote())["free_slots"])]
    for filler in fillers:
        ray.get(actor.create_model.remote(filler, spec))
    with pytest.raises(SaturatedError):
        ray.get(actor.restore_model.remote(model_id, spec, 3), timeout=60)
    assert not ray.get(actor.has_model.remote(model_id)) and saved["path"].endswith("/weights/kept")
    for filler in fillers:
        ray.get(actor.unload_future.remote(filler, str(2**40)))


def test_a_watch_names_the_process_it_reached_and_then_blocks_on_it(trainer):
    # How the recovery actor tells a trainer that was unreachable for a while from one Ray restarted.
    actor, _ = trainer
    incarnation = ray.get(actor.watch.remote(None), timeout=30)
    assert ray.get(actor.watch.remote(""), timeout=30) == incarnation
    ready, _ = ray.wait([actor.watch.remote(incarnation)], timeout=1.0)
    assert ready == []  # watching the process it is: the call stays open until that process dies


def test_every_trainer_is_built_from_the_settings_of_its_service(tmp_path):
    settings = load_settings(env={}, home=tmp_path, max_adapters=5, max_rank=64, sampler_slots=1, device="cpu",
                             compute_nice=3, ray_address="auto", disk_adapter_gb=2)
    assert TrainerConfig.from_settings(settings) == TrainerConfig(
        max_adapters=5, max_rank=64, sampler_slots=1, device="cpu", compute_nice=3,
        checkpoint_dir=tmp_path / "checkpoints", host_adapter_mb=None, disk_adapter_gb=2, page_dir=tmp_path / "pages")


def test_a_paging_trainer_takes_more_models_than_slots_and_keeps_their_page_files_under_its_name(
        ray_driver, tmp_path_factory):
    index = fresh_actor_index()
    pages = tmp_path_factory.mktemp("pages")
    config = TrainerConfig(max_adapters=1, max_rank=8, sampler_slots=0, device="auto", compute_nice=0,
                           checkpoint_dir=tmp_path_factory.mktemp("checkpoints"),
                           model_cache_dir=tmp_path_factory.mktemp("models"), host_adapter_mb=0,
                           disk_adapter_gb=0.01, page_dir=pages)
    actor = start_trainer(index, "lilo/tiny-llama", config)
    try:
        assert ray.get(actor.ready.remote(), timeout=300)["free_slots"] > 1
        models = [f"p-{uuid.uuid4().hex[:8]}" for _ in range(3)]
        for model_id in models:
            ray.get(actor.create_model.remote(model_id, LoraSpec(rank=4, seed=0)), timeout=60)
        for model_id in models:  # each steps in turn, paged in from disk and out again
            ray.get(actor.run.remote(Command(model_id, 1, Kind.FORWARD_BACKWARD, f"{model_id}:1",
                                             payload=train_input(1), tokens=32)), timeout=60)
        assert len(list((pages / trainer_name(index)).glob("*.page.safetensors"))) == 2
    finally:
        stop_trainer(actor)
