"""The model families lilo trains, each in one place: which projections each LoraConfig target adapts, what of a
decoder layer stays frozen and why, and its tiny built-in model (``lilo/tiny-<name>``, random weights built
locally, for tests).

A projection is named by its module's last name (``q_proj``, ``in_proj_qkv``), or its last few where one name means
two things in a layer (``compressor.gate_proj`` beside the MLP's ``gate_proj``: the longest name that fits decides);
a fused MoE experts module's by its parameter (``gate_up_proj``). A frozen name freezes that module and all inside
it (``indexer``), or names a parameter (``compressor.position_bias``). The bank (``lilo.backend.adapters.bank``)
wraps every linear and experts projection whose name a family lists, in whatever model it loads, so a model of a
family not listed here trains where its projections share these names, and is refused for a target where some matrix
of its layers has a name no family adapts or freezes (``uncovered``), saying which. Where Tinker's docs are silent,
a sequence mixer's projections (attention, linear attention, a state-space mixer) train under ``train_attn`` and the
feed-forward side's (dense MLPs, experts, per-layer inputs) under ``train_mlp``, as TuFT and peft's ``all-linear``
do; what stays frozen has a reason in ``frozen``. This module is pure data: no torch, no transformers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class Tiny:
    """A family's tiny random model: ``<model_class>ForCausalLM`` of transformers with ``config``."""

    name: str  # served as lilo/<name>
    model_class: str
    config: Mapping[str, Any]
    model_type: str  # what transformers calls the saved model (get_info's arch)
    description: str
    head: str = "ForCausalLM"  # the transformers class is <model_class><head>
    image_processor: Mapping[str, Any] | None = None  # a vision-language model's (Qwen2-VL's image processor)


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # transformers' model_type of the family's checkpoints
    attn: tuple[str, ...]  # what train_attn adapts
    mlp: tuple[str, ...]  # what train_mlp adapts
    frozen: Mapping[str, str] = dataclasses.field(default_factory=dict)  # a layer's matrix no target adapts: why
    tiny: tuple[Tiny, ...] = ()
    # Whether a left-padded prompt decodes as that prompt alone does; where not, the sampler batches only prompts of
    # one length together.
    left_padding: bool = True
    # The fast kernels its layers take where installed (module: pip package), else transformers' torch reference
    # path: right, but slow on a GPU.
    kernels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # Whether it takes images: loaded whole (vision tower and language model), adapters on the language model only.
    images: bool = False
    # Whether its training passes run packed (lilo.backend.training.packing): every layer mixes tokens only through
    # causal (or sliding-window) attention over plain positions, or through a module named in ``recurrent``. Off,
    # they run padded.
    packs: bool = False
    # The modules (by name in their layer, or by class) that carry a state along the row (linear attention, a
    # state-space mixer): packed, each runs once per sequence, from a fresh state.
    recurrent: tuple[str, ...] = ()
    # Whether its layers read the attention mask themselves (GLM-5's indexer scores every key of the row): packed,
    # the stream's block-diagonal mask is built for them.
    packed_mask: bool = False


GQA = ("q_proj", "k_proj", "v_proj", "o_proj")  # grouped-query attention
MLA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")  # multi-head latent attention
GATED_MLP = ("gate_proj", "up_proj", "down_proj")
EXPERTS = ("gate_up_proj", "down_proj")  # fused experts (lilo.backend.adapters.experts)
GATED_DELTANET = ("in_proj_qkv", "in_proj_z", "out_proj")  # Qwen3.5's linear attention
UNEMBED = "lm_head"

ROUTER = {"gate": "a mixture-of-experts router: its few outputs pick the experts, and an adapter on it would move "
                  "the routing rather than the experts' work"}
DELTANET_FROZEN = {
    "conv1d": "a depthwise causal convolution over the last few tokens (a few taps per channel): no matrix to put a "
              "low-rank delta on",
    "in_proj_a": "Gated DeltaNet's decay gate: one output per value head",
    "in_proj_b": "Gated DeltaNet's write strength (beta): one output per value head",
}

