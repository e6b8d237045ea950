"""lilo.timing against a real HTTP server on loopback that serves a real CriticalPath, and a real offline W&B run."""

import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lilo import timing
from lilo.timing.critical_path import CriticalPath, Operation
from helpers import eventually
from wandb_records import has_exit_record, history_rows, metric_definitions


class TimingServer:
    """Answers GET /api/v1/timing from a CriticalPath, as a trainer does; records what it was asked."""

    def __init__(self) -> None:
        self.timings = CriticalPath(log_line=lambda line: None, drain_every_s=None)
        self.requests: list[tuple[dict, str]] = []
        self.delay_s = 0.0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                url = urllib.parse.urlparse(self.path)
                query = dict(urllib.parse.parse_qsl(url.query))
                server.requests.append((query, self.headers.get("X-API-Key")))
                time.sleep(server.delay_s)
                body = json.dumps(server.timings.snapshot(
                    query.get("model_id"), reset=query.get("reset") == "true", reader=query.get("reader", ""),
                )).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def step(self, model_id: str, i: int) -> None:
        self.timings.begin(Operation(model_id, f"{model_id}:{i}", "forward_backward", float(i)))
        self.timings.span(model_id, "forward_backward", "gpu", i + 0.25, i + 1.0, request_ids=[f"{model_id}:{i}"])


@pytest.fixture
def server():
    serving = TimingServer()
    yield serving
    serving.httpd.shutdown()
    serving.httpd.server_close()


@pytest.fixture(autouse=True)
def settle_reporter():
    yield
    assert timing.flush_critical_path(timeout=30)


def test_blocking_call_returns_flat_metrics_of_the_interval(server):
    server.step("m", 0)
    metrics = timing.log_critical_path("m", step=0, base_url=server.url, api_key="tml-k", background=False)
    assert metrics["lilo/forward_backward.execute.count"] == 1
    assert metrics["lilo/forward_backward.queue_wait.mean_s"] == pytest.approx(0.25)
    assert server.requests == [({"model_id": "m", "reset": "true", "reader": "log_critical_path"}, "tml-k")]
    # reset=True: the next call covers only what happened since.
    again = timing.log_critical_path("m", step=1, base_url=server.url, api_key="tml-k", background=False)
    assert again["lilo/forward_backward.execute.count"] == 0


def test_base_url_and_key_default_to_the_tinker_environment(server, monkeypatch):
    monkeypatch.setenv("TINKER_BASE_URL", server.url + "/")
    monkeypatch.setenv("TINKER_API_KEY", "tml-from-env")
    timing.log_critical_path("m", background=False)
    assert server.requests[0][1] == "tml-from-env"


def test_a_manual_reader_does_not_steal_the_loggers_interval(server):
    server.step("m", 0)
    timing.critical_path_metrics("m", base_url=server.url, reset=True, reader="curl")
    metrics = timing.log_critical_path("m", base_url=server.url, background=False)
    assert metrics["lilo/forward_backward.execute.count"] == 1


def test_background_call_returns_at_once_and_one_report_is_in_flight(server, capsys):
    server.delay_s = 0.5
    started = time.monotonic()
    assert timing.log_critical_path("m", step=1, base_url=server.url) is None
    assert timing.log_critical_path("m", step=2, base_url=server.url) is None  # dropped: one is fetching
    assert time.monotonic() - started < 0.4
    assert timing.flush_critical_path(timeout=10)
    assert len(server.requests) == 1
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["event"], line["step"]) for line in lines] == [("lilo_critical_path", 1)]


def test_without_a_wandb_run_one_json_line_goes_to_stdout(server, capsys):
    server.step("m", 0)
    timing.log_critical_path("m", step=7, base_url=server.url, background=False)
    (line,) = capsys.readouterr().out.splitlines()
    record = json.loads(line)
    assert (record["model_id"], record["step"], record["lilo/forward_backward.execute.count"]) == ("m", 7, 1)


def test_failures_never_raise():
    unreachable = "http://127.0.0.1:9"  # discard port: nothing listens there
    assert timing.log_critical_path("m", base_url=unreachable, background=False) == {}
    assert timing.log_critical_path("m", base_url=unreachable) is None
    assert timing.flush_critical_path(timeout=30)


def test_metrics_land_in_an_offline_wandb_run_against_lilo_step(server, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="lilo-test", mode="offline", dir=str(tmp_path))
    assert timing.client._active_wandb_run() is run  # found the way log_critical_path finds it
    try:
        for step in range(3):
            for i in range(step + 1):
                server.step("m", 10 * step + i)
            timing.log_critical_path("m", step=step, base_url=server.url)
            assert timing.flush_critical_path(timeout=30)
            run.log({"loss": 1.0 / (step + 1)})
    finally:
        run.finish()
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    # finish() can return before W&B's writer process has written the file out on a loaded machine: wait for the
    # run's exit record, which it writes last.
    eventually(lambda: has_exit_record(run_file), f"W&B's exit record in {run_file}", timeout_s=60, every_s=0.2)
    definitions = metric_definitions(run_file)
    assert [(d.glob_name, d.step_metric) for d in definitions] == [("lilo/*", "lilo/step")], history_rows(run_file)
    rows = [row for row in history_rows(run_file) if "lilo/step" in row]
    assert [json.loads(row["lilo/step"]) for row in rows] == [0, 1, 2]
    assert [json.loads(row["lilo/forward_backward.execute.count"]) for row in rows] == [1, 2, 3]
