"""N adapters' training steps coalesced into one pass, against one model per execution and against plain peft.

For each N: (a) the engine coalescing all N adapters' steps, (b) the same engine running one model per execution,
(c) what a user has without us: peft with N adapters on one base (``add_adapter``/``set_adapter``) stepped one
after another, each with its own AdamW. A step is forward + backward + optimizer step, ``--rows`` sequences of
``--seq`` tokens per adapter. Each figure is the median of ``--steps`` timed steps; the three variants take turns
``--rounds`` times and each keeps its best round (the machine may be shared). MFU = 4 x (matmul weights, output
head included; of fused MoE experts the share a token is routed to) x tokens/s / the fp32 FLOP/s of a 2048x2048
matmul measured in the same run. ``--model`` takes the tiny families too (``tiny-qwen3-moe``...): for an MoE model
peft also targets the experts (``target_parameters``), and ``experts_share`` is the part of a coalesced pass's
forward and backward spent in the experts (their base matmuls and adapters, timed by module hooks).
``optim_fused_speedup``: one fused AdamW step for N adapters against N separate ones; ``optim_ms``: that fused
step's time. ``base_only_tok_s``: forward + backward of the same tokens through the frozen base alone, the ceiling
of any LoRA method here; ``of_base_only``: coalesced over it. Prints one JSON line:
{"bench": "coalesce", "model": .., "results": [{"adapters": N, "coalesced_tok_s": .., "serial_tok_s": ..,
 "peft_tok_s": .., "speedup_vs_serial": .., "speedup_vs_peft": .., "mfu": .., "base_only_tok_s": .., "of_base_only": ..,
 "optim_fused_speedup": .., "optim_ms": ..},
 ...],
 "gemm_gflops": .., "adapter_mb": ..}
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import io
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from engine_bench import batch, run_with_compute_lane
from lilo.backend.adapters.experts import MultiLoRAExperts, expert_projections, is_fused_experts
from lilo.backend.families import family_of, role_of
from lilo.backend.models import TINY_MODELS, build_tiny, load_base_model, smollm2_directory
from lilo.backend.types import AdamParams, Datum, DatumImage, LoraSpec, TrainInput
from lilo.backend.vision import ImageLayout, image_layout, multimodal_inputs
from lilo.backend.torch_backend import TorchBackend
from lilo.engine.commands import Command, Kind
from lilo.engine.engine import Engine

RANK = 8


def gemm_gflops(size: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - started) / 1e9


def median_seconds(step, repeats: int) -> float:
    """Median wall time of ``repeats`` calls: a burst of load from elsewhere on a shared machine moves it less
    than it moves a mean."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return float(np.median(times))


@dataclasses.dataclass(frozen=True)
class Rows:
    """What a step's rows are: ``seq`` random tokens each, and on a vision-language base (``vision``) one random
    ``image_size`` px JPEG among them (its tokens counted in ``seq``), as the cookbook lays an image out."""

    vision: ImageLayout | None = None
    image_size: int = 224

    def tokens(self, rng: np.random.Generator, rows: int, seq: int, vocab: int,
               ) -> tuple[np.ndarray, list[list[DatumImage]]]:
        tokens = rng.integers(0, min(vocab, 990), (rows, seq))
        if self.vision is None:
            return tokens, [[] for _ in range(rows)]
        count = self.vision.token_count(self.image_size, self.image_size)
        if count + 8 > seq:
            raise SystemExit(f"--seq {seq} leaves no room for an image of {count} tokens; pass a longer --seq.")
        tokens[:, 4:4 + count] = self.vision.image_token_id
        images = []
        for _ in range(rows):
            pixels = (rng.random((self.image_size, self.image_size, 3)) * 255).astype("uint8")
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, "JPEG")
            images.append([DatumImage(buffer.getvalue(), "jpeg", 4, count)])
        return tokens, images

    def train(self, rng: np.random.Generator, rows: int, seq: int, vocab: int) -> TrainInput:
        tokens, images = self.tokens(rng, rows, seq, vocab)
        return TrainInput(data=[Datum(tokens=row, loss_inputs={"target_tokens": np.roll(row, -1),
                                                               "weights": np.ones(seq, dtype=np.float32)},
                                      images=tuple(own)) for row, own in zip(tokens, images)])

    def logits(self, model: nn.Module, multimodal: nn.Module | None, tokens: np.ndarray,
               images: list[list[DatumImage]]) -> torch.Tensor:
        ids = torch.as_tensor(tokens)
        if self.vision is None:
            return model(input_ids=ids, use_cache=False).logits
        inputs = multimodal_inputs(multimodal, self.vision, ids, None, [i for own in images for i in own])
        return model(**inputs, use_cache=False).logits


