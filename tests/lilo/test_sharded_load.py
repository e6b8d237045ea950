"""A rank's load of a sharded base (``load_sharded_base``), in two gloo processes: a checkpoint stored in bf16 and
trained in fp32 (a CPU trainer's case) is loaded as stored and cast once sharded, and the two ranks' sharded model
gives the logits of the whole model loaded in fp32 at once; in either dtype only the parameters are cast."""

import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from lilo.backend.models import build_tiny, build_tiny_llama, load_base_model

TOKENS = [[5, 17, 3, 99, 42, 8, 61, 2]]


def dtypes(model) -> tuple[set[str], dict[str, str]]:
    """The dtypes of ``model``'s parameters, and of each of its buffers."""
    return {str(p.dtype) for p in model.parameters()}, {name: str(b.dtype) for name, b in model.named_buffers()}


def _rank(rank: int, directory: str, rendezvous: str, answers) -> None:
    import torch.distributed as dist

    from lilo.backend.sharding.group import RankGroup, join, load_sharded_base

    join(RankGroup(rank, 2, f"file://{rendezvous}", "127.0.0.1"), torch.device("cpu"))
    model, sharded = load_sharded_base(Path(directory), torch.device("cpu"), torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(TOKENS)).logits
    # And in bf16, a GPU trainer's dtype (only its dtypes: no bf16 forward over gloo here).
    half, _ = load_sharded_base(Path(directory), torch.device("cpu"), torch.bfloat16)
    # As numpy: a tensor would travel as shared memory that goes with this process.
    answers.put((rank, sharded.local_bytes, logits.numpy(), dtypes(model), dtypes(half)))
    dist.barrier()
    dist.destroy_process_group()


def test_a_bf16_checkpoint_sharded_over_two_ranks_is_cast_to_fp32_and_answers_as_the_whole_model(tmp_path):
    directory = build_tiny_llama(tmp_path / "tiny", seed=3)
    stored = load_base_model(directory, dtype=torch.bfloat16)
    stored.save_pretrained(directory)  # now stored in bf16
    assert load_base_model(directory, dtype="auto").dtype == torch.bfloat16
    whole = load_base_model(directory, dtype=torch.float32)
    with torch.no_grad():
        expected = whole(input_ids=torch.as_tensor(TOKENS)).logits
    answers = mp.get_context("spawn").Queue()
    with tempfile.TemporaryDirectory() as scratch:
        mp.spawn(_rank, args=(str(directory), str(Path(scratch) / "rendezvous"), answers), nprocs=2)
    results = sorted((answers.get() for _ in range(2)), key=lambda answer: answer[0])
    whole_bytes = sum(p.numel() * 4 for p in whole.parameters())
    # Only the parameters are cast: RoPE's inv_freq stays fp32, as a whole load in bf16 keeps it.
    buffers = dtypes(load_base_model(directory, dtype=torch.bfloat16))[1]
    assert buffers and set(buffers.values()) == {str(torch.float32)}
    for _, local_bytes, logits, full, half in results:
        assert full == ({str(torch.float32)}, buffers) and half == ({str(torch.bfloat16)}, buffers)
        assert local_bytes < whole_bytes  # its shards, not all of the decoder
        torch.testing.assert_close(torch.from_numpy(logits), expected, rtol=1e-5, atol=1e-5)


def _moe_rank(rank: int, directory: str, cache: str, rendezvous: str, answers) -> None:
    import torch.distributed as dist

    from lilo.backend.sharding.group import RankGroup, join, load_sharded_base

    join(RankGroup(rank, 2, f"file://{rendezvous}", "127.0.0.1"), torch.device("cpu"))
    model, sharded = load_sharded_base(Path(directory), torch.device("cpu"), torch.float32, Path(cache))
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(TOKENS)).logits
    answers.put((rank, sharded.local_bytes, logits.numpy()))
    dist.barrier()
    dist.destroy_process_group()


def test_a_checkpoint_that_converts_on_load_is_written_once_in_the_models_layout_and_loads_as_stored(tmp_path):
    from lilo.backend.sharding.native_layout import converts_on_load, native_layout, stored_tensor_names

    dense = build_tiny(tmp_path / "dense", "tiny-llama")
    assert not converts_on_load(dense) and native_layout(dense, tmp_path / "cache") == dense
    # Qwen3-MoE as checkpoints ship it: each expert's projections apart, fused into 3-D tensors by the load.
    moe = build_tiny(tmp_path / "moe", "tiny-qwen3-moe")
    assert any(".experts.0.gate_proj." in name for name in stored_tensor_names(moe)) and converts_on_load(moe)
    native = native_layout(moe, tmp_path / "cache")
    assert native.parent == tmp_path / "cache" / "native" and not converts_on_load(native)
    assert any(name.endswith(".experts.gate_up_proj") for name in stored_tensor_names(native))
    assert (native / "config.json").read_text() == (moe / "config.json").read_text()
    written = {path.name: path.stat().st_mtime_ns for path in native.iterdir()}
    assert native_layout(moe, tmp_path / "cache") == native  # once: the second start finds it
    assert {path.name: path.stat().st_mtime_ns for path in native.iterdir()} == written
    stored, copied = load_base_model(moe, dtype="auto"), load_base_model(native, dtype="auto")
    assert stored.state_dict().keys() == copied.state_dict().keys()
    for name, tensor in stored.state_dict().items():
        assert torch.equal(tensor, copied.state_dict()[name]), name


def test_an_moe_checkpoint_sharded_over_two_ranks_answers_as_the_whole_model(tmp_path):
    directory = build_tiny(tmp_path / "moe", "tiny-qwen3-moe", seed=4)
    whole = load_base_model(directory, dtype=torch.float32)
    with torch.no_grad():
        expected = whole(input_ids=torch.as_tensor(TOKENS)).logits
    answers = mp.get_context("spawn").Queue()
    with tempfile.TemporaryDirectory() as scratch:
        mp.spawn(_moe_rank, args=(str(directory), str(tmp_path / "cache"), str(Path(scratch) / "rendezvous"),
                                  answers), nprocs=2)
    results = sorted((answers.get() for _ in range(2)), key=lambda answer: answer[0])
    copies = [path.name for path in (tmp_path / "cache" / "native").iterdir() if path.is_dir()]
    assert len(copies) == 1 and not copies[0].endswith(".partial"), copies  # one copy, made whole
    whole_bytes = sum(p.numel() * 4 for p in whole.parameters())
    for _, local_bytes, logits in results:
        assert local_bytes < whole_bytes
        # Read from the fused copy rather than fused while loading: the same values, other memory layouts, so
        # the experts' matmuls may round differently.
        torch.testing.assert_close(torch.from_numpy(logits), expected, rtol=1e-5, atol=1e-5)
