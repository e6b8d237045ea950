"""Shared test helpers: run the real `lilo` console script, inspect a cluster (free ports: cluster.ports)."""

from __future__ import annotations

import ast
import contextlib
import copy
import io
import itertools
import json
import os
import pkgutil
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import httpx
import numpy as np
import psutil
import pytest


LILO = str(Path(sys.executable).parent / "lilo")
LOOPBACK_IPS = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
# The key the tests' own requests carry (the session cluster's keys file makes it the tenant "local").
API_KEY = "tml-local-test"
TINKER_CLI = str(Path(sys.executable).parent / "tinker")
# Indices of the trainers and samplers tests start themselves, far above the service's own (0, 1, ...): one count for
# the whole session, so no two of them are ever named alike (two random draws were, and the second start failed).
_test_actor_indices = itertools.count(700)
T = TypeVar("T")


def eventually(condition: Callable[[], T], what: str | Callable[[], str], timeout_s: float = 60.0,
               every_s: float = 0.5, ignoring: tuple[type[BaseException], ...] = ()) -> T:
    """``condition()``'s first truthy value, asked every ``every_s`` seconds; the test fails, saying ``what`` (a
    sentence, or a function that writes one from what was last seen), when none comes within ``timeout_s``. An
    error of a type in ``ignoring`` (an actor restarting, say) counts as not yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            found = condition()
        except ignoring:
            found = None
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what() if callable(what) else what}")
        time.sleep(every_s)


def fresh_actor_index() -> int:
    """An index for a trainer or sampler a test starts itself, unique in this test session."""
    return next(_test_actor_indices)


def stop_trainer(actor) -> None:
    """Stop a trainer a test started (as the service does: its ranks and its threads) and free its CPUs, also when it
    never got ready or already died: one left running holds CPUs the later tests' actors would wait for."""
    import ray

    with contextlib.suppress(ray.exceptions.RayError):
        ray.get(actor.stop.remote(), timeout=60)
    ray.kill(actor)


def tinker_cli(service, *args: str, api_key: str | None = API_KEY, cwd: Path | None = None, home: Path | None = None,
               stdin: str | None = None) -> subprocess.CompletedProcess:
    """The real ``tinker`` command, pointed at ``service`` (anything with an ``api_url``) the way its users point
    it: the environment (``api_key`` None: no TINKER_API_KEY; ``home``: the HOME its stored credentials go under),
    ``stdin`` typed in."""
    env = {**os.environ, "TINKER_BASE_URL": service.api_url, "TINKER_TELEMETRY": "0",
           # A crash prints every thread's Python stack.
           "PYTHONFAULTHANDLER": "1", **({"TINKER_API_KEY": api_key} if api_key is not None else {}),
           **({"HOME": str(home)} if home is not None else {})}
    if api_key is None:
        env.pop("TINKER_API_KEY", None)
    done = subprocess.run([TINKER_CLI, *args], capture_output=True, text=True, timeout=300, env=env, cwd=cwd,
                          input=stdin)
    if done.returncode < 0:
        # Once in a CI run (never here, in hundreds of tries under load) the CLI died of SIGABRT with empty stderr
        # after finishing its command: Python 3.11 ends the SDK's daemon event-loop thread with pthread_exit at
        # interpreter exit, which can abort. That is the client process's exit, not the service's answer, so the
        # command (idempotent in every test: downloads pass --force) runs once more; a second crash fails the test.
        warnings.warn(f"tinker {' '.join(args)} died of signal {-done.returncode}; running it once more. "
                      f"stderr: {done.stderr[-2000:]}")
        done = subprocess.run([TINKER_CLI, *args], capture_output=True, text=True, timeout=300, env=env, cwd=cwd,
                              input=stdin)
    return done


def cli_json(service, *args: str, **options) -> dict:
    done = tinker_cli(service, "-f", "json", *args, **options)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stdout}{done.stderr}"
    return json.loads(done.stdout)
AUTH = {"X-API-Key": API_KEY}


def short_home() -> Path:
    """A fresh cluster home short enough for Ray's unix socket paths (pytest's tmp_path is too long)."""
    return Path(tempfile.mkdtemp(prefix="lilo-t-", dir="/tmp"))