def matmul_parameters(model: nn.Module) -> int:
    """Weights a token is multiplied by: every linear's, and of fused experts the routed share."""
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    routed = getattr(model.config, "num_experts_per_tok", 0)
    experts = sum(getattr(m, name).numel() * routed / m.num_experts
                  for m in model.modules() if is_fused_experts(m) for name in expert_projections(m))
    return int(linears + experts)


def linear_targets(model: nn.Module) -> list[str]:
    """peft's ``target_modules``: the linears lilo adapts in the model's family (lilo.backend.families), each by its
    whole path (a frozen module may share a last name: DeepSeek-V4's indexer.kv_proj), in the language model only
    (a vision tower's stay bare)."""
    family = family_of(model.config.model_type)
    decoder = next(path for path, module in model.named_modules() if module is model.get_decoder())
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)
            and name.startswith(f"{decoder}.") and role_of(family, name) in ("attn", "mlp")]


def fused_targets(model: nn.Module) -> list[str]:
    """peft's ``target_parameters`` for the model's fused experts (none for a dense model)."""
    return sorted({f"experts.{name}" for m in model.modules() if is_fused_experts(m) for name in expert_projections(m)},
                  key=lambda target: target.endswith("down_proj"))


def engine_tok_s(base: nn.Module, adapters: int, rows: int, seq: int, steps: int, coalesce: bool,
                 kind: Rows = Rows()) -> float:
    """Tokens/s through the engine: its compute lane on this (the torch) thread, a client thread submitting."""
    backend = TorchBackend(copy.deepcopy(base), max_adapters=adapters, max_rank=RANK, images=kind.vision)
    engine = Engine(backend, coalesce=coalesce, start=False)
    models = [f"m{i}" for i in range(adapters)]
    rng = np.random.default_rng(0)
    seq_ids = {m: 1 for m in models}
    measured: dict[str, float] = {}

    def one_step() -> None:
        futures = []
        for model_id in models:
            train = kind.train(rng, rows, seq, backend.vocab_size)
            futures.append(engine.submit(Command(model_id, seq_ids[model_id], Kind.FORWARD_BACKWARD,
                                                 f"{model_id}:{seq_ids[model_id]}", payload=train,
                                                 tokens=train.tokens)))
            futures.append(engine.submit(Command(model_id, seq_ids[model_id] + 1, Kind.OPTIM_STEP,
                                                 f"{model_id}:{seq_ids[model_id] + 1}", payload=AdamParams())))
            seq_ids[model_id] += 2
        for future in futures:
            future.result()

    def client() -> None:
        for future in [engine.create_model(m, LoraSpec(rank=RANK, seed=1)) for m in models]:
            future.result()
        one_step()  # warm-up
        measured["tok_s"] = adapters * rows * seq / median_seconds(one_step, steps)

    run_with_compute_lane(engine, client)
    return measured["tok_s"]


