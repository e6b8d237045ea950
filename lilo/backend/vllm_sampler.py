"""Sampling on vLLM: one engine with multi-LoRA over a base model, answering lilo's ``SamplingRequest`` the way the
torch sampler (``lilo.backend.sampling``) does, for the requests it can answer so.

``vllm_unsupported`` says, without vLLM, which requests those are: vLLM reports the sampled tokens' logprobs under
the temperature-scaled distribution only while no top-k or top-p filter is on (its ``processed_logprobs`` are taken
after the filter, renormalized; its raw ones before the temperature), stops on single tokens only, samples at least
one token, and has no prompt-position draws or target logprobs. Nor does it score prompts right with LoRA on: vLLM
0.32 maps each request of a step to its adapter for the output head, but a prompt's logits have a row per prompt
position, so with two requests in a step the engine dies (``einsum(): subscript b has size 2 ... size 4``), and
where the counts happen to agree rows would get another's adapter. So every request that scores its prompt goes to
the torch sampler.

``VllmSampler`` owns the engine (vLLM's ``AsyncLLM``: continuous batching, so concurrent ``sample`` calls share its
batches) and the adapters published to it: each key maps to the PEFT directory it was last published from, loaded
under a fresh LoRA id, so the next sample of the key uses the new weights, and a sample already running continues on
them from its next token (its request on the old version is aborted, and one on the new continues from the tokens
so far); the old version is dropped once nothing runs on it. This module imports neither torch nor vLLM until an
engine is made.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import uuid
from pathlib import Path
from typing import Any

from lilo.backend.types import SamplingRequest
from lilo.engine.contract import SampledSequence, SampleResult, TopK
from lilo.errors import InvalidRequestError, NotFoundError

# vLLM samples greedily below this temperature (vllm.sampling_params._SAMPLING_EPS); lilo only at 0.
VLLM_GREEDY_BELOW = 1e-5
# The most top-k logprobs vLLM returns per position (its max_logprobs default; lilo's MAX_TOPK is the same).
MAX_LOGPROBS = 20
# Sequences in one engine step (vLLM's default for its LLM class on CPU): the workload has 128 in flight.
MAX_SEQUENCES = 256
# Tokens in one engine step, at least (a whole prompt of the model's context must fit: prefills are not chunked).
MIN_STEP_TOKENS = 2048
# How long one engine step may take before vLLM declares its engine dead (its default is 300 s). On CPU, LoRA
# gathers every token's A and B at the padded max rank, so a prefill of thousands of tokens on a busy machine
# can take minutes.
STEP_TIMEOUT_S = "1800"
PEFT_CONFIG = "adapter_config.json"
STOP, LENGTH = "stop", "length"


def vllm_unsupported(request: SamplingRequest, max_model_len: int | None = None) -> str | None:
    """None when vLLM answers ``request`` as the torch sampler would (same meaning: the same greedy tokens, logprobs
    under the same distribution, the same stops); else a short reason to log as the request goes to the torch
    sampler. ``max_model_len``: the engine's context, when known."""
    if request.images:
        return "images (lilo hands vLLM token prompts only; the torch sampler runs the vision tower)"
    if request.target_prompt_logprobs is not None:
        return "target_prompt_logprobs"
    if request.prompt_alt_tokens_k:
        return "prompt_alt_tokens_k"
    if request.prompt_logprobs or request.topk_prompt_logprobs:
        return "prompt_logprobs (vLLM 0.32 routes a prompt's logits through the wrong adapters)"
    if request.max_tokens < 1:
        return "max_tokens=0 (prompt scoring only)"
    if 0 < request.temperature < VLLM_GREEDY_BELOW:
        return f"temperature below {VLLM_GREEDY_BELOW} (vLLM samples greedily there)"
    if request.temperature > 0 and (request.top_k > 0 or request.top_p < 1):
        return "top_k/top_p with temperature > 0 (vLLM's logprobs would be the filtered ones)"
    if any(len(stop) > 1 for stop in request.stop):
        return "a stop sequence of several tokens"
    if request.topk_sample_logprobs > MAX_LOGPROBS:
        return f"more than {MAX_LOGPROBS} top-k logprobs"
    if max_model_len is not None and len(request.prompt) + request.max_tokens > max_model_len:
        return f"prompt and max_tokens beyond vLLM's context of {max_model_len}"
    return None


