"""Tenants sharing one trainer whose passes hold two steps (``--max-batch-tokens`` = 2 x ``--seq``): the shares the
scheduler gives them, through the tinker SDK with two API keys, on a private local lilo with a tenants file.

Every client steps its own model as the cookbook does (forward_backward of ``--seq`` tokens and optim_step sent
together, both waited for, then the next step). Three phases of ``--seconds`` each, the tenants file rewritten
between them (lilo re-reads it on change):
- ``one_vs_six``: tenant a steps six models, tenant b one, equal weights; ``ratio``: b's steps over a's (1.0 is a
  fair share by tenant; by model it would be 1/6);
- ``weights_2_1``: a (weight 2) and b (weight 1) step three models each; ``ratio``: a's steps over b's (2.0);
- ``spare``: a's three models alone, then with b's three, then alone again; steps per second of each (a's spare room
  goes to b while b steps, and back when b stops).
Prints one JSON line:
{"bench": "tenants", "model": .., "seq": .., "one_vs_six": {"a_steps": .., "b_steps": .., "ratio": ..},
 "weights_2_1": {"a_steps": .., "b_steps": .., "ratio": ..},
 "spare": {"a_alone_steps_s": .., "a_shared_steps_s": .., "b_shared_steps_s": .., "a_after_steps_s": ..}}
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from cluster.ports import free_ports
from private_cluster import private_cluster

KEYS = "tml-bench-tenant-a=a\ntml-bench-tenant-b=b\n"
RELOAD_S = 3.0  # lilo looks at the tenants file once a second


class Tenant:
    """One tenant's clients, each stepping its own model in a loop while ``running``."""

    def __init__(self, url: str, name: str, models: int, seq: int) -> None:
        import tinker

        self.service = tinker.ServiceClient(base_url=url, api_key=f"tml-bench-tenant-{name}")
        self.trainings = [self.service.create_lora_training_client(base_model="lilo/tiny-llama", rank=8).result()
                          for _ in range(models)]
        self.seq = seq
        self.steps = 0
        self.running = threading.Event()
        self._lock = threading.Lock()
        for n, training in enumerate(self.trainings):
            threading.Thread(target=self._loop, args=(training, n), daemon=True).start()

    def _loop(self, training, n: int) -> None:
        from tinker import types

        tokens = np.random.default_rng(n).integers(3, 1000, self.seq + 1).tolist()
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * self.seq})
        while True:
            self.running.wait()
            passed = training.forward_backward([datum], "cross_entropy")
            stepped = training.optim_step(types.AdamParams(learning_rate=1e-4))
            passed.result()
            stepped.result()
            with self._lock:
                self.steps += 1


def measure(seconds: float, *tenants: Tenant) -> list[int]:
    """Run ``tenants`` together for ``seconds`` (after a second's warm-up); the steps each completed."""
    for tenant in tenants:
        tenant.running.set()
    time.sleep(1.0)
    start = [tenant.steps for tenant in tenants]
    time.sleep(seconds)
    counts = [tenant.steps - first for tenant, first in zip(tenants, start)]
    for tenant in tenants:
        tenant.running.clear()
    time.sleep(2.0)  # steps in flight finish
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="lilo-bench-tenants-"))
    (directory / "keys").write_text(KEYS)
    tenants_file = directory / "tenants.toml"
    tenants_file.write_text("")
    port = free_ports(1)[0]
    up = ("--trainers", "1", "--max-batch-tokens", str(2 * args.seq), "--max-adapters", "16",
          "--api-keys-file", str(directory / "keys"), "--tenants-file", str(tenants_file))
    with private_cluster("lilo/tiny-llama", port, *up):
        url = f"http://127.0.0.1:{port}"
        a6, b1 = Tenant(url, "a", 6, args.seq), Tenant(url, "b", 1, args.seq)
        a_steps, b_steps = measure(args.seconds, a6, b1)
        one_vs_six = {"a_steps": a_steps, "b_steps": b_steps, "ratio": round(b_steps / max(a_steps, 1), 2)}

        tenants_file.write_text("[tenants.a]\nweight = 2\n")
        time.sleep(RELOAD_S)
        a3, b3 = Tenant(url, "a", 3, args.seq), Tenant(url, "b", 3, args.seq)
        a_steps, b_steps = measure(args.seconds, a3, b3)
        weights = {"a_steps": a_steps, "b_steps": b_steps, "ratio": round(a_steps / max(b_steps, 1), 2)}

        tenants_file.write_text("")
        time.sleep(RELOAD_S)
        (alone,) = measure(args.seconds, a3)
        shared_a, shared_b = measure(args.seconds, a3, b3)
        (after,) = measure(args.seconds, a3)
        rates = {"a_alone": alone, "a_shared": shared_a, "b_shared": shared_b, "a_after": after}
        spare = {f"{phase}_steps_s": round(steps / args.seconds, 2) for phase, steps in rates.items()}
    print(json.dumps({"bench": "tenants", "model": "lilo/tiny-llama", "seq": args.seq, "one_vs_six": one_vs_six,
                      "weights_2_1": weights, "spare": spare}))


if __name__ == "__main__":
    main()