def peft_tok_s(base: nn.Module, adapters: int, rows: int, seq: int, steps: int, kind: Rows = Rows()) -> float:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=RANK, lora_alpha=RANK, target_modules=linear_targets(base), lora_dropout=0.0,
                        target_parameters=fused_targets(base) or None)
    model = get_peft_model(copy.deepcopy(base), config, adapter_name="a0")
    names = [f"a{i}" for i in range(adapters)]
    for name in names[1:]:
        model.add_adapter(name, config)
    optimizers = {}
    for name in names:
        params = [p for n, p in model.named_parameters() if f".{name}." in n]
        for p in params:
            p.requires_grad_(True)
        optimizers[name] = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    model.train()
    rng = np.random.default_rng(0)
    vocab = base.config.get_text_config().vocab_size
    loss_fn = nn.CrossEntropyLoss(reduction="sum")

    def one_step() -> None:
        for name in names:
            model.set_adapter(name)
            tokens, images = kind.tokens(rng, rows, seq, vocab)
            logits = kind.logits(model, getattr(model.base_model.model, "model", None), tokens, images)
            targets = torch.roll(torch.as_tensor(tokens), -1, dims=1).reshape(-1)
            loss = loss_fn(logits.reshape(-1, vocab).float(), targets)
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad()

    one_step()
    return adapters * rows * seq / median_seconds(one_step, steps)


def base_only_tok_s(base: nn.Module, adapters: int, rows: int, seq: int, steps: int, kind: Rows = Rows()) -> float:
    """The ceiling for any LoRA method on this base: forward + backward of the same tokens through the frozen base
    alone (gradients flowing back to the embeddings' output, as LoRA's need them), no adapter, no optimizer."""
    model = copy.deepcopy(base)
    rng = np.random.default_rng(0)
    tokens, images = kind.tokens(rng, adapters * rows, seq, base.config.get_text_config().vocab_size)

    # The embeddings' output a leaf that wants its gradient (a hook: some families read the token ids in their layers).
    model.get_input_embeddings().register_forward_hook(lambda module, args, output: output.detach().requires_grad_())

    def one_step() -> None:
        logits = kind.logits(model, getattr(model, "model", None), tokens, images)
        nn.functional.cross_entropy(logits.flatten(0, 1).float(), torch.roll(torch.as_tensor(tokens), -1, dims=1)
                                    .flatten(), reduction="sum").backward()

    one_step()
    return adapters * rows * seq / median_seconds(one_step, steps)


def experts_share(base: nn.Module, adapters: int, rows: int, seq: int, steps: int) -> float:
    """The part of coalesced forward_backward passes (``adapters`` models, one pass each step) spent in the fused
    experts' forward and backward, base matmuls and adapters together, timed by hooks on their modules."""
    backend = TorchBackend(copy.deepcopy(base), max_adapters=adapters, max_rank=RANK)
    models = [f"m{i}" for i in range(adapters)]
    for model_id in models:
        backend.add_adapter(model_id, LoraSpec(rank=RANK, seed=1))
    spent, started = [0.0], {}

    def begin(module, *_):
        started[module] = time.perf_counter()

    def end(module, *_):
        spent[0] += time.perf_counter() - started.pop(module)

    for module in backend.model.modules():
        if isinstance(module, MultiLoRAExperts):
            module.register_forward_pre_hook(begin)
            module.register_forward_hook(end)
            module.register_full_backward_pre_hook(begin)
            module.register_full_backward_hook(end)
    rng = np.random.default_rng(0)
    passes = [[Command(m, 1, Kind.FORWARD_BACKWARD, f"{m}:1", payload=batch(rng, rows, seq, backend.vocab_size))
               for m in models] for _ in range(steps + 1)]
    backend.forward_backward(passes[0], forward_only=False)  # warm-up
    spent[0], total = 0.0, 0.0
    for commands in passes[1:]:
        t0 = time.perf_counter()
        backend.forward_backward(commands, forward_only=False)
        total += time.perf_counter() - t0
    return spent[0] / total