def plain_shell_env() -> dict[str, str]:
    """This process's environment without what ``prepare_environment`` (conftest) added for Ray: the environment
    the `lilo` command gets from a user's shell."""
    from cluster.local import LOCAL_RAY_ENV

    return {key: value for key, value in os.environ.items() if key not in LOCAL_RAY_ENV}


def lilo(*args: str, timeout_s: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The real `lilo` command, run as from a user's shell (with ``env`` added to its environment)."""
    return subprocess.run([LILO, *args], capture_output=True, text=True, timeout=timeout_s,
                          env={**plain_shell_env(), **(env or {})})


def lilo_down(home: Path) -> None:
    """``lilo down`` of the service in ``home``, as a test's teardown runs it: it fails the test when the command fails
    or does not return, and then kills what is left of that cluster itself. A cluster left running would hold the
    cores and memory every later test of the session needs, and slow them all."""
    from cluster.local import read_state, stop_cluster
    from lilo.settings import load_settings

    try:
        stopped = lilo("down", "--home", str(home))
        problem = None if stopped.returncode == 0 else f"exit {stopped.returncode}: {stopped.stdout}{stopped.stderr}"
    except subprocess.TimeoutExpired as error:
        problem = f"it did not return within {error.timeout:g} s"
    if problem is not None:
        settings = load_settings(env={}, home=home)
        state = read_state(settings)
        killed = stop_cluster(settings, state.pid if state else None, timeout_s=0)
        raise AssertionError(f"lilo down --home {home} failed ({problem}); killed what was left: pids {killed}")


def modules_of(package) -> list[str]:
    """A package's name and the names of all its modules, subpackages' included."""
    return [package.__name__] + [m.name for m in pkgutil.walk_packages(package.__path__, prefix=f"{package.__name__}.")]


def imports_in(path: Path) -> set[str]:
    """The modules a file imports anywhere, by absolute name: at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module)
    return found


def imported_top_levels(modules: list[str], search_path: tuple[str, ...] = ()) -> set[str]:
    """The top-level names in ``sys.modules`` of a fresh interpreter once it imported these modules (with these
    directories first on its path)."""
    script = (
        "import importlib, sys\n"
        f"sys.path[:0] = {list(search_path)!r}\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def tcp_listeners(processes: list[psutil.Process]) -> list[tuple[str, int, str]]:
    """(ip, port, process name) of every TCP socket in LISTEN state held by these processes."""
    names = {p.pid: p.name() for p in processes}
    return [
        (conn.laddr.ip, conn.laddr.port, names[conn.pid])
        for conn in psutil.net_connections(kind="tcp")
        if conn.status == psutil.CONN_LISTEN and conn.pid in names
    ]


# A test of the ``ledger`` fixture (tests/conftest.py) that pokes at SQLite itself: it runs on SQLite only.
SQLITE_ONLY = pytest.mark.parametrize("ledger", ["sqlite"], indirect=True)


class Clock:
    """A clock a test moves by hand: ``clock.now += 5``."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def retrieve_finished(http: httpx.Client, url: str, request_id: str, polls: int = 10) -> httpx.Response:
    """POST retrieve_future (``url``) as the SDK does until the future has finished (its result or its error)."""
    for _ in range(polls):
        response = http.post(url, json={"request_id": request_id})
        pending = response.status_code == 408 or (
            "protobuf" not in response.headers.get("content-type", "") and response.json().get("type") == "try_again")
        if not pending:
            return response
    raise AssertionError(f"future {request_id} was still pending after {polls} long polls")


def record_counts(db_path: Path) -> dict[str, int]:
    """Rows per table of a futures DB, read through a read-only connection (the DB actor stays its one writer)."""
    with contextlib.closing(sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)) as connection:
        return {table: connection.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
                for table in ("futures", "models", "sessions", "sampling_sessions")}


def pending_requests(db_path: Path, model_id: str) -> int:
    """How many of a model's requests a futures DB file holds as pending (read-only, as ``record_counts``)."""
    with contextlib.closing(sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)) as connection:
        return connection.execute("SELECT COUNT(*) FROM futures WHERE model_id = ? AND status = 'pending'",
                                  (model_id,)).fetchone()[0]


