"""CriticalPath rules, with a hand-driven clock: no Ray, no sleeping."""

import json

import pytest

from helpers import eventually
from lilo.timing import critical_path as cp
from lilo.timing.critical_path import (
    ALL_MODELS, FIRST_MODEL_READY, CriticalPath, Observers, Operation, flatten, phase_of, split_wait,
)
from lilo.timing.phase_stats import PhaseStats


@pytest.fixture
def timings(clock):
    lines = []
    path = CriticalPath(clock=clock, wall_clock=clock, process_start_wall_s=90.0, log_line=lines.append,
                        drain_every_s=None)
    path.lines = lines
    return path


def submit(path, model_id, request_id, kind, at):
    path.begin(Operation(model_id=model_id, request_id=request_id, kind=kind, submitted_s=at))


@pytest.mark.parametrize(
    ("span_name", "phase"),
    [
        ("forward_backward", "forward_backward.execute"),
        ("accept", "accept.execute"),
        ("optim_step", "optim_step.execute"),
        ("capture:save_weights", "save_weights.capture"),
        ("persist:save_weights_for_sampler", "save_weights_for_sampler.persist"),
    ],
)
def test_span_names_map_to_phases(span_name, phase):
    assert phase_of(span_name) == phase


def test_execute_is_credited_to_every_model_of_a_batch_and_to_the_aggregate(timings):
    timings.span(["a", "b", "a"], "forward_backward", "gpu", 10.0, 12.0, request_ids=["a:1", "b:1", "a:2"], n=3)
    for model in ("a", "b"):
        stats = timings.snapshot(model)["phases"]["forward_backward.execute"]
        assert (stats["count"], stats["total_s"], stats["mean_batch"]) == (1, pytest.approx(2.0), 3)
    # Every per-model record also credits the aggregate: there the batch counts once per model in it.
    aggregate = timings.snapshot()["phases"]["forward_backward.execute"]
    assert (aggregate["count"], aggregate["total_s"], aggregate["mean_s"]) == (
        2, pytest.approx(4.0), pytest.approx(2.0))


def test_stats_are_count_total_mean_max_and_mean_batch(timings):
    timings.span("a", "forward_backward", "gpu", 0.0, 1.0, n=1)
    timings.span("a", "forward_backward", "gpu", 1.0, 4.0, n=3)
    assert timings.snapshot("a")["phases"]["forward_backward.execute"] == {
        "count": 2, "total_s": 4.0, "mean_s": 2.0, "max_s": 3.0, "mean_batch": 2.0, "mean_ranks": 1.0,
    }


def test_an_execution_on_several_ranks_says_how_many_and_its_waits_do_not(timings):
    submit(timings, "a", "a:1", "forward_backward", 0.0)
    timings.span("a", "forward_backward", "gpu", 1.0, 2.0, request_ids=["a:1"], n=1, ranks=4)
    timings.span("a", "forward_backward", "gpu", 2.0, 3.0, n=1, ranks=2)
    phases = timings.snapshot("a", reset=True)["phases"]
    assert phases["forward_backward.execute"]["mean_ranks"] == 3.0
    assert phases["forward_backward.queue_wait"]["mean_ranks"] == 1.0
    # A reader's next interval, and a trainer's rows merged elsewhere (the timing actor), keep the ranks apart.
    timings.span("a", "forward_backward", "gpu", 3.0, 4.0, n=1, ranks=2)
    assert timings.snapshot("a")["phases"]["forward_backward.execute"]["mean_ranks"] == 2.0
    merged = PhaseStats()
    for phase, row in timings.stats.take_interval("actor")["a"].items():
        merged.merge("a", phase, row)
    assert merged.stats("a")["forward_backward.execute"] == timings.snapshot("a")["phases"][
        "forward_backward.execute"] | {"count": 3, "total_s": 3.0, "mean_s": 1.0, "mean_ranks": 8 / 3}


def test_first_span_of_a_command_records_its_queue_wait_once(timings):
    submit(timings, "a", "a:1", "save_weights", at=10.0)
    timings.span("a", "capture:save_weights", "gpu", 13.0, 14.0, request_ids=["a:1"])
    timings.span("a", "persist:save_weights", "disk", 14.0, 20.0, request_ids=["a:1"])
    phases = timings.snapshot("a")["phases"]
    assert phases["save_weights.queue_wait"]["count"] == 1
    assert phases["save_weights.queue_wait"]["total_s"] == pytest.approx(3.0)
    assert phases["save_weights.capture"]["total_s"] == pytest.approx(1.0)
    assert phases["save_weights.persist"]["total_s"] == pytest.approx(6.0)


