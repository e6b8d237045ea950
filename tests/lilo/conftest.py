"""The library tests' shared fixtures: a real tiny Llama, written with from_pretrained's files and loaded back."""

import pytest

from lilo.backend.models import build_tiny_llama, load_base_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def base(tiny_dir):
    return load_base_model(tiny_dir)
