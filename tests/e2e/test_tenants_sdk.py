"""Tenants sharing one trainer, through the tinker SDK with three API keys on a service of its own with a tenants
file: a tenant stepping one model gets about the steps of one stepping six (the scheduler shares full passes by
tenant, not by model); limits on amounts refuse at once with a sentence the SDK raises; a tokens-per-minute limit
slows a client with 429s and every step still completes in order; the file is re-read when it changes and on
SIGHUP, without a restart."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from cluster.local import read_state
from helpers import eventually, lilo, own_service, tokens_datum
from lilo.settings import load_settings

KEYS = ("tml-alpha-key=alpha\ntml-beta-key=beta\ntml-gamma-key=gamma\ntml-delta-key=delta\n"
        "tml-epsilon-key=epsilon\ntml-zeta-key=zeta\n")
STEP_TOKENS = 1024
TENANTS = f"""
[tenants.gamma]
max_models = 1
max_rank = 8
base_models = ["lilo/tiny-llama"]
train_tokens_per_min = {3 * STEP_TOKENS}

[tenants.delta]
storage_gb = 1e-9
"""
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def tenants_service(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tenants")
    (directory / "keys").write_text(KEYS)
    tenants_file = directory / "tenants.toml"
    tenants_file.write_text(TENANTS)
    # A pass holds two steps, so the six models of one tenant and the one of another cannot all run together.
    args = ["--num-cpus", "4", "--trainers", "1", "--base-model", "lilo/tiny-llama",
            "--max-batch-tokens", str(2 * STEP_TOKENS),
            "--api-keys-file", str(directory / "keys"), "--tenants-file", str(tenants_file), "--max-adapters", "12"]
    with own_service(*args) as (url, banner):
        home = next(line.split(":", 1)[1].strip() for line in banner.splitlines() if line.strip().startswith("Home:"))
        yield url, tenants_file, read_state(load_settings(env={}, home=Path(home))).pid, home


@pytest.fixture(scope="module")
def gamma(tenants_service):
    """Tenant gamma's client and its one model (max_models 1)."""
    url, *_ = tenants_service
    with client(url, "gamma") as service:
        yield service, service.create_lora_training_client(base_model="lilo/tiny-llama", rank=4).result(
            timeout=TIMEOUT_S)


def client(url: str, tenant: str) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=url, api_key=f"tml-{tenant}-key")


def datum(seed: int) -> types.Datum:
    return tokens_datum(np.random.default_rng(seed).integers(3, 1000, STEP_TOKENS + 1).tolist())


def step(training: tinker.TrainingClient, seed: int) -> float:
    """One training step as the cookbook takes it: forward_backward and optim_step sent together, then both
    awaited."""
    passed = training.forward_backward([datum(seed)], "cross_entropy")
    stepped = training.optim_step(types.AdamParams(learning_rate=1e-3))
    loss = passed.result(timeout=TIMEOUT_S).metrics["loss:sum"]
    stepped.result(timeout=TIMEOUT_S)
    return loss


def test_one_model_of_a_tenant_gets_about_the_steps_of_another_tenants_six(tenants_service):
    url, *_ = tenants_service
    with client(url, "alpha") as alpha, client(url, "beta") as beta:
        six = [alpha.create_lora_training_client(base_model="lilo/tiny-llama", rank=4).result(timeout=TIMEOUT_S)
               for _ in range(6)]
        one = beta.create_lora_training_client(base_model="lilo/tiny-llama", rank=4).result(timeout=TIMEOUT_S)
        done, counting = {"alpha": 0}, threading.Lock()
        stop = threading.Event()

        def alpha_loop(training: tinker.TrainingClient, n: int) -> None:
            seed = 100 * n
            while not stop.is_set():
                step(training, seed)
                seed += 1
                with counting:
                    done["alpha"] += 1

        threads = [threading.Thread(target=alpha_loop, args=(t, n), daemon=True) for n, t in enumerate(six)]
        for thread in threads:
            thread.start()
        time.sleep(2)  # alpha's six are all stepping before beta starts
        start = done["alpha"]
        beta_steps = 12
        for seed in range(beta_steps):
            step(one, seed)
        alpha_steps = done["alpha"] - start
        stop.set()
        for thread in threads:
            thread.join(timeout=TIMEOUT_S)
    ratio = beta_steps / max(alpha_steps, 1)
    print(f"beta's one model: {beta_steps} steps while alpha's six took {alpha_steps} (ratio {ratio:.2f})")
    # Shared by model, beta's one model would get a sixth of alpha's steps (its turn among seven). Shared by tenant,
    # as many as alpha's six together while the trainer is what they wait for; a lockstep client's own round trips
    # between its forward_backward and optim_step leave passes it cannot be in (measured 0.57 to 0.71 here,
    # bench_tenants), so the bound is well above a sixth and below that.
    assert ratio >= 0.35, (beta_steps, alpha_steps)


