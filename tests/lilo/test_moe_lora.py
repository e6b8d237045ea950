"""Multi-LoRA on fused MoE experts, on each MoE family's tiny random model (8 experts, 2 a token) loaded through
from_pretrained: Qwen3-MoE, GPT-OSS (transposed experts with biases, its own gate) and DeepSeek-V3 (multi-head
latent attention, a shared expert, a dense first layer). The bank covers every expert projection, coalesced adapters
of different ranks get their own passes' gradients, an adapter that does not train the MLP leaves every expert
alone, and the PEFT export loads in peft with the service's logprobs."""

import copy

import numpy as np
import pytest
import torch

from lilo.backend.checkpoints.paths import local_directory
from lilo.backend.checkpoints.state import read_peft
from lilo.backend.adapters.experts import expert_projections, is_fused_experts, projection_shape
from lilo.backend.adapters.lora import ATTENTION_PROJECTIONS, projection_kind
from lilo.backend.models import build_tiny, load_base_model
from lilo.backend.torch_backend import TorchBackend
from lilo.backend.types import AdamParams, Datum, LoraSpec, SaveRequest, TrainInput
from lilo.engine.commands import Command, Kind

SPECS = {"r2": LoraSpec(rank=2, seed=1), "r8": LoraSpec(rank=8, seed=2, train_unembed=True),
         "attn": LoraSpec(rank=4, seed=3, train_mlp=False)}


@pytest.fixture(scope="module", params=["tiny-qwen3-moe", "tiny-gpt-oss", "tiny-deepseek-v3"])
def moe_directory(request, tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def moe(moe_directory):
    return load_base_model(moe_directory)


def backend_of(base, specs, **options) -> TorchBackend:
    backend = TorchBackend(copy.deepcopy(base), max_adapters=4, max_rank=8, **options)
    for model_id, spec in specs.items():
        backend.add_adapter(model_id, spec)
    return backend


def datum(seed: int, length: int = 21) -> Datum:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 1000, length)
    return Datum(tokens=tokens.tolist(), loss_inputs={"target_tokens": np.roll(tokens, -1).tolist(),
                                                      "weights": rng.random(length).round(2).tolist()})


def fb(model_id: str, seq: int, data) -> Command:
    train = TrainInput(data=data)
    return Command(model_id, seq, Kind.FORWARD_BACKWARD, f"{model_id}:{seq}", payload=train, tokens=train.tokens)


def opt(model_id: str, seq: int) -> Command:
    return Command(model_id, seq, Kind.OPTIM_STEP, f"{model_id}:{seq}", payload=AdamParams(learning_rate=1e-2))


def expert_grads(backend: TorchBackend, model_id: str) -> dict[str, torch.Tensor]:
    slot = backend.adapters[model_id].slot
    return {f"{path}.{factor}": getattr(layer, factor).grad[slot].clone()
            for path, layer in backend.layers.items() if ".experts." in path for factor in ("lora_A", "lora_B")}


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
    # The router is not wrapped; every attention projection the family has is.
    assert not any(path.endswith((".gate", ".router")) for path in backend.layers)
    attention = {name.rsplit(".", 1)[-1] for name, module in moe.named_modules() if isinstance(module, torch.nn.Linear)
                 and ".self_attn." in name}
    assert attention <= set(ATTENTION_PROJECTIONS)


def test_fresh_adapters_leave_the_model_as_the_family_computes_it(moe, moe_directory):
    backend = backend_of(moe, SPECS)
    sample = datum(5)
    ours = backend.forward_backward([fb("r8", 1, [sample])], forward_only=True)[0]["loss_fn_outputs"][0]["logprobs"]
    reference = load_base_model(moe_directory)
    logits = reference(input_ids=torch.as_tensor([sample.tokens])).logits[0]
    theirs = torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(sample.loss_inputs["target_tokens"])[:, None])
    assert np.allclose(ours, theirs.squeeze(-1).detach().numpy(), atol=1e-5)


def test_coalesced_adapters_of_different_ranks_get_the_gradients_of_their_own_passes(moe):
    data = {model_id: [datum(10 * n), datum(10 * n + 1, length=13)] for n, model_id in enumerate(SPECS)}
    coalesced, separate = backend_of(moe, SPECS), backend_of(moe, SPECS)
    for backend in (coalesced, separate):  # one step first, so that B is not zero and A gets gradients too
        backend.forward_backward([fb(m, 1, data[m]) for m in SPECS], forward_only=False)
        backend.optim_step([opt(m, 2) for m in SPECS])
    together = coalesced.forward_backward([fb(m, 3, data[m]) for m in SPECS], forward_only=False)
    alone = {m: separate.forward_backward([fb(m, 3, data[m])], forward_only=False)[0] for m in SPECS}
    for n, model_id in enumerate(SPECS):
        assert together[n]["metrics"]["loss:sum"] == pytest.approx(alone[model_id]["metrics"]["loss:sum"], rel=1e-5)
        ours, theirs = expert_grads(coalesced, model_id), expert_grads(separate, model_id)
        for key, grad in theirs.items():
            assert (ours[key] - grad).abs().max().item() <= 1e-5 * (grad.abs().max().item() or 1.0), key
    assert all(grad.abs().max() > 0 for grad in expert_grads(coalesced, "r2").values())