def test_execute_is_recorded_on_the_failure_path(timings):
    submit(timings, "a", "a:1", "forward_backward", at=0.0)
    timings.span("a", "forward_backward", "gpu", 1.0, 2.5, request_ids=["a:1"], n=1, ok=False)
    phases = timings.snapshot("a")["phases"]
    assert phases["forward_backward.execute"]["total_s"] == pytest.approx(1.5)
    assert phases["forward_backward.queue_wait"]["total_s"] == pytest.approx(1.0)


def test_queue_wait_splits_into_self_others_and_idle_that_add_up(timings):
    # b's command arrives at 0; the lane is idle 0-1, runs others' batch 1-3, a batch with b's earlier command
    # 3-4 (shared with c), is idle 4-5, then b's command starts at 5.
    submit(timings, "b", "b:2", "forward_backward", at=0.0)
    timings.span(["a", "c"], "forward_backward", "gpu", 1.0, 3.0, request_ids=["a:1", "c:1"])
    timings.span(["b", "c"], "forward_backward", "gpu", 3.0, 4.0, request_ids=["b:1", "c:2"])
    timings.span("b", "forward_backward", "gpu", 5.0, 6.0, request_ids=["b:2"])
    phases = timings.snapshot("b")["phases"]
    wait = {part: phases[f"forward_backward.queue_wait{part}"]["total_s"]
            for part in ("", "_self", "_others", "_idle", "_other_tenants")}
    assert wait == pytest.approx({"": 5.0, "_self": 1.0, "_others": 2.0, "_idle": 2.0, "_other_tenants": 0.0})
    assert wait["_self"] + wait["_others"] + wait["_idle"] == pytest.approx(wait[""])


def test_a_models_wait_behind_others_says_how_much_was_behind_other_tenants(timings):
    # b (tenant t) waits 0-4: 1-2 behind a (tenant u), 2-3 behind c (its own tenant t), 3-4 behind a and c together.
    for model, request, tenant in (("a", "a:1", "u"), ("c", "c:1", "t"), ("b", "b:1", "t")):
        timings.begin(Operation(model, request, "forward_backward", 0.0, tenant, 10))
    timings.span("a", "forward_backward", "gpu", 1.0, 2.0, request_ids=["a:1"])
    timings.span("c", "forward_backward", "gpu", 2.0, 3.0, request_ids=["c:1"])
    timings.span(["a", "c"], "forward_backward", "gpu", 3.0, 4.0)
    timings.span("b", "forward_backward", "gpu", 4.0, 5.0, request_ids=["b:1"])
    phases = timings.snapshot("b")["phases"]
    assert phases["forward_backward.queue_wait_others"]["total_s"] == pytest.approx(3.0)
    assert phases["forward_backward.queue_wait_other_tenants"]["total_s"] == pytest.approx(1.0)


def test_other_lanes_do_not_count_as_busy_for_the_compute_lane(timings):
    submit(timings, "a", "a:1", "forward_backward", at=0.0)
    timings.span("x", "persist:save_weights", "disk", 0.0, 4.0)
    timings.span("a", "forward_backward", "gpu", 4.0, 5.0, request_ids=["a:1"])
    phases = timings.snapshot("a")["phases"]
    assert phases["forward_backward.queue_wait_idle"]["total_s"] == pytest.approx(4.0)
    assert phases["forward_backward.queue_wait_others"]["total_s"] == 0.0


@pytest.mark.parametrize(
    ("history", "submitted", "started", "expected"),
    [
        ([], 0.0, 2.0, (2.0, 0.0, 0.0, 2.0, 0.0)),
        ([(0.0, 2.0, ("m",), {"t"})], 0.0, 2.0, (2.0, 2.0, 0.0, 0.0, 0.0)),
        ([(-5.0, 1.0, ("x",), {"t"})], 0.0, 2.0, (2.0, 0.0, 1.0, 1.0, 0.0)),  # behind its own tenant's x
        ([(-5.0, 1.0, ("y",), {"u"})], 0.0, 2.0, (2.0, 0.0, 1.0, 1.0, 1.0)),  # behind another tenant's y
        ([(-5.0, -1.0, ("x",), {"t"})], 0.0, 2.0, (2.0, 0.0, 0.0, 2.0, 0.0)),
        ([(0.5, 1.0, ("y",), {"u"}), (1.0, 3.0, ("m", "x",), {"t"})], 0.0, 2.0, (2.0, 1.0, 0.5, 0.5, 0.5)),
    ],
)
def test_split_wait_table(history, submitted, started, expected):
    assert split_wait(history, "m", submitted, started, "t") == pytest.approx(expected)