def wait_for_heartbeat(db_path: str | Path, session_id: str, since: float, timeout_s: float = 30.0) -> None:
    """Until the futures DB file records a heartbeat of ``session_id`` at ``since`` or later."""
    def beaten_since() -> bool:
        with contextlib.closing(sqlite3.connect(db_path)) as reader:
            (beaten_at,) = reader.execute("SELECT last_heartbeat_at FROM sessions WHERE session_id = ?",
                                          (session_id,)).fetchone()
        return beaten_at >= since

    eventually(beaten_since, f"a heartbeat of {session_id} written to {db_path}", timeout_s)


def unload_models(api_url: str, model_ids: list[str], api_key: str = "tml-local-test") -> None:
    """Unload these models and wait until their adapter slots are free (the session cluster has 16 per trainer,
    and the tests that run last need some)."""
    with httpx.Client(timeout=60, headers={"X-API-Key": api_key}) as http:
        for model_id in model_ids:
            unloaded = http.post(f"{api_url}/api/v1/unload_model", json={"model_id": model_id})
            assert unloaded.status_code == 200, unloaded.text
            retrieve_finished(http, f"{api_url}/api/v1/retrieve_future", unloaded.json()["request_id"])


def two_on_one_trainer(created: list) -> list:
    """Two of ``created`` (training clients of one base model) placed on the same trainer. The session cluster has
    two trainers per base model and placement spreads a tenant's models over them, so two models made one after
    the other land apart: of three, two share one. Needs the ``ray_driver`` fixture."""
    return on_one_trainer(created, 2)


def on_one_trainer(created: list, count: int) -> list:
    """``count`` of ``created`` placed on the same trainer (of 2 * count - 1, that many share one)."""
    import ray

    from cluster.futures_actor import FUTURES_ACTOR_NAME
    from cluster.local import NAMESPACE

    futures = ray.get_actor(FUTURES_ACTOR_NAME, namespace=NAMESPACE)
    by_trainer: dict[str, list] = {}
    for client in created:
        by_trainer.setdefault(ray.get(futures.trainer_of.remote(client.model_id)), []).append(client)
    return next(clients for clients in by_trainer.values() if len(clients) >= count)[:count]


@contextlib.contextmanager
def ray_test_cluster(head_cpus: int) -> Iterator:
    """A ``ray.cluster_utils.Cluster`` (several Ray nodes on this machine, on loopback) with a head of
    ``head_cpus`` CPUs and no GPUs, in a temp dir of its own; shut down, by its own processes, on exit."""
    from ray.cluster_utils import Cluster

    from cluster.ports import free_ports

    temp_dir = short_home()
    # Ray's test cluster notes its address in <RAY_TMPDIR>/ray/ray_current_cluster, which must exist (/tmp/ray on a
    # machine that never ran Ray does not): ours, not the machine's.
    (temp_dir / "ray").mkdir(parents=True)
    before = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = str(temp_dir)
    try:
        # The head's dashboard and dashboard agent would take Ray's fixed defaults (8265, 52365), which another
        # cluster on this machine may hold; its other servers bind port 0.
        dashboard_port, agent_port = free_ports(2)
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": head_cpus, "num_gpus": 0, "temp_dir": str(temp_dir), "dashboard_port": dashboard_port,
            "dashboard_agent_listen_port": agent_port})
    finally:
        if before is None:
            os.environ.pop("RAY_TMPDIR")
        else:
            os.environ["RAY_TMPDIR"] = before
    try:
        yield cluster
    finally:
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


