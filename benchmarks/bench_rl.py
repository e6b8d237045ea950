"""N tinker SDK clients, each running an RL loop on its own adapter, against a local lilo sampling on the trainers'
torch samplers and then on a vLLM sampler.

Each client's step, as the cookbook's RL recipes run it: sample ``--groups`` groups of ``--group-size`` from the
current policy (one sample request per group, all in flight at once), score them with a trivial reward (the share
of even token ids), build importance_sampling data from the sampler's own logprobs with group-centred advantages,
forward_backward + optim_step, and publish the new weights (``save_weights_and_get_sampling_client``), whose
sampling client the next step samples. Per engine (``torch``: ``--samplers 0``; ``vllm``: ``--samplers 1``) and per
client count (``--clients``), after one warm-up step per client:
- ``step_s``: a step's wall time (median over every client's steps), split into ``sampling_s``, ``training_s``,
  ``publishing_s`` (each call's round trip as the client sees it) and ``waiting_s`` (the rest: scoring, building
  data, the client's own overhead);
- ``sampled_tok_s``: sampled tokens per second, all clients together, over the measured steps.
Headline: ``sampled_tok_s`` at the largest client count, per engine, and vLLM's over torch's.
Prints one JSON line:
{"bench": "rl", "model": .., "results": {"torch": [{"clients": N, "step_s": .., ...}], "vllm": [...]},
 "headline": {"clients": 8, "torch_tok_s": .., "vllm_tok_s": .., "vllm_ratio": ..}}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import numpy as np

from private_cluster import private_cluster

API_KEY = "tml-bench-rl"
MODELS = {"tiny": "lilo/tiny-llama", "smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}
ENGINES = {"torch": ("--samplers", "0"), "vllm": ("--samplers", "1")}


def rl_client(service, base_model: str, args: argparse.Namespace, seed: int, out: list) -> None:
    """One client: a warm-up step, then ``args.steps`` measured ones; appends each measured step's split."""
    from tinker import types

    rng = np.random.default_rng(seed)
    training = service.create_lora_training_client(base_model=base_model, rank=8).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=[])
    adam = types.AdamParams(learning_rate=1e-4)
    for step in range(args.steps + 1):
        started = time.perf_counter()
        prompts = [rng.integers(3, 1000, args.prompt_tokens).tolist() for _ in range(args.groups)]
        pending = [sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=args.group_size,
                                  sampling_params=params) for prompt in prompts]
        groups = [future.result() for future in pending]
        sampled = time.perf_counter()
        data, tokens = [], 0
        for prompt, group in zip(prompts, groups):
            rewards = np.array([np.mean([token % 2 == 0 for token in s.tokens]) for s in group.sequences])
            for sequence, advantage in zip(group.sequences, rewards - rewards.mean()):
                tokens += len(sequence.tokens)
                full = prompt + list(sequence.tokens)
                scored = len(full) - 1
                generated = len(sequence.tokens)
                pad = scored - generated
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:],
                                    "logprobs": [0.0] * pad + list(sequence.logprobs),
                                    "advantages": [0.0] * pad + [float(advantage)] * generated}))
        built = time.perf_counter()
        training.forward_backward(data, "importance_sampling").result()
        training.optim_step(adam).result()
        trained = time.perf_counter()
        sampler = training.save_weights_and_get_sampling_client().result()
        published = time.perf_counter()
        if step:  # the first step warms every path up
            out.append({"sampling_s": sampled - started, "training_s": trained - built,
                        "publishing_s": published - trained, "step_s": published - started, "tokens": tokens,
                        "started": started, "ended": published})


def run_clients(url: str, base_model: str, clients: int, args: argparse.Namespace) -> dict:
    import tinker

    steps: list[dict] = []
    with tinker.ServiceClient(base_url=url, api_key=API_KEY) as service:
        threads = [threading.Thread(target=rl_client, args=(service, base_model, args, seed, steps))
                   for seed in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if len(steps) != clients * args.steps:
        raise RuntimeError(f"{clients * args.steps - len(steps)} client step(s) failed; see the output above")
    window = max(s["ended"] for s in steps) - min(s["started"] for s in steps)
    median = {key: round(statistics.median(s[key] for s in steps), 3)
              for key in ("step_s", "sampling_s", "training_s", "publishing_s")}
    median["waiting_s"] = round(max(0.0, median["step_s"] - median["sampling_s"] - median["training_s"]
                                    - median["publishing_s"]), 3)
    return {"clients": clients, **median, "sampled_tok_s": round(sum(s["tokens"] for s in steps) / window, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--clients", default="1,4,8", help="client counts, comma-separated")
    parser.add_argument("--engines", default="torch,vllm", help=f"of {', '.join(ENGINES)}")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per client (after one warm-up)")
    parser.add_argument("--groups", type=int, default=2, help="prompts (sample requests) per step")
    parser.add_argument("--group-size", type=int, default=4, help="samples per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=8790)
    parser.add_argument("--coalesce-window-ms", help="the service's coalescing window (default: lilo's; 0: none)")
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    base_model = MODELS[args.model]
    counts = [int(n) for n in args.clients.split(",")]
    results: dict[str, list] = {}
    window = ("--coalesce-window-ms", args.coalesce_window_ms) if args.coalesce_window_ms is not None else ()
    for engine in args.engines.split(","):
        # A slot for each client's model and one for its latest sampler checkpoint; rank 8 at most, so the LoRA
        # math of both engines is sized to the adapters.
        with private_cluster(base_model, args.port, *ENGINES[engine], "--max-adapters", str(2 * max(counts)),
                             "--max-rank", "8", "--timeout", "600", *window):
            results[engine] = [run_clients(f"http://127.0.0.1:{args.port}", base_model, n, args) for n in counts]
    headline: dict = {"clients": max(counts)}
    for engine, rows in results.items():
        headline[f"{engine}_tok_s"] = rows[-1]["sampled_tok_s"]
    if "torch_tok_s" in headline and "vllm_tok_s" in headline:
        headline["vllm_ratio"] = round(headline["vllm_tok_s"] / headline["torch_tok_s"], 3)
    print(json.dumps({"bench": "rl", "model": args.model, "coalesce_window_ms": args.coalesce_window_ms,
                      "steps": args.steps, "groups": args.groups,
                      "group_size": args.group_size, "max_tokens": args.max_tokens, "results": results,
                      "headline": headline}))


if __name__ == "__main__":
    main()
