"""The engine behind the thinnest HTTP front: what K SDK clients in lockstep can get on this machine at best.

lilo's engine (the tiny model, one torch thread, coalescing as a trainer does) in one process, under a bare ASGI app
on uvicorn that speaks just enough of the Tinker protocol for ``bench_service``'s clients: a session, a LoRA model,
forward_backward, optim_step, retrieve_future answered from memory, and the engine's critical path
(``/api/v1/timing``, as a trainer reports it, so that the benchmark splits the steps as it does lilo's). No Ray, no
ledger, no auth, no traces, no durability: what is left is what the SDK clients, HTTP and the engine cost when they
share the machine. ``bench_service.py --bare`` runs K clients against it beside lilo, so that lilo's tokens/s can be
read against this ceiling as well as against the engine alone.

    python benchmarks/bare_service.py --port 8790 --max-adapters 32    # prints "ready" once it listens
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import subprocess
import sys
import tempfile
import threading
import urllib.parse
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

import orjson

from lilo.backend.types import LoraSpec
from lilo.engine.commands import Command, Kind
from lilo.protocol.proto import decode_forward_backward, encode_forward_backward_output
from serve.tinker.optimizers import step_params

# How long a retrieve_future waits for its result before it answers try_again (the SDK then asks again at once).
LONG_POLL_S = 30.0
JSON = b"application/json"
PROTOBUF = b"application/x-protobuf"
Answer = tuple[int, bytes, bytes]  # status, body, content type
Encode = Callable[[Any], tuple[bytes, bytes]]  # a result -> its body and content type


class BareService:
    """The protocol's minimum over ``engine``: each request's future kept in memory until retrieved."""

    def __init__(self, engine: Any, base_model: str) -> None:
        self._engine = engine
        self._base_model = base_model
        self._ids = itertools.count(1)
        self._sessions = itertools.count(1)
        self._answers: dict[int, asyncio.Future[tuple[bytes, bytes]]] = {}
        self._models: dict[str, list[str]] = {}  # each session's models, unloaded when it finishes
        self._routes: dict[str, Callable[[bytes], Awaitable[Answer]]] = {
            "/api/v1/client/config": self._empty, "/api/v1/create_session": self._create_session,
            "/api/v1/create_model": self._create_model, "/api/v1/get_info": self._get_info,
            "/api/v1/forward_backward": self._forward_backward, "/api/v1/optim_step": self._optim_step,
            "/api/v1/retrieve_future": self._retrieve_future}

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        route = self._routes.get(path)
        if path == "/api/v1/timing":
            status, answer, content_type = self._timing(scope["query_string"].decode())
        elif route is not None:
            status, answer, content_type = await route(body)
        elif path.startswith("/api/v1/sessions/") and path.endswith("/finish"):
            status, answer, content_type = self._finish_session(path.split("/")[4])
        else:  # dynamic_config, telemetry, heartbeats: the SDK does without them
            status, answer, content_type = 404, b'{"detail": "not in the bare service"}', JSON
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", content_type), (b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})

    def _timing(self, query: str) -> Answer:
        asked = dict(urllib.parse.parse_qsl(query))
        snapshot = self._engine.timings.snapshot(asked.get("model_id"), reset=asked.get("reset") == "true",
                                                 reader=asked.get("reader", ""))
        return 200, orjson.dumps(snapshot), JSON

    def _finish_session(self, session_id: str) -> Answer:
        """Unload the session's models, as lilo does, so that their slots go to the next clients."""
        for model_id in self._models.pop(session_id, []):
            self._engine.unload_model(model_id)
        return 200, b"{}", JSON

    async def _empty(self, _body: bytes) -> Answer:
        return 200, b"{}", JSON

    async def _create_session(self, _body: bytes) -> Answer:
        return 200, orjson.dumps({"session_id": f"bare-{next(self._sessions)}"}), JSON

    async def _get_info(self, body: bytes) -> Answer:
        model_id = orjson.loads(body)["model_id"]
        return 200, orjson.dumps({"model_id": model_id, "model_data": {"model_name": self._base_model},
                                  "is_lora": True}), JSON

    async def _create_model(self, body: bytes) -> Answer:
        request = orjson.loads(body)
        model_id = f"{request['session_id']}:train:{request['model_seq_id']}"
        self._models.setdefault(request["session_id"], []).append(model_id)
        created = self._engine.create_model(model_id, LoraSpec.from_config(request.get("lora_config") or {}))
        return self._future(created, lambda _: (orjson.dumps({"model_id": model_id, "type": "create_model"}), JSON),
                            model_id)

    async def _forward_backward(self, body: bytes) -> Answer:
        call = decode_forward_backward(body)
        request_id = next(self._ids)
        done = self._engine.submit(Command(call.model_id, call.seq_id, Kind.FORWARD_BACKWARD, str(request_id),
                                           payload=call.train, tokens=call.train.tokens))
        return self._future(done, lambda result: (encode_forward_backward_output(result["loss_fn_outputs"],
                                                                                 result["metrics"]), PROTOBUF),
                            call.model_id, request_id)

    async def _optim_step(self, body: bytes) -> Answer:
        request = orjson.loads(body)
        request_id = next(self._ids)
        params = step_params(request.get("adam_params"), request.get("optimizer_params"))
        done = self._engine.submit(Command(request["model_id"], request["seq_id"], Kind.OPTIM_STEP,
                                           str(request_id), payload=params))
        return self._future(done, lambda result: (orjson.dumps(result), JSON), request["model_id"], request_id)

    def _future(self, done: Future, encode: Encode, model_id: str, request_id: int | None = None) -> Answer:
        """Keep ``done``'s answer (encoded on the thread that finished it, as a trainer does) under a request id for
        retrieve_future."""
        request_id = request_id or next(self._ids)
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[tuple[bytes, bytes]] = loop.create_future()

        def finished(settled: Future) -> None:
            error = settled.exception()
            encoded = (orjson.dumps({"error": str(error), "category": "server"}), JSON) if error else \
                encode(settled.result())
            loop.call_soon_threadsafe(answer.set_result, encoded)

        done.add_done_callback(finished)
        self._answers[request_id] = answer
        return 200, orjson.dumps({"request_id": str(request_id), "model_id": model_id}), JSON

    async def _retrieve_future(self, body: bytes) -> Answer:
        request_id = int(orjson.loads(body)["request_id"])
        answer = self._answers.get(request_id)
        if answer is None:
            return 404, b'{"detail": "unknown request_id"}', JSON
        try:
            result, content_type = await asyncio.wait_for(asyncio.shield(answer), LONG_POLL_S)
        except TimeoutError:
            return 200, b'{"type": "try_again"}', JSON
        del self._answers[request_id]
        return 200, result, content_type


