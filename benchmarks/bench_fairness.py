"""Fair share under saturation, per model: a trainer whose pass holds two steps of ``--seq`` tokens
(``--max-batch-tokens`` = 2 x ``--seq``), stepped by lockstep clients of one or two tenants through the tinker SDK
(one API key per tenant, a tenants file for the weights) on a private local lilo.

Every client steps its own model as the cookbook does (forward_backward and optim_step sent together, both waited
for, then the next step), for ``--seconds`` after a warm-up, in four cases:
- ``one_tenant_8``: one tenant, 8 models;
- ``six_plus_one``: tenant a 6 models, tenant b 1, equal weights;
- ``weights_2_1``: a (weight 2) and b (weight 1), 3 models each;
- ``step_sizes``: one tenant, 6 models, half stepping ``--seq`` / 2 tokens and half 3 x ``--seq`` / 2.

A model's *fair share* is its tenant's weighted share of the tokens the trainer ran in the case, split evenly over the
tenant's models; ``share`` is the tokens the model got over that (1.0: exactly fair). Per tenant, ``spread`` is its
models' most over fewest share (with equal step sizes, most steps over fewest; null where a model made no step, as
is ``worst_spread`` then). The goal: every spread <= 1.5 and every share >= 0.5. Prints one JSON line:
{"bench": "fairness", "model": .., "seq": .., "budget": .., "seconds": ..,
 "cases": {name: {"models": [[tenant, tokens_per_step, steps, share], ...], "spread": {tenant: ..},
                  "min_share": ..}, ...},
 "worst_spread": .., "worst_share": ..}
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from cluster.ports import free_ports
from private_cluster import private_cluster

TENANTS = ("a", "b")
RELOAD_S = 3.0  # lilo looks at the tenants file once a second
WARM_UP_S = 3.0


@dataclasses.dataclass(frozen=True)
class Case:
    models: tuple[tuple[str, int], ...]  # (tenant, tokens per step) of each model
    weights: dict[str, float]


def cases(seq: int) -> dict[str, Case]:
    small, large = seq // 2, 3 * seq // 2
    return {
        "one_tenant_8": Case((("a", seq),) * 8, {}),
        "six_plus_one": Case((("a", seq),) * 6 + (("b", seq),), {}),
        "weights_2_1": Case((("a", seq),) * 3 + (("b", seq),) * 3, {"a": 2.0}),
        "step_sizes": Case((("a", small), ("a", large)) * 3, {}),
    }


class Client:
    """One model stepped in lockstep on a thread of its own while ``running``; counts its steps."""

    def __init__(self, service, tenant: str, tokens: int, seed: int, running: threading.Event,
                 stopping: threading.Event) -> None:
        self.tenant, self.tokens, self.steps = tenant, tokens, 0
        self.training = service.create_lora_training_client(base_model="lilo/tiny-llama", rank=8).result()
        self._running, self._stopping = running, stopping
        self.thread = threading.Thread(target=self._loop, args=(seed,), daemon=True)
        self.thread.start()

    def _loop(self, seed: int) -> None:
        from tinker import types

        ids = np.random.default_rng(seed).integers(3, 1000, self.tokens + 1).tolist()
        datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * self.tokens})
        while self._running.wait() and not self._stopping.is_set():
            passed = self.training.forward_backward([datum], "cross_entropy")
            stepped = self.training.optim_step(types.AdamParams(learning_rate=1e-4))
            passed.result()
            stepped.result()
            self.steps += 1


def measure(url: str, case: Case, seconds: float) -> dict:
    """Run ``case``'s clients together; each model's steps in ``seconds`` after the warm-up, and its share."""
    import tinker

    services = {tenant: tinker.ServiceClient(base_url=url, api_key=f"tml-bench-fair-{tenant}") for tenant in TENANTS}
    running, stopping = threading.Event(), threading.Event()
    clients = [Client(services[tenant], tenant, tokens, n, running, stopping)
               for n, (tenant, tokens) in enumerate(case.models)]
    running.set()
    time.sleep(WARM_UP_S)
    first = [client.steps for client in clients]
    time.sleep(seconds)
    steps = [client.steps - before for client, before in zip(clients, first)]
    stopping.set()
    for client in clients:
        client.thread.join()
    for service in services.values():
        service.close("success").result()
    return shares(case, steps)


def shares(case: Case, steps: list[int]) -> dict:
    tokens = [n * step_tokens for n, (_, step_tokens) in zip(steps, case.models)]
    tenants = sorted({tenant for tenant, _ in case.models})
    weight = {tenant: case.weights.get(tenant, 1.0) for tenant in tenants}
    models_of = {tenant: sum(1 for t, _ in case.models if t == tenant) for tenant in tenants}
    total = sum(tokens)
    fair = {tenant: total * weight[tenant] / sum(weight.values()) / models_of[tenant] for tenant in tenants}
    share = [got / fair[tenant] if fair[tenant] else 0.0 for got, (tenant, _) in zip(tokens, case.models)]
    spread = {}
    for tenant in tenants:
        own = [s for s, (t, _) in zip(share, case.models) if t == tenant]
        spread[tenant] = round(max(own) / min(own), 2) if min(own) > 0 else None  # None: a model made no step
    return {"models": [[tenant, step_tokens, n, round(s, 2)] for (tenant, step_tokens), n, s
                       in zip(case.models, steps, share)],
            "spread": spread, "min_share": round(min(share), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--cases", default=None, help="comma-separated names of the cases to run (default: all)")
    args = parser.parse_args()
    chosen = cases(args.seq)
    if args.cases:
        chosen = {name: chosen[name] for name in args.cases.split(",")}
    directory = Path(tempfile.mkdtemp(prefix="lilo-bench-fairness-"))
    (directory / "keys").write_text("".join(f"tml-bench-fair-{tenant}={tenant}\n" for tenant in TENANTS))
    tenants_file = directory / "tenants.toml"
    tenants_file.write_text("")
    port = free_ports(1)[0]
    up = ("--trainers", "1", "--max-batch-tokens", str(2 * args.seq), "--max-adapters", "32",
          "--api-keys-file", str(directory / "keys"), "--tenants-file", str(tenants_file))
    results = {}
    with private_cluster("lilo/tiny-llama", port, *up):
        url = f"http://127.0.0.1:{port}"
        for name, case in chosen.items():
            tenants_file.write_text("".join(f"[tenants.{t}]\nweight = {w}\n" for t, w in case.weights.items()))
            time.sleep(RELOAD_S)
            results[name] = measure(url, case, args.seconds)
    spreads = [s for result in results.values() for s in result["spread"].values()]
    worst_spread = None if None in spreads else max(spreads)
    print(json.dumps({"bench": "fairness", "model": "lilo/tiny-llama", "seq": args.seq, "budget": 2 * args.seq,
                      "seconds": args.seconds, "cases": results, "worst_spread": worst_spread,
                      "worst_share": min(result["min_share"] for result in results.values())}))


if __name__ == "__main__":
    main()
