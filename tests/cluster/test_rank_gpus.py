"""Which GPU a rank of a sharded trainer takes, when it sees every GPU of its node (``gpu_groups.SHARED_GPUS_ENV``:
Ray leaves CUDA_VISIBLE_DEVICES as the node has it, and each rank finds the one Ray gave it)."""

import pytest

from cluster.gpu_groups import SHARED_GPUS_ENV, own_gpu_index, rank_runtime_env


@pytest.mark.parametrize(("gpu_ids", "visible", "index"), [
    (["3"], None, 3),  # the node's GPUs all visible: Ray's id is torch's index
    (["3"], "", 3),
    (["5"], "4,5,6,7", 1),  # a node started with some of its GPUs: Ray's ids are entries of that list
    (["2"], "2", 0),  # Ray masked it anyway (a rank started without the shared environment)
])
def test_a_rank_finds_its_own_gpu_among_those_it_sees(gpu_ids, visible, index):
    assert own_gpu_index(gpu_ids, visible) == index


@pytest.mark.parametrize(("gpu_ids", "visible", "words"), [
    ([], None, "holds one GPU"), (["0", "1"], None, "holds one GPU"), (["3"], "0,1", "not among")])
def test_a_rank_without_exactly_one_visible_gpu_of_its_own_says_so(gpu_ids, visible, words):
    with pytest.raises(RuntimeError, match=words):
        own_gpu_index(gpu_ids, visible)


def test_only_ranks_with_gpus_share_their_nodes_gpus():
    assert rank_runtime_env(1.0) == {"env_vars": SHARED_GPUS_ENV} and rank_runtime_env(0) is None
