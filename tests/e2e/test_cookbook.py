"""The public tinker-cookbook (0.6.1), unchanged, runs its own recipes against the service: supervised chat
fine-tuning that saves a checkpoint, then RL on the arithmetic environment from that checkpoint with each loss a
user would pick. Each recipe runs as a user runs it, `python -m tinker_cookbook.recipes.<recipe>.train key=value ...`,
offline, and the tests read what it leaves in its log_path. test_cookbook_recipes.py runs more of its recipes
(DPO, on-policy distillation, guess_number, SDFT) with these helpers."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY_DIRECTORY

from helpers import API_KEY

# SmolLM2's chat template is ChatML with no thinking block; the cookbook's qwen3_instruct renderer produces exactly
# its tokens (the tiny model in TINY_DIRECTORY carries SmolLM2's tokenizer and template).
RENDERER = "qwen3_instruct"
# The arithmetic environment's few-shot turn (ArithmeticEnv.standard_fewshot_prefix): the supervised data starts
# with it too, so the checkpoint answers the prompts RL will show it.
FEWSHOT = [{"role": "user", "content": "What is 4 + 5?"}, {"role": "assistant", "content": "9"}]
# The cookbook's sampler-vs-trainer check (rl.metrics.compute_kl_sample_train) on the logprobs of the same tokens.
# Sampler and trainer run the same fp32 weights on the CPU, so they agree to rounding.
KL_LIMIT = 1e-3
RECIPE_TIMEOUT_S = 900
# A sum of 100 or more takes four tokens with the stop token, so three-digit answers run out of room and lose the
# format reward while shorter ones keep it. The tiny model cannot add, so it guesses the length, and samples of one
# prompt differ in reward. With the recipe's default of 5 every answer fits, and a checkpoint that has learnt to stop
# leaves every group's rewards equal (no advantage, nothing for the loss to train on).
MAX_TOKENS = 3


def recipe_environment(api_url: str) -> dict[str, str]:
    """What a user offline sets: the service's URL and key (the SDK reads TINKER_BASE_URL and TINKER_API_KEY), no
    model hub, no W&B, no SDK telemetry."""
    environment = {**os.environ, "TINKER_BASE_URL": api_url, "TINKER_API_KEY": API_KEY,
                   "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled",
                   "TINKER_TELEMETRY": "0"}
    # Every run fetches the cookbook's price list from the internet (cost_estimation.load_model_pricing, which
    # logs a warning without it). A proxy nobody listens on keeps that on loopback; the SDK's own requests to the
    # service skip it.
    environment.update({"HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
                        "NO_PROXY": "127.0.0.1,localhost"})
    return environment


def run_recipe(module: str, api_url: str, cwd: Path | None = None, variables: dict[str, str] | None = None,
               **arguments: object) -> subprocess.CompletedProcess:
    """``python -m <module> key=value ...`` (the recipe's chz command line), in ``cwd`` where given, with
    ``variables`` added to the offline user's environment (a recipe argument may itself be called ``env``)."""
    command = [sys.executable, "-m", module, *(f"{key}={value}" for key, value in arguments.items())]
    return subprocess.run(command, env={**recipe_environment(api_url), **(variables or {})}, cwd=cwd,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=RECIPE_TIMEOUT_S)


def failure_report(run: subprocess.CompletedProcess) -> str:
    return f"exit {run.returncode}\n{(run.stdout + run.stderr)[-6000:]}"


def metrics_rows(log_path: Path) -> list[dict]:
    """The rows of the metrics.jsonl the cookbook writes in its log_path, one per step."""
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]


def write_addition_conversations(path: Path, count: int, seed: int = 0) -> Path:
    """A chat JSONL (the recipe's `dataset=<file>.jsonl` option) of additions shaped like the arithmetic env's
    prompts: answering one teaches the model to write a number and stop, which the environment rewards."""
    rng = random.Random(seed)
    with path.open("w") as lines:
        for _ in range(count):
            x, y = rng.randint(0, 100), rng.randint(0, 100)
            messages = [*FEWSHOT, {"role": "user", "content": f"What is {x} + {y}?"},
                        {"role": "assistant", "content": str(x + y)}]
            lines.write(json.dumps({"messages": messages}) + "\n")
    return path


