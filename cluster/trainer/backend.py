"""Building a trainer's ``TorchBackend`` on its torch thread: the same for a 1-rank trainer and for each rank of a
sharded one (``cluster.trainer.ranks``). Torch is imported inside: Ray imports the actor modules in processes that
hold a trainer's handle and need no torch."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import ray

if TYPE_CHECKING:
    from cluster.trainer.config import TrainerConfig
    from lilo.backend.sharding.group import RankGroup

logger = logging.getLogger(__name__)


def build_backend(name: str, base_model: str, config: TrainerConfig, group: RankGroup | None = None) -> Any:
    """The backend of trainer ``name`` (or of its rank ``group.rank``): the base model loaded onto this process's
    device (sharded over ``group`` when given, after joining it), its adapter slots, its pass budget."""
    from lilo.backend.training.batch_tokens import size_batch_tokens
    from lilo.backend.training.memory_cap import cap_bytes, cap_memory
    from lilo.backend.models import compute_dtype, load_base_model, load_decoder, model_directory, resolve_device
    from lilo.backend.kernels import kernel_report
    from lilo.backend.paging.policy import host_adapter_bytes
    from lilo.backend.sharding.group import join, load_sharded_base
    from lilo.backend.torch_backend import TorchBackend
    from lilo.backend.vision import image_layout
    from lilo.storage import CHECKPOINTS, PAGES, Storage

    directory = model_directory(base_model, config.model_cache_dir)
    device = resolve_device(config.device)
    if group is not None and device.type == "cuda":  # it sees all of its node's GPUs (gpu_groups.SHARED_GPUS_ENV)
        import torch

        from cluster.gpu_groups import assigned_gpu_ids, own_gpu_index

        device = torch.device("cuda", own_gpu_index(assigned_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES")))
    images = image_layout(directory)  # a sharded trainer's ranks each hold the whole (frozen) vision tower
    sharded = None
    if group is None:
        model = load_base_model(directory, device)
    else:
        join(group, device)
        # Memory-mapped on the host first, then each layer's shard onto the device: no device ever holds the whole
        # model, and no rank a private copy of it.
        model, sharded = load_sharded_base(directory, device, compute_dtype(device), config.model_cache_dir)
    follower = group is not None and group.rank > 0
    node_id = ray.get_runtime_context().get_node_id()
    page_dir = config.node_directory(config.page_dir, node_id) / name if config.page_dir and not follower else None
    checkpoint_dir = config.node_directory(config.checkpoint_dir, node_id) if config.checkpoint_dir else None
    storage = Storage(config.storage) if config.storage else None
    backend = TorchBackend(model, max_adapters=config.max_adapters, max_rank=config.max_rank,
                           sampler_slots=config.sampler_slots, checkpoint_dir=checkpoint_dir,
                           storage=storage and storage.child(CHECKPOINTS),
                           page_storage=storage and storage.child(PAGES),
                           base_model_name=base_model, decode=load_decoder(directory),
                           host_adapter_bytes=0 if follower else host_adapter_bytes(config.host_adapter_mb),
                           disk_adapter_bytes=0 if follower else int(config.disk_adapter_gb * 2**30),
                           page_dir=page_dir, sharded=sharded, optimizer=not follower,
                           images=images, pack=config.pack)
    # Capped and sized once the model and its slots are in: what is free then is what a pass may use.
    free_under_cap = cap_memory(cap_bytes(config.memory_gb, backend.device.type == "cuda"))
    backend.max_batch_tokens = config.max_batch_tokens or size_batch_tokens(
        backend.model, backend.device, backend.slot_state_bytes(), free_under_cap,
        reserved_bytes=sharded.gathered_peak_bytes if sharded else 0)
    if not follower:
        kernels = kernel_report(backend.bank.family, backend.device.type)
        if kernels:
            logger.info("%s: %s", name, kernels)
        logger.info("%s: %s passes of at most %d tokens%s%s", name, "packed" if backend.packs else "padded",
                    backend.max_batch_tokens,
                    "" if config.max_batch_tokens else " (sized from the device's free memory)",
                    f" per rank, over {group.world} ranks" if group else "")
    return backend
