"""The coalescing window's rules: the pure decision (``window_s``, ``awaited``) with hand-made rhythms, what
``Rhythm`` learns from observer events, and the engine's window around a backend whose passes take real time."""

import threading
import time

import pytest

from lilo.engine.commands import Kind
from lilo.engine.engine import Engine
from lilo.engine.window import PASS_SMOOTHING, THINKS_KEPT, WINDOW_SHARE_OF_PASS, Expected, Rhythm, awaited, window_s
from test_engine import Recorder, RecordingBackend, command


@pytest.mark.parametrize(("pass_s", "cap_s", "expected"), [
    (None, 0.05, 0.0),  # no pass of this kind ran yet: nothing to size a window by
    (0.1, 0.05, WINDOW_SHARE_OF_PASS * 0.1),  # a share of the pass
    (1.0, 0.05, 0.05),  # never beyond the cap
    (1.0, 0.0, 0.0),  # the cap 0 turns it off
])
def test_the_window_is_a_share_of_the_pass_and_never_beyond_the_cap(pass_s, cap_s, expected):
    assert window_s(pass_s, cap_s) == pytest.approx(expected)


@pytest.mark.parametrize(("expected", "room", "waited"), [
    (Expected(due_s=10.01, think_s=0.01, tokens=100), 1000, True),  # due inside the window (to 10.02)
    (Expected(due_s=10.05, think_s=0.05, tokens=100), 1000, False),  # due after the window closes
    (None, 1000, False),  # never sent this kind after going idle: no rhythm yet
    (Expected(due_s=9.99, think_s=0.02, tokens=100), 1000, True),  # 10 ms late, within its 20 ms think time
    (Expected(due_s=9.9, think_s=0.02, tokens=100), 1000, False),  # later than its think time again: it stopped
    (Expected(due_s=9.99, think_s=0.0, tokens=100), 1000, False),  # it always sent at once, and has not
    (Expected(due_s=10.01, think_s=0.01, tokens=2000), 1000, False),  # its step would not fit the budget
    (Expected(due_s=10.01, think_s=0.01, tokens=2000), None, True),  # optim_step: no token budget
])
def test_only_idle_models_in_rhythm_due_within_the_window_that_fit_are_awaited(expected, room, waited):
    assert awaited({"b": expected}, now_s=10.0, deadline_s=10.02, room_tokens=room) == (["b"] if waited else [])


def test_the_rhythm_is_the_median_think_time_so_one_pause_does_not_throw_it_off():
    rhythm = Rhythm()
    for think in (0.010, 0.012, 30.0, 0.011):  # the third step came after a 30 s evaluation
        rhythm.learn("a", Kind.FORWARD_BACKWARD, think, tokens=64)
    assert rhythm.expected("a", Kind.FORWARD_BACKWARD, idle_since_s=5.0) == Expected(
        due_s=pytest.approx(5.0115), think_s=pytest.approx(0.0115), tokens=64)
    for think in range(THINKS_KEPT):  # it keeps only the latest: a lasting change of rhythm is learnt
        rhythm.learn("a", Kind.FORWARD_BACKWARD, 1.0, tokens=64)
    assert rhythm.expected("a", Kind.FORWARD_BACKWARD, idle_since_s=5.0).think_s == 1.0
    rhythm.learn("a", Kind.SAMPLE, 0.01, tokens=64)  # samples have no window
    assert rhythm.expected("a", Kind.SAMPLE, idle_since_s=5.0) is None
    rhythm.forget("a")
    assert rhythm.expected("a", Kind.FORWARD_BACKWARD, idle_since_s=5.0) is None


def test_the_pass_duration_is_a_moving_average():
    rhythm = Rhythm()
    assert rhythm.pass_s(Kind.FORWARD_BACKWARD) is None
    rhythm.passed(Kind.FORWARD_BACKWARD, 0.2)
    rhythm.passed(Kind.FORWARD_BACKWARD, 0.3)
    assert rhythm.pass_s(Kind.FORWARD_BACKWARD) == pytest.approx(0.2 + PASS_SMOOTHING * 0.1)


class SlowBackend(RecordingBackend):
    """Passes that take real time, as a model's would, so the window has a pass duration to be a share of."""

    def __init__(self, pass_s: float) -> None:
        super().__init__()
        self.pass_s = pass_s

    def _batch(self, name, commands):
        time.sleep(self.pass_s)
        return super()._batch(name, commands)


