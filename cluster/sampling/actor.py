"""The sampler actors ``lilo-sampler-<i>``: one vLLM engine each with multi-LoRA (``lilo.backend.vllm_sampler``),
serving samples of one base model from the adapters published to it.

vLLM's CPU build cannot share lilo's environment (requirements-vllm.txt says why), so a sampler runs in its own
Python: Ray starts the actor's worker with the ``py_executable`` of its runtime environment, the sampler venv's
interpreter (``.venv-vllm`` beside this checkout, made by ``make .venv-vllm/.installed``, or ``$LILO_VLLM_PYTHON``),
which holds the same Ray and Python as the cluster. Where vLLM is installed in this environment itself (a GPU node's
``vllm``), the actor runs here.

This module imports neither torch nor vLLM: every process that holds a sampler's handle (the API replicas) imports
it. The actor loads its engine on a thread of its own as it starts; ``ready`` waits for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import logging
import os
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Awaitable, Sequence

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from cluster.local import NAMESPACE, ClusterError
from cluster.gpu_groups import assigned_gpu_ids, rank_group_name
from lilo.backend.types import SamplingRequest
from lilo.engine.contract import SampleResult
from lilo.errors import LiloError
from lilo.timing.traces import Carrier, parent, tracer

logger = logging.getLogger(__name__)

SAMPLER_PREFIX = "lilo-sampler-"
# The sampler environment's interpreter, when it is not the checkout's .venv-vllm (another path on every node).
VLLM_PYTHON_ENV = "LILO_VLLM_PYTHON"
CHECKOUT_VLLM_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"
# How long a sampler whose engine died waits for its last answers to leave before its process exits (Ray then
# starts it again, with no adapters: ``ready``'s incarnation changes).
DEAD_ENGINE_EXIT_S = 1.0


def sampler_name(index: int) -> str:
    return f"{SAMPLER_PREFIX}{index}"


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    max_loras: int = 4  # adapters in one batch
    max_rank: int = 32  # the highest adapter rank it takes (lilo's --max-rank)
    device: str = "auto"  # auto: the GPU Ray gave the actor, else the CPU
    gpu_fraction: float = 0.3  # of its GPU's memory, for weights and KV cache (a share of a trainer's GPU)
    kv_cache_gb: float = 1.0  # on CPU: the KV cache's memory
    threads: int | None = None  # on CPU: compute threads bound to the first CPUs (None: vLLM's own binding)
    tensor_parallel_size: int = 1  # workers the base model is split over (a sampler of a sharded base model)
    model_cache_dir: Path | None = None  # where lilo's named base models are made (lilo.backend.models)


def vllm_python() -> str | None:
    """The interpreter a sampler runs on: ``$LILO_VLLM_PYTHON``, the checkout's installed .venv-vllm, or this one
    when it has vLLM itself; None when there is none. Nothing is imported to find out."""
    configured = os.environ.get(VLLM_PYTHON_ENV)
    if configured:
        return configured
    if (CHECKOUT_VLLM_VENV / ".installed").exists():
        return str(CHECKOUT_VLLM_VENV / "bin" / "python")
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def vllm_available() -> bool:
    """Whether sampler actors can start here (a vLLM environment exists), without importing vLLM."""
    return vllm_python() is not None


def portable(outcome: Any) -> Any:
    """A result as it can cross to a process without vLLM: lilo's errors and Python's own stay as they are, any
    other exception (vLLM's) becomes a RuntimeError with its type and message."""
    if not isinstance(outcome, BaseException) or isinstance(outcome, LiloError) \
            or type(outcome).__module__ == "builtins":
        return outcome
    return RuntimeError(f"{type(outcome).__name__}: {outcome}")


@ray.remote(max_restarts=-1, max_concurrency=1000)
class SamplerActor:
    def __init__(self, name: str, base_model: str, config: SamplerConfig) -> None:
        self.name = name
        self.base_model = base_model
        self._incarnation = uuid.uuid4().hex  # which process this is: Ray restarts a dead sampler under its name
        self._tracer = tracer("sampler")
        self._loading: Future = Future()
        threading.Thread(target=self._load, args=(config,), name="lilo-sampler-load", daemon=True).start()

    def _load(self, config: SamplerConfig) -> None:
        try:
            from lilo.backend.models import model_directory
            from lilo.backend.vllm_sampler import VllmSampler

            device = config.device
            if device == "auto":
                device = "cuda" if ray.get_gpu_ids() else "cpu"
            if device == "cuda" and get_current_placement_group() is not None:
                # Beside a sharded trainer: its engine's workers take a share of each of the trainer's GPUs (set
                # before anything here initialises CUDA; vLLM's workers inherit it).
                os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(group_gpu_ids())
            self._loading.set_result(VllmSampler(
                model_directory(self.base_model, config.model_cache_dir), max_loras=config.max_loras,
                max_rank=config.max_rank, device=device, gpu_fraction=config.gpu_fraction,
                kv_cache_gb=config.kv_cache_gb, threads=config.threads,
                tensor_parallel_size=config.tensor_parallel_size))
        except BaseException as error:
            logger.exception("sampler %s could not start its engine for %s", self.name, self.base_model)
            self._loading.set_exception(portable(error))

    async def _sampler(self):
        return await asyncio.wrap_future(self._loading)

    async def ready(self) -> dict[str, Any]:
        """Waits for the engine (raises if it could not start); says what this sampler serves."""
        sampler = await self._sampler()
        return {"name": self.name, "base_model": self.base_model, "engine": "vllm",
                "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "incarnation": self._incarnation, "vocab_size": sampler.vocab_size,
                "eos_token_ids": sampler.eos_token_ids, "max_loras": sampler.max_loras,
                "max_rank": sampler.max_rank, "max_model_len": sampler.max_model_len,
                "thread_binding": sampler.thread_binding}

    async def publish(self, key: str, peft_dir: str) -> float:
        """(Re)load adapter ``key`` (a tinker:// sampler path) from its PEFT directory; the next sample of ``key``
        uses it. Returns the milliseconds the load took."""
        sampler = await self._sampler()
        start = time.perf_counter()
        if self._tracer is None:
            await sampler.load_adapter(key, peft_dir)
        else:
            with self._tracer.start_as_current_span("sampler.publish", attributes={"lilo.sampler": self.name,
                                                                                 "lilo.adapter": key}):
                await sampler.load_adapter(key, peft_dir)
        return (time.perf_counter() - start) * 1000

    async def unpublish(self, key: str) -> None:
        """Drop adapter ``key`` (its running samples finish first); NotFoundError when it is not loaded."""
        await (await self._sampler()).remove_adapter(key)

    async def adapters(self) -> list[str]:
        return (await self._sampler()).adapters()

    async def sample(self, requests: Sequence[SamplingRequest], adapters: Sequence[str | None],
                     traces: Sequence[Carrier | None] | None = None) -> list[SampleResult | Exception]:
        """Each request's samples through its adapter (None: the bare base model), or the exception that failed it
        alone: NotFoundError for an adapter not published here, InvalidRequestError for a bad request, ValueError
        for one vLLM cannot answer as the torch sampler would (``vllm_unsupported``; route those there). Concurrent
        calls share the engine's batches. ``traces``: each request's trace context, under which its span here
        goes (``lilo.timing.traces``)."""
        if len(requests) != len(adapters):
            raise ValueError(f"{len(requests)} requests but {len(adapters)} adapters; pass one adapter (or None) "
                             "per request.")
        sampler = await self._sampler()
        traces = traces or [None] * len(requests)
        outcomes = await asyncio.gather(*(self._traced(sampler.sample(request, adapter), trace, adapter, request)
                                          for request, adapter, trace in zip(requests, adapters, traces)),
                                        return_exceptions=True)
        if sampler.engine.errored:
            logger.error("sampler %s: its vLLM engine died; exiting so Ray starts it again", self.name)
            asyncio.get_running_loop().call_later(DEAD_ENGINE_EXIT_S, os._exit, 1)
        return [portable(outcome) for outcome in outcomes]

    async def _traced(self, work: Awaitable[SampleResult], trace: Carrier | None, adapter: str | None,
                      request: SamplingRequest) -> SampleResult:
        if self._tracer is None or not trace:
            return await work
        with self._tracer.start_as_current_span("sampler.sample", context=parent(trace), attributes={
                "lilo.sampler": self.name, "lilo.adapter": adapter or "", "lilo.num_samples": request.num_samples,
                "lilo.prompt_tokens": len(request.prompt), "lilo.max_tokens": request.max_tokens}):
            return await work


@ray.remote(num_cpus=0)
def bundle_gpu_id() -> str:
    """The GPU this task was given a share of."""
    return assigned_gpu_ids()[0]


def group_gpu_ids(timeout_s: float = 120.0) -> list[str]:
    """The GPUs of the sharded trainer whose placement group this process shares from its first bundle, in rank
    order: its own, then, for each further bundle, the one a task on the share of it the rank there left (this
    process's share) is given. Ray hands out no other way which GPU a bundle holds."""
    placement = get_current_placement_group()
    share = ray.get_runtime_context().get_assigned_resources().get("GPU", 0.0)
    further = [bundle_gpu_id.options(num_gpus=share, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement, placement_group_bundle_index=index)).remote() for index in range(1, placement.bundle_count)]
    return assigned_gpu_ids() + ray.get(further, timeout=timeout_s)


