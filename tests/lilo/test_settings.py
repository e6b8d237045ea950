"""The settings object: defaults, environment overrides, flag precedence, and messages that say what to change."""

from pathlib import Path

import pytest

from lilo.backend.registry import DEFAULT_BASE_MODEL
from lilo.settings import SettingsError, load_settings


def test_defaults_are_loopback_on_the_documented_ports():
    settings = load_settings(env={})
    assert (settings.http_host, settings.http_port, settings.dashboard_port) == ("127.0.0.1", 8000, 8265)
    assert settings.base_models == (DEFAULT_BASE_MODEL,)
    assert settings.ray_address is None
    assert settings.ray_temp_dir == Path.home() / ".lilo" / "ray"


def test_environment_overrides_defaults_and_flags_override_environment():
    env = {"LILO_HTTP_PORT": "9000", "LILO_DASHBOARD_PORT": "9265", "LILO_HOME": "/tmp/x"}
    assert load_settings(env=env).http_port == 9000
    settings = load_settings(env=env, http_port=9100, dashboard_port=None)
    assert (settings.http_port, settings.dashboard_port, settings.home) == (9100, 9265, Path("/tmp/x"))


def test_base_models_from_environment_keep_their_order():
    settings = load_settings(env={"LILO_BASE_MODELS": f"lilo/tiny-llama, {DEFAULT_BASE_MODEL}"})
    assert settings.base_models == ("lilo/tiny-llama", DEFAULT_BASE_MODEL)


def test_a_base_model_served_from_a_directory_under_a_name_of_its_own(tmp_path, monkeypatch):
    import json

    from lilo.backend.models import build_tiny, model_directory
    from lilo.backend.registry import MODEL_PATHS_ENV, base_model_spec, is_servable

    directory = build_tiny(tmp_path / "tiny", "tiny-qwen3.5")
    settings = load_settings(env={"LILO_BASE_MODELS": f"lilo/tiny-llama,Qwen/Qwen3.5-9B-Base={directory}"})
    assert settings.base_models == ("lilo/tiny-llama", "Qwen/Qwen3.5-9B-Base")
    assert settings.model_paths == (("Qwen/Qwen3.5-9B-Base", str(directory)),)
    environment = settings.model_paths_env()
    assert json.loads(environment[MODEL_PATHS_ENV]) == {"Qwen/Qwen3.5-9B-Base": str(directory)}
    # A process with that environment (every one of lilo's Ray job) finds the model's files and facts by the name.
    monkeypatch.setenv(MODEL_PATHS_ENV, environment[MODEL_PATHS_ENV])
    assert model_directory("Qwen/Qwen3.5-9B-Base") == directory and is_servable("Qwen/Qwen3.5-9B-Base")
    spec = base_model_spec("Qwen/Qwen3.5-9B-Base")
    assert (spec.arch, spec.max_context_length) == ("qwen3_5_text", 512) and str(directory) in spec.description
    assert load_settings(env={}).model_paths_env() == {}


