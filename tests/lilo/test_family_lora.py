"""Multi-LoRA on each family's tiny random model loaded through from_pretrained, beyond plain attention and MLP:
the MoE families with fused experts (Qwen3-MoE; GPT-OSS, transposed experts with biases and its own gate;
DeepSeek-V3, multi-head latent attention, a shared expert, a dense first layer; Qwen3.5-MoE) and the hybrid ones
with linear attention (Qwen3.5 and Qwen3.5-MoE: Gated DeltaNet in three of four layers). The bank covers every
expert projection, a fresh adapter leaves the family's own forward as it is, an adapter's loss and gradients equal
the family's forward with it merged, coalesced adapters of different ranks get their own passes' gradients, an
adapter that does not train the MLP leaves every expert alone, and the PEFT export loads in peft with the service's
logprobs."""

import numpy as np
import pytest
import torch

from helpers import backend_with, weighted_datum
from lilo.backend.checkpoints.paths import local_directory
from lilo.backend.checkpoints.state import read_peft
from lilo.backend.adapters.experts import expert_projections, is_fused_experts, projection_shape
from lilo.backend.families import role_of
from lilo.backend.models import build_tiny, load_base_model
from lilo.backend.torch_backend import TorchBackend
from lilo.backend.types import AdamParams, Datum, LoraSpec, SaveRequest, TrainInput
from lilo.engine.commands import Command, Kind

SPECS = {"r2": LoraSpec(rank=2, seed=1), "r8": LoraSpec(rank=8, seed=2, train_unembed=True),
         "attn": LoraSpec(rank=4, seed=3, train_mlp=False)}


