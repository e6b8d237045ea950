"""The model the cookbook's recipes now default to, under the name they ask for, offline: a tiny Qwen3.5 (Gated
DeltaNet linear attention in 3 of 4 layers) served with `lilo up --base-model Qwen/Qwen3.5-9B-Base=DIR`, and the
cookbook's chat_sl recipe run against it unchanged but for `model_name` and `renderer_name=qwen3_5`.

The recipe loads its tokenizer by that name, from the model hub; offline, from the Hugging Face cache, where a user
who downloaded the model once has it. The test writes the tiny model's tokenizer there (a cache of its own,
``HF_HOME``) under that name, as such a download would have. The tokenizer is SmolLM2's with Qwen3.5's thinking
tokens added (the renderer needs ``</think>`` to be one token)."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import tinker

from helpers import API_KEY, own_service
from test_cookbook import assert_final_checkpoint_saved, failure_report, metrics_rows, run_recipe, \
    write_addition_conversations

NAME = "Qwen/Qwen3.5-9B-Base"
THINKING_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "preprocessor_config.json")  # the last: a vision-language model's image processor


def tiny_qwen35(directory: Path) -> Path:
    """A tiny random Qwen3.5 with a tokenizer the cookbook's qwen3_5 renderer takes, saved as a model directory."""
    from transformers import AutoTokenizer

    from lilo.backend.models import build_tiny, smollm2_directory

    tokenizer = AutoTokenizer.from_pretrained(smollm2_directory())
    tokenizer.add_tokens(THINKING_TOKENS)
    build_tiny(directory, "tiny-qwen3.5", seed=2, vocab_size=len(tokenizer),
               eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    tokenizer.save_pretrained(directory)
    return directory


def hub_cache_with(cache: Path, name: str, directory: Path) -> Path:
    """A Hugging Face cache (``HF_HOME``) holding ``directory``'s config and tokenizer as a download of the hub's
    ``name`` leaves them: ``hub/models--<org>--<model>/snapshots/<revision>/`` and ``refs/main`` naming it."""
    revision = "0" * 40
    repository = cache / "hub" / f"models--{name.replace('/', '--')}"
    snapshot = repository / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for file in ("config.json", *TOKENIZER_FILES):
        if (directory / file).exists():
            shutil.copy(directory / file, snapshot / file)
    (repository / "refs").mkdir()
    (repository / "refs" / "main").write_text(revision)
    return cache


@contextlib.contextmanager
def served_under_hub_name(tmp_path_factory, name: str, directory: Path) -> Iterator[tuple[str, Path]]:
    """A service serving ``directory`` as the hub's ``name``, and a Hugging Face cache holding its files under that
    name: (the API's URL, the cache's home)."""
    cache = hub_cache_with(tmp_path_factory.mktemp("hf-home"), name, directory)
    with own_service("--num-cpus", "3", "--trainers", "1", "--base-model", f"{name}={directory}") as (url, _):
        yield url, cache


@pytest.fixture(scope="module")
def qwen35_service(tmp_path_factory):
    directory = tiny_qwen35(tmp_path_factory.mktemp("qwen35") / "model")
    with served_under_hub_name(tmp_path_factory, NAME, directory) as served:
        yield served


def test_the_service_lists_and_trains_the_name_the_cookbook_asks_for(qwen35_service):
    url, _ = qwen35_service
    capabilities = httpx.get(f"{url}/api/v1/get_server_capabilities", headers={"X-API-Key": API_KEY},
                             timeout=60).json()
    assert [model["model_name"] for model in capabilities["supported_models"]] == [NAME]
    with tinker.ServiceClient(base_url=url, api_key=API_KEY) as service:
        training = service.create_lora_training_client(base_model=NAME, rank=4).result(timeout=180)
        info = training.get_info()
        assert (info.model_data.arch, info.model_data.model_name, info.model_data.tokenizer_id) == (
            "qwen3_5_text", NAME, NAME)


def test_chat_sl_runs_on_qwen35_under_its_name_with_its_own_renderer(qwen35_service, tmp_path):
    url, cache = qwen35_service
    dataset = write_addition_conversations(tmp_path / "additions.jsonl", count=32)
    log_path = tmp_path / "log"
    run = run_recipe("tinker_cookbook.recipes.chat_sl.train", url, variables={"HF_HOME": str(cache)},
                     model_name=NAME, renderer_name="qwen3_5", dataset=dataset, batch_size=4, num_epochs=1,
                     learning_rate=1e-2, lora_rank=8, max_length=128, log_path=log_path)
    assert run.returncode == 0, failure_report(run)
    rows = [row for row in metrics_rows(log_path) if "train_mean_nll" in row]
    assert len(rows) == 8, rows
    print("chat_sl on tiny Qwen3.5, NLL per step:", [round(row["train_mean_nll"], 2) for row in rows])
    assert rows[-1]["train_mean_nll"] < rows[0]["train_mean_nll"], rows
    assert_final_checkpoint_saved(log_path)
