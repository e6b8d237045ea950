"""A rank's own host memory while it loads its share of a sharded base model (``--trainer-ranks``), with lilo's own
loading (``load_sharded_base``'s two steps: ``load_base_model`` as stored onto the CPU, then ``shard_base_model``,
which casts the shards) in ``--ranks`` gloo processes on this machine.

The model is a random Llama of ``--hidden`` x ``--layers`` saved in bf16, as checkpoints ship, and trained in bf16
(a GPU trainer's compute dtype) and in fp32 (a CPU trainer's). Loaded as stored, its weights stay views of the
memory-mapped files, shared by the ranks through the page cache; a rank copies only its shards, cast. Per rank,
its anonymous memory (``own_mb``: not the files' page cache) grown by the load and after sharding (from after the
model's code is imported). ``shard_mb`` is its 1/N of the decoder layers and the whole embeddings and head at that
dtype: what a rank holds once sharded, in its own memory where a cast copied it, else in shared pages of the files.

Then a Qwen3-MoE of the same width (``--experts`` experts) saved as checkpoints ship it, each expert's projections
apart, which transformers fuses as it loads: loaded as stored (``"layout": "as_stored"``, each rank converting it,
a private copy) and from lilo's copy in the model's own layout (``"native"``, ``native_layout``, written once
before the ranks start), in bf16. Prints one JSON line:
{"bench": "rank_load", "ranks": N, "results": [{"model": "llama"|"qwen3_moe", "layout": .., "dtype": ..,
 "loaded_mb": [..per rank], "sharded_mb": [..], "shard_mb": .., "model_mb": ..}, ...]}
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

MB = 2**20


def own_mb() -> float:
    """This process's anonymous memory: what no file backs, so the kernel cannot drop it. The pages of a
    memory-mapped checkpoint are page cache instead, shared by the node's processes and dropped under pressure
    (a process's unique set size counts the ones only it touched, which says nothing of what it holds)."""
    rollup = Path("/proc/self/smaps_rollup").read_text()
    return int(next(line.split()[1] for line in rollup.splitlines() if line.startswith("Anonymous:"))) / 1024


def one_rank(rank: int, world: int, directory: str, rendezvous: str, dtype_name: str, answers) -> None:
    """Load ``directory`` as stored, then shard it, as ``load_sharded_base`` does."""
    import gc

    import torch.distributed as dist

    from lilo.backend.models import load_base_model
    from lilo.backend.sharding.group import RankGroup, join, shard_base_model
    from lilo.backend.sharding.native_layout import model_tensor_names

    device = torch.device("cpu")
    join(RankGroup(rank, world, f"file://{rendezvous}", "127.0.0.1"), device)
    model_tensor_names(Path(directory))  # its modelling code imported, on the meta device: not the load's cost
    before = own_mb()
    model = load_base_model(directory, "cpu", dtype="auto")
    loaded = own_mb() - before
    shard_base_model(model, device, getattr(torch, dtype_name))
    gc.collect()
    answers.put((rank, round(loaded, 1), round(own_mb() - before, 1)))
    dist.barrier()
    dist.destroy_process_group()


def measure(weights, directory: Path, scratch: Path, ranks: int, dtype_name: str, **labels) -> dict:
    """Each rank's memory loading ``directory`` (which holds the model ``weights``) and sharding it in ``dtype``."""
    size = getattr(torch, dtype_name).itemsize
    model_bytes = sum(p.numel() for p in weights.parameters()) * size
    whole = sum(p.numel() for name, p in weights.named_parameters() if ".layers." not in name) * size
    answers = mp.get_context("spawn").Queue()
    rendezvous = scratch / f"rendezvous-{uuid.uuid4().hex}"  # a fresh one per measurement
    mp.spawn(one_rank, args=(ranks, str(directory), str(rendezvous), dtype_name, answers), nprocs=ranks)
    by_rank = sorted(answers.get() for _ in range(ranks))
    return {**labels, "dtype": dtype_name, "loaded_mb": [loaded for _, loaded, _ in by_rank],
            "sharded_mb": [sharded for _, _, sharded in by_rank],
            "shard_mb": round(((model_bytes - whole) / ranks + whole) / MB, 1), "model_mb": round(model_bytes / MB, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--experts", type=int, default=16)
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from lilo.backend.sharding.native_layout import native_layout

    with tempfile.TemporaryDirectory(prefix="lilo-rank-load-") as name:
        scratch = Path(name)
        shape = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=16,
                     num_key_value_heads=4, vocab_size=32000)
        dense = LlamaForCausalLM(LlamaConfig(intermediate_size=4 * args.hidden, **shape)).to(torch.bfloat16)
        dense.save_pretrained(scratch / "llama")
        results = [measure(dense, scratch / "llama", scratch, args.ranks, dtype_name, model="llama",
                           layout="as_stored") for dtype_name in ("bfloat16", "float32")]
        del dense
        moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            intermediate_size=4 * args.hidden, moe_intermediate_size=args.hidden // 2, num_experts=args.experts,
            num_experts_per_tok=2, head_dim=args.hidden // 16, **shape)).to(torch.bfloat16)
        moe.save_pretrained(scratch / "moe")  # each expert's projections apart, as the hub's files have them
        native = native_layout(scratch / "moe", scratch / "cache")
        for layout, directory in (("as_stored", scratch / "moe"), ("native", native)):
            results.append(measure(moe, directory, scratch, args.ranks, "bfloat16", model="qwen3_moe",
                                   layout=layout))
    print(json.dumps({"bench": "rank_load", "ranks": args.ranks, "results": results}))


if __name__ == "__main__":
    main()
