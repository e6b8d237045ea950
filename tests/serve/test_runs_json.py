"""Training runs and checkpoints in the wire shapes of the SDK's own types (TrainingRun, Checkpoint)."""

from tinker import types

from lilo.backend.checkpoints.index import CheckpointEntry
from serve.tinker.runs import Listed, checkpoint_json, timestamp, training_run_json

RUN = {"model_id": "s:train:0", "base_model": "lilo/tiny-llama", "tenant": None, "lora_config": {"rank": 8},
       "last_request_time": 1_700_000_100.5, "user_metadata": {"k": "v"}, "trainer": "lilo-trainer-0"}


def entry(kind: str, name: str, time_s: float) -> Listed:
    """A checkpoint's files, and no record of it in the futures DB (private, never expiring)."""
    return CheckpointEntry("s:train:0", kind, name, time_s, 123), None


def test_a_checkpoint_has_exactly_the_fields_of_the_sdks_checkpoint():
    wire = checkpoint_json(entry("sampler_weights", "step-1", 1_700_000_000.25))
    parsed = types.Checkpoint.model_validate(wire)
    assert set(wire) == set(types.Checkpoint.model_fields)
    assert (parsed.checkpoint_id, parsed.checkpoint_type, parsed.tinker_path, parsed.size_bytes) == (
        "sampler_weights/step-1", "sampler", "tinker://s:train:0/sampler_weights/step-1", 123)
    assert parsed.time.timestamp() == 1_700_000_000.25
    assert types.ParsedCheckpointTinkerPath.from_tinker_path(parsed.tinker_path).checkpoint_id == parsed.checkpoint_id


def test_a_training_run_carries_its_newest_checkpoint_of_each_kind():
    checkpoints = [entry("weights", "b", 30), entry("weights", "a", 10), entry("sampler_weights", "s", 20)]
    wire = training_run_json(RUN, checkpoints)
    parsed = types.TrainingRun.model_validate(wire)
    assert set(wire) == set(types.TrainingRun.model_fields)
    assert parsed.last_checkpoint.checkpoint_id == "weights/b"
    assert parsed.last_sampler_checkpoint.checkpoint_id == "sampler_weights/s"
    assert (parsed.model_owner, parsed.lora_rank, parsed.user_metadata) == ("local", 8, {"k": "v"})
    bare = types.TrainingRun.model_validate(training_run_json(RUN, []))
    assert bare.last_checkpoint is None and bare.last_sampler_checkpoint is None


def test_timestamps_are_utc_iso_8601():
    assert timestamp(0) == "1970-01-01T00:00:00+00:00"