def final_checkpoint(log_path: Path) -> dict:
    """The checkpoint the cookbook saves at the end of a run, as its log_path's checkpoints.jsonl records it."""
    rows = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    return next(row for row in rows if row["name"] == "final")


def assert_final_checkpoint_saved(log_path: Path) -> None:
    final = final_checkpoint(log_path)
    assert final["state_path"].startswith("tinker://") and final["state_path"].endswith("/weights/final")
    assert final["sampler_path"].endswith("/sampler_weights/final")


class RecipeRun:
    """A recipe's finished run and its log_path."""

    def __init__(self, run: subprocess.CompletedProcess, log_path: Path) -> None:
        self.run = run
        self.log_path = log_path

    def final_checkpoint(self) -> dict:
        return final_checkpoint(self.log_path)


@pytest.fixture(scope="module")
def supervised_run(local_cluster, tmp_path_factory) -> RecipeRun:
    """chat_sl on 64 addition conversations: 16 steps of 8 (two epochs) at a learning rate a random-init model
    moves at. The model comes out writing short numbers and stopping, mostly: RL's rewards then differ within
    groups."""
    directory = tmp_path_factory.mktemp("cookbook-sl")
    dataset = write_addition_conversations(directory / "additions.jsonl", count=64)
    log_path = directory / "log"
    run = run_recipe("tinker_cookbook.recipes.chat_sl.train", local_cluster.api_url,
                     model_name=TINY_DIRECTORY, renderer_name=RENDERER, dataset=dataset, batch_size=8,
                     num_epochs=2, learning_rate=1e-2, lora_rank=8, max_length=128, log_path=log_path)
    return RecipeRun(run, log_path)


def test_the_chat_sl_recipe_trains_and_saves_a_checkpoint(supervised_run):
    assert supervised_run.run.returncode == 0, failure_report(supervised_run.run)
    nll = [row["train_mean_nll"] for row in metrics_rows(supervised_run.log_path) if "train_mean_nll" in row]
    assert len(nll) == 16
    assert nll[-1] < 0.5 * nll[0]
    assert_final_checkpoint_saved(supervised_run.log_path)


# The recipe's default loss is named by passing no loss_fn at all, as a user who changes nothing runs it.
RL_LOSSES = [pytest.param(None, id="default-stable_reinforce"), "gspo", "importance_sampling", "ppo"]


@pytest.mark.parametrize("loss_fn", RL_LOSSES)
def test_math_rl_trains_from_the_sl_checkpoint_and_its_sampler_agrees_with_its_trainer(
        local_cluster, supervised_run, tmp_path, loss_fn: str | None):
    assert supervised_run.run.returncode == 0, "the supervised run this starts from failed"
    log_path = tmp_path / "log"
    arguments = dict(env="arithmetic", model_name=TINY_DIRECTORY, renderer_name=RENDERER,
                     load_checkpoint_path=supervised_run.final_checkpoint()["state_path"],
                     group_size=4, groups_per_batch=8, max_tokens=MAX_TOKENS, max_steps=3, learning_rate=1e-4,
                     eval_every=0, save_every=0, log_path=log_path)
    if loss_fn is not None:
        arguments["loss_fn"] = loss_fn
    run = run_recipe("tinker_cookbook.recipes.math_rl.train", local_cluster.api_url, **arguments)
    assert run.returncode == 0, failure_report(run)

    config = json.loads((log_path / "config.json").read_text())
    assert config["loss_fn"] == (loss_fn or "stable_reinforce")
    steps = [row for row in metrics_rows(log_path) if "env/all/reward/total" in row]
    assert [row["step"] for row in steps] == [0, 1, 2]
    # Rewards that differ within a group give nonzero advantages: the loss had something to train on.
    assert any(row["env/all/by_group/frac_mixed"] > 0 for row in steps), steps
    for row in steps:
        assert abs(row["optim/kl_sample_train_v1"]) < KL_LIMIT, row
        assert row["optim/kl_sample_train_v2"] < KL_LIMIT, row
