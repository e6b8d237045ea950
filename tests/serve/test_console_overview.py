"""The console's overview as pure functions (a model's critical-path bar, what a tenant sees of a trainer) and its
page's routes, through the real FastAPI app (no cluster: the page and its files need none)."""

import pytest
from fastapi.testclient import TestClient

from serve.app import api
from serve.console.overview import SEGMENTS, by_tier, critical_path_bar, model_state, trainer_view


def stats(count: int, total_s: float, mean_batch: float = 1.0) -> dict[str, float]:
    return {"count": count, "total_s": total_s, "mean_s": total_s / count if count else 0.0, "max_s": total_s,
            "mean_batch": mean_batch, "mean_ranks": 1.0}


def test_a_bar_sums_each_segments_phases_over_every_kind_and_weighs_the_mean_batch_by_executions():
    phases = {"forward_backward.execute": stats(3, 0.6, mean_batch=2.0), "optim_step.execute": stats(1, 0.1),
              "forward_backward.queue_wait": stats(3, 0.9), "forward_backward.queue_wait_self": stats(3, 0.2),
              "forward_backward.queue_wait_others": stats(3, 0.5), "forward_backward.queue_wait_idle": stats(3, 0.2),
              "forward_backward.queue_wait_other_tenants": stats(3, 0.3), "save_weights.capture": stats(1, 0.05),
              "save_weights.persist": stats(1, 0.3), "forward_backward.page_in": stats(1, 0.04),
              "accept.page_out": stats(1, 0.01), "forward_backward.coalesce_wait": stats(2, 0.07)}
    bar = critical_path_bar(phases)
    assert list(bar["seconds"]) == list(SEGMENTS)
    assert bar["seconds"] == pytest.approx({"execute": 0.7, "wait_self": 0.2, "wait_others": 0.5, "wait_idle": 0.2,
                                            "coalesce": 0.07, "capture": 0.05, "persist": 0.3, "page_in": 0.05})
    # queue_wait is the sum of its split, and other_tenants a part of others: neither is counted again.
    assert bar["steps"] == 3 and bar["commands"] == 4 and bar["mean_batch"] == pytest.approx((3 * 2 + 1) / 4)


def test_an_interval_that_ran_nothing_is_an_empty_bar():
    assert critical_path_bar({}) == {"seconds": dict.fromkeys(SEGMENTS, 0), "steps": 0, "commands": 0,
                                     "mean_batch": None}


TRAINER = {"name": "lilo-trainer-0", "base_model": "lilo/tiny-llama", "state": "ready", "gpu": False, "ranks": 1,
           "node_id": "n0", "node_ip": "127.0.0.1", "models": 3, "free_slots": 45,
           "sampling": {"loaded": {"lilo-sampler-0": ["tinker://theirs:train:0/sampler_weights/s"]}},
           "rank_places": None}
RESIDENCY = {"slots": 48, "room": {"device": 45, "host": 10, "disk": 100},
             "tiers": {"mine:train:0": "device", "mine:train:1": "host", "theirs:train:0": "disk"}}


def test_a_tenant_sees_a_trainers_counts_and_only_its_own_model_ids():
    view = trainer_view(TRAINER, RESIDENCY, {"mine:train:0", "mine:train:1"}, admin=False)
    assert view["models"] == 3 and view["slots"] == 48 and view["room"] == RESIDENCY["room"]
    assert view["model_ids"] == ["mine:train:0", "mine:train:1"]
    assert "sampling" not in view and "theirs" not in repr(view)


def test_an_admin_sees_every_model_id_and_the_samplers():
    view = trainer_view(TRAINER, RESIDENCY, set(), admin=True)
    assert view["model_ids"] == ["mine:train:0", "mine:train:1", "theirs:train:0"] and view["sampling"]


def test_a_trainer_that_did_not_say_where_its_models_are_shows_none():
    view = trainer_view(TRAINER, None, {"mine:train:0"}, admin=False)
    assert view["model_ids"] == [] and view["slots"] is None and view["room"] is None


def test_each_model_has_the_tier_its_trainer_reports_and_a_state_from_its_record():
    assert by_tier([RESIDENCY, None, {"tiers": {"x": "device"}}])["mine:train:1"] == "host"
    assert model_state({"unloaded_at": 5.0, "trainer": "t"}) == "unloaded"
    assert model_state({"unloaded_at": None, "trainer": None}) == "placing"
    assert model_state({"unloaded_at": None, "trainer": "t"}) == "loaded"


def test_the_page_and_its_files_are_served_without_a_key_and_nothing_else_is():
    with TestClient(api) as http:
        page = http.get("/console")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "/console/console.js" in page.text and "frame-ancestors 'none'" in page.headers[
            "content-security-policy"]
        script = http.get("/console/console.js")
        assert script.status_code == 200 and "sessionStorage" in script.text and "localStorage" not in script.text
        assert http.get("/console/console.css").headers["content-type"].startswith("text/css")
        for missing in ("/console/nothing.js", "/console/..%2Foverview.py", "/console/__init__.py"):
            assert http.get(missing).status_code == 404, missing
        # The data is not open: the overview needs a key.
        assert http.get("/api/v1/console/overview").status_code == 401
