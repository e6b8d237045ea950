"""64 models cycling through a trainer with 8 slots, against the same steps with every model resident.

Each model in turn does forward_backward + optim_step (``--rows`` sequences of ``--seq`` tokens, rank 8, the tiny
Llama unless ``--model smollm2``), round after round, through the engine: with 8 slots every step first pages its
model in and the idlest out. Three trainers take the same steps: every model resident (64 slots), paged with host
memory for all of them (``host``), and paged with no host tier (``disk``: every page-in reads a page file). Each
steps ``--rounds`` timed rounds after a warm-up round; its rate is one over its median step. ``resident_in_8_slots``:
8 models all resident in 8 slots, stepping in turn: the same per-step cost without paging (a trainer's step costs
more the more slots it has, so 64 resident slots are slower than 8). The page-in and
page-out times are the engine's own ``page_in`` / ``page_out`` spans. ``bit_equal``: every model's weights, AdamW
moments and step equal (torch.equal) in all three at the end. Prints one JSON line:
{"bench": "paging", "models": 64, "slots": 8, "page_in_p50_ms": {"host": .., "disk": ..}, "page_out_p50_ms": {..},
 "steps_per_s": {"resident": .., "host": .., "disk": ..}, "throughput_vs_resident": .. (host),
 "throughput_vs_resident_disk": .., "throughput_vs_resident_in_8_slots": .., "state_kb": .., "bit_equal": ..}
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine_bench import batch, run_with_compute_lane
from lilo.backend.models import build_tiny_llama, load_base_model, smollm2_directory
from lilo.backend.torch_backend import TorchBackend
from lilo.backend.types import AdamParams, LoraSpec, TrainInput
from lilo.engine.commands import Command, Kind
from lilo.engine.engine import Engine

RANK = 8
GB = 2**30


class PageSpans:
    """An observer keeping the engine's page_in / page_out spans: (direction, tier, seconds); the persist lane's
    read-aheads (``page_in:prefetch``) apart."""

    def __init__(self) -> None:
        self.moves: list[tuple[str, str, float]] = []
        self.read_ahead_s: list[float] = []

    def register_model(self, model_id, spec) -> None:
        pass

    def forget_model(self, model_id) -> None:
        pass

    def begin(self, operation) -> None:
        pass

    def span(self, model, name, lane, t0, t1=None, **attrs) -> None:
        if name == "page_in:prefetch":
            self.read_ahead_s.append(t1 - t0)
        elif name.startswith("page_"):
            self.moves.append((name.split(":")[0], attrs["tier"], t1 - t0))


def train_input(model_index: int, step: int, rows: int, seq: int, vocab: int) -> TrainInput:
    return batch(np.random.default_rng(model_index * 100_003 + step), rows, seq, vocab)


def run(base: nn.Module, models: int, slots: int, rows: int, seq: int, rounds: int, host_bytes: int,
        disk_bytes: int, page_dir: Path, queued: bool = False) -> tuple[TorchBackend, PageSpans, float]:
    """Steps/s over ``rounds`` timed rounds (after a warm-up round), each model stepping in turn: one over the
    median step's seconds, which a burst of load from elsewhere on a shared machine moves less than a mean.
    ``queued``: every model's step is submitted at the start of a round (the engine takes them in turn and reads
    the next ones' page files ahead); a step's seconds are then its round's over the models."""
    backend = TorchBackend(copy.deepcopy(base), max_adapters=slots, max_rank=RANK, sampler_slots=0,
                           host_adapter_bytes=host_bytes, disk_adapter_bytes=disk_bytes, page_dir=page_dir,
                           checkpoint_dir=page_dir / "checkpoints")
    spans = PageSpans()
    engine = Engine(backend, spans, coalesce=False, start=False, clock=time.perf_counter)
    names = [f"m{i:02d}" for i in range(models)]
    step_s: list[float] = []

    def one_round(round_index: int) -> None:
        if queued:
            started, steps = time.perf_counter(), []
            for i, model_id in enumerate(names):
                seq_id = 2 * round_index + 1
                train = train_input(i, round_index, rows, seq, backend.vocab_size)
                steps.append(engine.submit(Command(model_id, seq_id, Kind.FORWARD_BACKWARD, f"{model_id}:{seq_id}",
                                                   payload=train, tokens=train.tokens)))
                steps.append(engine.submit(Command(model_id, seq_id + 1, Kind.OPTIM_STEP, f"{model_id}:{seq_id + 1}",
                                                   payload=AdamParams(learning_rate=1e-3))))
            for step in steps:
                step.result()
            step_s.append((time.perf_counter() - started) / models)
            return
        for i, model_id in enumerate(names):
            started = time.perf_counter()
            seq_id = 2 * round_index + 1
            train = train_input(i, round_index, rows, seq, backend.vocab_size)
            engine.submit(Command(model_id, seq_id, Kind.FORWARD_BACKWARD, f"{model_id}:{seq_id}", payload=train,
                                  tokens=train.tokens)).result()
            engine.submit(Command(model_id, seq_id + 1, Kind.OPTIM_STEP, f"{model_id}:{seq_id + 1}",
                                  payload=AdamParams(learning_rate=1e-3))).result()
            step_s.append(time.perf_counter() - started)

    def client() -> None:
        for future in [engine.create_model(m, LoraSpec(rank=RANK, seed=i)) for i, m in enumerate(names)]:
            future.result()
        one_round(0)  # warm-up
        spans.moves.clear()
        step_s.clear()
        for round_index in range(1, rounds + 1):
            one_round(round_index)

    run_with_compute_lane(engine, client)
    return backend, spans, 1 / float(np.median(step_s))


