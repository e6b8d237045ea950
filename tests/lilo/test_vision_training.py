"""Rows with images on a vision-language base model (tiny Qwen3-VL, with deepstack features; tiny Qwen2.5-VL, whose
vision tower has gated MLPs that must not be adapted): the image reaches the language model, rows with images and
text-only rows of different adapters coalesced give each its own pass's loss and gradients, and the PEFT export
loads in peft with the service's logprobs on an image datum."""


import numpy as np
import pytest
import torch

from helpers import backend_with, image_datum, jpeg, text_datum
from lilo.backend.checkpoints.paths import local_directory
from lilo.backend.models import build_tiny, load_base_model
from lilo.backend.types import AdamParams, Datum, DatumImage, LoraSpec, SaveRequest, TrainInput
from lilo.backend.vision import image_layout, multimodal_inputs
from lilo.engine.commands import Command, Kind

SPECS = {"r2": LoraSpec(rank=2, seed=1), "r8": LoraSpec(rank=8, seed=2, train_unembed=True),
         "attn": LoraSpec(rank=4, seed=3, train_mlp=False)}


@pytest.fixture(scope="module", params=["tiny-qwen3-vl", "tiny-qwen2.5-vl", "tiny-qwen3.5-vl", "tiny-kimi-k2.5"])
def directory(request, tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def base(directory):
    return load_base_model(directory)


def fb(model_id: str, seq: int, data, forward_only: bool = False) -> Command:
    train = TrainInput(data=data)
    return Command(model_id, seq, Kind.FORWARD if forward_only else Kind.FORWARD_BACKWARD, f"{model_id}:{seq}",
                   payload=train, tokens=train.tokens)


def grads(backend, model_id: str) -> dict[str, torch.Tensor]:
    slot = backend.adapters[model_id].slot
    return {f"{path}.{factor}": getattr(layer, factor).grad[slot].clone()
            for path, layer in backend.layers.items() for factor in ("lora_A", "lora_B")}


def test_no_adapter_sits_in_the_vision_tower(base, directory):
    backend = backend_with(base, {}, images=image_layout(directory))
    assert backend.layers and not any("visual" in path for path in backend.layers)
    assert backend.uncovered == {"attn": [], "mlp": []}


def test_the_image_reaches_the_language_model(base, directory):
    layout = image_layout(directory)
    backend = backend_with(base, {"r2": SPECS["r2"]}, images=layout)
    one, other = image_datum(layout, 1), image_datum(layout, 1)
    other = Datum(one.tokens, one.loss_inputs, images=(DatumImage(jpeg(70, 100, 99), "jpeg", 6, one.images[0].tokens),))
    losses = [backend.forward_backward([fb("r2", 1, [datum], True)], forward_only=True)[0]["metrics"]["loss:sum"]
              for datum in (one, other)]
    assert losses[0] != losses[1]
    # And its positions are the model's multimodal rotary index, not a running count, where it has one (Qwen-VL);
    # Kimi's language model counts an image's positions as text.
    ids = torch.as_tensor([one.tokens])
    text_positions = torch.arange(len(one.tokens))[None]
    positions = multimodal_inputs(backend.multimodal, layout, ids, None, one.images,
                                  positions=text_positions)["position_ids"]
    if hasattr(backend.multimodal, "get_rope_index"):
        assert positions.shape == (3, 1, len(one.tokens)) and int(positions.max()) < len(one.tokens) - 1
    else:
        assert positions is text_positions


def test_coalesced_image_and_text_rows_get_their_own_passes_losses_and_gradients(base, directory):
    layout = image_layout(directory)
    data = {"r2": [image_datum(layout, 1), text_datum(2)], "r8": [image_datum(layout, 3, size=(40, 40))],
            "attn": [text_datum(4, length=25)]}
    together = backend_with(base, SPECS, images=layout)
    results = together.forward_backward([fb(m, 1, rows) for m, rows in data.items()], forward_only=False)
    for (model_id, rows), result in zip(data.items(), results):
        alone = backend_with(base, SPECS, images=layout)
        own = alone.forward_backward([fb(model_id, 1, rows)], forward_only=False)[0]
        assert np.isclose(result["metrics"]["loss:sum"], own["metrics"]["loss:sum"], rtol=1e-5)
        ours, theirs = grads(together, model_id), grads(alone, model_id)
        for key in theirs:
            assert torch.allclose(ours[key], theirs[key], rtol=1e-4, atol=1e-6), (model_id, key)
        assert any(float(grad.abs().max()) > 0 for grad in theirs.values())


def test_the_peft_export_loads_in_peft_with_the_services_logprobs_on_an_image(base, directory, tmp_path):
    from peft import PeftModel

    layout = image_layout(directory)
    backend = backend_with(base, {"r8": SPECS["r8"]}, images=layout, checkpoint_dir=tmp_path)
    for seq in (1, 3):
        backend.forward_backward([fb("r8", seq, [image_datum(layout, seq)])], forward_only=False)
        backend.optim_step([Command("r8", seq + 1, Kind.OPTIM_STEP, f"r8:{seq + 1}",
                                    payload=AdamParams(learning_rate=1e-2))])
    save = Command("r8", 5, Kind.SAVE_WEIGHTS_FOR_SAMPLER, "save", payload=SaveRequest(name="vl"))
    exported = local_directory(tmp_path, backend.persist_checkpoint(save, backend.capture_checkpoint(save))["path"])
    sample = image_datum(layout, 9)
    ours = backend.forward_backward([fb("r8", 6, [sample], True)], forward_only=True)[0]["loss_fn_outputs"][0]
    peft_model = PeftModel.from_pretrained(load_base_model(directory), exported)
    assert not any("visual" in name and "lora_" in name for name, _ in peft_model.named_parameters())
    ids = torch.as_tensor([sample.tokens])
    pixels = layout.pixel_inputs(sample.images)
    multimodal = peft_model.base_model.model.model
    rotary = {}
    if hasattr(multimodal, "get_rope_index"):  # Qwen-VL's positions; Kimi's are plain
        kinds = (ids == layout.image_token_id).int()
        positions, _ = multimodal.get_rope_index(ids, mm_token_type_ids=kinds, image_grid_thw=pixels["image_grid_thw"])
        rotary = dict(mm_token_type_ids=kinds, position_ids=positions)
    logits = peft_model(input_ids=ids, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                        **rotary).logits[0]
    theirs = torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(sample.loss_inputs["target_tokens"])[:, None])
    assert np.allclose(ours["logprobs"], theirs.squeeze(-1).detach().numpy(), atol=1e-5)


