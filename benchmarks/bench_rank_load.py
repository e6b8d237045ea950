"""A rank's own host memory while it loads its share of a sharded base model (``--trainer-ranks``), with lilo's own
loading (``load_sharded_base``'s two steps: ``load_base_model`` as stored onto the CPU, then ``shard_base_model``,
which casts the shards) in ``--ranks`` gloo processes on this machine.

The model is a random Llama of ``--hidden`` x ``--layers`` saved in bf16, as checkpoints ship, and trained in bf16
(a GPU trainer's compute dtype) and in fp32 (a CPU trainer's). Loaded as stored, its weights stay views of the
memory-mapped files, shared by the ranks through the page cache; a rank copies only its shards, cast. Per rank, its
unique memory (USS: what no other process shares) grown by the load and after sharding; ``shard_mb`` is what a rank
should keep: its 1/N of the decoder layers and the whole embeddings and head, at that dtype. Prints one JSON line:
{"bench": "rank_load", "ranks": N, "results": [{"dtype": .., "loaded_mb": [..per rank], "sharded_mb": [..],
 "shard_mb": .., "model_mb": ..}, ...]}
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

MB = 2**20


def own_mb() -> float:
    return psutil.Process().memory_full_info().uss / MB


def one_rank(rank: int, world: int, directory: str, rendezvous: str, dtype_name: str, answers) -> None:
    import gc

    import torch.distributed as dist

    from lilo.backend.models import load_base_model
    from lilo.backend.sharding.group import RankGroup, join, shard_base_model

    device = torch.device("cpu")
    join(RankGroup(rank, world, f"file://{rendezvous}", "127.0.0.1"), device)
    before = own_mb()
    model = load_base_model(directory, "cpu", dtype="auto")
    loaded = own_mb() - before
    shard_base_model(model, device, getattr(torch, dtype_name))
    gc.collect()
    answers.put((rank, round(loaded, 1), round(own_mb() - before, 1)))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory(prefix="lilo-rank-load-") as scratch:
        directory = Path(scratch) / "model"
        config = LlamaConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                             num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(directory)
        model_bytes = sum(p.numel() * 4 for p in model.parameters())  # at fp32; bf16 is half
        whole = sum(p.numel() * 4 for name, p in model.named_parameters() if ".layers." not in name)
        del model
        results = []
        for dtype_name, size in (("bfloat16", 2), ("float32", 4)):
            answers = mp.get_context("spawn").Queue()
            rendezvous = Path(scratch) / f"rendezvous-{dtype_name}"
            mp.spawn(one_rank, args=(args.ranks, str(directory), str(rendezvous), dtype_name, answers),
                     nprocs=args.ranks)
            by_rank = sorted(answers.get() for _ in range(args.ranks))
            results.append({"dtype": dtype_name, "loaded_mb": [loaded for _, loaded, _ in by_rank],
                            "sharded_mb": [sharded for _, _, sharded in by_rank],
                            "shard_mb": round(((model_bytes - whole) / args.ranks + whole) * size / 4 / MB, 1),
                            "model_mb": round(model_bytes * size / 4 / MB, 1)})
    print(json.dumps({"bench": "rank_load", "ranks": args.ranks, "results": results}))


if __name__ == "__main__":
    main()
