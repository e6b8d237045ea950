"""A trainer of 1 rank against trainers of 2 (and more) ranks, the frozen base sharded over them (FSDP2 per decoder
layer; ``lilo.backend.sharding``), on a private local Ray cluster: gloo processes on the CPU, NCCL on GPUs.

Each trainer serves ``--adapters`` models (ranks 8, 4, 16, 8... in turn); a step is every model's forward_backward
sent at once (coalesced into one execution, its rows split over the ranks) and then every model's optim_step. The
step time is the median of ``--steps`` timed steps after a warm-up. Per rank: ``base_mb``, the base weights it holds
(its shards and the whole embeddings and head); ``peak_mb``, its peak (the device's peak allocation on CUDA; on the
CPU the process's peak resident size, which includes loading the whole model once before sharding it). Per pass,
the bytes one follower receives or sends: FSDP's all-gathers of the layers (forward, and again in the backward),
the adapters' weights rank 0 broadcasts (those changed since the last pass: every step's) and the LoRA gradients
summed into rank 0's. ``tp_estimate_mb``: what tensor parallel would move instead for the same tokens (two
all-reduces of the hidden states per layer forward and two backward, a ring's 2 (N-1)/N of each), for the choice in
docs/design.md. Prints one JSON line:
{"bench": "sharded", "model": .., "device": .., "adapters": .., "tokens_per_step": .., "results": [{"ranks": N,
 "step_ms": .., "speedup_vs_1": .., "base_mb": [..per rank], "peak_mb": [..], "exchanged_mb_per_pass":
 {"gathered": .., "weights": .., "gradients": ..}, "tp_estimate_mb": ..}, ...], "losses_equal": ..}
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster.local import prepare_environment  # noqa: E402

prepare_environment()

import numpy as np  # noqa: E402
import ray  # noqa: E402

from cluster.local import connect_driver  # noqa: E402
from cluster.ports import free_ports  # noqa: E402
from cluster.trainer.actor import start_trainer  # noqa: E402
from cluster.trainer.config import TrainerConfig  # noqa: E402
from lilo.backend.types import AdamParams, Datum, LoraSpec, TrainInput  # noqa: E402
from lilo.engine.commands import Command, Kind  # noqa: E402
from lilo.settings import load_settings  # noqa: E402
from private_cluster import private_cluster  # noqa: E402

MODELS = {"tiny": "lilo/tiny-llama", "smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}
ADAPTER_RANKS = (8, 4, 16, 8)
MB = 2**20


def steps(actor, models: list[str], rows: int, seq: int, count: int, vocab: int) -> tuple[list[float], list]:
    """``count`` coalesced steps of every model; (each step's seconds, the first step's losses)."""
    rng = np.random.default_rng(0)
    seconds, first = [], None
    for step in range(count):
        data = {model: [_datum(rng, seq, vocab) for _ in range(rows)] for model in models}
        started = time.perf_counter()
        results = ray.get([actor.run.remote(Command(model, 2 * step + 1, Kind.FORWARD_BACKWARD, f"{model}:{step}",
                                                    payload=TrainInput(data=data[model]), tokens=rows * seq))
                           for model in models])
        ray.get([actor.run.remote(Command(model, 2 * step + 2, Kind.OPTIM_STEP, f"{model}:{step}:opt",
                                          payload=AdamParams(learning_rate=1e-3))) for model in models])
        seconds.append(time.perf_counter() - started)
        first = first or [result["metrics"]["loss:sum"] for result in results]
    return seconds, first


def _datum(rng, length: int, vocab: int) -> Datum:
    tokens = rng.integers(0, vocab, length)
    return Datum(tokens=tokens, loss_inputs={"target_tokens": np.roll(tokens, -1),
                                             "weights": np.ones(length, dtype=np.float32)})


def tp_estimate_bytes(config, tokens: int, ranks: int, dtype_bytes: int) -> int:
    """Bytes one rank sends (= receives) per training pass under tensor parallel: per layer two all-reduces of the
    (tokens, hidden) activations forward and two backward, a ring moving 2 (N - 1) / N of each."""
    per_reduce = tokens * config.hidden_size * dtype_bytes * 2 * (ranks - 1) / ranks
    return int(4 * config.num_hidden_layers * per_reduce)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="tiny, smollm2, or a model directory")
    parser.add_argument("--ranks", default="1,2", help="comma-separated rank counts, 1 first")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rows", type=int, default=4, help="sequences per adapter per step")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU per rank)")
    args = parser.parse_args()
    counts = [int(n) for n in args.ranks.split(",")]
    base_model = MODELS.get(args.model, args.model)
    port = free_ports(1)[0]
    with private_cluster("lilo/tiny-llama", port, "--trainers", "1", "--num-cpus", str(sum(counts) + 3)) as home:
        connect_driver(load_settings(home=home))
        from transformers import AutoConfig

        from lilo.backend.models import model_directory

        model_config = AutoConfig.from_pretrained(model_directory(base_model))
        config = TrainerConfig(max_adapters=args.adapters, max_rank=max(ADAPTER_RANKS), sampler_slots=1,
                               device=args.device, compute_nice=0, checkpoint_dir=home / "bench-checkpoints",
                               max_batch_tokens=args.rows * args.seq * args.adapters)
        results, losses = [], []
        for ranks in counts:
            actor = start_trainer(800 + uuid.uuid4().int % 99, base_model, config, num_cpus=1,
                                  num_gpus=1 if args.device == "cuda" else 0, ranks=ranks)
            ray.get(actor.ready.remote(), timeout=600)
            models = [f"m{k}" for k in range(args.adapters)]
            for k, model in enumerate(models):
                ray.get(actor.create_model.remote(model, LoraSpec(rank=ADAPTER_RANKS[k % len(ADAPTER_RANKS)], seed=k)))
            seconds, first = steps(actor, models, args.rows, args.seq, args.steps + 1, model_config.vocab_size)
            info = ray.get(actor.rank_info.remote())
            exchanged = info[0]["exchanged"]
            passes = max(1, exchanged.get("passes", 0))
            step_ms = 1000 * statistics.median(seconds[1:])
            results.append({
                "ranks": ranks, "step_ms": round(step_ms, 1),
                "speedup_vs_1": round(results[0]["step_ms"] / step_ms, 3) if results else 1.0,
                "base_mb": [round(rank["base_bytes"] / MB, 1) for rank in info],
                "peak_mb": [round(rank["peak_bytes"] / MB, 1) for rank in info],
                "exchanged_mb_per_pass": {kind: round(exchanged.get(kind, 0) / passes / MB, 2)
                                          for kind in ("gathered", "weights", "gradients")},
                "tp_estimate_mb": round(tp_estimate_bytes(model_config, args.adapters * args.rows * args.seq, ranks,
                                                          2 if args.device == "cuda" else 4) / MB, 2)})
            losses.append(first)
            ray.get(actor.stop.remote(), timeout=120)
            ray.kill(actor)
        equal = all(np.allclose(other, losses[0], rtol=1e-4) for other in losses[1:])
        print(json.dumps({"bench": "sharded", "model": base_model, "device": args.device, "adapters": args.adapters,
                          "tokens_per_step": args.adapters * args.rows * args.seq, "results": results,
                          "losses_equal": equal}))


if __name__ == "__main__":
    main()
