"""The engine around a small in-test backend: ordering, coalescing, isolation, lanes, and its telemetry.

The backend here is a stand-in that records what it was asked to run (the torch backend is tested on its own), and
implements the same contract; everything else is the real engine, with real threads and the real CriticalPath.
"""

import threading

import pytest

from lilo.engine.commands import Command, Kind
from lilo.engine.contract import Backend, contract_mismatches
from lilo.engine.engine import Engine, EngineStopped
from lilo.engine.scheduler import next_batch
from lilo.errors import CancelledByClientError, ConflictError, GoneError, InvalidRequestError, NotFoundError


class RecordingBackend:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self.fail_request_ids: set[str] = set()
        self.persist_gate = threading.Event()
        self.persist_gate.set()
        self.capture_started, self.capture_gate = threading.Event(), threading.Event()
        self.capture_gate.set()
        self.sample_started, self.sample_gate = threading.Event(), threading.Event()
        self.sample_gate.set()
        self.seen_cancelled: list[str] = []

    def add_adapter(self, model_id, spec):
        self.calls.append(("add", [model_id]))
        if spec == "broken":
            raise ValueError("rank must be positive")

    def remove_adapter(self, model_id):
        self.calls.append(("remove", [model_id]))

    def training_slots(self):
        return 1000

    def pass_ranks(self):
        return 1

    def make_room(self, model_ids, running, queued):
        return []

    def prefetch(self, model_ids):
        return []

    def _batch(self, name, commands):
        self.calls.append((name, [c.request_id for c in commands]))
        return [ValueError(f"token id out of range in {c.request_id}") if c.request_id in self.fail_request_ids
                else {"ran": c.request_id} for c in commands]

    def forward_backward(self, commands, forward_only):
        return self._batch("forward" if forward_only else "forward_backward", commands)

    def optim_step(self, commands):
        return self._batch("optim_step", commands)

    def sample(self, commands, cancelled):
        self.sample_started.set()
        assert self.sample_gate.wait(10)
        self.seen_cancelled += [c.request_id for c in commands if cancelled(c.request_id)]
        return self._batch("sample", commands)

    def load_checkpoint(self, command):
        return self._batch("load_weights", [command])[0]

    def capture_checkpoint(self, command):
        self.capture_started.set()
        self.capture_gate.wait(10)
        self.calls.append(("capture", [command.request_id]))
        return {"copy": command.request_id}

    def persist_checkpoint(self, command, captured):
        self.persist_gate.wait(10)
        self.calls.append(("persist", [command.request_id]))
        return {"path": f"tinker://{command.model_id}/{captured['copy']}"}


class Recorder:
    """Another observer, as a trainer's own telemetry would be."""

    def __init__(self) -> None:
        self.events = []

    def register_model(self, model_id, spec):
        self.events.append(("register", model_id))

    def forget_model(self, model_id):
        self.events.append(("forget", model_id))

    def begin(self, operation):
        self.events.append(("begin", operation.request_id))

    def span(self, model, name, lane, t0, t1=None, **attrs):
        self.events.append(("span", name, lane, tuple(attrs.get("request_ids", ())), attrs.get("n"), attrs.get("ok")))


def command(model, seq, kind=Kind.FORWARD_BACKWARD, fingerprint=None, tokens=128, key=("cross_entropy",)):
    return Command(model_id=model, seq_id=seq, kind=kind, request_id=f"{model}:{seq}", payload=None,
                   fingerprint=fingerprint or f"{model}:{seq}", batch_key=key, tokens=tokens)


@pytest.fixture
def backend():
    return RecordingBackend()


def ready_engine(backend, models, **options) -> Engine:
    engine = Engine(backend, **options)
    for future in [engine.create_model(m, spec={"rank": 8}) for m in models]:
        future.result(timeout=10)
    return engine


def results(futures):
    return [f.result(timeout=10) for f in futures]


def paused_engine(backend, models, **options) -> Engine:
    """Models created, lanes not yet running: submissions pile up and are released together by ``start()``."""
    engine = Engine(backend, start=False, **options)
    for m in models:
        engine.create_model(m, spec={"rank": 8})
    return engine


