"""What keeping checkpoints in a storage (--storage) costs: a SmolLM2-135M adapter (rank 32, every projection,
AdamW moments: what save_state writes) saved, and fetched by a trainer on another node, per storage.

Storages: ``home`` (the default: the node's own directory, nothing moves), ``directory`` (a directory standing for
a mount every node has; here on the same disk) and ``s3`` (moto's S3 server on loopback, benchmarks/s3_server.py,
through pyarrow's real S3 client: what an object store costs in requests and copies, not a network's bandwidth).
Per storage, ``--saves`` saves through ``TorchBackend.persist_checkpoint`` (the persist lane's work: write on the
node, then upload), then as many first loads on a second backend with a node directory of its own (``fetched``:
download, then read) and the same of a copy it already holds (``current``: the storage asked whether it changed).
Medians in ms; ``upload_ms`` is save minus the home's save; ``raw_put_ms`` / ``raw_get_ms``: the storage's own
ceiling, the same bytes written and read through pyarrow directly, once. Prints one JSON line:
{"bench": "storage", "model": ..., "rank": 32, "checkpoint_mb": .., "save_ms": {"home": .., "directory": .., "s3": ..},
 "upload_ms": {..}, "fetch_ms": {..}, "current_ms": {..}, "upload_mb_per_s": {..}, "raw_put_ms": {..},
 "raw_get_ms": {..}}
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.s3_server import S3Server  # noqa: E402
from lilo.backend.checkpoints import stored  # noqa: E402
from lilo.backend.models import load_base_model, smollm2_directory  # noqa: E402
from lilo.backend.torch_backend import TorchBackend  # noqa: E402
from lilo.backend.types import LoraSpec, SaveRequest  # noqa: E402
from lilo.engine.commands import Command, Kind  # noqa: E402
from lilo.storage import Storage  # noqa: E402

RANK = 32
MODEL = "model"


def backend_on(base, node: Path, storage: Storage | None) -> TorchBackend:
    """A trainer's backend on a node of its own (its own copy of the base model: a backend adapts the one it gets)."""
    return TorchBackend(copy.deepcopy(base), max_adapters=1, max_rank=RANK, checkpoint_dir=node / "checkpoints",
                        storage=storage.child("checkpoints") if storage else None)


def timed_saves(backend: TorchBackend, saves: int) -> tuple[list[float], str]:
    times, path = [], ""
    for seq in range(saves):
        command = Command(MODEL, seq, Kind.SAVE_WEIGHTS, f"save-{seq}", payload=SaveRequest("bench"))
        captured = backend.capture_checkpoint(command)
        started = time.perf_counter()
        path = backend.persist_checkpoint(command, captured)["path"]
        times.append((time.perf_counter() - started) * 1000)
    return times, path


def timed_fetches(base, root: Path, storage: Storage, path: str, saves: int) -> tuple[list[float], list[float]]:
    fetched, current = [], []
    for n in range(saves):
        reader = backend_on(base, root / f"reader-{n}", storage)
        started = time.perf_counter()
        reader.checkpoints.fetched(path)
        fetched.append((time.perf_counter() - started) * 1000)
        stored.RECHECK_S = 0.0  # ask the storage each time: what a check costs
        started = time.perf_counter()
        reader.checkpoints.fetched(path)
        current.append((time.perf_counter() - started) * 1000)
    return fetched, current


def raw_transfer_ms(storage: Storage, directory: Path) -> tuple[float, float]:
    """The storage's own ceiling, without lilo: the checkpoint's files written (one stream each) and read back (one
    read each) through the same pyarrow filesystem, in ms."""
    files = [file for file in directory.iterdir() if file.is_file()]
    if storage.is_local:
        storage.local_path("raw").mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for file in files:
        with storage.fs.open_output_stream(storage._key(f"raw/{file.name}")) as target:
            target.write(file.read_bytes())
    put = time.perf_counter() - started
    started = time.perf_counter()
    for file in files:
        with storage.fs.open_input_file(storage._key(f"raw/{file.name}")) as source:
            source.read()
    return round(put * 1000, 1), round((time.perf_counter() - started) * 1000, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--saves", type=int, default=5)
    args = parser.parse_args()
    base = load_base_model(smollm2_directory())
    results: dict[str, dict[str, float]] = {"save_ms": {}, "upload_ms": {}, "fetch_ms": {}, "current_ms": {},
                                            "upload_mb_per_s": {}, "raw_put_ms": {}, "raw_get_ms": {}}
    size_mb = 0.0
    with tempfile.TemporaryDirectory(prefix="lilo-bench-storage-") as scratch, contextlib.ExitStack() as stack:
        root = Path(scratch)
        s3 = S3Server()
        stack.callback(s3.stop)
        storages = {"home": None, "directory": Storage(root / "shared"), "s3": Storage(s3.uri("bench"))}
        for name, storage in storages.items():
            writer = backend_on(base, root / name / "writer", storage)
            writer.add_adapter(MODEL, LoraSpec(rank=RANK, seed=0))
            writer.capture_checkpoint(Command(MODEL, 0, Kind.SAVE_WEIGHTS, "warm", payload=SaveRequest("warm")))
            saves, path = timed_saves(writer, args.saves)
            results["save_ms"][name] = round(statistics.median(saves), 1)
            directory = writer.checkpoints.directory(path)
            size_mb = sum(file.stat().st_size for file in directory.iterdir() if file.is_file()) / 2**20
            if storage is not None:
                raw = raw_transfer_ms(storage, directory)
                results["raw_put_ms"][name], results["raw_get_ms"][name] = raw
                fetched, current = timed_fetches(base, root / name, storage, path, args.saves)
                results["fetch_ms"][name] = round(statistics.median(fetched), 1)
                results["current_ms"][name] = round(statistics.median(current), 1)
            writer.remove_adapter(MODEL)
            shutil.rmtree(root / name, ignore_errors=True)
        for name in ("directory", "s3"):
            upload = results["save_ms"][name] - results["save_ms"]["home"]
            results["upload_ms"][name] = round(upload, 1)
            results["upload_mb_per_s"][name] = round(size_mb / (upload / 1000), 1) if upload > 0 else None
    print(json.dumps({"bench": "storage", "model": "SmolLM2-135M", "rank": RANK, "checkpoint_mb": round(size_mb, 1),
                      "saves": args.saves, **results}))


if __name__ == "__main__":
    main()