def serve(port: int, max_adapters: int, compute_nice: int) -> None:
    """Load the tiny model, listen on 127.0.0.1:``port`` (on a thread of full priority), print "ready", and run the
    engine's compute lane on this thread, ``compute_nice`` steps nicer, as a trainer does."""
    import torch
    import uvicorn

    from cluster.worker_setup import lower_thread_priority
    from lilo.backend.models import build_tiny_llama, load_base_model
    from lilo.backend.torch_backend import TorchBackend
    from lilo.engine.engine import Engine

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as directory:
        model = load_base_model(build_tiny_llama(Path(directory) / "tiny"))
    engine = Engine(TorchBackend(model, max_adapters=max_adapters), start=False)
    engine.start(compute_thread=False)
    server = uvicorn.Server(uvicorn.Config(BareService(engine, "lilo/tiny-llama"), host="127.0.0.1", port=port,
                                           log_level="warning", access_log=False))
    threading.Thread(target=server.run, name="bare-http", daemon=True).start()
    while not server.started:
        threading.Event().wait(0.05)
    print("ready", flush=True)
    lower_thread_priority(compute_nice)  # after the HTTP thread started: it keeps its priority
    engine.run_compute_lane()


@contextlib.contextmanager
def bare_service(port: int, max_adapters: int) -> Iterator[str]:
    """This script in a process of its own, on 127.0.0.1:``port``, until the block ends; yields its base URL."""
    here = Path(__file__).resolve()
    process = subprocess.Popen([sys.executable, str(here), "--port", str(port), "--max-adapters", str(max_adapters)],
                               stdout=subprocess.PIPE, text=True, cwd=here.parent.parent)
    try:
        line = process.stdout.readline() if process.stdout else ""
        if line.strip() != "ready":
            raise RuntimeError(f"the bare service did not start (exit code {process.wait(timeout=30)})")
        yield f"http://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8790)
    parser.add_argument("--max-adapters", type=int, default=16)
    parser.add_argument("--compute-nice", type=int, default=10, help="as lilo's trainer (--compute-nice)")
    args = parser.parse_args()
    serve(args.port, args.max_adapters, args.compute_nice)


if __name__ == "__main__":
    main()