def test_the_recording_backend_implements_the_backend_contract(backend):
    assert isinstance(backend, Backend)
    assert contract_mismatches(RecordingBackend) == []


def test_a_backend_off_the_contract_is_told_what_differs():
    class Outdated(RecordingBackend):
        load_checkpoint = None

        def load_weights(self, command):
            return {}

        def forward_backward(self, commands):
            return []

    assert contract_mismatches(Outdated) == [
        "forward_backward(self, commands) should be forward_backward(self, commands, forward_only)",
        "load_checkpoint is missing"]


def test_ready_steps_of_many_models_share_one_execution(backend):
    engine = paused_engine(backend, ["a", "b", "c", "d"])
    futures = [engine.submit(command(m, 1)) for m in "abcd"]
    engine.start()
    assert results(futures) == [{"ran": f"{m}:1"} for m in "abcd"]
    assert [call for call in backend.calls if call[0] == "forward_backward"] == [
        ("forward_backward", ["a:1", "b:1", "c:1", "d:1"])]
    engine.stop()


def test_out_of_order_arrivals_run_in_seq_order(backend):
    engine = ready_engine(backend, ["a"])
    late = engine.submit(command("a", 3))
    middle = engine.submit(command("a", 2))
    first = engine.submit(command("a", 1))
    results([first, middle, late])
    assert [ids for name, ids in backend.calls if name == "forward_backward"] == [["a:1"], ["a:2"], ["a:3"]]
    engine.stop()


def test_a_refused_request_holds_its_seq_and_fails_in_turn_without_reaching_the_backend(backend):
    engine = ready_engine(backend, ["a"])
    after = engine.submit(command("a", 2))  # the client's next step, sent before the refusal was recorded
    refused = Command("a", 1, Kind.REFUSED, "a:1", payload="weights has 7 entries but the input has 8")
    failed = engine.submit(refused)
    with pytest.raises(InvalidRequestError, match="weights has 7 entries"):
        failed.result(timeout=10)
    assert after.result(timeout=10) == {"ran": "a:2"}
    assert [call for call in backend.calls if call[0] != "add"] == [("forward_backward", ["a:2"])]
    engine.stop()


def test_a_sample_handed_over_twice_generates_once(backend):
    engine = paused_engine(backend, ["a"])
    first = engine.submit(command("a", 0, kind=Kind.SAMPLE, key=()))
    assert engine.submit(command("a", 0, kind=Kind.SAMPLE, key=())) is first
    engine.start()
    assert first.result(timeout=10) == {"ran": "a:0"}
    assert engine.submit(command("a", 0, kind=Kind.SAMPLE, key=())) is first  # still recognised after it ran
    assert [ids for name, ids in backend.calls if name == "sample"] == [["a:0"]]
    engine.stop()


def test_a_retry_runs_once_and_a_different_payload_is_a_conflict(backend):
    engine = paused_engine(backend, ["a"])
    first = engine.submit(command("a", 1, fingerprint="x"))
    assert engine.submit(command("a", 1, fingerprint="x")) is first
    with pytest.raises(ConflictError, match="seq_id 1 of model 'a'"):
        engine.submit(command("a", 1, fingerprint="y"))
    engine.start()
    first.result(timeout=10)
    assert engine.submit(command("a", 1, fingerprint="x")) is first  # still recognised after it ran
    assert sum(name == "forward_backward" for name, _ in backend.calls) == 1
    engine.stop()


def test_one_bad_command_fails_alone_while_its_batch_mates_succeed(backend):
    backend.fail_request_ids = {"b:1"}
    engine = paused_engine(backend, ["a", "b", "c"])
    futures = [engine.submit(command(m, 1)) for m in "abc"]
    engine.start()
    assert futures[0].result(timeout=10) == {"ran": "a:1"}
    with pytest.raises(ValueError, match="token id out of range in b:1"):
        futures[1].result(timeout=10)
    assert futures[2].result(timeout=10) == {"ran": "c:1"}
    engine.stop()


