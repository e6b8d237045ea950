"""Real tokens per second and peak memory of an RL-shaped coalesced step, packed vs padded, in one run.

The step is ``--clients`` clients' forward_backward requests (``importance_sampling``, one adapter each, rank 16),
``--rows`` datums each, a prompt of ``--prompt`` tokens and a completion drawn log-normal (median ``--median``,
capped at ``--cap``), as ``bench_padding.py`` draws them, all coalesced into one ``TorchBackend.forward_backward``
under a pass budget of ``--budget`` tokens. Each layout runs in a process of its own (``--worker``), which loads the
model, runs one step to warm up, then ``--steps`` steps, while a thread samples its RSS every 2 ms: ``tokens_per_s``
is the step's real tokens over its median time (the warm-up's left out), ``peak_mb`` the highest RSS during all of
them less the RSS before, ``computed_share`` the real tokens over those the passes computed. ``--model``: ``tiny``
(lilo/tiny-llama) or ``smollm2`` (SmolLM2-135M, the demo's base). ``attention_ms``: one attention layer (the model's
heads, fp32) over the first packed pass's stream, as packed passes run it (causal SDPA per sequence) and with one
block-diagonal mask over the whole stream (the alternative on a CPU without varlen kernels), median of 3.
Prints one JSON line:
{"bench": "packing", "model": .., "real_tokens": .., "padded": {...}, "packed": {...}, "speedup": ..,
 "peak_ratio": .., "attention_ms": {"tokens": .., "sequences": .., "per_sequence": .., "block_mask": ..}}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from peak_rss import PeakRss


def run_worker(layout: str, args: argparse.Namespace) -> dict:
    environment = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    command = [sys.executable, __file__, "--worker", layout, *sys.argv[1:]]
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"the {layout} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def step_lengths(args: argparse.Namespace) -> list[list[int]]:
    """Each client's datum lengths (bench_padding's draw)."""
    import numpy as np

    rng = np.random.default_rng(0)
    drawn = np.minimum(rng.lognormal(np.log(args.median), 0.8, args.clients * args.rows).astype(int) + 1, args.cap)
    lengths = (args.prompt + drawn).tolist()
    return [lengths[n * args.rows:(n + 1) * args.rows] for n in range(args.clients)]


def load(model: str):
    from lilo.backend.models import build_tiny, load_base_model, smollm2_directory

    if model == "smollm2":
        return load_base_model(smollm2_directory())
    return load_base_model(build_tiny(Path(tempfile.mkdtemp(prefix="bench-packing-")), "tiny-llama", seed=1))


def worker(layout: str, args: argparse.Namespace) -> None:
    import numpy as np
    import torch

    from lilo.backend.torch_backend import TorchBackend
    from lilo.backend.types import Datum, LoraSpec, TrainInput
    from lilo.engine.commands import Command, Kind

    torch.manual_seed(0)
    backend = TorchBackend(load(args.model), max_adapters=args.clients, max_rank=16, max_batch_tokens=args.budget,
                           pack=layout == "packed")
    rng = np.random.default_rng(1)
    for n in range(args.clients):
        backend.add_adapter(f"client{n}", LoraSpec(rank=16, seed=n))

    def datum(length: int) -> Datum:
        tokens = rng.integers(0, backend.vocab_size, length + 1)
        return Datum(tokens=tokens[:-1], loss_inputs={
            "target_tokens": tokens[1:], "logprobs": -rng.random(length).astype(np.float32),
            "advantages": rng.normal(size=length).astype(np.float32)})

    def step(seq: int, lengths: list[list[int]]) -> list[Command]:
        return [Command(f"client{n}", seq, Kind.FORWARD_BACKWARD, f"c{n}:{seq}",
                        payload=TrainInput(data=[datum(length) for length in mine], loss_fn="importance_sampling"))
                for n, mine in enumerate(lengths)]

    lengths = step_lengths(args)
    rows = [row for mine in lengths for row in mine]
    seconds = []
    with PeakRss() as peak:
        backend.forward_backward(step(0, lengths), forward_only=False)  # warm-up: the allocator's pools grow to size
        for seq in range(1, args.steps + 1):
            commands = step(seq, lengths)
            started = time.perf_counter()
            results = backend.forward_backward(commands, forward_only=False)
            seconds.append(time.perf_counter() - started)
            failed = [r for r in results if isinstance(r, Exception)]
            if failed:
                raise RuntimeError(f"a step failed: {failed[0]}")
    from lilo.backend.sharding.plans import TrainRow

    train_rows = [TrainRow(0, 0, Datum(tokens=np.zeros(n), loss_inputs={}), "cross_entropy", {}) for n in rows]
    passes = [part for parts in backend._passes(train_rows) for part in parts]
    computed = sum(backend._pass_tokens(part) for part in passes)
    median = statistics.median(seconds)
    print(json.dumps({"passes": len(passes), "computed_share": round(sum(rows) / computed, 3),
                      "seconds": round(median, 2), "tokens_per_s": round(sum(rows) / median, 1),
                      "peak_mb": round(peak.mb, 1)}))


# (attention heads, head dim) of each model.
HEADS = {"tiny": (4, 64), "smollm2": (9, 64)}


def attention_ms(args: argparse.Namespace) -> dict:
    """One attention layer over the first packed pass's stream: per sequence against one block-diagonal mask."""
    import torch

    from lilo.backend.training.packing import packed_bins

    lengths = [length for mine in step_lengths(args) for length in mine]
    sequences = [lengths[i] for i in packed_bins(lengths, args.budget)[0]]
    tokens = sum(sequences)
    heads, dim = HEADS[args.model]
    torch.manual_seed(0)
    query, key, value = (torch.randn(1, heads, tokens, dim) for _ in range(3))
    owner = torch.repeat_interleave(torch.arange(len(sequences)), torch.tensor(sequences))
    position = torch.arange(tokens)
    mask = ((owner[:, None] == owner[None, :]) & (position[:, None] >= position[None, :]))[None, None]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def per_sequence() -> torch.Tensor:
        ends = torch.tensor(sequences).cumsum(0).tolist()
        return torch.cat([sdpa(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True)
                          for a, b in zip([0, *ends[:-1]], ends)], dim=2)

    def block_mask() -> torch.Tensor:
        return sdpa(query, key, value, attn_mask=mask)

    if not torch.allclose(per_sequence(), block_mask(), atol=1e-5):
        raise RuntimeError("per-sequence and block-mask attention disagree")
    timed = {}
    for name, run in (("per_sequence", per_sequence), ("block_mask", block_mask)):
        times = []
        for _ in range(3):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        timed[name] = round(statistics.median(times) * 1000, 1)
    return {"tokens": tokens, "sequences": len(sequences), **timed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=150)
    parser.add_argument("--median", type=int, default=600)
    parser.add_argument("--cap", type=int, default=4096)
    parser.add_argument("--budget", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", choices=("padded", "packed"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args)
        return
    results = {layout: run_worker(layout, args) for layout in ("padded", "packed")}
    real = sum(sum(mine) for mine in step_lengths(args))
    print(json.dumps({"bench": "packing", "model": args.model, "clients": args.clients, "rows": args.rows,
                      "budget": args.budget, "real_tokens": real, **results,
                      "speedup": round(results["packed"]["tokens_per_s"] / results["padded"]["tokens_per_s"], 2),
                      "peak_ratio": round(results["packed"]["peak_mb"] / max(results["padded"]["peak_mb"], 0.1),
                                          2),
                      "attention_ms": attention_ms(args)}))


if __name__ == "__main__":
    main()
