"""Traces (lilo.timing.traces, lilo.timing.trace_observer): off unless configured the standard way; the trainer's
spans of a request under the trace it carried; a coalesced pass linked to every request it served; export that
never holds the caller. Real OpenTelemetry SDK and OTLP/HTTP exporter, sending to a real receiver on loopback."""

import socket
import threading
import time

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

from helpers import eventually
from lilo.engine.commands import Command
from lilo.engine.engine import Engine
from lilo.timing import traces
from lilo.timing.trace_observer import TraceObserver, trace_observer
from lilo.timing.trace_export import BoundedExport
from lilo.timing.traces import carrier, traces_endpoint
from benchmarks.otlp_receiver import OtlpReceiver
from test_engine import RecordingBackend, command


@pytest.fixture
def receiver():
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


def test_the_endpoint_comes_from_the_standard_variables():
    assert traces_endpoint({}) is None
    assert traces_endpoint({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}) == "http://c:4318/v1/traces"
    assert traces_endpoint({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://d:9/traces"}) == "http://d:9/traces"


def test_with_no_endpoint_set_no_tracer_and_no_exporter_start(monkeypatch):
    monkeypatch.delenv(traces.TRACES_ENDPOINT, raising=False)
    monkeypatch.delenv(traces.BASE_ENDPOINT, raising=False)
    assert traces.tracer("trainer") is None and trace_observer() is None
    engine = Engine(RecordingBackend(), trace_observer(), start=False)
    assert not any(isinstance(observer, TraceObserver) for observer in engine.observer.observers)
    assert engine.timings in engine.observer.observers
    assert not traces.export_counts()  # no exporter in this process
    assert carrier() is None  # nothing recording: the ingress sends no context along


def tracer_to(endpoint: str, part: str):
    provider = TracerProvider(resource=Resource.create({"service.name": f"lilo-{part}"}))
    processor = BoundedExport(OTLPSpanExporter(endpoint=endpoint, timeout=2.0), every_s=0.05)
    provider.add_span_processor(processor)
    return provider.get_tracer("test"), processor


def test_a_pass_of_two_models_is_linked_to_both_requests_and_each_request_keeps_its_trace(receiver):
    ingress, _ = tracer_to(receiver.endpoint, "ingress")
    trainer, processor = tracer_to(receiver.endpoint, "trainer")
    observer = TraceObserver(trainer)
    engine = Engine(RecordingBackend(), observer, start=False)
    for model in "ab":
        engine.create_model(model, spec={"rank": 8})
    requests = {}
    for model in "ab":
        with ingress.start_as_current_span(f"POST forward_backward {model}") as span:
            requests[model] = span.get_span_context()
            engine.submit(Command(**{**command(model, 1).__dict__, "trace": carrier()}))
    engine.start()
    done = [engine.submit(command("a", 2))]  # untraced (a restore's own command): the pass is traced all the same
    [future.result(timeout=10) for future in done]
    engine.stop()
    observer.drain()
    assert processor.force_flush(10_000)

    spans = receiver.wait_for(lambda spans: len([s for s in spans if s.service == "lilo-trainer"]) >= 6)
    by_trace = {model: [s for s in spans if s.trace_id == f"{context.trace_id:032x}"]
                for model, context in requests.items()}
    for model, context in requests.items():
        names = sorted(s.name for s in by_trace[model] if s.service == "lilo-trainer")
        assert names == ["trainer.execute", "trainer.queue_wait"], by_trace[model]
        trainer_spans = [s for s in by_trace[model] if s.service == "lilo-trainer"]
        assert all(s.parent_span_id == f"{context.span_id:016x}" for s in trainer_spans)
        assert all(s.attributes["lilo.model_id"] == model for s in trainer_spans)
    (shared,) = [s for s in spans if s.name == "trainer.pass forward_backward" and len(s.links) == 2]
    assert set(shared.links) == {(f"{c.trace_id:032x}", f"{c.span_id:016x}") for c in requests.values()}
    assert shared.attributes["lilo.models"] == 2 and shared.attributes["lilo.requests"] == 2
    assert shared.attributes["lilo.tokens"] == 256
    assert any(s.name == "trainer.pass forward_backward" and not s.links for s in spans)  # the untraced one
    queue_wait = next(s for s in by_trace["a"] if s.name == "trainer.queue_wait")
    execute = next(s for s in by_trace["a"] if s.name == "trainer.execute")
    assert queue_wait.end_ns == execute.start_ns and abs(execute.start_ns - time.time_ns()) < 60e9


def test_a_dead_collector_never_holds_the_caller_and_its_losses_are_counted():
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tracer_, processor = tracer_to(f"http://127.0.0.1:{port}/v1/traces", "trainer")
    started = time.perf_counter()
    for index in range(2000):
        with tracer_.start_as_current_span(f"span {index}"):
            pass
    ended_s = time.perf_counter() - started
    assert ended_s < 5.0, ended_s  # enqueued only: the exports fail on their own thread
    eventually(lambda: processor.counts.failed + processor.counts.dropped >= 2000,
               lambda: f"2000 spans failed or dropped; counts: {processor.counts}", timeout_s=30, every_s=0.1)
    assert processor.counts.exported == 0
    assert processor.counts.failed + processor.counts.dropped == 2000


def test_a_full_queue_drops_spans_instead_of_waiting():
    class Stuck:
        def __init__(self):
            self.entered = threading.Event()

        def export(self, batch):
            self.entered.set()
            time.sleep(60)

    exporter = Stuck()
    processor = BoundedExport(exporter, max_queued=10, every_s=0.01)
    # The thread stuck in an export of one span first: while it takes spans, a busy machine may let it take any
    # number of them into its batch, and only a stuck thread makes the queue's bound the only room left.
    processor.on_end(-1)
    assert exporter.entered.wait(10)
    for index in range(100):
        processor.on_end(index)
    assert processor.counts.dropped == 90  # ten queued behind the stuck export, the rest dropped at once