def test_optimizer_steps_of_several_models_run_as_one_fused_step(backend):
    engine = paused_engine(backend, ["a", "b", "c"])
    futures = [engine.submit(command(m, 1, kind=Kind.OPTIM_STEP, key=())) for m in "abc"]
    engine.start()
    results(futures)
    assert [call for call in backend.calls if call[0] == "optim_step"] == [("optim_step", ["a:1", "b:1", "c:1"])]
    engine.stop()


def test_an_optim_step_waits_for_its_models_earlier_work_and_nothing_passes_it(backend):
    engine = paused_engine(backend, ["a"])
    futures = [engine.submit(command("a", 1)), engine.submit(command("a", 2, kind=Kind.OPTIM_STEP, key=())),
               engine.submit(command("a", 3))]
    engine.start()
    results(futures)
    assert [name for name, _ in backend.calls if name != "add"] == ["forward_backward", "optim_step",
                                                                   "forward_backward"]
    engine.stop()


def test_the_anchor_rotates_so_no_model_starves(backend):
    # A budget of one command per batch: the order of batches shows who anchors each turn.
    engine = paused_engine(backend, ["a", "b", "c"], token_budget=100)
    futures = [engine.submit(command(m, s, tokens=100)) for s in (1, 2) for m in "abc"]
    engine.start()
    results(futures)
    order = [ids[0] for name, ids in backend.calls if name == "forward_backward"]
    assert order == ["a:1", "b:1", "c:1", "a:2", "b:2", "c:2"]
    engine.stop()


@pytest.mark.parametrize(("heads", "budget", "expected"), [
    ({"a": command("a", 1), "b": command("b", 1)}, 8192, ["a:1", "b:1"]),
    ({"a": command("a", 1, tokens=6000), "b": command("b", 1, tokens=6000)}, 8192, ["a:1"]),
    ({"a": command("a", 1, tokens=9000)}, 8192, ["a:1"]),
    ({"a": command("a", 1), "b": command("b", 1, key=("ppo",))}, 8192, ["a:1"]),
    ({"a": command("a", 1, kind=Kind.SAVE_WEIGHTS), "b": command("b", 1, kind=Kind.SAVE_WEIGHTS)}, 8192, ["a:1"]),
    ({"b": command("b", 1), "c": command("c", 1, kind=Kind.OPTIM_STEP)}, 8192, ["b:1"]),
    ({}, 8192, []),
])
def test_next_batch_table(heads, budget, expected):
    assert [c.request_id for c in next_batch(heads, ["a", "b", "c"], budget)] == expected


def test_without_coalescing_every_command_runs_alone():
    heads = {"a": command("a", 1), "b": command("b", 1)}
    assert [c.request_id for c in next_batch(heads, ["a", "b"], coalesce=False)] == ["a:1"]


def test_a_slow_disk_write_never_stalls_compute(backend):
    engine = ready_engine(backend, ["a"])
    backend.persist_gate.clear()
    saved = engine.submit(command("a", 1, kind=Kind.SAVE_WEIGHTS, key=()))
    step = engine.submit(command("a", 2))
    assert step.result(timeout=10) == {"ran": "a:2"}  # ran while the save was still being written
    assert not saved.done()
    backend.persist_gate.set()
    assert saved.result(timeout=10) == {"path": "tinker://a/a:1"}
    engine.stop()


def test_a_save_captured_while_the_engine_stops_is_still_written(backend):
    engine = ready_engine(backend, ["a"])
    backend.capture_gate.clear()
    saved = engine.submit(command("a", 1, kind=Kind.SAVE_WEIGHTS, key=()))
    assert backend.capture_started.wait(10)
    stopping = threading.Thread(target=engine.stop)
    stopping.start()  # it waits for the compute lane, which is in the middle of the capture
    while not engine._stopped:
        threading.Event().wait(0.01)
    backend.capture_gate.set()
    assert saved.result(timeout=10) == {"path": "tinker://a/a:1"}
    stopping.join(10)


