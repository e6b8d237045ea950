"""Joining a trainer's rank group, and sharding the frozen base model over it (FSDP2 per decoder layer)."""

from __future__ import annotations

import dataclasses
import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

# How long a rank waits in one collective for the others (they run each pass in lockstep, so a wait is a pass's
# skew): past it the collective fails, and with it the pass, instead of blocking on a rank that died.
COLLECTIVE_TIMEOUT_S = 20.0


@dataclasses.dataclass(frozen=True)
class RankGroup:
    """Where this process sits in its trainer's group: ``rank`` of ``world``, meeting at ``address`` (a
    ``file://`` rendezvous on the group's node: nothing listens for it), its collectives' sockets on the network
    interface that holds ``host`` (the node's address: loopback in local mode)."""

    rank: int
    world: int
    address: str
    host: str
    timeout_s: float = COLLECTIVE_TIMEOUT_S


@dataclasses.dataclass(frozen=True)
class ShardedBase:
    """What sharding left on this rank and what a pass gathers: bytes of the base weights held here (its shards
    and the replicated rest), and bytes one rank receives to gather the layers once (``layer_gather_bytes``) and the
    decoder's own parameters (``root_gather_bytes``: the final norm; gathered once per pass); ``largest_layer_bytes``:
    the largest decoder layer whole, as a pass holds it while it runs."""

    local_bytes: int
    layer_gather_bytes: int
    root_gather_bytes: int
    largest_layer_bytes: int = 0

    @property
    def gathered_peak_bytes(self) -> int:
        """What a pass holds of gathered layers at once, beside the shards: the one running and the next, which FSDP
        gathers ahead of it."""
        return 2 * self.largest_layer_bytes

    def gathered_per_pass(self, backward: bool) -> int:
        """Bytes this rank receives in FSDP's all-gathers in one pass: every layer in the forward and again in the
        backward (each is resharded after its forward), the decoder's own parameters once."""
        return self.root_gather_bytes + self.layer_gather_bytes * (2 if backward else 1)


def join(group: RankGroup, device: torch.device) -> None:
    """Join the group's default process group (blocks until all ``world`` ranks have)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    _use_interface_of(group.host)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=group.address, rank=group.rank, world_size=group.world,
                            timeout=datetime.timedelta(seconds=group.timeout_s))


def _use_interface_of(host: str) -> None:
    """gloo and NCCL open their sockets on the interface holding ``host`` (unless told otherwise), not on whatever
    the machine's hostname resolves to: in local mode nothing may listen beyond loopback."""
    import psutil

    interface = next((name for name, addresses in psutil.net_if_addrs().items()
                      if any(address.address == host for address in addresses)), None)
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def load_sharded_base(directory: Path, device: torch.device, dtype: torch.dtype,
                      cache_dir: Path | None = None) -> tuple[nn.Module, ShardedBase]:
    """This rank's part of the base model in ``directory``, in ``dtype`` on ``device`` (``shard_base_model``).

    It is loaded as stored, so its weights stay views of the memory-mapped files, whose pages the node's ranks
    share, and cast only once sharded: a rank copies its own shards and the replicated embeddings and head, never
    the whole model (a cast before sharding would make every rank a private copy of all of it). A checkpoint that
    transformers would convert as it loads (per-expert MoE files) is read from its copy in the model's own layout
    under ``cache_dir`` (lilo's model cache by default; ``native_layout``), made once per node."""
    from lilo.backend.models import default_cache_dir, load_base_model
    from lilo.backend.sharding.native_layout import native_layout

    model = load_base_model(native_layout(directory, cache_dir or default_cache_dir()), "cpu", dtype="auto")
    return model, shard_base_model(model, device, dtype)


def shard_base_model(model: nn.Module, device: torch.device, dtype: torch.dtype | None = None) -> ShardedBase:
    """Shard ``model``'s decoder layers (and the decoder's own parameters) over the joined group, moving them to
    ``device`` (and casting them to ``dtype``); the embeddings and head stay whole, moved there too. Call before the
    LoRA layers wrap it: FSDP keeps the frozen linears it found, and the LoRA parameters added after stay plain
    tensors, replicated."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    decoder = model.get_decoder()
    replicated = set(decoder.get_input_embeddings().parameters())
    size = dtype.itemsize if dtype else None
    each_layer = [_bytes(layer.parameters(), size) for layer in decoder.layers]
    root_bytes = sum(_bytes([p], size) for name, p in decoder.named_parameters()
                     if p not in replicated and not name.startswith("layers."))
    for layer in decoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(decoder, mesh=mesh, ignored_params=replicated)
    # The buffers as loaded: from_pretrained keeps RoPE's inv_freq in fp32 whatever the dtype, and a cast to bf16
    # would round the positions of every token.
    buffers = dict(model.named_buffers(remove_duplicate=False))
    model.to(device, dtype)  # the shards' cast, and what FSDP left alone: the embeddings, the head
    for name, buffer in buffers.items():
        path, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(path), leaf, buffer.to(device))
    local = sum(_local_bytes(p) for p in model.parameters())
    share = (world - 1) / world
    return ShardedBase(local, int(sum(each_layer) * share), int(root_bytes * share), max(each_layer))


def _bytes(parameters, element_size: int | None = None) -> int:
    """Bytes of ``parameters``, at ``element_size`` bytes an entry (default: their own dtype's)."""
    return sum(p.numel() * (element_size or p.element_size()) for p in parameters)


def _local_bytes(parameter: torch.Tensor) -> int:
    local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
    return local.numel() * local.element_size()
