"""Multi-LoRA on fused MoE experts, on a real tiny Qwen3-MoE (8 experts, 2 a token) loaded through from_pretrained:
the bank covers every expert projection, coalesced adapters of different ranks get their own passes' gradients, an
adapter that does not train the MLP leaves every expert alone, and the PEFT export loads in peft with the service's
logprobs."""

import copy

import numpy as np
import pytest
import torch

from lilo.backend.checkpoints.paths import local_directory
from lilo.backend.checkpoints.state import read_peft
from lilo.backend.models import build_tiny_qwen3_moe, load_base_model
from lilo.backend.torch_backend import TorchBackend
from lilo.backend.types import AdamParams, Datum, LoraSpec, SaveRequest, TrainInput
from lilo.engine.commands import Command, Kind

SPECS = {"r2": LoraSpec(rank=2, seed=1), "r8": LoraSpec(rank=8, seed=2, train_unembed=True),
         "attn": LoraSpec(rank=4, seed=3, train_mlp=False)}


@pytest.fixture(scope="module")
def moe_directory(tmp_path_factory):
    return build_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny-qwen3-moe"))


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
    backend = backend_of(moe, {})
    experts = sorted(path for path in backend.layers if ".experts." in path)
    assert experts == [f"model.layers.{n}.mlp.experts.{name}"
                       for n in range(2) for name in ("down_proj", "gate_up_proj")]
    # Per slot and expert: A (rank, hidden) and B (2 x the experts' width, rank) on the gate/up projection.
    gate_up, slots = backend.layers["model.layers.0.mlp.experts.gate_up_proj"], backend.bank.weights.shape[0]
    assert tuple(gate_up.lora_A.shape) == (slots, 8, 8, 128) and tuple(gate_up.lora_B.shape) == (slots, 8, 128, 8)
    # The experts hold most of the model's weights; the router is not wrapped.
    weights = dict(moe.named_parameters())
    experts_weights = sum(p.numel() for name, p in weights.items() if ".experts." in name)
    share = experts_weights / sum(p.numel() for p in weights.values())
    assert share > 0.5
    assert not any("mlp.gate" in path for path in backend.layers)


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


def test_an_adapter_that_does_not_train_the_mlp_leaves_every_expert_untouched(moe):
    backend = backend_of(moe, SPECS)
    for seq in (1, 3):
        backend.forward_backward([fb(m, seq, [datum(seq)]) for m in SPECS], forward_only=False)
        backend.optim_step([opt(m, seq + 1) for m in SPECS])
    slot = backend.adapters["attn"].slot
    for path, layer in backend.layers.items():
        if ".experts." in path:
            assert not layer.lora_A[slot].any() and not layer.lora_B[slot].any(), path
    assert backend.layers["model.layers.0.self_attn.q_proj"].lora_B[slot].any()


def test_the_peft_export_loads_in_peft_with_the_services_logprobs(moe, moe_directory, tmp_path):
    from peft import PeftModel

    backend = backend_of(moe, {"r8": SPECS["r8"]}, checkpoint_dir=tmp_path)
    for seq in (1, 3):
        backend.forward_backward([fb("r8", seq, [datum(seq)])], forward_only=False)
        backend.optim_step([opt("r8", seq + 1)])
    save = Command("r8", 5, Kind.SAVE_WEIGHTS_FOR_SAMPLER, "save", payload=SaveRequest(name="moe"))
    directory = local_directory(tmp_path, backend.persist_checkpoint(save, backend.capture_checkpoint(save))["path"])
    sample = datum(9)
    ours = backend.forward_backward([fb("r8", 6, [sample])], forward_only=True)[0]["loss_fn_outputs"][0]["logprobs"]
    peft_model = PeftModel.from_pretrained(load_base_model(moe_directory), directory)
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
