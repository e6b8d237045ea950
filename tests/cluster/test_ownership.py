"""Every request for a model reaches the trainer that owns it, checked from the trainers' side.

The session cluster runs two trainers per base model (the registered tiny model and one from a local directory).
"""

import time

import httpx
import numpy as np
import ray
import tinker
from tinker import types

from cluster.futures_actor import FUTURES_ACTOR_NAME
from cluster.local import NAMESPACE
from helpers import AUTH


def datum(seed: int) -> types.Datum:
    tokens = np.random.default_rng(seed).integers(0, 1000, 17).tolist()
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 16})


def test_each_model_runs_only_on_its_owner_across_trainers_and_base_models(local_cluster, ray_driver):
    steps = 2
    futures_actor = ray.get_actor(FUTURES_ACTOR_NAME, namespace=NAMESPACE)
    trainers = [f"lilo-trainer-{i}" for i in range(4)]
    served = {name: ray.get(ray.get_actor(name, namespace=NAMESPACE).ready.remote())["base_model"]
              for name in trainers}
    # Placement fills the least loaded trainer first; earlier tests may have left the two of a base model uneven,
    # so make enough models that both must get at least two of them.
    loads = {name: 0 for name in trainers}
    for owner in ray.get(futures_actor.placement.remote()).values():
        if owner in loads:  # other tests place runs on trainers that never existed
            loads[owner] += 1
    counts = {}
    for base in local_cluster.base_models:
        pair = [loads[name] for name in trainers if served[name] == base]
        assert len(pair) == 2
        counts[base] = 4 + abs(pair[0] - pair[1])
    with tinker.ServiceClient(base_url=local_cluster.api_url, api_key="tml-local-test") as service:
        clients = {base: [service.create_lora_training_client(base_model=base, rank=4).result(timeout=120)
                          for _ in range(counts[base])] for base in local_cluster.base_models}
        everyone = [client for group in clients.values() for client in group]
        for _ in range(steps):
            futures = [(c.forward_backward([datum(n)], "cross_entropy"), c.optim_step(types.AdamParams()))
                       for n, c in enumerate(everyone)]
            for backward, optim in futures:
                backward.result(timeout=120)
                optim.result(timeout=120)
        # Checked before the client closes, which unloads its models.
        placement = ray.get(futures_actor.placement.remote())
        owners = {client.model_id: placement[client.model_id] for client in everyone}
        # Each base model's models are spread over both of its trainers, and each sits on a trainer serving it.
        for base, group in clients.items():
            ours = [owners[c.model_id] for c in group]
            assert all(served[owner] == base for owner in ours)
            assert all(ours.count(owner) >= 2 for owner in set(ours)) and len(set(ours)) == 2
        for model_id, owner in owners.items():
            for name in trainers:
                trainer = ray.get_actor(name, namespace=NAMESPACE)
                snapshot = ray.get(trainer.timing.remote(model_id))
                if name == owner:
                    # The owner ran every step of it: forward_backward and optim_step, `steps` times each.
                    assert snapshot["phases"]["forward_backward.execute"]["count"] == steps
                    assert snapshot["phases"]["optim_step.execute"]["count"] == steps
                else:
                    assert snapshot is None  # no other trainer ever held it


def test_two_clients_stepping_at_once_share_one_pass(local_cluster, ray_driver):
    futures_actor = ray.get_actor(FUTURES_ACTOR_NAME, namespace=NAMESPACE)
    with tinker.ServiceClient(base_url=local_cluster.api_url, api_key="tml-local-test") as service:
        # Five models over the two trainers of this base model: three share one (pigeonhole).
        clients = [service.create_lora_training_client(base_model=local_cluster.base_models[0], rank=4)
                   .result(timeout=120) for _ in range(5)]
        placement = ray.get(futures_actor.placement.remote())
        by_trainer: dict[str, list] = {}
        for client in clients:
            by_trainer.setdefault(placement[client.model_id], []).append(client)
        busy, first, second = next(group for group in by_trainer.values() if len(group) >= 3)[:3]
        # A long pass of a third model (1,024 rows, seconds on this model) keeps the trainer busy while both
        # clients' steps arrive; they then run together in the next pass.
        held = busy.forward_backward([datum(100 + n) for n in range(1024)], "cross_entropy")
        time.sleep(1.0)  # let the long pass start first
        steps = [client.forward_backward([datum(n)], "cross_entropy") for n, client in enumerate((first, second))]
        held.result(timeout=120)
        for step in steps:
            step.result(timeout=120)
        for client in (first, second):
            timing = httpx.get(f"{local_cluster.api_url}/api/v1/timing", params={"model_id": client.model_id},
                               headers=AUTH).json()
            assert timing["phases"]["forward_backward.execute"]["mean_batch"] > 1
