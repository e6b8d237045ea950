"""The timing actor on the real local cluster: detached, fed by trainers' publishers, served over HTTP, exported
to Ray's metrics endpoint."""

import json
import subprocess
import sys
import textwrap
import urllib.request
import uuid

import httpx
import pytest
import ray

from cluster.futures_actor import FUTURES_ACTOR_NAME
from cluster.local import NAMESPACE
from cluster.timing import TimingPublisher, get_timing_actor
from helpers import AUTH, eventually, paged_timings
from lilo.timing.critical_path import CriticalPath, Operation


def recorded_steps(model_id: str, steps: int) -> CriticalPath:
    timings = CriticalPath(log_line=lambda line: None, drain_every_s=None)
    timings.mark("trainer.backend_ready_s")
    for i in range(steps):
        timings.begin(Operation(model_id, f"{model_id}:{i}", "forward_backward", float(i)))
        timings.span(model_id, "forward_backward", "gpu", i + 0.5, i + 1.0, request_ids=[f"{model_id}:{i}"], n=2)
    return timings


def registered(model_id: str) -> str:
    """A model id the futures DB knows (a tenant reads only its own models' timing), of the tests' tenant."""
    ray.get(ray.get_actor(FUTURES_ACTOR_NAME, namespace=NAMESPACE).add_model.remote(model_id, "lilo/tiny-llama", {}))
    return model_id


def test_timing_actor_outlives_its_creating_driver_and_is_found_by_name(local_cluster, ray_driver):
    name = f"lilo-timing-test-{uuid.uuid4().hex[:8]}"
    creator = textwrap.dedent(f"""
        import ray
        from cluster.local import connect_driver, prepare_environment
        from lilo.settings import load_settings
        prepare_environment()
        connect_driver(load_settings(env={{}}, home={str(local_cluster.home)!r}))
        from cluster.timing import get_timing_actor
        actor = get_timing_actor({name!r})
        row = [2, 4, 2, 3.0, 2.0]  # count, batch, ranks, total, max
        ray.get(actor.push.remote("trainer-x", {{"m-outlive": {{"forward_backward.execute": row}}}}, {{}}))
    """)
    subprocess.run([sys.executable, "-c", creator], check=True, timeout=120, capture_output=True)
    actor = ray.get_actor(name, namespace=NAMESPACE)
    try:
        snapshot = ray.get(actor.snapshot.remote("m-outlive"))
        assert snapshot["phases"]["forward_backward.execute"]["count"] == 2
        assert snapshot["phases"]["forward_backward.execute"]["mean_batch"] == 2.0
        assert ray.get(actor.trainers.remote()) == ["trainer-x"]
    finally:
        ray.kill(actor)


def test_a_trainers_timing_reaches_the_cluster_endpoint(local_cluster, ray_driver):
    model_id = registered(f"m-{uuid.uuid4().hex[:8]}")
    publisher = TimingPublisher(recorded_steps(model_id, steps=3), "trainer-test", get_timing_actor())
    assert publisher.push_now()
    url = f"{local_cluster.api_url}/api/v1/timing"
    body = httpx.get(url, params={"model_id": model_id}, headers=AUTH).json()
    assert body["model_id"] == model_id
    assert body["phases"]["forward_backward.execute"]["count"] == 3
    assert body["phases"]["forward_backward.queue_wait"]["mean_s"] == pytest.approx(0.5)
    assert body["gauges"]["trainer.backend_ready_s"] > 0
    cluster = httpx.get(url, headers=AUTH).json()
    assert cluster["model_id"] == "*" and cluster["phases"]["forward_backward.execute"]["count"] >= 3


def test_endpoint_readers_do_not_split_an_interval(local_cluster, ray_driver):
    model_id = registered(f"m-{uuid.uuid4().hex[:8]}")
    assert TimingPublisher(recorded_steps(model_id, steps=2), "trainer-test", get_timing_actor()).push_now()
    url = f"{local_cluster.api_url}/api/v1/timing"
    counts = [
        httpx.get(url, params={"model_id": model_id, "reset": "true", "reader": reader}, headers=AUTH).json()["phases"]
        ["forward_backward.execute"]["count"]
        for reader in ("wandb", "curl", "wandb")
    ]
    assert counts == [2, 2, 0]


