"""Every family lilo registers a tiny model of trains every projection Tinker's LoraConfig names, and a family with
a projection lilo puts no adapter on is refused for that target, saying which, instead of training less."""

import pytest
import torch
from transformers import Phi3Config, Phi3ForCausalLM

from lilo.backend.models import TINY_MODELS, build_tiny, load_base_model
from lilo.backend.registry import TINY_FAMILIES, TINY_PREFIX, is_servable
from lilo.backend.torch_backend import TorchBackend
from lilo.backend.types import LoraSpec
from lilo.errors import InvalidRequestError


def test_the_registry_serves_every_tiny_family_the_backend_builds():
    assert set(TINY_FAMILIES) == set(TINY_MODELS)
    assert all(is_servable(f"{TINY_PREFIX}{name}") for name in TINY_MODELS)


@pytest.mark.parametrize("family", sorted(TINY_MODELS))
def test_every_registered_family_trains_each_target_whole(family, tmp_path):
    backend = TorchBackend(load_base_model(build_tiny(tmp_path, family)), max_adapters=2, max_rank=4)
    assert backend.uncovered == {"attn": [], "mlp": []}
    kinds = {path.rsplit(".", 1)[-1] for path in backend.layers}
    assert "lm_head" in kinds and kinds & {"q_proj", "q_a_proj"} and kinds & {"down_proj"}
    backend.add_adapter("all", LoraSpec(rank=4, train_unembed=True))


# What get_info says trains, per family and target: a decoder layer's projections (and the output head).
PROJECTIONS = {
    "tiny-llama": {"attn": ["self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"],
                   "mlp": ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj"]},
    "tiny-qwen3-moe": {"attn": ["self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"],
                       "mlp": ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]},
    "tiny-deepseek-v3": {"attn": ["self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "self_attn.o_proj",
                                  "self_attn.q_a_proj", "self_attn.q_b_proj"],
                         # Its first layer is dense; the rest have routed and shared experts.
                         "mlp": ["mlp.down_proj", "mlp.experts.down_proj", "mlp.experts.gate_up_proj",
                                 "mlp.gate_proj", "mlp.shared_experts.down_proj", "mlp.shared_experts.gate_proj",
                                 "mlp.shared_experts.up_proj", "mlp.up_proj"]},
    # Gated DeltaNet's projections in 3 of 4 layers, gated attention's in the 4th; its conv1d and its per-head
    # gates in_proj_a / in_proj_b stay frozen (lilo.backend.families says why).
    "tiny-qwen3.5": {"attn": ["linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj",
                              "self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"],
                     "mlp": ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj"]},
    # One mixer a layer: Mamba-2 (its in_proj; out_proj frozen), attention, MoE, a plain MLP.
    "tiny-nemotron-h": {"attn": ["mixer.in_proj", "mixer.k_proj", "mixer.o_proj", "mixer.q_proj", "mixer.v_proj"],
                        "mlp": ["mixer.down_proj", "mixer.experts.down_proj", "mixer.experts.up_proj",
                                "mixer.shared_experts.down_proj", "mixer.shared_experts.up_proj", "mixer.up_proj"]},
    "tiny-gemma4": {"attn": ["self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"],
                    "mlp": ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "per_layer_input_gate",
                            "per_layer_projection"]},
    # The attention's one key-value head and its compressor's pooling (in the compressed layers), its queries and
    # the grouped output's mixing; the indexer, the grouped o_a_proj and the hyper-connections stay frozen.
    "tiny-deepseek-v4": {"attn": ["self_attn.compressor.gate_proj", "self_attn.compressor.kv_proj",
                                  "self_attn.kv_proj", "self_attn.o_b_proj", "self_attn.q_a_proj",
                                  "self_attn.q_b_proj"],
                         "mlp": ["mlp.experts.down_proj", "mlp.experts.gate_up_proj",
                                 "mlp.shared_experts.down_proj", "mlp.shared_experts.gate_proj",
                                 "mlp.shared_experts.up_proj"]},
}


@pytest.mark.parametrize("family", sorted(PROJECTIONS))
def test_the_backend_names_the_projections_each_target_trains(family, tmp_path):
    backend = TorchBackend(load_base_model(build_tiny(tmp_path, family)), max_adapters=1, max_rank=4)
    assert backend.projections == {**PROJECTIONS[family], "unembed": ["lm_head"]}


def test_no_family_trains_a_projection_under_another_target_than_any_other_family():
    from lilo.backend.families import ATTENTION_PROJECTIONS, FAMILIES, MLP_PROJECTIONS

    assert not set(ATTENTION_PROJECTIONS) & set(MLP_PROJECTIONS)
    for family in FAMILIES:  # and none freezes what it trains
        assert not set(family.frozen) & set(family.attn + family.mlp), family.name


