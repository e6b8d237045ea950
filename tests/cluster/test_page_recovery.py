"""A trainer killed for real (SIGKILL) while models wait paged out to disk: Ray restarts it under its name, and each
model comes back, as the recovery actor asks (``restore_model``), from the newer of its page file and its latest
save_weights checkpoint. This trainer is none of the service's (the recovery actor does not watch it), so the test
makes the calls the recovery actor would."""

import json
import signal
import uuid

import psutil
import ray
import torch
from safetensors import safe_open

from cluster.trainer.actor import start_trainer
from cluster.trainer.config import TrainerConfig, trainer_name
from helpers import eventually, fresh_actor_index, stop_trainer, train_input
from lilo.backend.paging.files import page_file_name
from lilo.backend.types import AdamParams, LoraSpec, SaveRequest
from lilo.engine.commands import Command, Kind

SPEC = LoraSpec(rank=4, seed=0)


def page_file_state(path) -> tuple[torch.Tensor, dict]:
    """A page file's whole state and what it says of itself."""
    with safe_open(str(path), framework="pt") as handle:
        return handle.get_tensor("state"), handle.metadata()


def restarted(actor, pid: int, within_s: float = 300.0) -> int:
    """The pid of the process Ray restarted ``actor`` in, once it serves again."""
    def new_pid() -> int | None:
        serving = ray.get(actor.ready.remote(), timeout=60)["pid"]
        return serving if serving != pid else None

    return eventually(new_pid, "the trainer serving from a restarted process", timeout_s=within_s,
                      ignoring=(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError))


def one_slot_trainer(tmp_path_factory, host_adapter_mb: int) -> tuple:
    """A trainer of one slot that pages to host memory (``host_adapter_mb``) and disk; its handle, its page
    directory and its checkpoint directory."""
    index = fresh_actor_index()
    pages, checkpoints = tmp_path_factory.mktemp("pages"), tmp_path_factory.mktemp("checkpoints")
    config = TrainerConfig(max_adapters=1, max_rank=8, sampler_slots=0, device="auto", compute_nice=0,
                           checkpoint_dir=checkpoints, model_cache_dir=tmp_path_factory.mktemp("models"),
                           host_adapter_mb=host_adapter_mb, disk_adapter_gb=0.01, page_dir=pages)
    return start_trainer(index, "lilo/tiny-llama", config), pages / trainer_name(index), checkpoints


def test_a_killed_trainers_models_come_back_from_their_newer_copy_and_an_unloaded_one_stays_gone(
        ray_driver, tmp_path_factory):
    actor, directory, _ = one_slot_trainer(tmp_path_factory, host_adapter_mb=0)
    paged, saved, unloaded = (f"{role}-{uuid.uuid4().hex[:8]}" for role in ("paged", "saved", "unloaded"))

    def run(model_id: str, seq: int, kind: Kind, payload, **extra):
        command = Command(model_id, seq, kind, f"{model_id}:{seq}", payload=payload, **extra)
        return ray.get(actor.run.remote(command), timeout=120)

    def step(model_id: str, seq: int, seed: int) -> None:
        run(model_id, seq, Kind.FORWARD_BACKWARD, train_input(seed), tokens=32)
        run(model_id, seq + 1, Kind.OPTIM_STEP, AdamParams(learning_rate=1e-2))

    try:
        pid = ray.get(actor.ready.remote(), timeout=300)["pid"]
        # One slot: each model another one needs goes out to disk (no host tier).
        ray.get(actor.create_model.remote(paged, SPEC), timeout=60)
        step(paged, 1, 1)
        run(paged, 3, Kind.SAVE_WEIGHTS, SaveRequest("old"))  # older than the page file to come
        step(paged, 4, 2)  # its next seq: 6
        ray.get(actor.create_model.remote(saved, SPEC), timeout=60)  # pages `paged` out, with 2 steps
        step(saved, 1, 3)
        ray.get(actor.create_model.remote(unloaded, SPEC), timeout=60)  # pages `saved` out
        left_behind = (directory / page_file_name(saved)).read_bytes()
        step(unloaded, 1, 4)
        step(saved, 3, 5)  # paged back in (its page file goes), `unloaded` out
        run(saved, 5, Kind.SAVE_WEIGHTS, SaveRequest("newer"))  # its next seq: 6
        # A page file older than that checkpoint, as one left by an earlier run would be.
        (directory / page_file_name(saved)).write_bytes(left_behind)
        at_page_out, meta = page_file_state(directory / page_file_name(paged))
        assert meta["step"] == "2" and meta["model_id"] == paged

        process = psutil.Process(pid)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        restarted(actor, pid)

        # The page file is newer than `paged`'s checkpoint "old": its whole state comes back from it.
        assert ray.get(actor.restore_model.remote(paged, SPEC, 6), timeout=120) == str(directory /
                                                                                        page_file_name(paged))
        # `saved`'s checkpoint is newer than its left-over page file, which goes. Restoring it takes the one slot,
        # so `paged` goes out to disk again: bit for bit what it was when its trainer died.
        assert ray.get(actor.restore_model.remote(saved, SPEC, 6), timeout=120).endswith("/weights/newer")
        assert not (directory / page_file_name(saved)).exists()
        again, meta_again = page_file_state(directory / page_file_name(paged))
        assert torch.equal(again, at_page_out) and (meta_again["step"], meta_again["has_grads"]) == ("2", "0")

        # Unloaded while its trainer was down: its page file goes, so a restore cannot bring it back.
        ray.get(actor.unload_future.remote(unloaded, str(2**40)), timeout=60)
        assert not (directory / page_file_name(unloaded)).exists()
        assert ray.get(actor.restore_model.remote(unloaded, SPEC, 3), timeout=120) is None  # a fresh adapter

        # The clients go on in order: the next step of each applies at the seq it was due at.
        for model_id in (paged, saved):
            result = run(model_id, 6, Kind.FORWARD_BACKWARD, train_input(6), tokens=32)
            assert result["metrics"]["loss:sum"] > 0
    finally:
        stop_trainer(actor)


def test_a_stopping_trainer_saves_its_paged_models_too(ray_driver, tmp_path_factory):
    # What `lilo down` asks of each trainer: every model saved, so the next start restores each exactly.
    actor, directory, checkpoints = one_slot_trainer(tmp_path_factory, host_adapter_mb=1)
    models = [f"m{i}-{uuid.uuid4().hex[:8]}" for i in range(3)]
    try:
        for i, model_id in enumerate(models):
            ray.get(actor.create_model.remote(model_id, SPEC), timeout=60)
            for seq in range(1, 2 * i + 2, 2):  # model i takes i + 1 steps
                ray.get(actor.run.remote(Command(model_id, seq, Kind.FORWARD_BACKWARD, f"{model_id}:{seq}",
                                                 payload=train_input(seq), tokens=32)), timeout=60)
                ray.get(actor.run.remote(Command(model_id, seq + 1, Kind.OPTIM_STEP, f"{model_id}:{seq + 1}",
                                                 payload=AdamParams(learning_rate=1e-2))), timeout=60)
        assert len(list(directory.glob("*.page.safetensors"))) == 1  # one on disk, one in host memory, one in the slot
        paths = ray.get(actor.stop.remote(save_as="down"), timeout=120)
        assert sorted(paths) == sorted(f"tinker://{model_id}/weights/down" for model_id in models)
        for i, model_id in enumerate(models):
            meta = json.loads((checkpoints / model_id / "weights" / "down" / "meta.json").read_text())
            assert meta["step"] == i + 1
    finally:
        ray.kill(actor)
