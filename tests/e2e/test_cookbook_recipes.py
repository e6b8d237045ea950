"""More of tinker-cookbook 0.6.1's recipes, unchanged, each through its own command line
(`python -m tinker_cookbook.recipes.<recipe> key=value ...`) against the service, offline, on tiny local data:

- DPO (recipes/preference/dpo/train.py): forward_backward_custom on chosen/rejected pairs, with the reference's
  logprobs from compute_logprobs of a sampler saved before the first step; it saves a final checkpoint.
- On-policy distillation (recipes/distillation/on_policy_distillation.py): the student samples, the teacher (that
  DPO run's sampler checkpoint, served by lilo) scores its samples with compute_logprobs, and the reverse KL is the
  only advantage.
- guess_number (recipes/multiplayer_rl/guess_number/train.py): multi-turn RL, up to ten turns an episode.
- SDFT (recipes/sdft/train.py): the same model as teacher with a golden answer in its prompt gives top-K prompt
  logprobs, and the student trains with cross_entropy on (tokens, K) targets and weights.

The recipes that take only hub datasets (DPO's `hhh`, distillation's `deepmath`) run in a directory that holds a
small local copy under the hub id (`Anthropic/hh-rlhf/`, `zwhe99/DeepMath-103K/`): `datasets.load_dataset` reads a
local directory of that name before the hub, as a user with a downloaded copy runs them. SDFT reads a local Arrow
dataset through its own `toolalpaca_data_path` option. Each test prints the recipe's per-step metrics."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from conftest import TINY_DIRECTORY
from test_cookbook import (KL_LIMIT, RENDERER, RecipeRun, assert_final_checkpoint_saved, failure_report, metrics_rows,
                           run_recipe)


def addition_questions(count: int, seed: int = 0) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    pairs = [(rng.randint(0, 50), rng.randint(0, 50)) for _ in range(count)]
    return [(f"What is {x} + {y}?", x + y) for x, y in pairs]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def steps_with(rows: list[dict], key: str) -> list[dict]:
    return [row for row in rows if key in row]


def print_steps(recipe: str, rows: list[dict], keys: tuple[str, ...]) -> None:
    """The per-step metrics the recipe logged, one line a step (shown with `pytest -s`, and on failure)."""
    for row in rows:
        values = ", ".join(f"{key}={row[key]:.6g}" for key in keys if key in row)
        print(f"{recipe} step {row['step']}: {values}")


def assert_finite(rows: list[dict], keys: tuple[str, ...]) -> None:
    for row in rows:
        for key in keys:
            assert math.isfinite(row[key]), (key, row)


DPO_KEYS = ("dpo_loss", "accuracy", "margin", "chosen_reward", "rejected_reward")


@pytest.fixture(scope="module")
def dpo_run(local_cluster, tmp_path_factory) -> RecipeRun:
    """The DPO recipe's `hhh` dataset from 32 local comparisons (the sum against a refusal), in batches of 8: four
    steps at a learning rate the tiny model moves at."""
    directory = tmp_path_factory.mktemp("cookbook-dpo")
    for split, count, seed in (("train", 32, 0), ("test", 4, 1)):
        rows = [{"chosen": f"\n\nHuman: {question}\n\nAssistant: {answer}",
                 "rejected": f"\n\nHuman: {question}\n\nAssistant: I don't know."}
                for question, answer in addition_questions(count, seed)]
        write_jsonl(directory / "Anthropic" / "hh-rlhf" / f"{split}.jsonl", rows)
    log_path = directory / "log"
    run = run_recipe("tinker_cookbook.recipes.preference.dpo.train", local_cluster.api_url, cwd=directory,
                     model_name=TINY_DIRECTORY, renderer_name=RENDERER, dataset="hhh", batch_size=8,
                     max_length=128, learning_rate=1e-3, max_steps=4, log_path=log_path)
    return RecipeRun(run, log_path)


def test_dpo_trains_on_local_comparisons_against_its_reference_and_saves_a_checkpoint(dpo_run):
    assert dpo_run.run.returncode == 0, failure_report(dpo_run.run)
    steps = steps_with(metrics_rows(dpo_run.log_path), "dpo_loss")
    print_steps("dpo", steps, DPO_KEYS)
    assert [row["step"] for row in steps] == [0, 1, 2, 3]
    assert_finite(steps, DPO_KEYS)
    # Before the first update the policy is its reference: the trainer's logprobs (forward_backward_custom) and the
    # reference sampler's (compute_logprobs) agree, so every pair's margin is 0 and the loss is log 2.
    assert steps[0]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert steps[-1]["dpo_loss"] < steps[0]["dpo_loss"] and steps[-1]["margin"] > 0
    assert_final_checkpoint_saved(dpo_run.log_path)


RL_KEYS = ("env/all/reward/total", "optim/kl_sample_train_v1", "optim/kl_sample_train_v2", "grad_norm:mean",
           "optim/entropy")


def assert_sampler_agrees_with_trainer(steps: list[dict]) -> None:
    for row in steps:
        assert abs(row["optim/kl_sample_train_v1"]) < KL_LIMIT, row
        assert row["optim/kl_sample_train_v2"] < KL_LIMIT, row


def test_on_policy_distillation_from_a_teacher_checkpoint_lilo_serves(local_cluster, dpo_run, tmp_path):
    assert dpo_run.run.returncode == 0, "the DPO run whose checkpoint is the teacher failed"
    questions = [{"question": question} for question, _ in addition_questions(16)]
    write_jsonl(tmp_path / "zwhe99" / "DeepMath-103K" / "train.jsonl", questions)
    log_path = tmp_path / "log"
    run = run_recipe("tinker_cookbook.recipes.distillation.on_policy_distillation", local_cluster.api_url,
                     cwd=tmp_path, model_name=TINY_DIRECTORY, renderer_name=RENDERER, dataset="deepmath",
                     teacher_model=TINY_DIRECTORY, teacher_checkpoint=dpo_run.final_checkpoint()["sampler_path"],
                     group_size=2, groups_per_batch=4, max_tokens=16, lora_rank=8, learning_rate=1e-3, max_steps=3,
                     eval_every=0, save_every=0, log_path=log_path)
    assert run.returncode == 0, failure_report(run)
    steps = steps_with(metrics_rows(log_path), "teacher_kl")
    print_steps("distillation", steps, ("teacher_kl", *RL_KEYS))
    assert [row["step"] for row in steps] == [0, 1, 2]
    assert_finite(steps, ("teacher_kl", *RL_KEYS))
    assert_sampler_agrees_with_trainer(steps)
    # The prompt-only environment rewards nothing: the teacher's KL is the only advantage, and it moved the student.
    assert all(row["env/all/reward/total"] == 0 and row["grad_norm:mean"] > 0 for row in steps), steps
    assert_final_checkpoint_saved(log_path)


def test_guess_number_plays_multi_turn_episodes(local_cluster, tmp_path):
    """One number a step, guessed by two players: every turn is a datum (the reply, cut at max_tokens, is no prefix
    of the next prompt), so a step trains on 20 datums of about 250 tokens. The random tiny model never writes
    `Guess: <n>`, so every turn takes the format penalty and every game ends after ten turns at -10: equal rewards,
    no advantage (grad_norm 0). What this shows is the multi-turn plumbing, with the sampler's logprobs of every
    turn matching the trainer's, not learning."""
    log_path = tmp_path / "log"
    run = run_recipe("tinker_cookbook.recipes.multiplayer_rl.guess_number.train", local_cluster.api_url,
                     model_name=TINY_DIRECTORY, renderer_name=RENDERER, batch_size=1, group_size=2, max_tokens=4,
                     max_steps=1, eval_every=0, save_every=0, log_path=log_path)
    assert run.returncode == 0, failure_report(run)
    steps = steps_with(metrics_rows(log_path), "env/all/reward/total")
    print_steps("guess_number", steps, (*RL_KEYS, "env/all/turns_per_episode", "tokens/trained"))
    assert [row["step"] for row in steps] == [0]
    assert_finite(steps, RL_KEYS)
    assert_sampler_agrees_with_trainer(steps)
    for row in steps:
        assert row["env/all/total_episodes"] == 2 and row["env/all/turns_per_episode"] > 1, row
    assert_final_checkpoint_saved(log_path)