INDEXER = ("DeepSeek Sparse Attention's indexer: it only picks the keys each query attends to (a top-k), so the loss "
           "gives it no gradient")

# The tiny shapes: small enough that a test builds one in a second, with the family's every kind of layer.
_SHAPE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=1000,
              max_position_embeddings=512)
_QWEN3_5 = dict(_SHAPE, num_hidden_layers=4, intermediate_size=256, num_key_value_heads=2, head_dim=32,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                linear_conv_kernel_dim=4)

# Qwen-VL's image processors: a token per 2 x 2 patches, at most 64 tokens an image here so tiny images stay tiny.
def _qwen_vl_images(patch: int) -> dict[str, Any]:
    side = patch * 2
    return dict(patch_size=patch, merge_size=2, temporal_patch_size=2, min_pixels=side * side * 4,
                max_pixels=side * side * 64, image_mean=[0.5] * 3, image_std=[0.5] * 3)


_VL_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=1000, max_position_embeddings=2048, bos_token_id=1,
                eos_token_id=2)
_DEEPSEEK_V3 = dict(_SHAPE, intermediate_size=256, moe_intermediate_size=64, num_key_value_heads=4, n_routed_experts=8,
                    num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32,
                    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_group=2, topk_group=1,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
# The four vision tokens at the top of the tiny vocabulary (a test's tokenizer adds them there).
_VL_TOKENS = dict(vision_start_token_id=996, vision_end_token_id=997, image_token_id=998, video_token_id=999)

FAMILIES: tuple[Family, ...] = (
    Family("Llama", ("llama", "olmo3"), GQA, GATED_MLP, packs=True, tiny=(
        Tiny("tiny-llama", "Llama", dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=4, vocab_size=1000,
                                         max_position_embeddings=512), "llama", "Llama"),
        Tiny("tiny-olmo3", "Olmo3", dict(_SHAPE, intermediate_size=256, num_key_value_heads=2, pad_token_id=0,
                                         eos_token_id=1, bos_token_id=2), "olmo3",
             "OLMo 3 (Llama's projections; sliding-window layers, norms after each block)"),
    )),
    Family("Qwen3", ("qwen3",), GQA, GATED_MLP, packs=True, tiny=(
        Tiny("tiny-qwen3", "Qwen3", dict(_SHAPE, intermediate_size=256, num_key_value_heads=2, head_dim=32),
             "qwen3", "Qwen3 (dense)"),)),
    Family("Qwen3-MoE", ("qwen3_moe",), GQA, EXPERTS, ROUTER, packs=True, tiny=(
        Tiny("tiny-qwen3-moe", "Qwen3Moe", dict(_SHAPE, intermediate_size=256, moe_intermediate_size=64,
                                                num_key_value_heads=2, head_dim=32, num_experts=8,
                                                num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[]),
             "qwen3_moe", "Qwen3-MoE (8 experts, 2 a token)"),)),
    Family("GPT-OSS", ("gpt_oss",), GQA, EXPERTS, {"router": ROUTER["gate"]}, packs=True, tiny=(
        Tiny("tiny-gpt-oss", "GptOss", dict(_SHAPE, intermediate_size=64, num_key_value_heads=2, head_dim=32,
                                            num_local_experts=8, num_experts_per_tok=2, sliding_window=64),
             "gpt_oss", "GPT-OSS (8 experts, 2 a token; biases, transposed experts)"),)),
    # Kimi K2's language model is this architecture (model_type deepseek_v3), as is K2.5 and K2.6's (below).
    Family("DeepSeek-V3", ("deepseek_v3", "glm4_moe"), MLA + GQA, GATED_MLP + EXPERTS, ROUTER, packs=True, tiny=(
        Tiny("tiny-deepseek-v3", "DeepseekV3", _DEEPSEEK_V3, "deepseek_v3",
             "DeepSeek-V3 (multi-head latent attention; 8 routed experts and a shared one)"),
        Tiny("tiny-glm4-moe", "Glm4Moe", dict(_SHAPE, intermediate_size=256, moe_intermediate_size=64,
                                              num_key_value_heads=2, head_dim=32, n_routed_experts=8,
                                              num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                              n_group=1, topk_group=1),
             "glm4_moe", "GLM-4.5 (GQA; a dense first layer, then 8 routed experts and a shared one)"),
    )),
    # Qwen3.6 and Qwen3.8 are served as this architecture: transformers 5.24 has no model type of their own.
    Family("Qwen3.5", ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"), GQA + GATED_DELTANET,
           GATED_MLP + EXPERTS, {**ROUTER, **DELTANET_FROZEN,
                                 "shared_expert_gate": "one output: the shared expert's weight for each token"},
           kernels={"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d"},
           packs=True, recurrent=("linear_attn",),
           tiny=(Tiny("tiny-qwen3.5", "Qwen3_5", _QWEN3_5, "qwen3_5_text",
                      "Qwen3.5 (hybrid: Gated DeltaNet linear attention in 3 of 4 layers)"),
                 Tiny("tiny-qwen3.5-moe", "Qwen3_5Moe",
                      dict(_QWEN3_5, moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=8,
                           num_experts_per_tok=2),
                      "qwen3_5_moe_text", "Qwen3.5-MoE (hybrid attention; 8 experts, 2 a token, a shared one)"),
                 Tiny("tiny-qwen3.5-vl", "Qwen3_5",
                      dict(text_config=dict(_QWEN3_5, rope_parameters={
                          "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                          "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
                           vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                              out_hidden_size=128, patch_size=16, spatial_merge_size=2,
                                              temporal_patch_size=2, num_position_embeddings=64),
                           **_VL_TOKENS),
                      "qwen3_5", "Qwen3.5 as the hub ships it: a vision tower beside the hybrid language model",
                      head="ForConditionalGeneration", image_processor=_qwen_vl_images(16))),
           images=True),
    # A Mamba-2 mixer's in_proj (x, z, B, C and dt in one) is its sequence mixing, as attention's projections are;
    # its experts are plain (up, then down: no gate).
    Family("Nemotron-H", ("nemotron_h",), GQA + ("in_proj",), ("up_proj", "down_proj"),
           {**ROUTER, "conv1d": DELTANET_FROZEN["conv1d"],
            "out_proj": "the Mamba-2 mixer's output: its fused kernels read the weight itself, past any adapter, and "
                        "peft refuses an adapter there on Mamba models, so an export with one would not load"},
           kernels={"mamba_ssm": "mamba-ssm", "causal_conv1d": "causal-conv1d"},
           packs=True, recurrent=("NemotronHMamba2Mixer",), tiny=(
               Tiny("tiny-nemotron-h", "NemotronH",
                    dict(_SHAPE, num_hidden_layers=4, layers_block_type=["mamba", "moe", "attention", "mlp"],
                         intermediate_size=256, num_key_value_heads=2, head_dim=32, mamba_num_heads=4,
                         mamba_head_dim=32, n_groups=1, ssm_state_size=16, chunk_size=16,
                         n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                         moe_shared_expert_intermediate_size=64),
                    "nemotron_h", "Nemotron-H (hybrid: Mamba-2, attention, MoE and MLP layers)"),)),
    # Gemma 3n and 4 add each layer an input of its own (per-layer embeddings): a gate projection down to it and a
    # projection back up, beside the MLP, on the feed-forward side.
    Family("Gemma 4", ("gemma4", "gemma4_text"), GQA, GATED_MLP + ("per_layer_input_gate", "per_layer_projection"),
           packs=True,
           tiny=(Tiny("tiny-gemma4", "Gemma4", dict(_SHAPE, intermediate_size=256, num_key_value_heads=2, head_dim=32,
                                                    vocab_size_per_layer_input=1000, hidden_size_per_layer_input=16,
                                                    sliding_window=8,
                                                    layer_types=["sliding_attention", "full_attention"]),
                      "gemma4_text", "Gemma 4 (per-layer inputs; sliding and full attention)"),)),
    # DeepSeek-V3's attention with a lightning indexer (DeepSeek Sparse Attention), which picks the keys each query
    # attends to.
    Family("GLM-5", ("glm_moe_dsa",), MLA, GATED_MLP + EXPERTS,
           {**ROUTER, **dict.fromkeys(("wq_b", "wk", "weights_proj"), INDEXER)}, packs=True, packed_mask=True,
           tiny=(Tiny("tiny-glm5", "GlmMoeDsa", dict(_SHAPE, intermediate_size=256, moe_intermediate_size=64,
                                                     num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                                                     n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32,
                                                     kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                                                     v_head_dim=16, head_dim=16, index_topk=8, index_head_dim=32,
                                                     index_n_heads=8, pad_token_id=0),
                      "glm_moe_dsa", "GLM-5 (DeepSeek Sparse Attention: an indexer picks 8 keys a query)"),)),
    # Compressed attention: one shared key-value head (kv_proj), a compressor per compressed layer that pools blocks
    # of tokens into extra keys (its kv_proj and gate_proj), an indexer that picks some of them, and a grouped output
    # projection; the residual stream is several (hyper-connections).
    Family("DeepSeek-V4", ("deepseek_v4",), ("q_a_proj", "q_b_proj", "kv_proj", "compressor.gate_proj", "o_b_proj"),
           GATED_MLP + EXPERTS,
           {**ROUTER, "indexer": INDEXER,
            "o_a_proj": "the grouped output projection (one block-diagonal matrix, each group projecting its own "
                        "heads): peft has no adapter for it, so an export with one would not load; o_b_proj, "
                        "which mixes the groups into the hidden state, trains",
            "compressor.position_bias": "a learned bias per place within a compressed block: no projection",
            **dict.fromkeys(("attn_hc", "ffn_hc"), "a hyper-connection: a handful of weights per token that mix the "
                                                   "layer's few residual streams (hc_mult), no projection of the "
                                                   "hidden state")},
           tiny=(Tiny("tiny-deepseek-v4", "DeepseekV4",
                      dict(_SHAPE, num_hidden_layers=3, moe_intermediate_size=64, head_dim=32, qk_rope_head_dim=8,
                           q_lora_rank=32, o_groups=2, o_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2,
                           n_shared_experts=1, sliding_window=8, hc_mult=2, index_n_heads=4, index_head_dim=32,
                           index_topk=4,
                           layer_types=["sliding_attention", "compressed_sparse_attention",
                                        "heavily_compressed_attention"],
                           mlp_layer_types=["hash_moe", "moe", "moe"],
                           # Blocks short enough that a row of 7 tokens reaches both compressors.
                           compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 6}),
                      "deepseek_v4", "DeepSeek-V4 (compressed and sparse attention, hyper-connections; 8 experts, "
                                     "a shared one)"),),
           # Its compressors pool blocks of a row's tokens by their place in the row, pads included.
           left_padding=False, packs=True, recurrent=("DeepseekV4Attention",)),
    Family("Qwen3-VL", ("qwen3_vl", "qwen3_vl_text"), GQA, GATED_MLP, images=True, packs=True, tiny=(
        Tiny("tiny-qwen3-vl", "Qwen3VL",
             dict(text_config=dict(_VL_TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                              "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
                  vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                     patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                                     num_position_embeddings=64, deepstack_visual_indexes=[1]),
                  **_VL_TOKENS),
             "qwen3_vl", "Qwen3-VL (a vision tower with deepstack features; 3-D rotary positions)",
             head="ForConditionalGeneration", image_processor=_qwen_vl_images(16)),)),
    # Kimi K2.5 and K2.6 (kimi_k25): DeepSeek-V3's language model beside a MoonViT vision tower, 1-D positions.
    Family("Kimi K2.5", ("kimi_k25",), MLA + GQA, GATED_MLP + EXPERTS, ROUTER, images=True, packs=True, tiny=(
        Tiny("tiny-kimi-k2.5", "Kimi_K25",
             dict(text_config=dict(_DEEPSEEK_V3, model_type="deepseek_v3"),
                  vision_config=dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                     intermediate_size=64, patch_size=14, pos_emb_height=16, pos_emb_width=16),
                  projection_hidden_size=32, tie_word_embeddings=False, **_VL_TOKENS),
             "kimi_k25", "Kimi K2.5 / K2.6 (a MoonViT vision tower beside DeepSeek-V3's language model)",
             head="ForConditionalGeneration",
             image_processor=dict(image_processor_type="Kimi_K25ImageProcessor", patch_size=14, merge_size=2,
                                  max_patches=256, size={"max_height": 32, "max_width": 32},
                                  image_mean=[0.5] * 3, image_std=[0.5] * 3)),)),
    Family("Qwen2.5-VL", ("qwen2_5_vl", "qwen2_5_vl_text"), GQA, GATED_MLP, images=True, packs=True, tiny=(
        Tiny("tiny-qwen2.5-vl", "Qwen2_5_VL",
             dict(text_config=dict(_VL_TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                              "mrope_section": [2, 3, 3]}),
                  vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                     patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                                     fullatt_block_indexes=[1]),
                  **_VL_TOKENS),
             "qwen2_5_vl", "Qwen2.5-VL (a windowed vision tower with gated MLPs; 3-D rotary positions)",
             head="ForConditionalGeneration", image_processor=_qwen_vl_images(14)),)),
)