def test_a_family_with_a_projection_lilo_cannot_adapt_is_refused_for_that_target_and_says_which():
    # Phi-3 fuses its attention's query, key and value into one qkv_proj (its MLP's gate_up_proj lilo adapts).
    torch.manual_seed(0)
    model = Phi3ForCausalLM(Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=4, vocab_size=100, pad_token_id=0))
    backend = TorchBackend(model, max_adapters=2, max_rank=4, base_model_name="tiny-phi3")
    assert backend.uncovered == {"attn": ["self_attn.qkv_proj"], "mlp": []}
    with pytest.raises(InvalidRequestError, match=r"tiny-phi3 \(phi3\) has attn projections lilo puts no adapter "
                                                  r"on \(self_attn.qkv_proj\).*pass train_attn=False"):
        backend.add_adapter("whole", LoraSpec(rank=4))
    backend.add_adapter("mlp", LoraSpec(rank=4, train_attn=False))
    assert backend.free_slots == 1


def test_a_qwen35_checkpoint_as_the_hub_ships_it_loads_whole_and_trains_its_language_model(tmp_path):
    # The hub's Qwen3.5 checkpoints are vision-language (model_type qwen3_5, the language model under text_config):
    # lilo loads them whole, to take images (tests/lilo/test_vision_training.py), and adapts the language model.
    model = load_base_model(build_tiny(tmp_path, "tiny-qwen3.5-vl"))
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    backend = TorchBackend(model, max_adapters=1, max_rank=4)
    assert backend.uncovered == {"attn": [], "mlp": []} and backend.bank.family.name == "Qwen3.5"
    assert backend.layers and not any("visual" in path for path in backend.layers)


def kimi_k25_checkpoint(directory):
    """A tiny Kimi K2.5 / K2.6 checkpoint as the hub ships one: vision-language (kimi_k25), which transformers loads
    only whole, its language model DeepSeek-V3's stored under language_model.model.layers; and the whole model."""
    import transformers
    from safetensors.torch import load_file, save_file

    from lilo.backend.families import TINY

    vision = dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64, patch_size=14)
    torch.manual_seed(0)
    whole = transformers.Kimi_K25ForConditionalGeneration(transformers.Kimi_K25Config(
        text_config=dict(TINY["tiny-deepseek-v3"].config, model_type="deepseek_v3"), vision_config=vision))
    whole.save_pretrained(directory)
    weights = directory / "model.safetensors"  # transformers 5.24 writes the layers back as "blocks"
    save_file({key.replace("language_model.model.blocks.", "language_model.model.layers."): tensor
               for key, tensor in load_file(weights).items()}, weights, metadata={"format": "pt"})
    assert any(key.startswith("language_model.model.layers.") for key in load_file(weights))
    return directory, whole


def test_a_kimi_k25_checkpoint_loads_whole_and_trains_its_language_model(tmp_path):
    directory, whole = kimi_k25_checkpoint(tmp_path)
    model = load_base_model(directory)
    assert type(model).__name__ == "Kimi_K25ForConditionalGeneration"
    tokens = torch.randint(0, 1000, (1, 12))
    with torch.no_grad():
        assert torch.allclose(model(input_ids=tokens).logits, whole(input_ids=tokens).logits, atol=1e-6)
    backend = TorchBackend(model, max_adapters=1, max_rank=4)
    assert backend.uncovered == {"attn": [], "mlp": []} and backend.bank.family.name == "Kimi K2.5"
    assert backend.layers and not any("vision_tower" in path for path in backend.layers)


def test_the_language_model_of_a_vision_language_checkpoint_answers_as_the_whole_on_text(tmp_path):
    # How lilo loads a vision-language checkpoint of a family it takes no images for (one it does not list).
    from lilo.backend.models import language_model_of

    directory, whole = kimi_k25_checkpoint(tmp_path)
    model = language_model_of(directory, torch.float32)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    tokens = torch.randint(0, 1000, (1, 12))
    with torch.no_grad():
        assert torch.allclose(model(input_ids=tokens).logits, whole(input_ids=tokens).logits, atol=1e-6)


def test_a_kimi_k25_checkpoint_is_written_for_sharded_ranks_in_the_models_own_layout(tmp_path):
    from lilo.backend.sharding.native_layout import converts_on_load, native_layout

    directory, whole = kimi_k25_checkpoint(tmp_path / "kimi")
    native = native_layout(directory, tmp_path / "cache")
    assert native != directory and not converts_on_load(native)
    model = load_base_model(native)
    tokens = torch.randint(0, 1000, (1, 12))
    with torch.no_grad():
        assert torch.allclose(model(input_ids=tokens).logits, whole(input_ids=tokens).logits, atol=1e-6)


def test_the_kernel_report_says_which_fast_kernels_run_and_what_to_install_for_the_others():
    from lilo.backend.families import FAMILIES, Family
    from lilo.backend.kernels import kernel_report

    family = Family("Hybrid", (), (), (), kernels={"json": "json-kernels", "no_such_kernels_here": "fast-scan"})
    assert kernel_report(family, "cuda") == (
        "Hybrid layers: fast kernels from json-kernels; the torch reference path for what fast-scan would run "
        "(not installed; pip install fast-scan for its kernels)")
    assert kernel_report(family, "cpu").endswith("fast-scan would run (not installed)")
    assert kernel_report(FAMILIES[0], "cuda") is None  # Llama: no kernels of its own
    assert {family.name for family in FAMILIES if family.kernels} == {"Qwen3.5", "Nemotron-H"}