def test_a_tenants_models_share_its_turns_evenly_while_the_trainer_is_saturated(tenants_service):
    # Six lockstep clients of one tenant and one of another, a pass that holds two steps: the second tenant's model
    # takes about half the places, and the first's six share the other half evenly. Before the scheduler kept a
    # service per model (lilo.engine.fair_share), the one of the six filled in beside the other tenant's anchor kept
    # its place in the rotation and took nearly every place of its tenant; the rest starved.
    url, *_ = tenants_service
    rounds = 4  # the steps each of the six makes on average
    with client(url, "epsilon") as epsilon, client(url, "zeta") as zeta:
        six = [epsilon.create_lora_training_client(base_model="lilo/tiny-llama", rank=4).result(timeout=TIMEOUT_S)
               for _ in range(6)]
        one = zeta.create_lora_training_client(base_model="lilo/tiny-llama", rank=4).result(timeout=TIMEOUT_S)
        steps, counting, stop = [0] * 7, threading.Lock(), threading.Event()

        def loop(training: tinker.TrainingClient, n: int) -> None:
            while not stop.is_set():
                step(training, 1000 + n)
                with counting:
                    steps[n] += 1

        threads = [threading.Thread(target=loop, args=(t, n), daemon=True) for n, t in enumerate([*six, one])]
        for thread in threads:
            thread.start()
        eventually(lambda: sum(steps[:6]) >= rounds * 6, lambda: f"{rounds} rounds of the six's steps; made {steps}",
                   timeout_s=TIMEOUT_S)
        made = list(steps[:6])
        stop.set()
        for thread in threads:
            thread.join(timeout=TIMEOUT_S)
    print(f"steps of one tenant's six models while another's one stepped {steps[6]}: {made}")
    # Fair, the six finish steps in turn, so their counts stay within a few steps of each other; starving, most stay
    # at the step or two they made before the others' rhythm took over.
    assert max(made) - min(made) <= 3 and min(made) >= rounds // 2, made


def test_usage_says_what_each_tenant_used_to_it_and_to_the_operator(tenants_service):
    url, _, _, home = tenants_service  # after the fair share test: alpha stepped six models (unloaded with its session)

    def usage(tenant: str) -> dict:
        return httpx.get(f"{url}/api/v1/usage", headers={"X-API-Key": f"tml-{tenant}-key"}, timeout=60).json()

    alpha = usage("alpha")
    assert alpha["tenant"] == "alpha" and alpha["models"] == 0 and alpha["inflight"] == 0, alpha
    assert alpha["train_tokens"] >= 6 * STEP_TOKENS and alpha["requests"] >= 6 + 12, alpha  # creations and steps
    assert alpha["execute_s"] > 0 and alpha["commands"] >= 12 and alpha["limits"]["weight"] == 1, alpha
    with client(url, "beta") as beta:
        training = beta.create_lora_training_client(base_model="lilo/tiny-llama", rank=4).result(timeout=TIMEOUT_S)
        before = usage("beta")
        step(training, 3)
        after = usage("beta")
        assert after["models"] == before["models"] >= 1 and after["tenant"] == "beta"
        assert after["train_tokens"] - before["train_tokens"] == STEP_TOKENS
        assert after["requests"] - before["requests"] == 2 and after["execute_s"] > before["execute_s"]
        status = lilo("status", "--home", home, "--tenants", "--json", timeout_s=60)
        tenants = json.loads(status.stdout)["tenants"]
        assert tenants["beta"]["models"] == after["models"]
        assert tenants["alpha"]["train_tokens"] >= alpha["train_tokens"]
        assert tenants["gamma"]["limits"]["max_models"] == 1
        shown = lilo("status", "--home", home, "--tenants", timeout_s=60).stdout
        assert f"    beta: {after['models']} model(s), " in shown and "max_models 1, max_rank 8" in shown, shown