def test_the_engine_reports_through_the_observer_and_keeps_its_own_timings(backend):
    recorder = Recorder()
    engine = Engine(backend, observer=recorder, start=False)
    engine.create_model("a", spec={"rank": 8})
    engine.create_model("b", spec={"rank": 8})
    futures = [engine.submit(command(m, 1)) for m in "ab"]
    futures.append(engine.submit(command("a", 2, kind=Kind.SAVE_WEIGHTS, key=())))
    engine.start()
    results(futures)
    engine.stop()
    assert ("register", "a") in recorder.events and ("begin", "a:1") in recorder.events
    assert ("span", "forward_backward", "compute", ("a:1", "b:1"), 2, True) in recorder.events
    assert ("span", "capture:save_weights", "compute", ("a:2",), 1, True) in recorder.events
    assert ("span", "persist:save_weights", "persist", ("a:2",), 1, True) in recorder.events
    assert [e[1] for e in recorder.events if e[0] == "span" and e[1] == "accept"] == ["accept", "accept"]
    # Timing is on whatever observer was given: the engine's own CriticalPath saw the same work.
    phases = engine.timings.snapshot("a")["phases"]
    assert phases["forward_backward.execute"]["mean_batch"] == 2
    assert phases["forward_backward.queue_wait"]["count"] == 1
    assert phases["save_weights.capture"]["count"] == 1 and phases["save_weights.persist"]["count"] == 1
    assert phases["accept.execute"]["count"] == 1


def test_a_failing_observer_never_reaches_the_engine(backend):
    class Broken(Recorder):
        def span(self, *args, **kwargs):
            raise RuntimeError("telemetry backend down")

    engine = Engine(backend, observer=Broken())
    assert engine.create_model("a", spec={}).result(timeout=10) == "a"
    assert engine.submit(command("a", 1)).result(timeout=10) == {"ran": "a:1"}
    engine.stop()


def test_a_model_that_cannot_be_created_fails_its_future_and_its_queued_work(backend):
    engine = Engine(backend, start=False)
    created = engine.create_model("x", spec="broken")
    queued = engine.submit(command("x", 1))
    engine.start()
    with pytest.raises(ValueError, match="rank must be positive"):
        created.result(timeout=10)
    with pytest.raises(RuntimeError, match="could not be created"):
        queued.result(timeout=10)
    with pytest.raises(NotFoundError):
        engine.submit(command("x", 2))
    engine.stop()


def test_unloading_a_model_fails_the_commands_held_behind_a_missing_seq_with_a_message(backend):
    engine = ready_engine(backend, ["a"])
    waiting = engine.submit(command("a", 2))  # seq 1 never comes, so this waits
    assert engine.unload_model("a").result(timeout=10) == "a"
    with pytest.raises(NotFoundError, match="was removed before request a:2 ran"):
        waiting.result(timeout=10)
    engine.stop()


def test_stop_fails_queued_work_and_refuses_new_work(backend):
    engine = ready_engine(backend, ["a"])
    waiting = engine.submit(command("a", 5))
    engine.stop()
    with pytest.raises(EngineStopped):
        waiting.result(timeout=10)
    with pytest.raises(EngineStopped):
        engine.submit(command("a", 1))


def test_unknown_models_are_a_not_found_error(backend):
    engine = ready_engine(backend, [])
    with pytest.raises(NotFoundError, match="Unknown model_id 'ghost'"):
        engine.submit(command("ghost", 1))
    engine.stop()


def test_the_compute_lane_can_run_on_the_callers_thread(backend):
    engine = Engine(backend, start=False)
    engine.start(compute_thread=False)
    engine.create_model("a", spec={})
    step = engine.submit(command("a", 1))
    lane_threads = []
    backend.forward_backward = lambda commands, forward_only: (
        lane_threads.append(threading.current_thread()) or [{"ran": c.request_id} for c in commands])
    stopper = threading.Thread(target=lambda: (step.result(timeout=10), engine.stop()))
    stopper.start()
    engine.run_compute_lane()  # returns once stop() is called
    stopper.join()
    assert step.result() == {"ran": "a:1"}
    assert lane_threads == [threading.current_thread()]


def sample(session, seq, tokens=128):
    return command(session, seq, kind=Kind.SAMPLE, tokens=tokens, key=())