def merged_pass(moe, backend: TorchBackend, model_id: str, sample: Datum) -> tuple[float, dict[str, torch.Tensor]]:
    """An independent reference: the family's own forward with one adapter merged into the base weights (each
    projection's weight plus ``scale * B @ A``, per expert for fused experts), its weighted cross-entropy, and that
    loss's gradients with respect to each A and B."""
    slot = backend.adapters[model_id].slot
    weights, merged, factors = dict(moe.named_parameters()), {}, {}
    for path, layer in backend.layers.items():
        rank = layer.ranks[slot]
        if not rank:
            continue
        a = layer.lora_A[slot, ..., :rank, :].detach().clone().requires_grad_()
        b = layer.lora_B[slot, ..., :rank].detach().clone().requires_grad_()
        delta = layer.scales[slot] * (b @ a)  # (..., out, in)
        if ".experts." in path:
            name = path
            if moe.get_submodule(path.rsplit(".", 1)[0]).is_transposed:  # GPT-OSS: (experts, in, out)
                delta = delta.transpose(-1, -2)
        else:
            name = f"{path}.weight"
        merged[name] = weights[name] + delta
        factors[path] = (a, b)
    logits = torch.func.functional_call(moe, merged, (torch.as_tensor([sample.tokens]),)).logits[0]
    logprobs = torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(sample.loss_inputs["target_tokens"])[:, None])
    loss = -(logprobs[:, 0] * torch.as_tensor(sample.loss_inputs["weights"])).sum()
    loss.backward()
    return float(loss), {f"{path}.{factor}": tensor.grad for path, pair in factors.items()
                         for factor, tensor in zip(("lora_A", "lora_B"), pair)}


def test_an_adapters_loss_and_gradients_equal_the_familys_own_forward_with_it_merged(moe):
    backend = backend_of(moe, SPECS)
    for model_id in SPECS:  # one step first, so that B is not zero and A gets gradients too
        backend.forward_backward([fb(model_id, 1, [datum(1)])], forward_only=False)
        backend.optim_step([opt(model_id, 2)])
    sample = datum(3)
    ours = backend.forward_backward([fb("r8", 3, [sample])], forward_only=False)[0]["metrics"]["loss:sum"]
    loss, theirs = merged_pass(moe, backend, "r8", sample)
    assert ours == pytest.approx(loss, rel=1e-5)
    slot, rank = backend.adapters["r8"].slot, SPECS["r8"].rank
    assert any(".experts." in key for key in theirs)
    for key, grad in theirs.items():
        path, factor = key.rsplit(".", 1)
        mine = getattr(backend.layers[path], factor).grad[slot]
        mine = mine[..., :rank, :] if factor == "lora_A" else mine[..., :rank]
        assert (mine - grad).abs().max().item() <= 1e-4 * (grad.abs().max().item() or 1.0), key


def test_an_adapter_that_does_not_train_the_mlp_leaves_every_expert_untouched(moe):
    backend = backend_of(moe, SPECS)
    for seq in (1, 3):
        backend.forward_backward([fb(m, seq, [datum(seq)]) for m in SPECS], forward_only=False)
        backend.optim_step([opt(m, seq + 1) for m in SPECS])
    slot = backend.adapters["attn"].slot
    for path, layer in backend.layers.items():
        if ".experts." in path:
            assert not layer.lora_A[slot].any() and not layer.lora_B[slot].any(), path
    assert any(layer.lora_B[slot].any() for path, layer in backend.layers.items()
               if projection_kind(path) in ATTENTION_PROJECTIONS)


@pytest.mark.parametrize("family", ["tiny-qwen3-moe", "tiny-gpt-oss", "tiny-deepseek-v3"])
def test_the_peft_export_loads_in_peft_with_the_services_logprobs(family, tmp_path):
    from peft import PeftModel

    moe_directory = build_tiny(tmp_path / family, family)
    moe = load_base_model(moe_directory)
    backend = backend_of(moe, {"r8": SPECS["r8"]}, checkpoint_dir=tmp_path)
    for seq in (1, 3):
        backend.forward_backward([fb("r8", seq, [datum(seq)])], forward_only=False)
        backend.optim_step([opt("r8", seq + 1)])
    save = Command("r8", 5, Kind.SAVE_WEIGHTS_FOR_SAMPLER, "save", payload=SaveRequest(name="moe"))
    directory = local_directory(tmp_path, backend.persist_checkpoint(save, backend.capture_checkpoint(save))["path"])
    sample = datum(9)
    ours = backend.forward_backward([fb("r8", 6, [sample])], forward_only=True)[0]["loss_fn_outputs"][0]["logprobs"]
    peft_model = PeftModel.from_pretrained(load_base_model(moe_directory), directory)
    # peft adapts every projection lilo trained (none retargeted, none dropped): one A per trained projection.
    trained = [key for key in backend.capture_checkpoint(save)[1].tensors if key.endswith(".lora_A")]
    assert sum(".lora_A." in name for name, _ in peft_model.named_parameters()) == len(trained)
    logits = peft_model(input_ids=torch.as_tensor([sample.tokens])).logits[0]
    theirs = torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(sample.loss_inputs["target_tokens"])[:, None])
    assert np.allclose(ours, theirs.squeeze(-1).detach().numpy(), atol=1e-5)
    # The experts' adapters are what moved it: the base model alone gives other logprobs.
    base = load_base_model(moe_directory)(input_ids=torch.as_tensor([sample.tokens])).logits[0]
    assert not torch.allclose(torch.log_softmax(base, -1), torch.log_softmax(logits, -1), atol=1e-3)
    # And it reads back as lilo wrote it.
    state = read_peft(directory)
    captured = backend.capture_checkpoint(save)[1]
    assert state.spec.train_mlp and state.tensors.keys() == captured.tensors.keys()
    assert all(torch.equal(state.tensors[key], captured.tensors[key]) for key in captured.tensors)
