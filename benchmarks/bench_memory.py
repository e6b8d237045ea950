"""A trainer's peak memory per forward_backward pass against the tokens in it, on SmolLM2, for this checkout and
optionally another (``--before PATH``, e.g. a worktree of the commit before), in one run.

Each measurement is a process of its own (``--worker``) that loads the model into a ``TorchBackend`` as a trainer
does, adds one adapter (rank 8, attention and MLP), runs a small warm-up step, then one ``forward_backward`` while a
thread samples its RSS every 2 ms; ``peak_mb`` is the highest RSS during the request less the RSS before it, and
``mb_per_token`` that over the padded tokens of the request's largest pass. The worker caps its own memory
(``RLIMIT_DATA``, ``--cap-gb``, default 12) so that a pass that would take the machine's memory fails instead
(``"out_of_memory": true``, with the peak it had reached).
Cases:
- ``pass``: one pass of ``rows`` x ``seq`` tokens (the budget set to exactly that), for each of ``--passes``;
- ``long_row``: one sequence of ``--long-row`` tokens under a budget of a quarter of it (a lone row past the budget;
  recomputed where the checkout recomputes);
- ``guess_number``: multiplayer_rl.guess_number's first request, 40 datums of 500 tokens, under the budget a trainer
  sizes by default on this machine.
Prints one JSON line:
{"bench": "memory", "model": "smollm2", "estimate_mb_per_token": .., "results": {"now": [{"case": .., "rows": ..,
 "seq": .., "budget": .., "pass_tokens": .., "peak_mb": .., "mb_per_token": .., "seconds": .., "out_of_memory": ..},
 ...], "before": [...]}}
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from peak_rss import PeakRss

GUESS_NUMBER = (40, 500)


def cases(args: argparse.Namespace) -> list[dict]:
    listed = []
    for shape in args.passes.split(","):
        rows, seq = (int(n) for n in shape.split("x"))
        listed.append({"case": "pass", "rows": rows, "seq": seq, "budget": rows * seq})
    listed.append({"case": "long_row", "rows": 1, "seq": args.long_row, "budget": args.long_row // 4})
    listed.append({"case": "guess_number", "rows": GUESS_NUMBER[0], "seq": GUESS_NUMBER[1], "budget": "default"})
    return listed


def run_worker(tree: Path, case: dict, cap_gb: float) -> dict:
    environment = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    command = [sys.executable, __file__, "--worker", json.dumps(case), "--cap-gb", str(cap_gb)]
    done = subprocess.run(command, env=environment, cwd=tree, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"worker {case} in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def worker(case: dict, cap_gb: float) -> None:
    import numpy as np
    import torch

    from lilo.backend.models import load_base_model, smollm2_directory
    from lilo.backend.torch_backend import TorchBackend
    from lilo.backend.types import Datum, LoraSpec, TrainInput
    from lilo.engine.commands import Command, Kind

    torch.manual_seed(0)
    backend = TorchBackend(load_base_model(smollm2_directory()), max_adapters=2, max_rank=8)
    if case["budget"] == "default":
        from lilo.backend.training.batch_tokens import size_batch_tokens

        backend.max_batch_tokens = size_batch_tokens(backend.model, backend.device, backend.slot_state_bytes())
    else:
        backend.max_batch_tokens = int(case["budget"])
    backend.add_adapter("a", LoraSpec(rank=8, seed=1))
    rng = np.random.default_rng(0)

    def request(seq_id: int, rows: int, seq: int) -> Command:
        data = []
        for _ in range(rows):
            tokens = rng.integers(0, backend.vocab_size, seq + 1)
            data.append(Datum(tokens=tokens[:-1], loss_inputs={"target_tokens": tokens[1:],
                                                               "weights": np.ones(seq, dtype=np.float32)}))
        return Command("a", seq_id, Kind.FORWARD_BACKWARD, f"r{seq_id}", payload=TrainInput(data=data))

    backend.forward_backward([request(1, 1, 16)], forward_only=False)  # warm-up: the gradient bank becomes resident
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    held = int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmData"))) * 1024
    resource.setrlimit(resource.RLIMIT_DATA, (held + int(cap_gb * 2**30), hard))
    command = request(2, case["rows"], case["seq"])
    with PeakRss() as peak:
        started = time.perf_counter()
        (result,) = backend.forward_backward([command], forward_only=False)
        seconds = time.perf_counter() - started
    rows_per_pass = max(1, min(case["rows"], backend.max_batch_tokens // case["seq"]))
    pass_tokens = rows_per_pass * case["seq"]
    peak_mb = peak.mb
    print(json.dumps({**case, "budget": backend.max_batch_tokens, "pass_tokens": pass_tokens,
                      "peak_mb": round(peak_mb, 1), "mb_per_token": round(peak_mb / pass_tokens, 3),
                      "seconds": round(seconds, 2), "out_of_memory": isinstance(result, Exception)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="another checkout to measure the same way (its own lilo)")
    parser.add_argument("--passes", default="2x512,4x512,8x512", help="rows x seq of the one-pass cases")
    parser.add_argument("--long-row", type=int, default=2048)
    parser.add_argument("--cap-gb", type=float, default=12.0, help="memory a worker's request may take at most")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker), args.cap_gb)
        return
    from lilo.backend.training.batch_tokens import activation_bytes_per_token
    from lilo.backend.models import smollm2_directory

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(smollm2_directory())
    trees = {"now": Path(__file__).resolve().parent.parent}
    if args.before:
        trees["before"] = args.before.resolve()
    results: dict[str, list] = {name: [] for name in trees}
    for case in cases(args):
        for name, tree in trees.items():  # taking turns: a slow spell hits both alike
            results[name].append(run_worker(tree, case, args.cap_gb))
            print(f"{name}: {results[name][-1]}", file=sys.stderr)
    print(json.dumps({"bench": "memory", "model": "smollm2",
                      "estimate_mb_per_token": round(activation_bytes_per_token(config, 4) / 2**20, 3),
                      "results": results}))


if __name__ == "__main__":
    main()
