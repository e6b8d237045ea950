"""How many trainers the cluster should have, and where: pure functions of what the reconciler sees (the cluster's
GPU nodes, the trainers it knows, the clock), with no Ray in them (``cluster.reconciler`` gathers the inputs and
carries out the answers).

- ``trainers_to_start``: on every node with GPUs no trainer holds, one trainer per GPU (per N GPUs for a base model
  sharded over N, ``--trainer-ranks``), base models dealt out in turn (the fewest trainers first), as
  ``start_trainers`` deals them at deploy.
- ``may_request_trainer``: one more trainer for a base model whose trainers are all full, up to the cap.
- ``trainers_to_release``: trainers with no models for the idle timeout, never below the minimum of GPU trainers; a
  CPU trainer (started before any GPU joined) once a GPU trainer serves its base model.
- ``config_has_gpu_workers``: whether a `ray up` config can bring GPU nodes (then no CPU trainer starts on the head).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class GpuNode:
    """A live node of the cluster that has GPUs."""

    node_id: str
    gpus: int


@dataclasses.dataclass(frozen=True)
class Seat:
    """A trainer the reconciler knows of: starting (``ready`` False) or ready; ``node_id`` None while Ray has not
    placed it yet (a trainer asked for by demand waits for a node the autoscaler brings)."""

    name: str
    base_model: str
    node_id: str | None
    ready: bool
    models: int = 0
    # When it last held no model (None: it holds some, or is not ready yet).
    idle_since: float | None = None
    # Whether it holds a GPU: False for a CPU trainer, started at deploy on a cluster that had no GPU yet.
    gpu: bool = True
    # Devices it spans (its base sharded over them; its followers in its placement group, on its node).
    ranks: int = 1


def trainers_to_start(nodes: Sequence[GpuNode], seats: Sequence[Seat], base_models: Sequence[str],
                      left_free: Mapping[str, int] | None = None,
                      ranks: Mapping[str, int] | None = None) -> list[tuple[str, str]]:
    """``(node_id, base_model)`` of each trainer to start: a node's GPUs less those its trainers span (starting ones
    included) and less the GPUs left free on it (``left_free``: trainers released there for idleness, whose node the
    autoscaler is to take back), a trainer of base model m taking ``ranks[m]`` GPUs (default 1), so a node of 8
    GPUs gets two trainers of 4. Base models are dealt out in turn (the fewest trainers first) among those that fit
    what is left of the node. Nothing while a trainer waits for a node: Ray gives it the next free GPUs first."""
    if any(seat.node_id is None for seat in seats):
        return []
    left_free, ranks = left_free or {}, ranks or {}
    served = {model: sum(seat.base_model == model for seat in seats) for model in base_models}
    starts: list[tuple[str, str]] = []
    for node in sorted(nodes, key=lambda node: node.node_id):
        free = node.gpus - left_free.get(node.node_id, 0) - sum(seat.ranks for seat in seats
                                                                 if seat.node_id == node.node_id)
        while fitting := [model for model in base_models if ranks.get(model, 1) <= free]:
            model = min(fitting, key=lambda name: (served[name], base_models.index(name)))
            served[model] += 1
            free -= ranks.get(model, 1)
            starts.append((node.node_id, model))
    return starts


def may_request_trainer(base_model: str, seats: Sequence[Seat], max_trainers: int) -> bool:
    """Whether to ask for one more trainer of ``base_model`` (its trainers are all full): not while one of its
    trainers is still starting (that one brings the room), nor at ``max_trainers``."""
    starting = any(seat.base_model == base_model and not seat.ready for seat in seats)
    return not starting and len(seats) < max_trainers


def trainers_to_release(seats: Sequence[Seat], now: float, idle_timeout_s: float, min_trainers: int) -> list[str]:
    """Ready trainers that held no model for ``idle_timeout_s`` (0: never), longest idle first: GPU trainers while
    at least ``min_trainers`` GPU trainers stay, and CPU trainers (started at deploy on a cluster with no GPU yet)
    once a GPU trainer of their base model is ready. From then on a CPU trainer takes no new model
    (``cluster.placement.free_slots``), so it would never be used again; until then it is all that serves its base
    model, and stays whatever the minimum."""
    if idle_timeout_s <= 0:
        return []
    idle = sorted((seat for seat in seats if seat.ready and seat.models == 0 and seat.idle_since is not None
                   and now - seat.idle_since >= idle_timeout_s), key=lambda seat: (seat.idle_since, seat.name))
    on_gpu = {seat.base_model for seat in seats if seat.gpu and seat.ready}
    cpu = [seat.name for seat in idle if not seat.gpu and seat.base_model in on_gpu]
    gpu = [seat.name for seat in idle if seat.gpu]
    return cpu + gpu[:max(0, sum(seat.gpu for seat in seats) - min_trainers)]


def config_has_gpu_workers(config: Mapping[str, Any]) -> bool:
    """Whether a `ray up` cluster config has a worker node type with GPUs (its ``resources`` say so)."""
    head = config.get("head_node_type")
    return any(float((node_type.get("resources") or {}).get("GPU", 0)) > 0
               for name, node_type in (config.get("available_node_types") or {}).items() if name != head)