def test_the_sampler_decodes_prompts_with_images_as_the_trainer_scores_them(base, directory):
    # Two adapters' prompts with images of different sizes and a text-only one, left-padded in one generation and
    # decoded through the cache with multimodal positions: each sampled token's logprob is the one a training pass
    # gives it, and so is each prompt token's (finite at the image's positions too).
    from lilo.backend.types import SamplingRequest

    layout = image_layout(directory)
    backend = backend_with(base, SPECS, images=layout)
    for seq in (1, 3):
        backend.forward_backward([fb(m, seq, [image_datum(layout, seq + n)]) for n, m in enumerate(SPECS)],
                                 forward_only=False)
        backend.optim_step([Command(m, seq + 1, Kind.OPTIM_STEP, f"{m}:{seq + 1}",
                                    payload=AdamParams(learning_rate=1e-2)) for m in SPECS])
    prompts = {"r2": image_datum(layout, 21), "r8": image_datum(layout, 22, size=(40, 64), after=2),
               "attn": text_datum(23, length=9)}
    requests = [Command(m, 5, Kind.SAMPLE, f"{m}:5", payload=SamplingRequest(
        prompt=list(d.tokens), images=d.images, max_tokens=6, temperature=1.0, seed=4, prompt_logprobs=True))
        for m, d in prompts.items()]
    for (model_id, prompt), result in zip(prompts.items(), backend.sample(requests)):
        (sequence,) = result["sequences"]
        tokens = list(prompt.tokens) + sequence["tokens"]
        scored = Datum(tokens=tokens[:-1], images=prompt.images,
                       loss_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
        logprobs = backend.forward_backward([fb(model_id, 6, [scored], True)], forward_only=True)[0]
        logprobs = np.asarray(logprobs["loss_fn_outputs"][0]["logprobs"])
        length = len(prompt.tokens)
        np.testing.assert_allclose(sequence["logprobs"], logprobs[length - 1:], atol=1e-4)
        np.testing.assert_allclose(result["prompt_logprobs"][1:], logprobs[:length - 1], atol=1e-4)
        assert np.isfinite(result["prompt_logprobs"][1:]).all()
