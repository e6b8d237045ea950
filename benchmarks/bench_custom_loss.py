"""A custom loss run on the server against the SDK's client-side path, with K clients stepping in lockstep.

Starts a private cluster (tiny model, one trainer, its own temp home, loopback only). One SDK ServiceClient creates
the loss (a clipped importance-ratio loss over the sampler's logprobs and advantages); ``--clients`` training
clients, each in a thread, take ``--steps`` steps of ``forward_backward_custom`` + ``optim_step`` on
``--rows`` x ``--tokens`` data, in turns per round:
- ``server``: the handle as created (uploaded: one forward_backward, run in the trainer's pass with the others');
- ``client``: the same handle without its loss_id, which the SDK runs client-side (a forward, the loss and its
  gradient in the client, then a backward with linearized weights: two passes).

Prints one JSON line: {"bench": "custom_loss", "clients": .., "server": {"step_p50_ms": .., "steps_per_s": ..},
"client": {...}, "speedup": ..} (``speedup``: the client path's step p50 over the server's; medians over rounds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import threading
import time

import numpy as np

from private_cluster import private_cluster

TINY = "lilo/tiny-llama"
MODES = ("server", "client")


def clipped_ratio_loss(logprobs, sampler_logprobs, advantages):
    import torch

    ratio = torch.exp(logprobs - sampler_logprobs)
    loss = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages).sum()
    return loss, {"custom/ratio:mean": ratio.mean()}


def rl_data(seed: int, rows: int, tokens: int) -> list:
    from tinker import types

    rng = np.random.default_rng(seed)
    data = []
    for _ in range(rows):
        ids = rng.integers(0, 1000, tokens + 1).tolist()
        data.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={
            "target_tokens": ids[1:], "sampler_logprobs": rng.normal(-7, 0.3, tokens).astype(np.float32),
            "advantages": rng.normal(0, 1, tokens).astype(np.float32)}))
    return data


def run_clients(trainings: list, handle, args: argparse.Namespace) -> dict[str, float]:
    from tinker import types

    durations: list[float] = []
    lock, barrier = threading.Lock(), threading.Barrier(len(trainings))

    def client(index: int, training) -> None:
        data, adam = rl_data(index, args.rows, args.tokens), types.AdamParams(learning_rate=1e-4)
        barrier.wait(timeout=120)
        for _ in range(args.steps):
            started = time.monotonic()
            backward = training.forward_backward_custom(data, handle)
            optim = training.optim_step(adam)
            backward.result(timeout=300)
            optim.result(timeout=300)
            with lock:
                durations.append(time.monotonic() - started)

    threads = [threading.Thread(target=client, args=(i, training)) for i, training in enumerate(trainings)]
    t0 = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - t0
    return {"step_p50_ms": statistics.median(durations) * 1e3, "steps_per_s": len(durations) / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8740)
    args = parser.parse_args()
    os.environ["TINKER_TELEMETRY"] = "0"
    import tinker

    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    with private_cluster(TINY, args.port, "--trainers", "1", "--num-cpus", "4"), \
            tinker.ServiceClient(base_url=f"http://127.0.0.1:{args.port}", api_key="tml-bench-custom") as service:
        uploaded = service.create_custom_loss(
            clipped_ratio_loss, {"logprobs": 1, "sampler_logprobs": 1, "advantages": 1}).result(timeout=120)
        handles = {"server": uploaded, "client": dataclasses.replace(uploaded, loss_id=None)}
        trainings = [service.create_lora_training_client(base_model=TINY, rank=8).result(timeout=120)
                     for _ in range(args.clients)]
        run_clients(trainings, handles["server"], argparse.Namespace(**{**vars(args), "steps": 1}))  # warm
        for _ in range(args.rounds):
            for mode in MODES:
                runs[mode].append(run_clients(trainings, handles[mode], args))
    medians = {mode: {key: round(statistics.median(run[key] for run in runs[mode]), 2) for key in runs[mode][0]}
               for mode in MODES}
    print(json.dumps({"bench": "custom_loss", "clients": args.clients, **medians,
                      "speedup": round(medians["client"]["step_p50_ms"] / medians["server"]["step_p50_ms"], 2),
                      "steps": args.steps, "rows": args.rows, "tokens": args.tokens, "rounds": args.rounds}))


if __name__ == "__main__":
    main()
