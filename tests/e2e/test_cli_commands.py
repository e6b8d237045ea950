"""Every ``tinker`` CLI command a user runs against lilo, through the real CLI (tinker 0.38.0): what it can do, it
does; what a self-hosted service cannot (billing in money, the Hugging Face hub with no internet), it refuses with a
sentence. The checkpoint and run commands' details are in test_rest_surface.py; auth in test_cli_auth.py."""

import datetime
import json

import httpx
from tinker import types

from helpers import cli_json, sdk_datum, tinker_cli

TINY = "lilo/tiny-llama"
TIMEOUT_S = 120


def test_model_list_shows_the_served_base_models(local_cluster):
    listed = cli_json(local_cluster, "model", "list")
    names = [model["model_name"] for model in listed["models"]]
    assert names == list(local_cluster.base_models)
    assert [model["model_name"] for model in cli_json(local_cluster, "model", "list", "tiny-llama")["models"]] == [TINY]
    missing = tinker_cli(local_cluster, "model", "list", "no-such-model")  # names the organization: whoami
    assert missing.returncode != 0 and "for organization tml:organization:local" in missing.stderr, missing.stderr


def test_run_info_and_checkpoint_publication_work_from_the_cli(local_cluster, service):
    training = service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=TIMEOUT_S)
    path = training.save_weights_for_sampler("cli-published").result(timeout=TIMEOUT_S).path
    assert cli_json(local_cluster, "run", "info", training.model_id)["training_run_id"] == training.model_id
    assert tinker_cli(local_cluster, "checkpoint", "publish", path).returncode == 0
    assert cli_json(local_cluster, "checkpoint", "info", path)["public"] is True
    assert tinker_cli(local_cluster, "checkpoint", "unpublish", path).returncode == 0
    assert cli_json(local_cluster, "checkpoint", "info", path)["public"] is False


def test_billing_shows_the_hours_usage_and_storage(local_cluster, service):
    training = service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=TIMEOUT_S)
    training.forward_backward([sdk_datum(seed) for seed in range(2)], "cross_entropy").result(timeout=TIMEOUT_S)
    sampler = training.save_weights_and_get_sampling_client().result(timeout=TIMEOUT_S)
    sampler.sample(prompt=types.ModelInput.from_ints([1, 2, 3, 4]), num_samples=2,
                   sampling_params=types.SamplingParams(max_tokens=3)).result(timeout=TIMEOUT_S)
    hour = datetime.datetime.now(datetime.timezone.utc).replace(minute=0, second=0, microsecond=0)
    window = [(hour + datetime.timedelta(hours=k)).strftime("%Y-%m-%dT%H:%M:%SZ") for k in (-1, 1)]
    usage = cli_json(local_cluster, "billing", "usage", *window)
    mine = [row for row in usage["data"] if row["session_id"] == service.holder.get_session_id()]
    quantities = {row["event_info"]["type"]: row["event_info"].get("token_count", row["event_info"].get("count"))
                  for row in mine}
    # Two datums of 16 tokens, a prompt of 4 sampled twice (prefilled once per request), 3 tokens each, one save.
    assert quantities == {"training": 32, "sampling_prefill": 4, "sampling_sample": 6, "checkpoint": 1}, mine
    assert all(row["estimated_cost_usd"] is None and row["base_model"] == TINY for row in mine)
    unaligned = tinker_cli(local_cluster, "billing", "usage", "2026-01-01T00:30:00Z", "2026-01-02T00:00:00Z")
    assert unaligned.returncode != 0 and "whole UTC hours" in unaligned.stderr, unaligned.stderr
    storage = cli_json(local_cluster, "billing", "checkpoint-storage")
    assert "data" in storage


def test_push_hf_without_the_hub_says_so(local_cluster, service, tmp_path):
    training = service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=TIMEOUT_S)
    path = training.save_state("to-the-hub").result(timeout=TIMEOUT_S).path
    pushed = tinker_cli(local_cluster, "checkpoint", "push-hf", path, "--repo", "someone/lilo-test", home=tmp_path)
    assert pushed.returncode != 0, pushed.stdout
    assert "hf auth login" in pushed.stderr or "huggingface" in pushed.stderr.lower(), pushed.stderr[-2000:]


def test_session_export_trace_writes_the_sessions_requests_and_critical_path(local_cluster, service, tmp_path):
    training = service.create_lora_training_client(base_model=TINY, rank=4).result(timeout=TIMEOUT_S)
    training.forward_backward([sdk_datum(1)], "cross_entropy").result(timeout=TIMEOUT_S)
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=TIMEOUT_S)
    sampler = training.save_weights_and_get_sampling_client().result(timeout=TIMEOUT_S)
    sampler.sample(prompt=types.ModelInput.from_ints([1, 2, 3]), num_samples=1,
                   sampling_params=types.SamplingParams(max_tokens=3)).result(timeout=TIMEOUT_S)
    session_id = service.holder.get_session_id()
    output = tmp_path / "session.pftrace"
    exported = tinker_cli(local_cluster, "session", "export-trace", session_id, "--output", str(output))
    assert exported.returncode == 0, exported.stdout + exported.stderr
    events = json.loads(output.read_text())["traceEvents"]
    slices = {(event["name"], event["args"].get("status")) for event in events if event["ph"] == "X"}
    assert {("create_model", "completed"), ("forward_backward", "completed"), ("optim_step", "completed"),
            ("save_weights_for_sampler", "completed"), ("sample", "completed")} <= slices
    [path] = [event["args"] for event in events if event["name"] == "critical path"
              and event["tid"] == next(e["tid"] for e in events if e.get("args", {}).get("name") == training.model_id)]
    assert path["lilo/forward_backward.execute.count"] >= 1
    url = tinker_cli(local_cluster, "session", "export-trace", session_id, "--url-only").stdout.strip()
    forged = url.replace("signature=", "signature=0")
    refused = httpx.get(forged)
    assert refused.status_code == 403 and "export_session_trace" in refused.json()["detail"]
