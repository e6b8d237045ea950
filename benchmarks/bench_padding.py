"""The share of a training pass's computed tokens that are real, and the passes it takes, in each layout the trainer
has: packed (``lilo.backend.training.packing.packed_bins``: datums end to end, bins filled by real tokens, the
layout of the families that pack) and padded (rows right-padded to the longest of their micro-batch, micro-batches
filled longest rows first up to the pass budget: ``lilo.backend.torch_backend._micro_batches``; until 2026-12-06 in
arrival order). The pass is RL-shaped:
``--clients`` clients' steps coalesced, ``--rows`` rows each, a prompt of ``--prompt`` tokens and a completion
drawn log-normal (median ``--median``, capped at ``--cap``), ``--draws`` passes per budget. No model runs: this is
the layouts' arithmetic (``bench_packing.py`` runs the model).
Prints one JSON line:
{"bench": "padding", "budgets": [{"budget": .., "real_share": .., "real_share_min": .., "passes": ..,
 "packed_real_share": .., "packed_passes": ..}, ...], ...}
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from lilo.backend.sharding.plans import TrainRow
from lilo.backend.torch_backend import _micro_batches, _padded_size
from lilo.backend.training.packing import packed_bins
from lilo.backend.types import Datum


def rl_pass(rng: np.random.Generator, clients: int, rows: int, prompt: int, median: int, cap: int) -> list[TrainRow]:
    """One coalesced pass: each client's rows in turn, as its step arrived."""
    lengths = prompt + np.minimum(rng.lognormal(np.log(median), 0.8, clients * rows).astype(int) + 1, cap)
    return [TrainRow(0, n // rows, Datum(tokens=np.zeros(length, dtype=np.int32), loss_inputs={}), "cross_entropy",
                     {}) for n, length in enumerate(lengths)]


def padded(rows: list[TrainRow], budget: int) -> tuple[float, int]:
    """(real share, passes) padded."""
    batches = _micro_batches(rows, budget)
    return sum(len(row.datum.tokens) for row in rows) / sum(_padded_size(batch) for batch in batches), len(batches)


def packed(rows: list[TrainRow], budget: int) -> tuple[float, int]:
    """(real share, passes) packed: a pass computes exactly its datums' tokens."""
    bins = packed_bins([len(row.datum.tokens) for row in rows], budget)
    computed = sum(len(rows[i].datum.tokens) for b in bins for i in b)
    return sum(len(row.datum.tokens) for row in rows) / computed, len(bins)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=150)
    parser.add_argument("--median", type=int, default=600)
    parser.add_argument("--cap", type=int, default=4096)
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--budgets", default="8192,16384,65536")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    passes = [rl_pass(rng, args.clients, args.rows, args.prompt, args.median, args.cap) for _ in range(args.draws)]
    budgets = []
    for budget in (int(b) for b in args.budgets.split(",")):
        shares, counts = zip(*(padded(rows, budget) for rows in passes))
        packed_shares, packed_counts = zip(*(packed(rows, budget) for rows in passes))
        budgets.append({"budget": budget, "real_share": round(float(np.mean(shares)), 3),
                        "real_share_min": round(float(np.min(shares)), 3), "passes": float(np.mean(counts)),
                        "packed_real_share": round(float(np.min(packed_shares)), 3),
                        "packed_passes": float(np.mean(packed_counts))})
    print(json.dumps({"bench": "padding", "layout": "padded (grouped by length) and packed", "clients": args.clients,
                      "rows": args.rows, "prompt": args.prompt, "median": args.median, "cap": args.cap,
                      "draws": args.draws, "budgets": budgets}))


if __name__ == "__main__":
    main()