def training_state(backend: TorchBackend, model_id: str) -> list[torch.Tensor]:
    backend.make_room([model_id], (), ())
    adapter = backend.adapters[model_id]
    index = backend._entry_index(adapter.spec)
    flats = [backend.bank.weights, backend.optimizer.exp_avg, backend.optimizer.exp_avg_sq]
    return [flat[adapter.slot].index_select(0, index) for flat in flats] + [
        torch.tensor(backend.optimizer.steps(adapter.slot))]


def p50_ms(spans: PageSpans, direction: str, tier: str) -> float | None:
    times = [seconds for d, t, seconds in spans.moves if d == direction and t == tier]
    return round(float(np.median(times)) * 1e3, 3) if times else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--models", type=int, default=64)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        directory = smollm2_directory() if args.model == "smollm2" else build_tiny_llama(Path(scratch) / "tiny")
        base = load_base_model(directory, torch.device(args.device))
        common = dict(models=args.models, rows=args.rows, seq=args.seq, rounds=args.rounds)
        resident, _, resident_rate = run(base, slots=args.models, host_bytes=0, disk_bytes=0,
                                         page_dir=Path(scratch) / "resident", **common)
        host, host_spans, host_rate = run(base, slots=args.slots, host_bytes=GB, disk_bytes=0,
                                          page_dir=Path(scratch) / "host", **common)
        # The cost of paging alone: as many models as slots, all resident, each stepping in turn (a trainer's step
        # grows with its slots, so 64 resident slots step slower than 8).
        _, _, same_slots_rate = run(base, slots=args.slots, host_bytes=0, disk_bytes=0,
                                    page_dir=Path(scratch) / "same", **{**common, "models": args.slots})
        disk, disk_spans, disk_rate = run(base, slots=args.slots, host_bytes=0, disk_bytes=GB,
                                          page_dir=Path(scratch) / "disk", **common)
        # Every model's step queued at once: the persist lane reads the next models' page files ahead.
        _, _, resident_queued_rate = run(base, slots=args.models, host_bytes=0, disk_bytes=0,
                                         page_dir=Path(scratch) / "resident-queued", queued=True, **common)
        ahead, ahead_spans, ahead_rate = run(base, slots=args.slots, host_bytes=0, disk_bytes=GB,
                                             page_dir=Path(scratch) / "ahead", queued=True, **common)
        names = sorted(resident.adapters)
        bit_equal = all(torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
                        for name in names
                        for a, b, c, d in zip(training_state(resident, name), training_state(host, name),
                                              training_state(disk, name), training_state(ahead, name), strict=True))
        state_kb = host._state_bytes(names[-1]) / 1024
    print(json.dumps({
        "bench": "paging", "model": args.model, "device": args.device, "models": args.models, "slots": args.slots,
        "rank": RANK, "rows": args.rows, "seq": args.seq,
        "page_in_p50_ms": {"host": p50_ms(host_spans, "page_in", "host"),
                           "disk": p50_ms(disk_spans, "page_in", "disk"),
                           "disk_read_ahead": p50_ms(ahead_spans, "page_in", "disk")},
        "read_ahead_p50_ms": round(float(np.median(ahead_spans.read_ahead_s)) * 1e3, 3)
        if ahead_spans.read_ahead_s else None,
        "page_out_p50_ms": {"host": p50_ms(host_spans, "page_out", "host"),
                            "disk": p50_ms(disk_spans, "page_out", "disk")},
        "steps_per_s": {"resident": round(resident_rate, 2), "host": round(host_rate, 2),
                        "disk": round(disk_rate, 2), "resident_in_8_slots": round(same_slots_rate, 2)},
        "throughput_vs_resident": round(host_rate / resident_rate, 3),
        "throughput_vs_resident_disk": round(disk_rate / resident_rate, 3),
        "throughput_vs_resident_in_8_slots": round(host_rate / same_slots_rate, 3),
        "queued_steps_per_s": {"resident": round(resident_queued_rate, 2), "disk_read_ahead": round(ahead_rate, 2)},
        "throughput_vs_resident_queued_disk": round(ahead_rate / resident_queued_rate, 3),
        "state_kb": round(state_kb, 1), "bit_equal": bit_equal,
    }))


if __name__ == "__main__":
    main()