# Every family but plain Llama and Qwen3 (tests/lilo/test_torch_backend.py): with fused experts, with linear
# attention or a state-space mixer, with per-layer inputs and tied embeddings (Gemma 4), with a sparse attention's
# indexer (GLM-5), with norms after each block (OLMo 3), with compressed attention and hyper-connections
# (DeepSeek-V4: its sampler batches only prompts of one length).
FAMILIES = ["tiny-qwen3-moe", "tiny-gpt-oss", "tiny-deepseek-v3", "tiny-glm4-moe", "tiny-qwen3.5", "tiny-qwen3.5-moe",
            "tiny-nemotron-h", "tiny-gemma4", "tiny-glm5", "tiny-olmo3", "tiny-deepseek-v4"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_directory(request, tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def family(family_directory):
    return load_base_model(family_directory)


@pytest.fixture(scope="module")
def moe(family):
    if not any(is_fused_experts(module) for module in family.modules()):
        pytest.skip("a dense family: no experts")
    return family


def backend_of(base, specs, **options) -> TorchBackend:
    return backend_with(base, specs, max_adapters=4, max_rank=8, **options)


def datum(seed: int, length: int = 21) -> Datum:
    return weighted_datum(seed, length)


def fb(model_id: str, seq: int, data) -> Command:
    train = TrainInput(data=data)
    return Command(model_id, seq, Kind.FORWARD_BACKWARD, f"{model_id}:{seq}", payload=train, tokens=train.tokens)


def opt(model_id: str, seq: int) -> Command:
    return Command(model_id, seq, Kind.OPTIM_STEP, f"{model_id}:{seq}", payload=AdamParams(learning_rate=1e-2))


def adapter_grads(backend: TorchBackend, model_id: str) -> dict[str, torch.Tensor]:
    slot = backend.adapters[model_id].slot
    return {f"{path}.{factor}": getattr(layer, factor).grad[slot].clone()
            for path, layer in backend.layers.items() for factor in ("lora_A", "lora_B")}


def test_the_bank_puts_adapters_on_every_expert_projection(moe):
    fused = {path: module for path, module in moe.named_modules() if is_fused_experts(module)}
    backend = backend_of(moe, {})
    slots = backend.bank.weights.shape[0]
    assert fused and sorted(path for path in backend.layers if ".experts." in path) == sorted(
        f"{path}.{name}" for path, module in fused.items() for name in expert_projections(module))
    for path, module in fused.items():
        for name in expert_projections(module):
            # Per slot and expert: A (max rank, in) and B (out, max rank).
            experts, fan_in, fan_out = projection_shape(module, name)
            layer = backend.layers[f"{path}.{name}"]
            assert tuple(layer.lora_A.shape) == (slots, experts, 8, fan_in)
            assert tuple(layer.lora_B.shape) == (slots, experts, fan_out, 8)
    # The router is not wrapped; every other linear of the layers is, or is frozen by design.
    assert not any(path.endswith((".gate", ".router")) for path in backend.layers)
    linears = [name for name, module in moe.named_modules() if isinstance(module, torch.nn.Linear)
               and ".layers." in name]
    assert linears and all(name in backend.layers or role_of(backend.bank.family, name) == "frozen"
                           for name in linears)


def family_logprobs(model, sample: Datum) -> np.ndarray:
    """The target tokens' logprobs under ``model``'s own forward (no lilo, one unpadded row)."""
    logits = model(input_ids=torch.as_tensor([sample.tokens])).logits[0]
    logprobs = torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(sample.loss_inputs["target_tokens"])[:, None])
    return logprobs.squeeze(-1).detach().numpy()


def test_fresh_adapters_leave_the_model_as_the_family_computes_it(family, family_directory):
    backend = backend_of(family, SPECS)
    # Two rows of different lengths in one pass: the shorter one is right-padded, which the linear attention's
    # recurrence must not carry into its real tokens' results.
    samples = [datum(5), datum(6, length=9)]
    outputs = backend.forward_backward([fb("r8", 1, samples)], forward_only=True)[0]["loss_fn_outputs"]
    reference = load_base_model(family_directory)
    for sample, output in zip(samples, outputs):
        assert np.allclose(output["logprobs"], family_logprobs(reference, sample), atol=1e-5)


def test_coalesced_adapters_of_different_ranks_get_the_gradients_of_their_own_passes(family):
    data = {model_id: [datum(10 * n), datum(10 * n + 1, length=13)] for n, model_id in enumerate(SPECS)}
    coalesced, separate = backend_of(family, SPECS), backend_of(family, SPECS)
    for backend in (coalesced, separate):  # one step first, so that B is not zero and A gets gradients too
        backend.forward_backward([fb(m, 1, data[m]) for m in SPECS], forward_only=False)
        backend.optim_step([opt(m, 2) for m in SPECS])
    together = coalesced.forward_backward([fb(m, 3, data[m]) for m in SPECS], forward_only=False)
    alone = {m: separate.forward_backward([fb(m, 3, data[m])], forward_only=False)[0] for m in SPECS}
    for n, model_id in enumerate(SPECS):
        assert together[n]["metrics"]["loss:sum"] == pytest.approx(alone[model_id]["metrics"]["loss:sum"], rel=1e-5)
        ours, theirs = adapter_grads(coalesced, model_id), adapter_grads(separate, model_id)
        for key, grad in theirs.items():
            assert (ours[key] - grad).abs().max().item() <= 1e-5 * (grad.abs().max().item() or 1.0), key
    # Every projection the adapter trains got a gradient: the experts', and the linear attention's (r2 trains all but
    # the output head).
    untouched = [key for key, grad in adapter_grads(coalesced, "r2").items()
                 if coalesced.bank.target_of(key.rsplit(".", 1)[0]) != "unembed" and not grad.any()]
    assert not untouched, untouched


def merged_pass(model, backend: TorchBackend, model_id: str, sample: Datum) -> tuple[float, dict[str, torch.Tensor]]:
    """An independent reference: the family's own forward with one adapter merged into the base weights (each
    projection's weight plus ``scale * B @ A``, per expert for fused experts), its weighted cross-entropy, and that
    loss's gradients with respect to each A and B."""
    slot = backend.adapters[model_id].slot
    merged, factors = {}, {}
    for path, layer in backend.layers.items():
        rank = layer.ranks[slot]
        if not rank:
            continue
        a = layer.lora_A[slot, ..., :rank, :].detach().clone().requires_grad_()
        b = layer.lora_B[slot, ..., :rank].detach().clone().requires_grad_()
        delta = layer.scales[slot] * (b @ a)  # (..., out, in)
        if ".experts." in path:
            name = path
            if model.get_submodule(path.rsplit(".", 1)[0]).is_transposed:  # GPT-OSS: (experts, in, out)
                delta = delta.transpose(-1, -2)
        else:
            name = f"{path}.weight"
        # A tied output head (Gemma 4) is not a parameter of its own: its weight is the embeddings', which the
        # adapter leaves alone (tie_weights=False below).
        merged[name] = model.get_parameter(name) + delta
        factors[path] = (a, b)
    logits = torch.func.functional_call(model, merged, (torch.as_tensor([sample.tokens]),), tie_weights=False).logits[0]
    logprobs = torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(sample.loss_inputs["target_tokens"])[:, None])
    loss = -(logprobs[:, 0] * torch.as_tensor(sample.loss_inputs["weights"])).sum()
    loss.backward()
    return float(loss), {f"{path}.{factor}": tensor.grad for path, pair in factors.items()
                         for factor, tensor in zip(("lora_A", "lora_B"), pair)}


def test_an_adapters_loss_and_gradients_equal_the_familys_own_forward_with_it_merged(family):
    backend = backend_of(family, SPECS)
    for model_id in SPECS:  # one step first, so that B is not zero and A gets gradients too
        backend.forward_backward([fb(model_id, 1, [datum(1)])], forward_only=False)
        backend.optim_step([opt(model_id, 2)])
    sample = datum(3)
    ours = backend.forward_backward([fb("r8", 3, [sample])], forward_only=False)[0]["metrics"]["loss:sum"]
    loss, theirs = merged_pass(family, backend, "r8", sample)
    assert ours == pytest.approx(loss, rel=1e-5)
    slot, rank = backend.adapters["r8"].slot, SPECS["r8"].rank
    # Every projection the adapter trains was checked: the experts', the linear attention's, the rest.
    assert {key.rsplit(".", 1)[0] for key in theirs} == {path for path, layer in backend.layers.items()
                                                         if layer.ranks[slot]}
    for key, grad in theirs.items():
        path, factor = key.rsplit(".", 1)
        mine = getattr(backend.layers[path], factor).grad[slot]
        mine = mine[..., :rank, :] if factor == "lora_A" else mine[..., :rank]
        assert (mine - grad).abs().max().item() <= 1e-4 * (grad.abs().max().item() or 1.0), key