class ClusterService:
    """A lilo service deployed (``lilo up --address``) on a ``ray_test_cluster``: its trainers as `lilo status`
    lists them, and GPU nodes (fake ones: a ``GPU`` resource; the trainers compute on CPU) added to it."""

    def __init__(self, cluster, home: Path, port: int) -> None:
        self.cluster, self.home, self.port = cluster, home, port
        self.api_url = f"http://127.0.0.1:{port}"
        self.nodes: dict[str, object] = {}
        self.figures: dict[str, float] = {}

    def trainers(self) -> list[dict]:
        result = lilo("status", "--json", "--home", str(self.home), timeout_s=60)
        status = json.loads(result.stdout)["trainers"]
        return status["trainers"] if status else []

    def wait_for(self, predicate, timeout_s: float = 120.0, what: str = "") -> list[dict]:
        """The trainers ``lilo status`` lists, once ``predicate`` holds of them."""
        seen: list[list[dict]] = [[]]

        def holds() -> bool:
            seen[0] = self.trainers()
            return bool(predicate(seen[0]))

        eventually(holds, lambda: f"{what}; trainers: {seen[0]}", timeout_s)
        return seen[0]

    def add_gpu_node(self, label: str, gpus: int = 1):
        """A node of ``gpus`` fake GPUs and a CPU for each (a trainer's rank, or a trainer, takes one of both)."""
        node = self.cluster.add_node(num_cpus=gpus, num_gpus=gpus)
        self.nodes[label] = node
        return node

    def create_model(self, http: httpx.Client, session_id: str, seq: int, base_model: str) -> httpx.Response:
        return http.post(f"{self.api_url}/api/v1/create_model",
                         json={"session_id": session_id, "model_seq_id": seq, "base_model": base_model,
                               "lora_config": {"rank": 4}})


@contextlib.contextmanager
def service_on_test_cluster(head_cpus: int, *up_args: str) -> Iterator[ClusterService]:
    """``lilo up --address`` (with ``up_args``) on a fresh ``ray_test_cluster``; ``lilo down`` after."""
    from cluster.ports import free_ports  # here, not at the top: the library's tests import this module too

    with ray_test_cluster(head_cpus=head_cpus) as cluster:
        home, (port, dashboard_port) = short_home(), free_ports(2)
        started = lilo("up", "--detach", "--address", cluster.address, "--home", str(home), "--port", str(port),
                       "--dashboard-port", str(dashboard_port), *up_args)
        assert started.returncode == 0, started.stdout + started.stderr
        try:
            yield ClusterService(cluster, home, port)
        finally:
            lilo_down(home)


def trainers_on(trainers: list[dict], node) -> list[dict]:
    """The trainers (as `lilo status --json` lists them) on this Ray node."""
    return [trainer for trainer in trainers if trainer["node_id"] == node.node_id]


def sdk_datum(seed: int, length: int = 17):
    """A tinker Datum of ``length`` random tokens (repeatable by seed), for cross_entropy."""
    return tokens_datum(np.random.default_rng(seed).integers(0, 1000, length).tolist())


def tokens_datum(tokens: list[int]):
    """A tinker Datum that predicts each of ``tokens`` from those before it, for cross_entropy."""
    from tinker import types

    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


@contextlib.contextmanager
def own_service(*up_args: str, timeout_s: float = 480, home: Path | None = None) -> Iterator[tuple[str, str]]:
    """A lilo service of a test module's own (``lilo up --detach`` with ``up_args``, on a private head in ``home``,
    by default a fresh one, on free ports), its API URL; ``lilo down`` after."""
    from cluster.ports import free_ports  # here, not at the top: the library's tests import this module too

    home = home or short_home()
    port, dashboard = free_ports(2)
    started = lilo("up", "--detach", "--home", str(home), "--port", str(port), "--dashboard-port", str(dashboard),
                   *up_args, timeout_s=timeout_s)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield f"http://127.0.0.1:{port}", started.stdout
    finally:
        lilo_down(home)


def train_input(seed: int):
    """A lilo TrainInput of one 32-token datum (what a trainer actor's ``run`` takes), random but repeatable."""
    from lilo.backend.types import Datum, TrainInput

    tokens = np.random.default_rng(seed).integers(0, 1000, 32)
    return TrainInput(data=[Datum(tokens=tokens, loss_inputs={"target_tokens": np.roll(tokens, -1),
                                                              "weights": np.ones(32, dtype=np.float32)})])