def test_a_save_over_the_tenants_storage_is_refused_and_the_model_trains_on(tenants_service):
    url, *_ = tenants_service
    with client(url, "delta") as delta:
        training = delta.create_lora_training_client(base_model="lilo/tiny-llama", rank=4).result(timeout=TIMEOUT_S)
        step(training, 1)
        training.save_state("first").result(timeout=TIMEOUT_S)  # nothing kept yet: allowed
        with pytest.raises(tinker.PermissionDeniedError, match=r"'delta' may keep 1e-09 GB of checkpoints \(storage_gb"
                                                               r" in the tenants file\) and keeps"):
            training.save_state("second").result(timeout=TIMEOUT_S)
        step(training, 2)  # the refused save's seq does not hold the model's next requests


def test_limits_on_amounts_refuse_at_once_and_say_which(gamma):
    service, _ = gamma
    started = time.monotonic()
    with pytest.raises(tinker.PermissionDeniedError, match=r"up to rank 8 \(max_rank in the tenants file\), not 16"):
        service.create_lora_training_client(base_model="lilo/tiny-llama", rank=16).result(timeout=TIMEOUT_S)
    with pytest.raises(tinker.PermissionDeniedError, match=r"may not train 'lilo/tiny-qwen3' \(base_models in the "
                                                           r"tenants file allows lilo/tiny-llama\)"):
        service.create_lora_training_client(base_model="lilo/tiny-qwen3", rank=4).result(timeout=TIMEOUT_S)
    with pytest.raises(tinker.PermissionDeniedError, match=r"may hold 1 models \(max_models in the tenants file\) "
                                                           r"and holds 1; unload one"):
        service.create_lora_training_client(base_model="lilo/tiny-llama", rank=4).result(timeout=TIMEOUT_S)
    assert time.monotonic() - started < 30  # raised at once, not retried for minutes


def test_a_tenant_over_its_tokens_per_minute_is_slowed_and_completes_every_step_in_order(gamma):
    _, training = gamma
    started = time.monotonic()
    # Four steps of 60 tokens under a limit of 180 a minute: the fourth waits (429, Retry-After) until the first's
    # tokens age out, then runs, after the third.
    losses = [step(training, 7) for _ in range(4)]
    took = time.monotonic() - started
    assert losses == sorted(losses, reverse=True)  # the same datum, learned step after step, in order
    assert took > 20, took  # it was held back (a refusal the SDK waited out), not refused for good


def test_the_tenants_file_is_re_read_on_change_and_on_sighup_without_a_restart(tenants_service):
    url, tenants_file, supervisor, _ = tenants_service
    with client(url, "beta") as beta:
        beta.create_lora_training_client(base_model="lilo/tiny-llama", rank=4).result(timeout=TIMEOUT_S)
        # Changed: beta may hold one model, and holds one already.
        tenants_file.write_text(TENANTS + "\n[tenants.beta]\nmax_models = 1\n")
        time.sleep(3)
        with pytest.raises(tinker.PermissionDeniedError, match=r"'beta' may hold 1 models"):
            beta.create_lora_training_client(base_model="lilo/tiny-llama", rank=4).result(timeout=TIMEOUT_S)
        # Changed again, with the old modification time put back: only SIGHUP makes lilo read it.
        before = tenants_file.stat()
        tenants_file.write_text(TENANTS + "\n[tenants.beta]\nmax_models = 9\n")
        os.utime(tenants_file, ns=(before.st_atime_ns, before.st_mtime_ns))
        time.sleep(2)
        with pytest.raises(tinker.PermissionDeniedError, match=r"'beta' may hold 1 models"):
            beta.create_lora_training_client(base_model="lilo/tiny-llama", rank=4).result(timeout=TIMEOUT_S)
        os.kill(supervisor, signal.SIGHUP)
        time.sleep(3)
        beta.create_lora_training_client(base_model="lilo/tiny-llama", rank=4).result(timeout=TIMEOUT_S)