SDFT_KEYS = ("sdft/mean_teacher_entropy", "sdft/total_completion_tokens", "grad_norm:mean", "env/all/reward/total")


def test_sdft_distills_the_teachers_top_k_with_cross_entropy(local_cluster, tmp_path):
    """Ten local demonstrations (nine train, one test), two questions of two samples a step, the teacher's top 5."""
    import datasets

    demonstrations = [{"prompt": question, "golden_response": f"The answer is {answer}."}
                      for question, answer in addition_questions(10)]
    data_path = tmp_path / "tooluse" / "train_data"
    datasets.Dataset.from_list(demonstrations).save_to_disk(str(data_path))
    log_path = tmp_path / "log"
    topk = 5
    run = run_recipe("tinker_cookbook.recipes.sdft.train", local_cluster.api_url, model_name=TINY_DIRECTORY,
                     renderer_name=RENDERER, dataset="toolalpaca", toolalpaca_data_path=data_path, group_size=2,
                     groups_per_batch=2, max_tokens=12, topk=topk, lora_rank=8, learning_rate=1e-3, max_steps=2,
                     eval_every=0, save_every=0, log_path=log_path)
    assert run.returncode == 0, failure_report(run)
    steps = steps_with(metrics_rows(log_path), "sdft/num_datums")
    print_steps("sdft", steps, SDFT_KEYS)
    assert [row["step"] for row in steps] == [0, 1]
    assert_finite(steps, SDFT_KEYS)
    for row in steps:
        assert row["sdft/num_datums"] == 4 and row["sdft/total_completion_tokens"] > 0, row
        # The renormalised top-K distribution's entropy lies in [0, log K]; a gradient came out of the top-K loss.
        assert 0 <= row["sdft/mean_teacher_entropy"] <= math.log(topk) + 1e-6, row
        assert row["grad_norm:mean"] > 0, row
    assert_final_checkpoint_saved(log_path)
