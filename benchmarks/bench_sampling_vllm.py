"""vLLM's half of the sampling bench: one workload on a vLLM engine with multi-LoRA (lilo.backend.vllm_sampler),
in this process. Prints ONE JSON line:

- ``vllm_tok_s``: sampled tokens per second over the whole workload (every prompt's samples in flight at once),
  the median of 3 passes after a warm-up pass;
- ``vllm_threads``: the compute threads' CPU binding (``VLLM_CPU_OMP_THREADS_BIND``);
- ``vllm_load_s``: the engine's start, model load included;
- ``publish_ms``: from publishing a fresh PEFT directory (new files under a key already in use, as a save does)
  to the first sampled token of the next sample through it, the median of 5; ``publish_load_ms`` the load alone;
- ``sequences``: a JSON file of one pass at temperature 1 (``[{"prompt_index", "tokens", "logprobs"}]``), for
  the torch side to score the same tokens (``logprob_diff``).

``--workload PATH`` (benchmarks/bench_sampling.py writes it): ``{"model_dir", "prompts" (token ids), "adapter_dirs"
(PEFT directories), "prompt_adapter" (an adapter index per prompt, -1: the bare base model), "num_samples",
"max_tokens", "temperature", "seeds" (one per prompt, or null)}``. Without it, the issue's workload on SmolLM2 with
adapters of random weights: 32 prompts x 4 samples x 64 tokens over 4 rank-8 adapters, fp32.

Runs on the vLLM environment: started with another Python, it runs itself again on ``.venv-vllm``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def default_workload(directory: Path) -> dict[str, Any]:
    """The issue's workload: SmolLM2, 32 prompts of 32 tokens, 4 samples x 64 tokens each, over 4 rank-8 adapters
    (every projection of attention and MLP, random weights) written as save_weights_for_sampler writes them."""
    import numpy as np
    import torch
    from transformers import AutoConfig

    from lilo.backend.checkpoints.state import AdapterState, write_peft
    from lilo.backend.families import ATTENTION_PROJECTIONS, MLP_PROJECTIONS
    from lilo.backend.models import model_directory
    from lilo.backend.registry import DEFAULT_BASE_MODEL
    from lilo.backend.types import LoraSpec

    model_dir = model_directory(DEFAULT_BASE_MODEL)
    config = AutoConfig.from_pretrained(model_dir)
    hidden, head_dim = config.hidden_size, config.hidden_size // config.num_attention_heads
    shapes = {"q_proj": (hidden, config.num_attention_heads * head_dim),
              "k_proj": (hidden, config.num_key_value_heads * head_dim),
              "v_proj": (hidden, config.num_key_value_heads * head_dim),
              "o_proj": (config.num_attention_heads * head_dim, hidden),
              "gate_proj": (hidden, config.intermediate_size), "up_proj": (hidden, config.intermediate_size),
              "down_proj": (config.intermediate_size, hidden)}
    generator = torch.Generator().manual_seed(0)
    adapter_dirs = []
    for index in range(4):
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for name in ATTENTION_PROJECTIONS + MLP_PROJECTIONS:
                part = "self_attn" if name in ATTENTION_PROJECTIONS else "mlp"
                fan_in, fan_out = shapes[name]
                path = f"model.layers.{layer}.{part}.{name}"
                tensors[f"{path}.lora_A"] = torch.randn(8, fan_in, generator=generator) / fan_in ** 0.5
                tensors[f"{path}.lora_B"] = torch.randn(fan_out, 8, generator=generator) * 0.02
        target = directory / f"adapter-{index}"
        write_peft(AdapterState(LoraSpec(rank=8, train_unembed=False), tensors), target, DEFAULT_BASE_MODEL)
        adapter_dirs.append(str(target))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, 32).tolist() for _ in range(32)]
    return {"model_dir": str(model_dir), "prompts": prompts, "adapter_dirs": adapter_dirs,
            "prompt_adapter": [index % 4 for index in range(32)], "num_samples": 4, "max_tokens": 64,
            "temperature": 1.0, "seeds": list(range(32))}


async def measure(workload: dict[str, Any], threads: int, out_dir: Path) -> dict[str, Any]:
    from lilo.backend.types import SamplingRequest
    from lilo.backend.vllm_sampler import VllmSampler, peft_rank

    adapter_dirs = workload["adapter_dirs"]
    # The engine holds the workload's ranks: on CPU vLLM's LoRA cost grows with its padded max rank.
    max_rank = max(peft_rank(Path(directory)) for directory in adapter_dirs)
    start = time.perf_counter()
    sampler = await asyncio.to_thread(VllmSampler, Path(workload["model_dir"]), max_loras=len(adapter_dirs) + 1,
                                      max_rank=max_rank, kv_cache_gb=1.0, threads=threads)
    load_s = time.perf_counter() - start
    keys = [f"adapter-{index}" for index in range(len(adapter_dirs))]
    for key, directory in zip(keys, adapter_dirs):
        await sampler.load_adapter(key, directory)
    seeds = workload.get("seeds") or [None] * len(workload["prompts"])

    def requests(temperature: float, max_tokens: int) -> list[tuple[SamplingRequest, str | None]]:
        return [(SamplingRequest(prompt=prompt, max_tokens=max_tokens, num_samples=workload["num_samples"],
                                 temperature=temperature, seed=seed), keys[adapter] if adapter >= 0 else None)
                for prompt, adapter, seed in zip(workload["prompts"], workload["prompt_adapter"], seeds)]

    async def run(batch) -> tuple[float, list]:
        began = time.perf_counter()
        results = await asyncio.gather(*(sampler.sample(request, adapter) for request, adapter in batch))
        tokens = sum(len(sequence["tokens"]) for result in results for sequence in result["sequences"])
        rate = tokens / (time.perf_counter() - began)
        print(f"{tokens} tokens at {rate:.1f} tok/s", file=sys.stderr, flush=True)
        return rate, results

    try:
        await run(requests(workload["temperature"], 8))  # warm-up
        passes = [await run(requests(workload["temperature"], workload["max_tokens"])) for _ in range(3)]
        at_one = passes[0][1] if workload["temperature"] == 1.0 else \
            (await run(requests(1.0, workload["max_tokens"])))[1]
        sequences = [{"prompt_index": index, "tokens": sequence["tokens"], "logprobs": sequence["logprobs"]}
                     for index, result in enumerate(at_one) for sequence in result["sequences"]]
        sequences_path = out_dir / "vllm_sequences.json"
        sequences_path.write_text(json.dumps(sequences))
        publish, load = [], []
        probe = SamplingRequest(prompt=workload["prompts"][0], max_tokens=1, temperature=0.0)
        for attempt in range(5):
            fresh = out_dir / f"published-{attempt}"
            shutil.copytree(adapter_dirs[0], fresh)
            began = time.perf_counter()
            await sampler.load_adapter("published", fresh)
            load.append((time.perf_counter() - began) * 1000)
            await sampler.sample(probe, "published")
            publish.append((time.perf_counter() - began) * 1000)
    finally:
        sampler.shutdown()
    return {"vllm_tok_s": round(statistics.median(rate for rate, _ in passes), 1),
            "vllm_threads": sampler.thread_binding, "vllm_max_rank": max_rank, "vllm_load_s": round(load_s, 1),
            "publish_ms": round(statistics.median(publish), 1), "publish_load_ms": round(statistics.median(load), 1),
            "sequences": str(sequences_path)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", type=Path, help="the workload JSON (default: the issue's, made here)")
    parser.add_argument("--threads", type=int, default=2, help="compute threads, bound to the first CPUs")
    parser.add_argument("--out-dir", type=Path, help="where the sequences file goes (default: beside the workload "
                        "file, or a new temp dir)")
    args = parser.parse_args()
    if importlib.util.find_spec("vllm") is None:
        from cluster.sampling.actor import vllm_python

        python = vllm_python()
        if python is None:
            sys.exit("vLLM is not installed; run `make .venv-vllm/.installed` first.")
        os.execv(python, [python, *sys.argv])
    out_dir = args.out_dir or (args.workload.with_name(args.workload.stem + "-vllm") if args.workload
                               else Path(tempfile.mkdtemp(prefix="bench-sampling-vllm-")))
    out_dir.mkdir(parents=True, exist_ok=True)
    # vLLM and its engine processes log to stdout: everything but the one JSON line goes to stderr.
    result_stream = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    workload = json.loads(args.workload.read_text()) if args.workload else default_workload(out_dir)
    result = asyncio.run(measure(workload, args.threads, out_dir))
    print(json.dumps(result), file=result_stream, flush=True)


if __name__ == "__main__":
    main()
