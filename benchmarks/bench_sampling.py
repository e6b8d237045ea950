"""The torch sampler over 4 adapters against itself on the bare base model (and vLLM's, where installed).

Workload: SmolLM2-135M (fp32), 32 distinct prompts of 16-48 tokens, 4 samples each, 64 tokens each (no stop), at
temperature 1.0 with a seed per prompt; the prompts spread evenly over 4 rank-8 adapters (every projection trained,
lm_head too, as Tinker's defaults; random non-zero B, so the LoRA math is real). The trainer's ``TorchBackend``
samples them in one ``sample`` call, as its engine does; ``torch_base_tok_s`` is the same workload through the bare
base model (``base_only``). The two take turns, ``--runs`` times each; each rate is the median run's.

The adapters are also saved as PEFT directories (the backend's save_weights_for_sampler path) and the workload
written as JSON (``--workload-out``) for ``benchmarks/bench_sampling_vllm.py``; when that script and
``.venv-vllm/bin/python`` exist, it runs after the torch runs and its JSON fields join this line, with
``vllm_ratio`` (vLLM over torch) and ``logprob_diff``: the largest difference between the logprobs vLLM reports and
the trainer's own (one forward pass over prompt + tokens, same adapter, temperature 1). ``torch_logprob_diff`` is
the same check of the torch sampler's own samples. Prints one JSON line.
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

import torch

from lilo.backend.checkpoints.paths import local_directory
from lilo.backend.adapters.lora import BASE_SLOT
from lilo.backend.models import load_base_model, smollm2_directory
from lilo.backend.torch_backend import TorchBackend
from lilo.backend.types import Datum, LoraSpec, SamplingRequest, SaveRequest, TrainInput
from lilo.engine.commands import Command, Kind

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_BENCH = ROOT / "benchmarks" / "bench_sampling_vllm.py"

SUBJECTS = ["the history of the printing press", "how photosynthesis turns light into sugar", "a recipe for bread",
            "why the sky is blue", "the rules of chess", "how a compiler works", "the water cycle",
            "training for a marathon"]
FRAMES = ["Write a short paragraph about {}, in the plain style of an encyclopedia entry.",
          "Explain {} to a ten-year-old in plain words, with one example from everyday life.",
          "You are a patient teacher. A student asks you about {}. Answer in three sentences, and end with a question "
          "that checks whether they understood.",
          "Here are some notes I took yesterday about {}; they are messy and incomplete. Please rewrite them as a "
          "clear, well ordered summary with a title, and point out anything that looks wrong to you."]


def prompts(tokenizer, count: int) -> list[list[int]]:
    """``count`` distinct prompts of realistic lengths (16-48 tokens with SmolLM2's tokenizer)."""
    texts = [frame.format(subject) for frame in FRAMES for subject in SUBJECTS]
    return [tokenizer(text)["input_ids"] for text in texts[:count]]


def make_adapters(backend: TorchBackend, count: int, rank: int) -> list[str]:
    """``count`` adapters with their init's A and a random B on every projection, lm_head included."""
    names = [f"adapter{i}" for i in range(count)]
    for i, name in enumerate(names):
        backend.add_adapter(name, LoraSpec(rank=rank, seed=i, train_unembed=True))
        generator = torch.Generator().manual_seed(100 + i)
        slot = backend.adapters[name].slot
        with torch.no_grad():
            for layer in backend.layers.values():
                b = torch.randn(layer.lora_B.shape[1], rank, generator=generator) * 0.02
                layer.lora_B[slot, :, :rank] = b
    return names


def save_for_sampler(backend: TorchBackend, names: list[str]) -> list[str]:
    """Each adapter as PEFT files, through the trainer's own save_weights_for_sampler path; their directories."""
    directories = []
    for name in names:
        command = Command(name, 1, Kind.SAVE_WEIGHTS_FOR_SAMPLER, f"{name}:save", payload=SaveRequest(name="bench"))
        path = backend.persist_checkpoint(command, backend.capture_checkpoint(command))["path"]
        directories.append(str(local_directory(backend.checkpoint_dir, path)))
    return directories


def commands(workload: dict, names: list[str], base_only: bool) -> list[Command]:
    made = []
    for i, (prompt, adapter, seed) in enumerate(zip(workload["prompts"], workload["prompt_adapter"],
                                                    workload["seeds"])):
        request = SamplingRequest(prompt=prompt, max_tokens=workload["max_tokens"],
                                  num_samples=workload["num_samples"], temperature=workload["temperature"],
                                  seed=seed, base_only=base_only or adapter < 0)
        model_id = names[adapter] if adapter >= 0 else names[0]
        made.append(Command(model_id, i + 1, Kind.SAMPLE, f"{model_id}:s{i}", payload=request))
    return made


def timed_sample(backend: TorchBackend, batch: list[Command]) -> tuple[float, list]:
    """Output tokens per second of one ``sample`` call, and its results."""
    started = time.perf_counter()
    results = backend.sample(batch)
    seconds = time.perf_counter() - started
    failed = [r for r in results if isinstance(r, Exception)]
    if failed:
        raise failed[0]
    tokens = sum(len(s["tokens"]) for r in results for s in r["sequences"])
    return tokens / seconds, results


def trainer_logprobs(backend: TorchBackend, names: list[str], workload: dict,
                     sequences: list[dict]) -> list[list[float]]:
    """The trainer's logprobs (temperature 1) of each sequence's tokens after its prompt, under the prompt's adapter
    (forward_backward with forward_only, one pass over prompt + tokens); the bare base for prompts of none."""
    scored: list[list[float] | None] = [None] * len(sequences)
    by_adapter: dict[int, list[int]] = {}
    for n, sequence in enumerate(sequences):
        by_adapter.setdefault(workload["prompt_adapter"][sequence["prompt_index"]], []).append(n)
    for adapter, members in by_adapter.items():
        data = []
        for n in members:
            prompt, tokens = workload["prompts"][sequences[n]["prompt_index"]], list(sequences[n]["tokens"])
            whole = prompt + tokens
            data.append(Datum(tokens=whole[:-1], loss_inputs={"target_tokens": whole[1:],
                                                              "weights": [1.0] * (len(whole) - 1)}))
        if adapter < 0:
            outputs = [base_logprobs(backend, datum) for datum in data]
        else:
            command = Command(names[adapter], 10_000, Kind.FORWARD_BACKWARD, "score",
                              payload=TrainInput(data=data, loss_fn="cross_entropy"))
            (result,) = backend.forward_backward([command], forward_only=True)
            outputs = [output["logprobs"] for output in result["loss_fn_outputs"]]
        for n, logprobs in zip(members, outputs):
            scored[n] = logprobs[len(workload["prompts"][sequences[n]["prompt_index"]]) - 1:]
    return scored


def base_logprobs(backend: TorchBackend, datum: Datum) -> list[float]:
    backend.bank.route([BASE_SLOT])
    try:
        with torch.no_grad():
            logits = backend.model(input_ids=torch.as_tensor([datum.tokens])).logits[0].float()
    finally:
        backend.bank.route(None)
    targets = torch.as_tensor(datum.loss_inputs["target_tokens"])
    return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist()


def max_diff(sequences: list[dict], trainer: list[list[float]]) -> float:
    return max(abs(a - b) for sequence, theirs in zip(sequences, trainer)
               for a, b in zip(sequence["logprobs"], theirs, strict=True))


def run_vllm(workload_path: Path) -> dict | None:
    """bench_sampling_vllm.py's JSON line on ``workload_path``, or None when it or its environment is absent."""
    if not (VLLM_PYTHON.exists() and VLLM_BENCH.exists()):
        return None
    done = subprocess.run([str(VLLM_PYTHON), str(VLLM_BENCH), "--workload", str(workload_path)], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.strip().startswith("{")]
    if done.returncode != 0 or not lines:
        return {"vllm": f"failed (exit {done.returncode}): {done.stderr.strip()[-400:]}"}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="where the torch sampler runs: cpu (fp32), cuda (a bf16 base)")
    parser.add_argument("--workload-out", type=Path, help="where to write the workload JSON (default: a temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model_dir = smollm2_directory()
    with tempfile.TemporaryDirectory() as scratch:
        workload_path = args.workload_out or Path(scratch) / "workload.json"
        # The adapters' PEFT files lie beside the workload file, for as long as it is kept.
        checkpoint_dir = workload_path.with_name(workload_path.stem + "-adapters") if args.workload_out \
            else Path(scratch) / "adapters"
        backend = TorchBackend(load_base_model(model_dir, args.device), max_adapters=args.adapters, sampler_slots=0,
                               checkpoint_dir=checkpoint_dir, base_model_name=str(model_dir))
        names = make_adapters(backend, args.adapters, args.rank)
        workload = {
            "model_dir": str(model_dir), "prompts": prompts(AutoTokenizer.from_pretrained(model_dir), args.prompts),
            "adapter_dirs": save_for_sampler(backend, names),
            "prompt_adapter": [i % args.adapters for i in range(args.prompts)],
            "num_samples": args.samples, "max_tokens": args.max_tokens, "temperature": 1.0,
            "seeds": [1000 + i for i in range(args.prompts)], "stop": [], "dtype": "float32",
        }
        workload_path.parent.mkdir(parents=True, exist_ok=True)
        workload_path.write_text(json.dumps(workload))
        with_adapters, bare = commands(workload, names, False), commands(workload, names, True)
        timed_sample(backend, with_adapters[:2])  # warm-up: first-call allocations and kernel choices
        rates: dict[str, list[float]] = {"adapters": [], "base": []}
        results = None
        for _ in range(args.runs):
            rate, results = timed_sample(backend, with_adapters)
            rates["adapters"].append(rate)
            rates["base"].append(timed_sample(backend, bare)[0])
            print(f"run {len(rates['base'])}: {rates['adapters'][-1]:.1f} tok/s with adapters, "
                  f"{rates['base'][-1]:.1f} bare", file=sys.stderr, flush=True)  # progress on a slow machine
        own = [{"prompt_index": i, **sequence} for i, result in enumerate(results) for sequence in result["sequences"]]
        torch_diff = max_diff(own, trainer_logprobs(backend, names, workload, own))
        torch_tok_s, base_tok_s = statistics.median(rates["adapters"]), statistics.median(rates["base"])
        line = {
            "bench": "sampling", "model": "SmolLM2-135M", "device": args.device,
            "dtype": str(next(backend.model.parameters()).dtype).removeprefix("torch."), "prompts": args.prompts,
            "prompt_tokens": [min(map(len, workload["prompts"])), max(map(len, workload["prompts"]))],
            "samples": args.samples, "max_tokens": args.max_tokens, "adapters": args.adapters, "rank": args.rank,
            "max_rank": backend.max_rank, "temperature": 1.0, "runs": args.runs,
            "torch_threads": torch.get_num_threads(), "torch_tok_s": round(torch_tok_s, 1),
            "torch_base_tok_s": round(base_tok_s, 1), "torch_of_base": round(torch_tok_s / base_tok_s, 3),
            "torch_runs_tok_s": [round(r, 1) for r in rates["adapters"]],
            "torch_base_runs_tok_s": [round(r, 1) for r in rates["base"]],
            "torch_logprob_diff": float(f"{torch_diff:.3g}"), "cpus": os.cpu_count(),
        }
        vllm = run_vllm(workload_path)
        if vllm is None:
            line["vllm"] = "not installed"
        else:
            line.update({key: value for key, value in vllm.items() if key not in ("bench", "sequences")})
            if isinstance(vllm.get("vllm_tok_s"), (int, float)):
                line["vllm_ratio"] = round(vllm["vllm_tok_s"] / torch_tok_s, 3)
            if vllm.get("sequences"):
                theirs = json.loads((ROOT / vllm["sequences"]).read_text())  # a relative path is the repo's
                diff = max_diff(theirs, trainer_logprobs(backend, names, workload, theirs))
                line["logprob_diff"] = float(f"{diff:.3g}")
    print(json.dumps(line))


if __name__ == "__main__":
    main()