def test_unknown_model_is_a_404_with_a_message_and_bad_input_a_422(local_cluster):
    url = f"{local_cluster.api_url}/api/v1/timing"
    missing = httpx.get(url, params={"model_id": "no-such-model"}, headers=AUTH)
    assert missing.status_code == 404
    assert "no trainer has reported timing" in missing.json()["detail"]
    too_long = httpx.get(url, params={"reader": "r" * 1000}, headers=AUTH)
    assert too_long.status_code == 422


def metric_lines(model_id: str, within_s: float = 90.0) -> list[str]:
    """The node's Ray metrics lines of ``model_id``, once its phase counts are exported (Ray exports every few
    seconds)."""
    port = ray.nodes()[0]["MetricsExportPort"]
    wanted = f'model_id="{model_id}"'

    def exported() -> list[str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            lines = [line for line in response.read().decode().splitlines() if wanted in line]
        return lines if any(line.startswith("ray_lilo_phase_count_total") for line in lines) else []

    return eventually(exported, f"the phase counts of {model_id} on the node's metrics endpoint", timeout_s=within_s,
                      every_s=2)


def test_phases_show_on_the_nodes_metrics_endpoint(local_cluster, ray_driver):
    model_id = f"m-{uuid.uuid4().hex[:8]}"
    assert TimingPublisher(recorded_steps(model_id, steps=1), "trainer-metrics", get_timing_actor()).push_now()
    lines = metric_lines(model_id)
    count_lines = [line for line in lines if line.startswith("ray_lilo_phase_count_total")]
    assert any('phase="forward_backward.execute"' in line and 'trainer="trainer-metrics"' in line
               for line in count_lines), lines
    assert any(line.startswith("ray_lilo_phase_seconds_total") and "queue_wait_idle" in line for line in lines)


def test_a_models_page_ins_and_outs_show_on_the_metrics_endpoint(local_cluster, ray_driver, tmp_path):
    timings, (model_id, _) = paged_timings(tmp_path)  # its step paged it in, and the other model out
    assert TimingPublisher(timings, "trainer-paging", get_timing_actor()).push_now()
    lines = [line for line in metric_lines(model_id) if line.startswith("ray_lilo_phase_seconds_total")]
    for phase in ("forward_backward.page_in", "forward_backward.page_out"):
        (line,) = [line for line in lines if f'phase="{phase}"' in line]
        assert 'trainer="trainer-paging"' in line and float(line.split()[-1]) > 0


def test_timing_actor_prints_the_clusters_json_line_when_nobody_polls(local_cluster, ray_driver):
    from cluster.timing import TimingActor

    name = f"lilo-timing-log-{uuid.uuid4().hex[:8]}"
    model_id = f"m-{uuid.uuid4().hex[:8]}"
    actor = TimingActor.options(name=name, namespace=NAMESPACE, lifetime="detached").remote(log_every_s=1.0)
    try:
        ray.get(actor.push.remote("trainer-log", {model_id: {"forward_backward.execute": [1, 1, 1, 0.5, 0.5]},
                                                  "*": {"forward_backward.execute": [1, 1, 1, 0.5, 0.5]}}, {}))
        logs = local_cluster.settings.ray_temp_dir / "session_latest" / "logs"

        def printed() -> list[dict]:
            records = (json.loads(line) for path in logs.glob("worker-*.out")
                       for line in path.read_text(errors="replace").splitlines()
                       if line.startswith("{") and '"lilo_critical_path"' in line)
            return [record for record in records if record.get("trainers") == ["trainer-log"]]

        # A line the actor is still printing does not parse yet: read again.
        lines = eventually(printed, "a lilo_critical_path line of trainer-log in the actor's log", every_s=1,
                           ignoring=(json.JSONDecodeError,))
        assert lines[0]["scope"] == "cluster" and lines[0]["model_id"] == "*"
        assert lines[0]["phases"]["forward_backward.execute"]["count"] == 1
    finally:
        ray.kill(actor)
