"""A rank's load of a sharded base (``load_sharded_base``), in two gloo processes: a checkpoint stored in bf16 and
trained in fp32 (a CPU trainer's case) is loaded as stored and cast once sharded, and the two ranks' sharded model
gives the logits of the whole model loaded in fp32 at once."""

import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from lilo.backend.models import build_tiny_llama, load_base_model

TOKENS = [[5, 17, 3, 99, 42, 8, 61, 2]]


def _rank(rank: int, directory: str, rendezvous: str, answers) -> None:
    import torch.distributed as dist

    from lilo.backend.sharding.group import RankGroup, join, load_sharded_base

    join(RankGroup(rank, 2, f"file://{rendezvous}", "127.0.0.1"), torch.device("cpu"))
    model, sharded = load_sharded_base(Path(directory), torch.device("cpu"), torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(TOKENS)).logits
    # As numpy: a tensor would travel as shared memory that goes with this process.
    answers.put((rank, {str(p.dtype) for p in model.parameters()}, sharded.local_bytes, logits.numpy()))
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
    for _, dtypes, local_bytes, logits in results:
        assert dtypes == {str(torch.float32)}
        assert local_bytes < whole_bytes  # its shards, not all of the decoder
        torch.testing.assert_close(torch.from_numpy(logits), expected, rtol=1e-5, atol=1e-5)