def _union(field: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(name for family in FAMILIES for name in getattr(family, field)))


# What the bank adapts under each target, over every family.
ATTENTION_PROJECTIONS = _union("attn")
MLP_PROJECTIONS = _union("mlp")
TINY: dict[str, Tiny] = {tiny.name: tiny for family in FAMILIES for tiny in family.tiny}
# A model of a family not listed: what any family adapts, frozen what any family freezes and none adapts.
ANY_FAMILY = Family("any", (), ATTENTION_PROJECTIONS, MLP_PROJECTIONS,
                    {name: reason for family in FAMILIES for name, reason in family.frozen.items()
                     if name not in ATTENTION_PROJECTIONS + MLP_PROJECTIONS})


def _names(entry: str, path: str) -> bool:
    """Whether ``entry``'s dotted names (``compressor.gate_proj``) appear in ``path``, adjacent and in order: the
    module at ``path`` is, or lies inside, one ``entry`` names."""
    parts, names = path.split("."), entry.split(".")
    return any(parts[i:i + len(names)] == names for i in range(len(parts) - len(names) + 1))


def role_of(family: Family, path: str) -> str | None:
    """What ``family`` does with the module or parameter at ``path``: ``"frozen"`` (it, or a module it lies in, is
    frozen by design), ``"attn"`` or ``"mlp"`` (the target that adapts it: the longest name that fits), or None."""
    if any(_names(entry, path) for entry in family.frozen):
        return "frozen"
    fits = [entry for entry in family.attn + family.mlp if path == entry or path.endswith(f".{entry}")]
    if not fits:
        return None
    return "attn" if max(fits, key=len) in family.attn else "mlp"


def family_of(model_type: str) -> Family:
    """The family a checkpoint of transformers' ``model_type`` belongs to (``ANY_FAMILY``: not one listed here)."""
    return next((family for family in FAMILIES if model_type in family.model_types), ANY_FAMILY)