def sampler_strategy(node_id: str | None, group_of: str | None) -> Any:
    """Where a sampler runs: anywhere; on ``node_id`` only (beside its trainer); or, with ``group_of``, in the
    first bundle of that sharded trainer's placement group (each bundle a whole GPU whose rank left it a share),
    so it goes where the group goes and no other actor takes the shares."""
    if group_of is not None:
        return PlacementGroupSchedulingStrategy(ray.util.get_placement_group(rank_group_name(group_of)),
                                                placement_group_bundle_index=0)
    return "DEFAULT" if node_id is None else NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


def start_sampler(index: int, base_model: str, config: SamplerConfig, *, num_gpus: float = 0,
                  num_cpus: float = 1, node_id: str | None = None,
                  group_of: str | None = None) -> ray.actor.ActorHandle:
    """A named, detached sampler (``lilo-sampler-<index>`` in namespace ``lilo``) on the sampler environment's
    interpreter; it loads its engine as it starts (``ready`` waits for it). ``num_gpus`` may be a fraction: a
    share of a trainer's GPU. With ``node_id`` it lives on that node only (beside its trainer); with ``group_of``
    (a sharded trainer, started first) on a share of each of that trainer's GPUs, its engine tensor parallel over
    them (``sampler_strategy``)."""
    python = vllm_python()
    if python is None:
        raise ClusterError("vLLM is not installed here; run `make .venv-vllm/.installed` (or set "
                           f"{VLLM_PYTHON_ENV} to a Python that has vllm and Ray 2.60.0) to start sampler actors.")
    runtime_env = {} if python == sys.executable else {"py_executable": python}
    strategy = sampler_strategy(node_id, group_of)
    if group_of is not None:
        num_cpus = 0  # the group's bundles hold its ranks' CPUs; vLLM's workers are processes of this one
    return SamplerActor.options(name=sampler_name(index), namespace=NAMESPACE, lifetime="detached",
                                num_gpus=num_gpus, num_cpus=num_cpus, scheduling_strategy=strategy,
                                runtime_env=runtime_env).remote(sampler_name(index), base_model, config)