def test_an_adapter_that_does_not_train_the_mlp_leaves_every_expert_and_mlp_projection_untouched(family):
    backend = backend_of(family, SPECS)
    for seq in (1, 3):
        backend.forward_backward([fb(m, seq, [datum(seq)]) for m in SPECS], forward_only=False)
        backend.optim_step([opt(m, seq + 1) for m in SPECS])
    slot = backend.adapters["attn"].slot
    for path, layer in backend.layers.items():
        if backend.bank.target_of(path) != "attn":
            assert not layer.lora_A[slot].any() and not layer.lora_B[slot].any(), path
    assert any(layer.lora_B[slot].any() for path, layer in backend.layers.items()
               if backend.bank.target_of(path) == "attn")


def test_the_sampler_decodes_each_adapter_as_the_trainer_scores_it(family):
    # Two adapters' prompts of different lengths in one generation (the shorter left-padded), decoded token by token
    # through the family's cache (the linear attention's recurrent state and convolution window, the attention's
    # keys and values): each sampled token's logprob is the one a training pass gives it, and so is each prompt's.
    from lilo.backend.types import SamplingRequest

    backend = backend_of(family, SPECS)
    for seq in (1, 3):
        backend.forward_backward([fb(m, seq, [datum(seq)]) for m in SPECS], forward_only=False)
        backend.optim_step([opt(m, seq + 1) for m in SPECS])
    prompts = {"r2": datum(21, length=11).tokens, "r8": datum(22, length=5).tokens}
    requests = [Command(m, 5, Kind.SAMPLE, f"{m}:5", payload=SamplingRequest(
        prompt=prompt, max_tokens=6, temperature=1.0, seed=4, prompt_logprobs=True)) for m, prompt in prompts.items()]
    for (model_id, prompt), result in zip(prompts.items(), backend.sample(requests)):
        (sequence,) = result["sequences"]
        tokens = prompt + sequence["tokens"]
        scored = Datum(tokens=tokens[:-1],
                       loss_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
        logprobs = backend.forward_backward([fb(model_id, 6, [scored])], forward_only=True)[0]["loss_fn_outputs"][0]
        logprobs = np.asarray(logprobs["logprobs"])
        np.testing.assert_allclose(sequence["logprobs"], logprobs[len(prompt) - 1:], atol=1e-4)
        np.testing.assert_allclose(result["prompt_logprobs"][1:], logprobs[:len(prompt) - 1], atol=1e-4)


def test_the_peft_export_loads_in_peft_with_the_services_logprobs(family, family_directory, tmp_path):
    from peft import PeftModel

    backend = backend_of(family, {"r8": SPECS["r8"]}, checkpoint_dir=tmp_path)
    for seq in (1, 3):
        backend.forward_backward([fb("r8", seq, [datum(seq)])], forward_only=False)
        backend.optim_step([opt("r8", seq + 1)])
    save = Command("r8", 5, Kind.SAVE_WEIGHTS_FOR_SAMPLER, "save", payload=SaveRequest(name="moe"))
    directory = local_directory(tmp_path, backend.persist_checkpoint(save, backend.capture_checkpoint(save))["path"])
    sample = datum(9)
    ours = backend.forward_backward([fb("r8", 6, [sample])], forward_only=True)[0]["loss_fn_outputs"][0]["logprobs"]
    peft_model = PeftModel.from_pretrained(load_base_model(family_directory), directory)
    # peft adapts every projection lilo trained (none retargeted, none dropped): one A per trained projection.
    trained = [key for key in backend.capture_checkpoint(save)[1].tensors if key.endswith(".lora_A")]
    assert sum(".lora_A." in name for name, _ in peft_model.named_parameters()) == len(trained)
    logits = peft_model(input_ids=torch.as_tensor([sample.tokens])).logits[0]
    theirs = torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(sample.loss_inputs["target_tokens"])[:, None])
    assert np.allclose(ours, theirs.squeeze(-1).detach().numpy(), atol=1e-5)
    # The adapters are what moved it: the base model alone gives other logprobs.
    base = load_base_model(family_directory)(input_ids=torch.as_tensor([sample.tokens])).logits[0]
    assert not torch.allclose(torch.log_softmax(base, -1), torch.log_softmax(logits, -1), atol=1e-3)
    # And it reads back as lilo wrote it.
    state = read_peft(directory)
    captured = backend.capture_checkpoint(save)[1]
    assert state.spec.train_mlp and state.tensors.keys() == captured.tensors.keys()
    assert all(torch.equal(state.tensors[key], captured.tensors[key]) for key in captured.tensors)