def test_a_base_model_directory_without_a_model_is_refused_saying_what_to_point_at(tmp_path):
    with pytest.raises(SettingsError, match=rf"--base-model org/name={tmp_path}: {tmp_path} holds no config.json; "
                                            r"point it at a directory holding a transformers model"):
        load_settings(env={}, base_models=[f"org/name={tmp_path}"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"http_port": 0}, "http_port must be between 1 and 65535"),
        ({"http_port": 8265}, "give --port or --dashboard-port another value"),
        ({"http_host": "localhost"}, "--host must be an IP address"),
        ({"num_cpus": 0}, "--num-cpus must be at least 1"),
        ({"base_models": ["gpt-17"]}, "Unknown base model(s) gpt-17"),
        ({"home": "/tmp/" + "a" * 60}, "pass a shorter --home"),
        ({"device": "tpu"}, "--device must be auto, cpu or cuda"),
        ({"max_body_mb": 0}, "--max-body-mb must be at least 1"),
        ({"min_trainers": -1}, "--min-trainers must be 0 or more"),
        ({"min_trainers": 3, "max_trainers": 2}, "--max-trainers must be at least 1 and at least --min-trainers (3)"),
        ({"trainer_idle_timeout_s": -1}, "--trainer-idle-timeout must be 0 (never) or more seconds"),
        ({"trainer_wait_s": -1}, "--trainer-wait must be 0 or more seconds"),
        ({"follow_gpus": True, "ray_address": "auto", "trainers": 2}, "--trainers fixes how many trainers run"),
        ({"follow_gpus": True}, "--follow-gpus needs a cluster whose GPU nodes come and go"),
        ({"trainer_ranks": "0"}, "--trainer-ranks takes N or MODEL=N with N at least 1"),
        ({"trainer_ranks": "2,other/model=4"}, "--trainer-ranks names other/model, which no --base-model serves"),
    ],
)
def test_invalid_settings_say_what_to_change(overrides, message):
    with pytest.raises(SettingsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_settings(env={}, **overrides)


def test_invalid_environment_value_names_the_variable():
    with pytest.raises(SettingsError, match="LILO_HTTP_PORT='eighty' is not a valid int"):
        load_settings(env={"LILO_HTTP_PORT": "eighty"})


def test_a_long_home_is_fine_when_joining_an_existing_cluster():
    settings = load_settings(env={}, home="/tmp/" + "a" * 60, ray_address="auto")
    assert settings.ray_address == "auto"


def test_the_session_timeout_comes_from_the_environment_or_a_flag_and_is_not_negative():
    assert load_settings(env={}).session_timeout_s == 3600
    assert load_settings(env={"LILO_SESSION_TIMEOUT_S": "0"}).session_timeout_s == 0
    with pytest.raises(SettingsError, match="--session-timeout must be 0 .never. or more seconds"):
        load_settings(env={}, session_timeout_s=-1)


def test_compute_niceness_comes_from_the_environment_or_a_flag_and_stays_in_range():
    assert load_settings(env={}).compute_nice == 10
    assert load_settings(env={"LILO_COMPUTE_NICE": "0"}).compute_nice == 0
    with pytest.raises(SettingsError, match="--compute-nice must be between 0 and 19"):
        load_settings(env={}, compute_nice=20)


def test_adapter_slots_per_trainer_come_from_the_environment_or_a_flag_and_must_be_positive():
    assert load_settings(env={}).max_adapters == 16
    assert load_settings(env={"LILO_MAX_ADAPTERS": "32"}).max_adapters == 32
    with pytest.raises(SettingsError, match="--max-adapters must be at least 1"):
        load_settings(env={}, max_adapters=0)


def test_sampler_slots_per_trainer_come_from_the_environment_or_a_flag_and_may_be_zero():
    assert load_settings(env={}).sampler_slots == 2
    assert load_settings(env={"LILO_SAMPLER_SLOTS": "0"}).sampler_slots == 0
    with pytest.raises(SettingsError, match="--sampler-slots must be 0 or more"):
        load_settings(env={}, sampler_slots=-1)


def test_samplers_are_none_a_share_of_each_trainers_gpu_or_a_count_per_base_model():
    assert load_settings(env={}).samplers == 0
    assert load_settings(env={"LILO_SAMPLERS": "0.25"}).samplers == 0.25
    assert load_settings(env={}, samplers=2).samplers == 2
    for wrong in (-1, 1.5):
        with pytest.raises(SettingsError, match="--samplers must be 0"):
            load_settings(env={}, samplers=wrong)
    with pytest.raises(SettingsError, match="--sampler-max-loras must be at least 1"):
        load_settings(env={}, sampler_max_loras=0)


def test_the_largest_lora_rank_comes_from_the_environment_or_a_flag_and_must_be_positive():
    assert load_settings(env={}).max_rank == 32
    assert load_settings(env={"LILO_MAX_RANK": "64"}).max_rank == 64
    with pytest.raises(SettingsError, match="--max-rank must be at least 1"):
        load_settings(env={}, max_rank=0)


def test_following_the_gpus_is_decided_at_start_unless_set_and_its_bounds_come_from_the_environment():
    settings = load_settings(env={})
    assert (settings.follow_gpus, settings.min_trainers, settings.max_trainers) == (None, 1, 8)
    assert (settings.trainer_idle_timeout_s, settings.trainer_wait_s) == (600, 30)
    settings = load_settings(env={"LILO_FOLLOW_GPUS": "1", "LILO_RAY_ADDRESS": "auto", "LILO_MAX_TRAINERS": "4",
                                  "LILO_TRAINER_IDLE_TIMEOUT_S": "0"})
    assert (settings.follow_gpus, settings.max_trainers, settings.trainer_idle_timeout_s) == (True, 4, 0)
    with pytest.raises(SettingsError, match="LILO_FOLLOW_GPUS='maybe' is not a valid flag"):
        load_settings(env={"LILO_FOLLOW_GPUS": "maybe"})


def test_paging_tiers_come_from_the_environment_or_a_flag_and_may_be_zero():
    assert load_settings(env={}).host_adapter_mb is None  # a share of the node's memory, resolved per trainer
    assert load_settings(env={}).disk_adapter_gb == 16.0
    settings = load_settings(env={"LILO_HOST_ADAPTER_MB": "512", "LILO_DISK_ADAPTER_GB": "0.5"})
    assert (settings.host_adapter_mb, settings.disk_adapter_gb) == (512, 0.5)
    assert load_settings(env={}, host_adapter_mb=0, disk_adapter_gb=0).disk_adapter_gb == 0
    with pytest.raises(SettingsError, match="--host-adapter-mb must be 0"):
        load_settings(env={}, host_adapter_mb=-1)
    with pytest.raises(SettingsError, match="--disk-adapter-gb must be 0"):
        load_settings(env={}, disk_adapter_gb=-1)


def test_the_pass_budget_and_the_coalescing_window_come_from_the_environment_or_a_flag():
    settings = load_settings(env={})
    assert (settings.max_batch_tokens, settings.coalesce_window_ms) == (None, 100.0)  # None: sized per trainer
    settings = load_settings(env={"LILO_MAX_BATCH_TOKENS": "4096", "LILO_COALESCE_WINDOW_MS": "0"})
    assert (settings.max_batch_tokens, settings.coalesce_window_ms) == (4096, 0.0)
    assert load_settings(env={"LILO_MAX_BATCH_TOKENS": "4096"}, max_batch_tokens=512).max_batch_tokens == 512
    with pytest.raises(SettingsError, match="--max-batch-tokens must be at least 1, got 0; leave it out"):
        load_settings(env={}, max_batch_tokens=0)
    with pytest.raises(SettingsError, match=r"--coalesce-window-ms must be 0 \(no window\) or more, got -5"):
        load_settings(env={}, coalesce_window_ms=-5)


def test_trainer_ranks_apply_to_every_base_model_unless_one_is_named():
    settings = load_settings(env={"LILO_TRAINER_RANKS": "2,lilo/tiny-llama=4"},
                             base_models=["lilo/tiny-llama", DEFAULT_BASE_MODEL])
    assert (settings.ranks_of("lilo/tiny-llama"), settings.ranks_of(DEFAULT_BASE_MODEL)) == (4, 2)
    assert settings.most_ranks == 4
    assert load_settings(env={}).ranks_of(DEFAULT_BASE_MODEL) == 1


def test_the_ledger_is_a_postgresql_url_never_echoed_or_sqlite_by_default():
    assert load_settings(env={}).ledger is None
    url = "postgresql://lilo:s3cret@db.internal:5432/lilo"
    settings = load_settings(env={"LILO_LEDGER": url})
    assert settings.ledger == url and "s3cret" not in repr(settings)
    with pytest.raises(SettingsError, match="--ledger .LILO_LEDGER. takes a PostgreSQL URL") as refused:
        load_settings(env={}, ledger="mysql://lilo:s3cret@db/lilo")
    assert "s3cret" not in str(refused.value)
