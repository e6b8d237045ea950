"""Checkpoints on disk as clients see them: listing, deleting, the spec of a weights checkpoint, and ids that
try to leave the checkpoint directory."""

import os

import pytest
import torch

from lilo.backend.checkpoints.index import (
    checkpoint_files, checkpoint_path, checkpoint_path_parts, copy_checkpoint, delete_checkpoint, list_checkpoints,
    read_checkpoint_file, weights_spec,
)
from lilo.backend.checkpoints.paths import local_directory
from lilo.backend.checkpoints.state import AdapterState, write_peft, write_state
from lilo.backend.types import LoraSpec
from lilo.errors import InvalidRequestError, NotFoundError

RUN = "session-1:train:0"
SPEC = LoraSpec(rank=4, seed=3)


def save(root, kind, name, mtime):
    state = AdapterState(SPEC, {"layers.0.q_proj.lora_A": torch.ones(4, 8), "layers.0.q_proj.lora_B": torch.ones(8, 4)},
                         step=2)
    directory = local_directory(root, f"tinker://{RUN}/{kind}/{name}")
    write_state(state, directory) if kind == "weights" else write_peft(state, directory, "lilo/tiny-llama")
    for path in directory.iterdir():
        os.utime(path, (mtime, mtime))
    return directory


def test_complete_checkpoints_of_both_kinds_are_listed_oldest_first_with_their_sizes(tmp_path):
    save(tmp_path, "weights", "step-2", 200)
    sampler = save(tmp_path, "sampler_weights", "step-1", 100)
    (local_directory(tmp_path, f"tinker://{RUN}/weights/half-written")).mkdir(parents=True)  # no meta.json yet
    listed = list_checkpoints(tmp_path, RUN)
    assert [(c.checkpoint_id, c.time_s) for c in listed] == [("sampler_weights/step-1", 100), ("weights/step-2", 200)]
    assert listed[0].tinker_path == f"tinker://{RUN}/sampler_weights/step-1"
    assert listed[0].size_bytes == sum(path.stat().st_size for path in sampler.iterdir())
    assert list_checkpoints(tmp_path, "session-1:train:9") == []


@pytest.mark.parametrize("kind", ["weights", "sampler_weights"])
def test_a_rewrite_that_fails_half_way_leaves_no_complete_looking_checkpoint(tmp_path, kind):
    directory = save(tmp_path, kind, "latest", 200)
    broken = AdapterState(SPEC, {"layers.0.q_proj.lora_A": "not a tensor"}, step=3)  # the write raises midway
    with pytest.raises(AttributeError):
        write_state(broken, directory) if kind == "weights" else write_peft(broken, directory, "lilo/tiny-llama")
    # The old marker went first: no one takes old metadata with half-new tensors for a checkpoint.
    assert directory.exists() and list_checkpoints(tmp_path, RUN) == []


def test_a_deleted_checkpoint_is_gone_from_disk_and_from_the_list(tmp_path):
    directory = save(tmp_path, "weights", "step-2", 200)
    delete_checkpoint(tmp_path, RUN, "weights/step-2")
    assert not directory.exists() and list_checkpoints(tmp_path, RUN) == []
    with pytest.raises(NotFoundError, match="has no checkpoint 'weights/step-2'"):
        delete_checkpoint(tmp_path, RUN, "weights/step-2")


@pytest.mark.parametrize(("run", "checkpoint_id"), [
    (RUN, "weights/../../x"), (RUN, "weights/.."), (RUN, "../weights/x"), (RUN, "weights"), (RUN, "other/x"),
    (RUN, "weights/a/b"), ("..", "weights/x"), ("", "weights/x"), ("a/b", "weights/x"),
])
def test_ids_cannot_leave_the_checkpoint_directory(tmp_path, run, checkpoint_id):
    with pytest.raises(InvalidRequestError):
        checkpoint_path(run, checkpoint_id)
    with pytest.raises(InvalidRequestError):
        delete_checkpoint(tmp_path / "root", run, checkpoint_id)


def test_a_symlink_out_of_the_checkpoint_directory_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "root" / RUN).mkdir(parents=True)
    (tmp_path / "root" / RUN / "weights").symlink_to(outside)
    (outside / "x").mkdir()
    with pytest.raises(InvalidRequestError, match="outside the checkpoint directory"):
        delete_checkpoint(tmp_path / "root", RUN, "weights/x")
    assert (outside / "x").exists()


def test_the_spec_of_a_weights_checkpoint_is_read_from_its_metadata(tmp_path):
    save(tmp_path, "weights", "step-2", 200)
    save(tmp_path, "sampler_weights", "step-2", 200)
    assert weights_spec(tmp_path, f"tinker://{RUN}/weights/step-2") == SPEC
    with pytest.raises(InvalidRequestError, match="is not a training checkpoint"):
        weights_spec(tmp_path, f"tinker://{RUN}/sampler_weights/step-2")
    with pytest.raises(NotFoundError, match="No training checkpoint"):
        weights_spec(tmp_path, f"tinker://{RUN}/weights/missing")


def test_an_external_weights_checkpoint_is_listed_with_the_others(tmp_path):
    save(tmp_path, "external_weights", "export", 300)
    assert [entry.checkpoint_id for entry in list_checkpoints(tmp_path, RUN)] == ["external_weights/export"]


def test_the_files_served_are_the_plain_files_of_a_complete_checkpoint_only(tmp_path):
    directory = save(tmp_path, "external_weights", "export", 300)
    (tmp_path / "secret").write_text("not for download")
    (directory / "link").symlink_to(tmp_path / "secret")
    path = f"tinker://{RUN}/external_weights/export"
    files = checkpoint_files(tmp_path, path)
    assert sorted(files) == ["adapter_config.json", "adapter_model.safetensors"]
    whole = read_checkpoint_file(tmp_path, path, "adapter_model.safetensors", 0, 1 << 30)
    assert len(whole) == files["adapter_model.safetensors"]
    assert read_checkpoint_file(tmp_path, path, "adapter_model.safetensors", 8, 16) == whole[8:24]
    for file in ("link", "../../secret", "..", ""):
        with pytest.raises(NotFoundError, match="has no file"):
            read_checkpoint_file(tmp_path, path, file, 0, 10)
    with pytest.raises(NotFoundError, match="No checkpoint"):
        checkpoint_files(tmp_path, f"tinker://{RUN}/external_weights/never-saved")
    for escape in (f"tinker://{RUN}/external_weights/..", "tinker://../external_weights/x"):
        with pytest.raises(InvalidRequestError):
            checkpoint_files(tmp_path, escape)


def test_a_copy_shares_the_files_and_outlives_its_source(tmp_path):
    save(tmp_path, "weights", "source", 300)
    source, copy = f"tinker://{RUN}/weights/source", "tinker://copy-1/weights/source"
    copy_checkpoint(tmp_path, source, copy)
    copied = local_directory(tmp_path, copy)
    assert sorted(path.name for path in copied.iterdir()) == sorted(checkpoint_files(tmp_path, source))
    assert all(path.stat().st_nlink == 2 for path in copied.iterdir())  # hard links: no bytes duplicated
    assert weights_spec(tmp_path, copy) == SPEC
    delete_checkpoint(tmp_path, RUN, "weights/source")
    assert weights_spec(tmp_path, copy) == SPEC
    assert checkpoint_path_parts(copy) == ("copy-1", "weights/source")