class WaitTimes(Recorder):
    """Also keeps how long each coalescing window was held open."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def span(self, model, name, lane, t0, t1=None, **attrs):
        super().span(model, name, lane, t0, t1, **attrs)
        if name.startswith("coalesce_wait:"):
            self.waits.append(t1 - t0)


def lockstep(engine, models, steps, lag_s, first=1, kind=Kind.FORWARD_BACKWARD):
    """Each model a client thread: submit its step, wait for its result, submit the next, ``steps`` times from seq
    ``first``; each round starts together, the i-th client ``i * lag_s`` behind the first."""
    rounds = threading.Barrier(len(models))

    def client(i, model):
        for seq in range(first, first + steps):
            rounds.wait(timeout=30)
            time.sleep(i * lag_s)
            engine.submit(command(model, seq, kind)).result(timeout=30)

    threads = [threading.Thread(target=client, args=(i, m)) for i, m in enumerate(models)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)


def passes(backend, kind=Kind.FORWARD_BACKWARD):
    return [ids for name, ids in backend.calls if name == kind]


def windows(recorder):
    return [event for event in recorder.events if event[0] == "span" and event[1].startswith("coalesce_wait:")]


@pytest.mark.parametrize("kind", [Kind.FORWARD_BACKWARD, Kind.FORWARD, Kind.OPTIM_STEP])
def test_lockstep_clients_a_few_ms_apart_share_every_pass_once_in_rhythm(kind):
    backend, recorder = SlowBackend(pass_s=0.2), Recorder()
    engine = Engine(backend, recorder)
    for model in "abc":
        engine.create_model(model, spec={"rank": 8}).result(timeout=10)
    lockstep(engine, "abc", steps=8, lag_s=0.005, kind=kind)
    # Step 1 teaches the engine the pass duration, step 2 each model's think time; from then on one pass a round.
    assert all(len(ids) == 3 for ids in passes(backend, kind)[-4:]), passes(backend, kind)
    assert windows(recorder)
    engine.stop()


def test_two_lockstep_clients_see_each_wait_as_one_span_from_where_the_window_opened():
    """With two models the one waited for comes first in the rotation when it joins (the last pass's anchor went to
    the back): the window is still the first one's, so its wait is recorded and its deadline kept."""
    backend, recorder = SlowBackend(pass_s=0.2), WaitTimes()
    engine = Engine(backend, recorder)
    for model in "ab":
        engine.create_model(model, spec={"rank": 8}).result(timeout=10)
    lockstep(engine, "ab", steps=8, lag_s=0.01)
    assert all(len(ids) == 2 for ids in passes(backend)[-4:]), passes(backend)
    # From step 3 every round waits, from a's arrival to b's 10 ms later: never dropped or restarted when b's
    # command comes first, and never past the window (a quarter of the 0.2 s pass).
    assert len(recorder.waits) >= 5, recorder.waits
    assert all(0.005 <= wait <= WINDOW_SHARE_OF_PASS * 0.2 + 0.005 for wait in recorder.waits), recorder.waits
    engine.stop()


def test_without_the_window_lockstep_clients_split_their_passes():
    backend = SlowBackend(pass_s=0.2)
    engine = Engine(backend, window_cap_ms=0)
    for model in "abc":
        engine.create_model(model, spec={"rank": 8}).result(timeout=10)
    lockstep(engine, "abc", steps=5, lag_s=0.005)
    assert any(len(ids) < 3 for ids in passes(backend)[-3:]), passes(backend)
    engine.stop()


def test_a_lone_client_never_waits():
    backend, recorder = SlowBackend(pass_s=0.02), Recorder()
    engine = Engine(backend, recorder)
    engine.create_model("a", spec={"rank": 8}).result(timeout=10)
    lockstep(engine, "a", steps=6, lag_s=0.0)
    assert len(passes(backend)) == 6 and windows(recorder) == []
    engine.stop()


def test_a_client_that_stopped_is_waited_for_at_most_once_and_never_holds_the_others():
    backend, recorder = SlowBackend(pass_s=0.2), Recorder()
    engine = Engine(backend, recorder)
    for model in "ab":
        engine.create_model(model, spec={"rank": 8}).result(timeout=10)
    lockstep(engine, "ab", steps=4, lag_s=0.005)
    held = len(windows(recorder))
    lockstep(engine, "a", steps=4, lag_s=0.0, first=5)  # b stopped: a steps on alone
    # After b's last step a's next pass may still wait once (b was due), never again.
    assert len(windows(recorder)) - held <= 1
    assert passes(backend)[-3:] == [["a:6"], ["a:7"], ["a:8"]]
    engine.stop()


def test_a_full_pass_of_one_tenant_waits_for_a_less_served_tenants_lockstep_client():
    """Tenant a keeps three models' steps queued; tenant b's one client steps in lockstep, thinking 60 ms between
    steps (beyond a plain window of a 0.2 s pass, 50 ms). Passes hold two steps: b's step takes one of a's places
    in nearly every pass, so b gets its tenant's half of the trainer."""
    import dataclasses

    backend = SlowBackend(pass_s=0.2)
    engine = Engine(backend, token_budget=256)
    for model in ("a0", "a1", "a2", "b0"):
        engine.create_model(model, spec={"rank": 8}).result(timeout=10)
    stop = threading.Event()

    def tenant_a(model):
        seq, pending = 1, []
        while not stop.is_set():
            pending.append(engine.submit(dataclasses.replace(command(model, seq), tenant="a")))
            seq += 1
            if len(pending) > 2:
                pending.pop(0).result(timeout=30)

    threads = [threading.Thread(target=tenant_a, args=(m,), daemon=True) for m in ("a0", "a1", "a2")]
    for thread in threads:
        thread.start()
    for seq in range(1, 16):
        engine.submit(dataclasses.replace(command("b0", seq), tenant="b")).result(timeout=30)
        time.sleep(0.06)
    stop.set()
    for thread in threads:
        thread.join(timeout=30)
    everything = passes(backend)
    with_b = [ids for ids in everything if any(request.startswith("b0:") for request in ids)]
    assert len(with_b) == 15
    # Once b's rhythm is learnt (its first steps), a pass that would start while b thinks waits for it: between
    # b's fifth pass and its last, (nearly) every pass has b's step. Without the wait, every other one would not.
    between = everything[everything.index(with_b[4]):everything.index(with_b[-1]) + 1]
    assert len([ids for ids in between if ids not in with_b]) <= 2, between
    engine.stop()
