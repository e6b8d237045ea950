"""The cookbook's vlm_classifier recipe (tinker_cookbook.recipes.vlm_classifier) on a local image folder: its own
dataset (ClassifierDataset: the renderer's image chunks, the last assistant message trained), its own
ClassifierEvaluator (greedy samples, the class name read back) and the SamplerNLLEvaluator the cookbook's supervised
loop builds from its test split, in that loop (tinker_cookbook.supervised.train), as its train.py wires them. Only
the dataset names differ: the recipe's builders name hub datasets, which an offline machine cannot reach.

    python vlm_classifier_local.py BASE_URL MODEL_NAME RENDERER DATA_DIR LOG_PATH
"""

from __future__ import annotations

import asyncio
import sys

import chz
from tinker_cookbook.recipes.vlm_classifier.data import ClassifierDataset, ClassifierDatasetConfig
from tinker_cookbook.recipes.vlm_classifier.eval import ClassifierEvaluator, ClassifierEvaluatorConfig
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.types import SupervisedDatasetBuilder

IMAGE_PX = 64


@chz.chz
class LocalImages(SupervisedDatasetBuilder):
    data_dir: str
    model_name: str
    renderer_name: str

    def __call__(self) -> tuple[ClassifierDataset, ClassifierDataset]:
        def split(name: str, flip: float) -> ClassifierDataset:
            return ClassifierDataset(ClassifierDatasetConfig(
                dataset=self.data_dir, dataset_split=name, model_name_for_tokenizer=self.model_name,
                renderer_name=self.renderer_name, batch_size=4, max_length=512, max_image_size=IMAGE_PX,
                hflip_probability=flip))

        return split("train", 0.5), split("test", 0.0)


@chz.chz
class LocalClassifierEvaluator:
    data_dir: str
    model_name: str
    renderer_name: str

    def __call__(self) -> ClassifierEvaluator:
        return ClassifierEvaluator(ClassifierEvaluatorConfig(
            dataset=self.data_dir, dataset_split="test", model_name_for_tokenizer=self.model_name,
            renderer_name=self.renderer_name, max_tokens=8, n_eval=4, max_image_size=IMAGE_PX))


def main(base_url: str, model_name: str, renderer_name: str, data_dir: str, log_path: str) -> None:
    where = dict(data_dir=data_dir, model_name=model_name, renderer_name=renderer_name)
    config = train.Config(
        log_path=log_path, model_name=model_name, recipe_name="recipe_vlm_classifier", renderer_name=renderer_name,
        dataset_builder=LocalImages(**where), evaluator_builders=[LocalClassifierEvaluator(**where)],
        infrequent_evaluator_builders=[], learning_rate=1e-2, lr_schedule="cosine", num_epochs=2,
        base_url=base_url, lora_rank=8, save_every=0, eval_every=2, infrequent_eval_every=0)
    asyncio.run(train.main(config))


if __name__ == "__main__":
    main(*sys.argv[1:])