def optim_fused(base: nn.Module, adapters: int, repeats: int = 30) -> tuple[float, float]:
    """(speedup, ms): the median time of N separate optim_step calls over that of one call stepping all N, and
    that one call's median time (fresh gradients before each call, not timed)."""
    backend = TorchBackend(copy.deepcopy(base), max_adapters=adapters, max_rank=RANK)
    models = [f"m{i}" for i in range(adapters)]
    for model_id in models:
        backend.add_adapter(model_id, LoraSpec(rank=RANK, seed=1))
    steps = [Command(m, 1, Kind.OPTIM_STEP, f"{m}:1", payload=AdamParams()) for m in models]

    def timed(calls) -> float:
        total = 0.0
        for call in calls:
            backend.bank.grads.normal_()
            started = time.perf_counter()
            backend.optim_step(call)
            total += time.perf_counter() - started
        return total

    timed([steps])  # warm-up
    separate = [timed([[s] for s in steps]) for _ in range(repeats)]
    fused = [timed([steps]) for _ in range(repeats)]
    return float(np.median(separate) / np.median(fused)), float(np.median(fused)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "smollm2", *TINY_MODELS], default="tiny")
    parser.add_argument("--adapters", default="1,4,8,16")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=7, help="timed steps per round (their median counts)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per variant (the best counts)")
    parser.add_argument("--image-size", type=int, default=224,
                        help="a vision-language model's rows each hold one image of this many pixels a side")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.model == "smollm2":
        directory = smollm2_directory()
    else:
        directory = build_tiny(Path(tempfile.mkdtemp()) / "tiny", "tiny-llama" if args.model == "tiny" else args.model)
    base = load_base_model(directory)
    kind = Rows(image_layout(directory), args.image_size)
    flops = gemm_gflops()
    weights = matmul_parameters(base)
    results = []
    for adapters in [int(n) for n in args.adapters.split(",")]:
        # The three take turns, --rounds times, and each keeps its best round: slow spells of a shared machine
        # then hit all of them alike instead of whichever happened to run during one.
        coalesced = serial = peft = base_only = 0.0
        for _ in range(args.rounds):
            shape = (base, adapters, args.rows, args.seq, args.steps)
            coalesced = max(coalesced, engine_tok_s(*shape, coalesce=True, kind=kind))
            serial = max(serial, engine_tok_s(*shape, coalesce=False, kind=kind))
            peft = max(peft, peft_tok_s(*shape, kind=kind))
            base_only = max(base_only, base_only_tok_s(*shape, kind=kind))
        speedup, optim_ms = optim_fused(base, adapters) if adapters > 1 else (1.0, 0.0)
        results.append({
            "adapters": adapters,
            "coalesced_tok_s": round(coalesced, 1),
            "serial_tok_s": round(serial, 1),
            "peft_tok_s": round(peft, 1),
            "speedup_vs_serial": round(coalesced / serial, 2),
            "speedup_vs_peft": round(coalesced / peft, 2),
            "mfu": round(4 * weights * coalesced / (flops * 1e9), 3),
            "base_only_tok_s": round(base_only, 1),
            "of_base_only": round(coalesced / base_only, 2),
            "optim_fused_speedup": round(speedup, 2),
            "optim_ms": round(optim_ms, 2),
        })
    # Resident per adapter: its row of the bank's weights and gradients and of Adam's two moments.
    backend = TorchBackend(copy.deepcopy(base), max_adapters=1, max_rank=RANK, sampler_slots=0)
    per_adapter = sum(t.nbytes for t in (backend.bank.weights, backend.bank.grads, backend.optimizer.exp_avg,
                                         backend.optimizer.exp_avg_sq)) / 2**20
    line = {"bench": "coalesce", "model": args.model, "rows": args.rows, "seq": args.seq, "results": results,
            "gemm_gflops": round(flops, 1), "adapter_mb": round(per_adapter, 2)}
    if kind.vision is not None:
        line["image_px"], line["image_tokens"] = args.image_size, kind.vision.token_count(args.image_size,
                                                                                          args.image_size)
    if fused_targets(base):
        line["experts_share"] = round(experts_share(base, max(int(n) for n in args.adapters.split(",")), args.rows,
                                                    args.seq, args.steps), 3)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