def sample_seed(seed: int | None, sample_index: int) -> int | None:
    """Sample k of a request draws from its own seed, derived as the torch sampler derives its streams."""
    return None if seed is None else (seed * 1_000_003 + sample_index) % 2**63


def sampling_params_of(request: SamplingRequest, sample_index: int) -> dict[str, Any]:
    """vLLM ``SamplingParams`` keywords for sample ``sample_index`` of ``request`` (one vLLM request per sample, so
    each has its own seed)."""
    params: dict[str, Any] = {
        "n": 1, "max_tokens": request.max_tokens, "temperature": request.temperature,
        "seed": sample_seed(request.seed, sample_index),
        # lilo's stops are explicit (the end-of-sequence token is in them unless the client said otherwise).
        "ignore_eos": True, "stop_token_ids": [stop[0] for stop in request.stop if stop],
        "logprobs": request.topk_sample_logprobs,
        "detokenize": bool(request.stop_strings), "skip_special_tokens": False,
    }
    if request.temperature > 0:
        params.update(top_k=request.top_k if request.top_k > 0 else 0, top_p=request.top_p)
    if request.stop_strings:
        params.update(stop=list(request.stop_strings), include_stop_str_in_output=True)
    return params


def _ranked(position: dict[int, Any], k: int) -> TopK:
    """The k likeliest of one position's vLLM logprobs (``{token: Logprob}``, ranks from 1), likeliest first."""
    ranked = sorted((entry.rank, token, entry.logprob) for token, entry in position.items()
                    if entry.rank is not None and entry.rank <= k)
    return [(token, logprob) for _, token, logprob in ranked]


def sequence_of(stretches: list[Any], topk: int) -> SampledSequence:
    """A sample's vLLM ``CompletionOutput``s as lilo's sampled sequence: one, or one per version of its adapter it
    ran on (each continuing the tokens of the ones before), their tokens and logprobs end to end."""
    reason = stretches[-1].finish_reason
    if reason not in (STOP, LENGTH):
        raise RuntimeError(f"vLLM ended a sample with {reason!r}.")
    tokens = [token for stretch in stretches for token in stretch.token_ids]
    positions = [position for stretch in stretches for position in stretch.logprobs]
    sequence: SampledSequence = {
        "tokens": tokens, "logprobs": [position[token].logprob for position, token in zip(positions, tokens)],
        "stop_reason": reason}
    if topk:
        sequence["topk_logprobs"] = [_ranked(position, topk) for position in positions]
    return sequence


def peft_rank(peft_dir: Path) -> int:
    """The rank of the PEFT adapter in ``peft_dir``; InvalidRequestError when it holds none, or one that trains
    fused MoE experts (PEFT's ``target_parameters``), which lilo does not hand to vLLM (vLLM 0.32's MoE LoRA layers
    are Triton kernels, and on the CPU the first step with one kills the engine; docs/design.md): the trainer's
    torch sampler answers its samples."""
    try:
        config = json.loads((peft_dir / PEFT_CONFIG).read_text())
        rank = int(config["r"])
    except (FileNotFoundError, NotADirectoryError, KeyError, ValueError) as error:
        raise InvalidRequestError(f"{peft_dir} holds no PEFT LoRA adapter ({error}); publish a directory "
                                  "save_weights_for_sampler wrote.") from None
    if config.get("target_parameters"):
        experts = ", ".join(config["target_parameters"])
        raise InvalidRequestError(f"The adapter in {peft_dir} trains fused MoE experts ({experts}), which lilo does "
                                  "not load into vLLM yet; the torch sampler answers it.")
    return rank


def context_length(model_dir: Path) -> int:
    """The base model's context (its config's ``max_position_embeddings``), as vLLM takes it by default."""
    return int(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])