def test_samples_run_in_any_order_and_a_missing_seq_holds_nothing_up(backend):
    engine = ready_engine(backend, [])
    # seq 1 never arrives (refused at the door, say): 0 and 2 still run.
    assert results([engine.submit(sample("s", 2)), engine.submit(sample("s", 0))]) == [{"ran": "s:2"}, {"ran": "s:0"}]
    engine.stop()


def test_ready_samples_of_many_clients_share_one_generation_within_the_budget(backend):
    engine = paused_engine(backend, [], token_budget=300)
    futures = [engine.submit(sample(s, 0)) for s in "pqr"]
    engine.start()
    results(futures)
    assert [ids for name, ids in backend.calls if name == "sample"] == [["p:0", "q:0"], ["r:0"]]
    engine.stop()


def test_samples_and_training_take_turns(backend):
    engine = paused_engine(backend, ["a"], token_budget=128)
    futures = [engine.submit(sample("s", n)) for n in range(3)] + [engine.submit(command("a", n)) for n in (1, 2)]
    engine.start()
    results(futures)
    assert [name for name, _ in backend.calls if name != "add"] == [
        "sample", "forward_backward", "sample", "forward_backward", "sample"]
    engine.stop()


def test_stop_fails_queued_samples_too(backend):
    engine = paused_engine(backend, [])
    queued = engine.submit(sample("s", 0))
    engine.stop()
    with pytest.raises(EngineStopped):
        queued.result(timeout=10)


def test_a_cancelled_sample_leaves_the_queue_or_fails_once_its_generation_ends(backend):
    engine = paused_engine(backend, [], token_budget=128)  # one sample per generation
    running, queued = engine.submit(sample("s", 0)), engine.submit(sample("s", 1))
    backend.sample_gate.clear()
    engine.start()
    assert backend.sample_started.wait(10)
    assert engine.cancel_sample("s:1") == "queued"
    with pytest.raises(CancelledByClientError, match="s:1 was cancelled"):
        queued.result(timeout=0)  # at once: it never runs
    assert engine.cancel_sample("s:0") == "running"
    backend.sample_gate.set()
    with pytest.raises(CancelledByClientError, match="s:0 was cancelled"):
        running.result(timeout=10)
    assert backend.seen_cancelled == ["s:0"]  # the backend could stop it early
    assert engine.cancel_sample("s:0") == engine.cancel_sample("nobody:7") == "none"
    assert [ids for name, ids in backend.calls if name == "sample"] == [["s:0"]]
    engine.stop()


def test_unloading_a_model_runs_what_it_queued_in_order_then_frees_it_and_refuses_more(backend):
    engine = paused_engine(backend, ["a"])
    queued = [engine.submit(command("a", 1)), engine.submit(command("a", 2, kind=Kind.OPTIM_STEP, key=()))]
    behind_a_gap = engine.submit(command("a", 4))  # seq 3 never arrives
    unloaded = engine.unload_model("a")
    with pytest.raises(GoneError, match="'a' was unloaded"):
        engine.submit(command("a", 3))
    engine.start()
    assert results(queued) == [{"ran": "a:1"}, {"ran": "a:2"}]
    assert unloaded.result(timeout=10) == "a"
    with pytest.raises(NotFoundError, match="removed before request a:4 ran"):
        behind_a_gap.result(timeout=10)
    assert [name for name, _ in backend.calls] == ["add", "forward_backward", "optim_step", "remove"]
    with pytest.raises(GoneError, match="'a' was unloaded"):
        engine.submit(command("a", 5))
    engine.stop()


def test_a_model_created_to_load_a_checkpoint_runs_the_load_as_seq_0_before_its_first_step(backend):
    engine = Engine(backend, start=False)
    engine.create_model("a", spec={"rank": 8}, first_seq=0)
    step = engine.submit(command("a", 1))
    load = engine.submit(command("a", 0, kind=Kind.LOAD_WEIGHTS, key=()))
    engine.start()
    results([load, step])
    assert [name for name, _ in backend.calls] == ["add", "load_weights", "forward_backward"]
    engine.stop()
