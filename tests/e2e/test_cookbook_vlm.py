"""The cookbook's image classifier recipe (vlm_classifier) against a vision-language model served under the name it
asks for, offline: a tiny Qwen3-VL (tests/helpers.tiny_vl_with_tokenizer) served as Qwen/Qwen3-VL-30B-A3B-Instruct,
the cookbook's own qwen3_vl_instruct renderer and image processor reading its files from a Hugging Face cache (as a
user who downloaded the model once has them), its dataset, evaluators and training loop on a local image folder of
two classes (tests/e2e/vlm_classifier_local.py)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers import tiny_vl_with_tokenizer
from test_cookbook import RECIPE_TIMEOUT_S, assert_final_checkpoint_saved, failure_report, metrics_rows, \
    recipe_environment
from test_cookbook_qwen35 import served_under_hub_name

NAME = "Qwen/Qwen3-VL-30B-A3B-Instruct"
CLASSES = {"red square": (200, 30, 30), "blue circle": (30, 30, 200)}


def image_folder(root: Path, per_class: int = 4) -> Path:
    """``root/{train,test}/<class>/<n>.jpg``: the layout datasets.load_dataset reads as an image folder, labels
    from the folder names. Each class its own colour and shape, with noise."""
    rng = np.random.default_rng(0)
    for split, count in (("train", per_class), ("test", 2)):
        for name, colour in CLASSES.items():
            folder = root / split / name.replace(" ", "_")
            folder.mkdir(parents=True)
            for n in range(count):
                pixels = rng.normal(128, 20, (48, 48, 3))
                y, x = np.mgrid[0:48, 0:48]
                shape = (abs(x - 24) < 14) & (abs(y - 24) < 14) if "square" in name else (x - 24) ** 2 + (
                    y - 24) ** 2 < 196
                pixels[shape] = colour
                Image.fromarray(pixels.clip(0, 255).astype("uint8")).save(folder / f"{n}.jpg")
    return root


@pytest.fixture(scope="module")
def vlm_service(tmp_path_factory):
    directory = tiny_vl_with_tokenizer(tmp_path_factory.mktemp("vl") / "model")
    with served_under_hub_name(tmp_path_factory, NAME, directory) as served:
        yield served


def test_the_vlm_classifier_recipe_trains_and_evaluates_on_images(vlm_service, tmp_path):
    url, cache = vlm_service
    data = image_folder(tmp_path / "images")
    log_path = tmp_path / "log"
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("vlm_classifier_local.py")), url, NAME,
                          "qwen3_vl_instruct", str(data), str(log_path)],
                         env={**recipe_environment(url), "HF_HOME": str(cache)}, stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=RECIPE_TIMEOUT_S)
    assert run.returncode == 0, failure_report(run)
    rows = metrics_rows(log_path)
    trained = [row["train_mean_nll"] for row in rows if "train_mean_nll" in row]
    assert len(trained) == 4, rows  # 8 training images, 4 a batch, 2 epochs
    print("vlm_classifier on tiny Qwen3-VL, NLL per step:", [round(nll, 2) for nll in trained])
    # The SamplerNLLEvaluator scored the test images through compute_logprobs (a NaN at an image position would
    # make it NaN), and the ClassifierEvaluator sampled answers for them.
    nll = [value for row in rows for key, value in row.items() if key.endswith("nll") and key.startswith("test")]
    accuracy = [value for row in rows for key, value in row.items() if key.endswith("accuracy")]
    assert nll and all(math.isfinite(value) for value in nll), rows
    assert accuracy and all(0.0 <= value <= 1.0 for value in accuracy), rows
    assert_final_checkpoint_saved(log_path)