def test_accept_records_its_wait_and_sets_first_model_ready_once(timings, clock):
    timings.register_model("a", spec={"rank": 8})
    clock.now = 102.0
    timings.span("a", "accept", "gpu", 101.0, 102.0, ok=True)
    clock.now = 110.0
    timings.register_model("b", spec={"rank": 8})
    timings.span("b", "accept", "gpu", 110.0, 111.0, ok=True)
    phases = timings.snapshot("a")["phases"]
    assert phases["accept.execute"]["total_s"] == pytest.approx(1.0)
    assert phases["accept.queue_wait"]["total_s"] == pytest.approx(1.0)
    assert timings.snapshot()["gauges"][FIRST_MODEL_READY] == pytest.approx(12.0)


def test_startup_gauges_are_measured_from_process_start_and_set_once(timings, clock):
    timings.mark("trainer.backend_ready_s")
    clock.now = 130.0
    timings.mark("trainer.backend_ready_s")
    timings.mark("trainer.serving_ready_s")
    assert timings.snapshot()["gauges"] == {"trainer.backend_ready_s": 10.0, "trainer.serving_ready_s": 40.0}


def test_max_series_bounds_per_model_series_but_not_the_aggregate(clock):
    path = CriticalPath(clock=clock, wall_clock=clock, process_start_wall_s=0.0, drain_every_s=None)
    path.stats = PhaseStats(max_series=3)
    for i in range(10):
        path.span(f"m{i}", "forward_backward", "gpu", float(i), float(i) + 1.0)
    path.drain()
    assert path.stats.models() == ["m7", "m8", "m9"]
    assert path.snapshot("m0")["phases"] == {}
    assert path.snapshot()["phases"]["forward_backward.execute"]["count"] == 10


def test_least_recently_updated_series_is_evicted_first():
    stats = PhaseStats(max_series=2)
    stats.record("a", "x.execute", (1.0,), 1)
    stats.record("b", "x.execute", (1.0,), 1)
    stats.record("a", "x.execute", (1.0,), 1)
    stats.record("c", "x.execute", (1.0,), 1)
    assert stats.models() == ["a", "c"]


def test_max_pending_bounds_submission_stamps(monkeypatch, timings):
    monkeypatch.setattr(cp, "MAX_PENDING", 4)
    for i in range(10):
        submit(timings, "a", f"a:{i}", "forward_backward", at=0.0)
    timings.span("a", "forward_backward", "gpu", 1.0, 2.0, request_ids=[f"a:{i}" for i in range(10)])
    # Only the 4 newest stamps were kept, so only they record a queue wait.
    assert timings.snapshot("a")["phases"]["forward_backward.queue_wait"]["count"] == 4


def test_forget_model_drops_its_series_and_pending_stamps_never_the_aggregate(timings):
    timings.span("a", "forward_backward", "gpu", 0.0, 1.0)
    submit(timings, "a", "a:9", "forward_backward", at=0.0)
    timings.forget_model("a")
    assert timings.snapshot("a")["phases"] == {}
    assert timings.snapshot()["phases"]["forward_backward.execute"]["count"] == 1
    timings.span("a", "forward_backward", "gpu", 5.0, 6.0, request_ids=["a:9"])
    assert "forward_backward.queue_wait" not in timings.snapshot("a")["phases"]


def test_reset_returns_the_interval_since_the_last_reset(timings):
    timings.span("a", "forward_backward", "gpu", 0.0, 5.0)
    assert timings.snapshot("a", reset=True)["phases"]["forward_backward.execute"]["max_s"] == 5.0
    assert timings.snapshot("a")["phases"]["forward_backward.execute"]["count"] == 0
    timings.span("a", "forward_backward", "gpu", 5.0, 6.0)
    stats = timings.snapshot("a", reset=True)["phases"]["forward_backward.execute"]
    assert (stats["count"], stats["total_s"], stats["max_s"]) == (1, 1.0, 1.0)


def test_two_readers_do_not_split_an_interval(timings):
    timings.span("a", "forward_backward", "gpu", 0.0, 1.0)
    assert timings.snapshot("a", reset=True, reader="wandb")["phases"]["forward_backward.execute"]["count"] == 1
    timings.span("a", "forward_backward", "gpu", 1.0, 3.0)
    # curl resets too, yet the W&B reader still gets everything since its own last reset.
    assert timings.snapshot("a", reset=True, reader="curl")["phases"]["forward_backward.execute"]["count"] == 2
    stats = timings.snapshot("a", reset=True, reader="wandb")["phases"]["forward_backward.execute"]
    assert (stats["count"], stats["total_s"], stats["max_s"]) == (1, 2.0, 2.0)
    # Resetting one model leaves the reader's interval of another model alone.
    timings.span("b", "forward_backward", "gpu", 3.0, 4.0)
    timings.snapshot("a", reset=True, reader="wandb")
    assert timings.snapshot("b", reader="wandb")["phases"]["forward_backward.execute"]["count"] == 1


