"""One fused MoE experts block with N adapters on its experts: lilo's grouped GEMMs against the eager loop.

lilo's ``MultiLoRAExperts`` runs a coalesced pass's routed tokens, sorted by (expert, slot), as one grouped GEMM
over the experts per projection and two over the (expert, slot) groups for the adapters' deltas (``grouped_mm``: a
grouped GEMM kernel on CUDA). The alternative is transformers' eager loop with each adapter's two GEMMs added per
(expert, slot): ``loop_pass`` here, which is also the reference the grouped pass must match (its output and every
adapter's gradients, ``max_rel_error``). A pass is forward + backward of ``--adapters`` x ``--tokens`` routed
tokens, each to ``--top-k`` of ``--experts`` experts of a Qwen3-MoE block (``--hidden``, ``--inter``); on CUDA the
defaults are Qwen3-30B-A3B's layer in bf16, on the CPU a smaller block in fp32. Each time is the median of
``--steps`` passes. Prints one JSON line:
{"bench": "experts", "device": .., "dtype": .., "shape": {..}, "grouped_ms": .., "loop_ms": .., "speedup": ..,
 "grouped_tflops": .., "max_rel_error": ..}
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from lilo.backend.adapters.experts import MultiLoRAExperts, expert_projections, projection_shape, wrap_experts
from lilo.backend.adapters.lora import BATCHED, Routing

# Qwen3-30B-A3B's MoE layer on a GPU; on the CPU a block that 2 cores pass through in about a second.
SHAPES = {"cuda": {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8, "tokens": 2048},
          "cpu": {"hidden": 512, "inter": 256, "experts": 32, "top_k": 4, "tokens": 128}}


def experts_block(hidden: int, inter: int, experts: int, adapters: int, rank: int, device: torch.device,
                  dtype: torch.dtype) -> MultiLoRAExperts:
    """A random Qwen3-MoE experts block wrapped with ``adapters`` random adapters of ``rank`` on every projection."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts)
    base = Qwen3MoeExperts(config)
    with torch.no_grad():
        for parameter in base.parameters():
            parameter.normal_(0, hidden ** -0.5)
    base = base.to(device, dtype)
    views = []
    for name in expert_projections(base):
        count, width_in, width_out = projection_shape(base, name)
        a = torch.randn(adapters, count, rank, width_in, device=device, dtype=dtype) * width_in ** -0.5
        b = torch.randn(adapters, count, width_out, rank, device=device, dtype=dtype) * rank ** -0.5
        views.append((a, b, torch.zeros_like(a), torch.zeros_like(b)))
    block = wrap_experts(base, views)
    for projection in block.projections.values():
        for slot in range(adapters):
            projection.set_adapter(slot, rank, 1.0)
    return block


def loop_pass(block: MultiLoRAExperts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
              top_k_weights: torch.Tensor, token_slot: torch.Tensor) -> torch.Tensor:
    """transformers' eager loop over the experts hit, each adapter's delta added per (expert, slot)."""
    base = block.base
    first, down = expert_projections(base)
    # Each (slot, expert)'s A and B as views from one unbind per axis: indexing the bank per pair would make its
    # backward write a whole bank-sized gradient per pair.
    factors = {name: tuple([per_slot.unbind(0) for per_slot in factor.unbind(0)]
                           for factor in (projection.lora_A, projection.lora_B))
               for name, projection in block.projections.items()}
    out = torch.zeros_like(hidden_states)
    for expert in top_k_index.unique().tolist():
        choice, token = torch.where(top_k_index.T == expert)
        x = hidden_states[token]
        h = _loop_projection(block, first, factors[first], expert, x, token_slot[token])
        h = base._apply_gate(h) if base.has_gate else base.act_fn(h)
        y = _loop_projection(block, down, factors[down], expert, h, token_slot[token])
        out = out.index_add(0, token, y * top_k_weights[token, choice, None])
    return out


def _loop_projection(block: MultiLoRAExperts, name: str, factors: tuple[list, list], expert: int, x: torch.Tensor,
                     slots: torch.Tensor) -> torch.Tensor:
    base, scales = block.base, block.projections[name].scales
    weight = getattr(base, name)[expert]
    y = x @ (weight if base.is_transposed else weight.T)
    deltas = torch.zeros_like(y)
    for slot in slots.unique().tolist():
        rows = torch.where(slots == slot)[0]
        a, b = factors[0][slot][expert], factors[1][slot][expert]
        deltas = deltas.index_add(0, rows, (x[rows] @ a.T) @ b.T * scales[slot])
    return y + deltas


def timed_ms(run, device: torch.device, steps: int) -> float:
    times = []
    for _ in range(steps + 1):  # the first warms up
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return float(np.median(times[1:])) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    for name in SHAPES["cpu"]:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, help="default: by device (SHAPES)")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = {name: getattr(args, name) or default for name, default in SHAPES[device.type].items()}
    torch.manual_seed(0)
    block = experts_block(shape["hidden"], shape["inter"], shape["experts"], args.adapters, args.rank, device, dtype)
    rows = args.adapters
    tokens = rows * shape["tokens"]
    hidden_states = torch.randn(tokens, shape["hidden"], device=device, dtype=dtype, requires_grad=True)
    logits = torch.randn(tokens, shape["experts"], device=device)
    top_k_weights, top_k_index = torch.softmax(logits, -1).topk(shape["top_k"], -1)
    top_k_weights = top_k_weights.to(dtype)
    slots = torch.arange(rows)
    token_slot = slots.to(device).repeat_interleave(shape["tokens"])
    routing = Routing.of(slots, BATCHED, device)
    parameters = [p for projection in block.projections.values() for p in (projection.lora_A, projection.lora_B)]

    def grouped() -> torch.Tensor:
        for projection in block.projections.values():
            projection.routing = routing
        return block(hidden_states, top_k_index, top_k_weights)

    def loop() -> torch.Tensor:
        return loop_pass(block, hidden_states, top_k_index, top_k_weights, token_slot)

    def training_pass(forward) -> list[torch.Tensor]:
        out = forward()
        return [out.detach(), *torch.autograd.grad(out.float().square().sum(), [hidden_states, *parameters])]

    reference, ours = training_pass(loop), training_pass(grouped)
    error = max(((mine - theirs).abs().max() / theirs.abs().max().clamp(min=1e-12)).item()
                for mine, theirs in zip(ours, reference))
    grouped_ms = timed_ms(lambda: training_pass(grouped), device, args.steps)
    loop_ms = timed_ms(lambda: training_pass(loop), device, args.steps)
    # A GEMM is 2 x routed tokens x its weights. The frozen base's run twice (forward, and the input's gradient);
    # the adapters' three times (forward, the input's gradient, and both factors' own).
    expert_weights = sum(int(np.prod(projection_shape(block.base, name)[1:])) for name in block.projections)
    adapter_weights = sum(args.rank * sum(projection_shape(block.base, name)[1:]) for name in block.projections)
    routed = tokens * shape["top_k"]
    flops = 2 * routed * (2 * expert_weights + 3 * adapter_weights)
    print(json.dumps({"bench": "experts", "device": device.type, "dtype": str(dtype).removeprefix("torch."),
                      "shape": {**shape, "adapters": args.adapters, "rank": args.rank},
                      "grouped_ms": round(grouped_ms, 2), "loop_ms": round(loop_ms, 2),
                      "speedup": round(loop_ms / grouped_ms, 2),
                      "grouped_tflops": round(flops / (grouped_ms / 1e3) / 1e12, 3),
                      "max_rel_error": float(f"{error:.2e}")}))


if __name__ == "__main__":
    main()