def cpu_binding(threads: int | None, ranks: int = 1) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND``: vLLM's own choice (``auto``: on x86 it keeps a core for its scheduler, so
    one compute thread on two cores) or the first ``threads`` CPUs this process may run on for each of ``ranks``
    tensor-parallel workers (``|`` between the workers' CPUs). Several workers on one NUMA node need the latter
    (vLLM's ``auto`` binds one node a worker): without ``threads`` they share this process's CPUs evenly."""
    if threads is None and ranks == 1:
        return "auto"
    allowed = sorted(os.sched_getaffinity(0))
    threads = threads or max(1, len(allowed) // ranks)
    if not 1 <= threads * ranks <= len(allowed):
        raise ValueError(f"threads={threads} for each of {ranks} worker(s), but this process may run on "
                         f"{len(allowed)} CPUs.")
    return "|".join(",".join(str(cpu) for cpu in allowed[rank * threads:(rank + 1) * threads])
                    for rank in range(ranks))


def tensor_parallel(workers: int) -> dict:
    """Engine arguments splitting the base model's layers over ``workers`` processes of this one (on the GPUs Ray
    gave it): a sampler of a base model a trainer shards over that many devices. None for one."""
    return {"tensor_parallel_size": workers, "distributed_executor_backend": "mp"} if workers > 1 else {}


@dataclasses.dataclass
class _Version:
    """One published version of an adapter: its LoRA request and the samples using it now."""

    lora: Any  # vllm.lora.request.LoRARequest
    running: int = 0
    retired: bool = False  # superseded by a newer publish: removed from the engine once no sample uses it


class VllmSampler:
    """A vLLM engine over the base model in ``model_dir`` with up to ``max_loras`` adapters per batch, each of rank
    up to ``max_rank``. Construction loads the model (tens of seconds; call it off the event loop); every other
    method runs on the event loop that uses the engine."""

    def __init__(self, model_dir: Path, *, max_loras: int, max_rank: int, device: str = "cpu",
                 gpu_fraction: float = 0.9, kv_cache_gb: float = 1.0, threads: int | None = None,
                 prefix_caching: bool = True, tensor_parallel_size: int = 1) -> None:
        cpu = device == "cpu"
        memory = ({"kv_cache_memory_bytes": int(kv_cache_gb * 2**30)} if cpu
                  else {"gpu_memory_utilization": gpu_fraction})
        # Read by vLLM's engine processes, which inherit this environment when the engine starts below.
        os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", STEP_TIMEOUT_S)
        if cpu:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(threads, tensor_parallel_size)
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.model_dir = Path(model_dir)
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.has_tokenizer = (self.model_dir / "tokenizer_config.json").exists()
        args = AsyncEngineArgs(
            model=str(self.model_dir), skip_tokenizer_init=not self.has_tokenizer,
            # fp32 on CPU: the parity of sampled and trained logprobs holds to 1e-3 there.
            dtype="float32" if cpu else "auto", enforce_eager=cpu,
            enable_lora=True, max_loras=max_loras, max_lora_rank=max_rank,
            # Keep more adapters loaded than one batch uses: the others are read again from their PEFT files.
            max_cpu_loras=4 * max_loras,
            logprobs_mode="processed_logprobs", max_logprobs=MAX_LOGPROBS,
            enable_prefix_caching=prefix_caching,
            # vLLM 0.32 on CPU dies ("CPU Generator does not use offset") when it discards the token of a seeded
            # request whose prefill was cut into chunks: it rewinds the request's generator, which CPU generators
            # cannot. Whole prefills only, so no step samples a token it discards.
            enable_chunked_prefill=False, max_num_seqs=MAX_SEQUENCES,
            max_num_batched_tokens=max(MIN_STEP_TOKENS, context_length(self.model_dir)),
            **memory, **tensor_parallel(tensor_parallel_size))
        self.engine = AsyncLLM.from_engine_args(args)
        model_config = self.engine.model_config
        self.vocab_size: int = model_config.get_vocab_size()
        self.max_model_len: int = model_config.max_model_len
        eos = getattr(model_config.hf_config, "eos_token_id", None)
        self.eos_token_ids: list[int] = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.thread_binding = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "") if cpu else ""
        self._versions: dict[str, _Version] = {}
        self._lora_ids = itertools.count(1)
        self._decode = self._decoder() if self.has_tokenizer else None

    def _decoder(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_dir).decode

    # --- adapters ------------------------------------------------------------------------------------------
    async def load_adapter(self, key: str, peft_dir: str | Path) -> None:
        """(Re)load the adapter ``key`` from its PEFT directory: the next sample of ``key`` uses these weights, and
        samples of its previous version already running continue on them from their next token (``_generate``); the
        previous version is dropped once none runs on it."""
        from vllm.lora.request import LoRARequest

        directory = Path(peft_dir)
        rank = peft_rank(directory)
        if rank > self.max_rank:
            raise InvalidRequestError(f"The adapter {key!r} has rank {rank}; this sampler holds ranks up to "
                                      f"{self.max_rank}.")
        lora_id = next(self._lora_ids)
        # vLLM tells LoRA requests apart by name, so every version has its own.
        lora = LoRARequest(lora_name=f"{key}#{lora_id}", lora_int_id=lora_id, lora_path=str(directory))
        try:
            await self.engine.add_lora(lora)
        except Exception as error:
            raise InvalidRequestError(f"vLLM could not load the adapter {key!r} from {directory}: {error}") from None
        old = self._versions.get(key)
        self._versions[key] = _Version(lora)
        if old is not None:
            old.retired = True
            await self._drop_if_idle(old)

    async def remove_adapter(self, key: str) -> None:
        """Forget ``key`` (its running samples finish first); NotFoundError when it is not loaded."""
        version = self._versions.pop(key, None)
        if version is None:
            raise NotFoundError(f"No adapter {key!r} is loaded on this sampler.")
        version.retired = True
        await self._drop_if_idle(version)

    async def _drop_if_idle(self, version: _Version) -> None:
        if version.retired and version.running == 0:
            await self.engine.remove_lora(version.lora.lora_int_id)

    def has_adapter(self, key: str) -> bool:
        return key in self._versions

    def adapters(self) -> list[str]:
        return sorted(self._versions)

    # --- sampling ------------------------------------------------------------------------------------------
    def check(self, request: SamplingRequest) -> None:
        """Raise what the torch sampler raises for a bad request (InvalidRequestError), and refuse (ValueError) a
        request vLLM cannot answer as it would: the caller routes those to the torch sampler."""
        from lilo.backend.sampling import validate

        validate(request, self.vocab_size, self._decode)
        reason = vllm_unsupported(request, self.max_model_len)
        if reason is not None:
            raise ValueError(f"vLLM cannot answer this request as the torch sampler would ({reason}); sample it "
                             "on the torch sampler.")

    async def sample(self, request: SamplingRequest, adapter: str | None) -> SampleResult:
        """``request``'s samples through the adapter ``adapter`` (None: the bare base model). Runs in the engine's
        continuous batches with every other sample in flight."""
        self.check(request)
        if adapter is not None and adapter not in self._versions:
            raise NotFoundError(f"The adapter {adapter!r} is not loaded on this sampler; publish it first.")
        stretches = await asyncio.gather(*(self._generate(request, k, adapter) for k in range(request.num_samples)))
        return {"sequences": [sequence_of(found, request.topk_sample_logprobs) for found in stretches]}

    async def _generate(self, request: SamplingRequest, sample_index: int, adapter: str | None) -> list[Any]:
        """Sample ``sample_index`` of ``request`` through the latest version of ``adapter``: its ``CompletionOutput``,
        or, when a newer version is published while it generates (an inflight checkpoint saved again), one per
        version, each continuing from the tokens before (its prompt and them prefilled again, mostly from the
        prefix cache) as the torch sampler continues on a slot's new weights."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompt, left, stretches = list(request.prompt), request.max_tokens, []
        version = self._versions[adapter] if adapter is not None else None
        while True:
            final, newer = None, None
            if version is not None:
                version.running += 1
            stream = self.engine.generate(TokensPrompt(prompt_token_ids=prompt), SamplingParams(
                **{**sampling_params_of(request, sample_index), "max_tokens": left}), uuid.uuid4().hex,
                lora_request=version.lora if version is not None else None)
            try:
                async for output in stream:
                    final = output
                    latest = self._versions.get(adapter) if adapter is not None else None
                    if latest is not None and latest is not version and not output.finished:
                        newer = latest
                        break
            finally:
                await stream.aclose()  # a stream left early aborts its request in the engine
                if version is not None:
                    version.running -= 1
                    await self._drop_if_idle(version)
            if final is None or (newer is None and not final.finished):
                raise RuntimeError("vLLM returned no finished sample.")
            stretches.append(final.outputs[0])
            if newer is None:
                return stretches
            generated = list(final.outputs[0].token_ids)
            prompt, left, version = prompt + generated, left - len(generated), newer

    def shutdown(self) -> None:
        self.engine.shutdown()
        self.engine = None  # its own __del__ shuts it down again now, not at interpreter exit when that fails