def test_named_readers_are_bounded_and_the_default_reader_survives():
    stats = PhaseStats(max_readers=2)
    stats.record("a", "x.execute", (1.0,), 1)
    stats.stats("a", reset=True)
    for name in ("r1", "r2", "r3"):
        stats.stats("a", reader=name, reset=True)
    stats.record("a", "x.execute", (1.0,), 1)
    # The default reader kept its reset; the evicted r1 starts over from the beginning.
    assert stats.stats("a")["x.execute"]["count"] == 1
    assert stats.stats("a", reader="r1")["x.execute"]["count"] == 2
    assert stats.stats("a", reader="r3")["x.execute"]["count"] == 1


def test_snapshot_shape_and_flatten(timings):
    timings.mark("trainer.serving_ready_s")
    timings.span("a", "forward_backward", "gpu", 0.0, 1.0, n=2)
    snapshot = timings.snapshot("a")
    assert set(snapshot) == {"model_id", "uptime_s", "phases", "gauges"}
    flat = flatten(snapshot)
    assert flat["lilo/uptime_s"] == snapshot["uptime_s"]
    assert flat["lilo/forward_backward.execute.mean_batch"] == 2.0
    assert flat["lilo/trainer.serving_ready_s"] == 10.0
    assert set(flatten(snapshot, prefix="x")) == {key.replace("lilo/", "x/", 1) for key in flat}


def test_an_unpolled_trainer_logs_one_json_line_per_period(timings, clock):
    timings.span("a", "forward_backward", "gpu", 100.0, 101.0)
    timings.drain()
    assert timings.lines == []
    clock.now = 100.0 + cp.LOG_EVERY_S + 1
    timings.span("a", "forward_backward", "gpu", clock.now - 1, clock.now)
    timings.drain()
    timings.span("a", "forward_backward", "gpu", clock.now, clock.now + 1)
    timings.drain()
    assert len(timings.lines) == 1
    line = json.loads(timings.lines[0])
    assert line["event"] == "lilo_critical_path" and line["model_id"] == ALL_MODELS
    assert line["phases"]["forward_backward.execute"]["count"] == 2


def test_a_polled_trainer_stays_quiet(timings, clock):
    clock.now = 100.0 + cp.LOG_EVERY_S
    timings.snapshot()
    clock.now += cp.LOG_EVERY_S - 1
    timings.span("a", "forward_backward", "gpu", clock.now - 1, clock.now)
    timings.drain()
    assert timings.lines == []


class Exploding:
    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise RuntimeError(f"{name} exploded")
        return fail


def test_a_failing_observer_never_reaches_the_engine_or_the_others(timings, caplog):
    fan_out = Observers(Exploding(), timings)
    fan_out.register_model("a", spec=None)
    fan_out.begin(Operation("a", "a:1", "forward_backward", 0.0))
    fan_out.span("a", "forward_backward", "gpu", 1.0, 2.0, request_ids=["a:1"])
    fan_out.forget_model("b")
    assert timings.snapshot("a")["phases"]["forward_backward.queue_wait"]["total_s"] == pytest.approx(1.0)
    assert "span exploded" in caplog.text


def test_the_background_drainer_folds_spans_without_a_reader():
    path = CriticalPath(log_line=lambda line: None, drain_every_s=0.01)
    path.span("a", "forward_backward", "gpu", 0.0, 1.0)
    eventually(lambda: path.stats.models() == ["a"], "the span folded into the stats of a", timeout_s=10,
               every_s=0.01)


def test_a_coalescing_window_is_its_own_phase_and_ends_the_queue_wait_where_it_opened(timings):
    # a arrives at 0, its pass could start at 1 but holds its window open until 2 for b, which arrives at 1.5;
    # the pass then runs 2-3 with both.
    submit(timings, "a", "a:1", "forward_backward", at=0.0)
    submit(timings, "b", "b:1", "forward_backward", at=1.5)
    timings.span(["a", "b"], "coalesce_wait:forward_backward", "gpu", 1.0, 2.0, request_ids=["a:1", "b:1"], n=2)
    timings.span(["a", "b"], "forward_backward", "gpu", 2.0, 3.0, request_ids=["a:1", "b:1"], n=2)
    a, b = timings.snapshot("a")["phases"], timings.snapshot("b")["phases"]
    assert phase_of("coalesce_wait:forward_backward") == "forward_backward.coalesce_wait"
    assert (a["forward_backward.queue_wait"]["total_s"], a["forward_backward.coalesce_wait"]["total_s"]) == (
        pytest.approx(1.0), pytest.approx(1.0))
    assert (b["forward_backward.queue_wait"]["total_s"], b["forward_backward.coalesce_wait"]["total_s"]) == (
        pytest.approx(0.0), pytest.approx(0.5))
    assert a["forward_backward.execute"]["mean_batch"] == 2