def paged_timings(directory: Path, models: int = 2):
    """The critical path of a real engine whose ``models`` tiny models share one slot, each taking a
    forward_backward in turn (so each is paged out to host memory and back in); and the models' ids."""
    from lilo.backend.models import build_tiny_llama, load_base_model
    from lilo.backend.torch_backend import TorchBackend
    from lilo.backend.types import LoraSpec
    from lilo.engine.commands import Command, Kind
    from lilo.engine.engine import Engine

    backend = TorchBackend(load_base_model(build_tiny_llama(directory / "tiny-llama")), max_adapters=1, max_rank=8,
                           checkpoint_dir=directory / "checkpoints", host_adapter_bytes=16 * 2**20)
    engine = Engine(backend)
    model_ids = [f"paged-{i}-{os.urandom(4).hex()}" for i in range(models)]
    try:
        for model_id in model_ids:
            engine.create_model(model_id, LoraSpec(rank=4, seed=0)).result(60)
        for model_id in model_ids:
            engine.submit(Command(model_id, 1, Kind.FORWARD_BACKWARD, f"{model_id}:1", payload=train_input(1),
                                  tokens=32)).result(60)
    finally:
        engine.stop()
    return engine.timings, model_ids


def backend_with(base, specs: dict, **options):
    """A TorchBackend over a copy of the model ``base`` holding a fresh adapter of each of ``specs`` (model id ->
    LoraSpec)."""
    from lilo.backend.torch_backend import TorchBackend

    backend = TorchBackend(copy.deepcopy(base), **options)
    for model_id, spec in specs.items():
        backend.add_adapter(model_id, spec)
    return backend


def weighted_datum(seed: int, length: int):
    """A lilo Datum of ``length`` random tokens, each trained to predict the next, with random weights."""
    from lilo.backend.types import Datum

    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 1000, length)
    return Datum(tokens=tokens.tolist(), loss_inputs={"target_tokens": np.roll(tokens, -1).tolist(),
                                                      "weights": rng.random(length).round(2).tolist()})


def jpeg(width: int, height: int, seed: int) -> bytes:
    """A JPEG of ``width`` x ``height`` random pixels."""
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG")
    return buffer.getvalue()


def image_datum(layout, seed: int, size: tuple[int, int] = (70, 100), before: int = 5, after: int = 6):
    """A lilo Datum laid out as the cookbook's renderers lay an image out (text, vision start, the image's tokens,
    vision end, text) for a base model of image ``layout``, its image positions' targets and weights zero."""
    from lilo.backend.types import Datum, DatumImage

    rng = np.random.default_rng(seed)
    data = jpeg(*size, seed)
    count = layout.token_count(*size)
    tokens = [*rng.integers(0, 990, before), 996, *[layout.image_token_id] * count, 997, *rng.integers(0, 990, after)]
    targets = np.roll(np.asarray(tokens), -1)
    weights = rng.random(len(tokens)).round(2)
    image = slice(before + 1, before + 1 + count)
    targets[image], weights[image] = 0, 0.0
    return Datum(tokens=tokens, loss_inputs={"target_tokens": targets.tolist(), "weights": weights.tolist()},
                 images=(DatumImage(data, "jpeg", before + 1, count),))


def text_datum(seed: int, length: int = 17):
    """A lilo Datum of ``length`` random tokens below a tiny model's special ones, each weighted 1."""
    from lilo.backend.types import Datum

    tokens = np.random.default_rng(seed).integers(0, 990, length)
    return Datum(tokens=tokens.tolist(), loss_inputs={"target_tokens": np.roll(tokens, -1).tolist(),
                                                      "weights": [1.0] * length})


VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen-VL's chat layout, written small: each image part where it goes, as vision start, one image pad, vision end.
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}{% else %}{% for part in message.content %}"
    "{% if part.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part.text }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_vl_with_tokenizer(directory: Path, seed: int = 0) -> Path:
    """A tiny random Qwen3-VL with a tokenizer: SmolLM2's with Qwen-VL's four vision tokens added (their ids in the
    model's config) and a Qwen-VL-like chat template, saved as a model directory."""
    from transformers import AutoTokenizer

    from lilo.backend.families import TINY
    from lilo.backend.models import build_tiny, smollm2_directory

    tokenizer = AutoTokenizer.from_pretrained(smollm2_directory())
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    ids = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(VISION_TOKENS)))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = dict(TINY["tiny-qwen3-vl"].config["text_config"], vocab_size=len(tokenizer), eos_token_id=end)
    build_tiny(directory, "tiny-qwen3-vl", seed=seed, text_config=text, eos_token_id=end,
               vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
               image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"])
    tokenizer.save_pretrained(directory)
    return directory
