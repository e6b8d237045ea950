"""The SDK's RL surface against the local cluster: sampling with ``record_stability_info`` and training on it with
``stable_reinforce`` (provenance spans resolved against the records), ``gspo``, and ``forward_backward_custom``."""

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from conftest import TENANT_KEYS

PROMPT = [5, 17, 42, 99, 7, 3]
MAX_TOKENS = 6


def sampled_datum(sequence: types.SampledSequence, advantage: float, provenance: bool = True) -> types.Datum:
    """The cookbook's RL datum of one sampled sequence (recipes/rl_loop.py): input = prompt + sampled[:-1], targets
    shifted by one, prompt positions padded with zeros; with its provenance, as stable_reinforce requires."""
    sampled = sequence.tokens
    observed = len(PROMPT) - 1
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT + sampled[:-1]),
        loss_fn_inputs={"target_tokens": PROMPT[1:] + sampled, "logprobs": [0.0] * observed + sequence.logprobs,
                        "advantages": [0.0] * observed + [advantage] * len(sampled)})
    if not provenance:
        return datum
    sid = sequence.sequence_id
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sid, length=len(PROMPT)),
                     types.SampledProvenanceSpan(sequence_id=sid, length=len(sampled) - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=observed),
                        types.SampledProvenanceSpan(sequence_id=sid, length=len(sampled))])


def sample(sampler, num_samples: int = 2) -> list[types.SampledSequence]:
    params = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3, stop=[])
    return sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples, params).result(timeout=120).sequences


@pytest.fixture
def recorded(service):
    """A training client and the sequences its own session sampled with record_stability_info."""
    training = service.create_lora_training_client(base_model="lilo/tiny-llama", rank=4).result(timeout=120)
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result(timeout=120)
    return training, sample(sampler)


def test_stable_reinforce_trains_on_recorded_sequences_with_the_samplers_logprobs(recorded):
    training, sequences = recorded
    assert len({s.sequence_id for s in sequences}) == 2
    advantages = [1.0, -1.0]
    data = [sampled_datum(s, a) for s, a in zip(sequences, advantages)]
    result = training.forward_backward(data, "stable_reinforce").result(timeout=120)
    # Nothing trained since the save: the trainer's logprobs of the sampled tokens are the sampler's (ratio 1), so
    # the loss is -sum(A * logprob) over the sampled tokens, with the logprobs the sampler recorded.
    expected = -sum(a * sum(s.logprobs) for s, a in zip(sequences, advantages))
    assert result.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)
    for output, sequence in zip(result.loss_fn_outputs, sequences):
        np.testing.assert_allclose(output["logprobs"].tolist()[len(PROMPT) - 1:], sequence.logprobs, atol=1e-4)
    step = training.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)
    assert step.metrics["grad_norm:mean"] > 0
    # Each training use restarts a sequence's day: training on them again works.
    again = training.forward_backward(data, "stable_reinforce").result(timeout=120)
    assert again.metrics["loss:sum"] != pytest.approx(expected, rel=1e-6)  # the step changed the weights


def test_stable_reinforce_refuses_what_it_cannot_resolve_naming_it(service, local_cluster, recorded):
    training, sequences = recorded
    good = sampled_datum(sequences[0], 1.0)
    forged = types.Datum(model_input=good.model_input, loss_fn_inputs=good.loss_fn_inputs,
                         model_input_spans=[types.SampledProvenanceSpan(sequence_id="999999:0", length=11)],
                         loss_fn_input_spans=good.loss_fn_input_spans)
    with pytest.raises(tinker.APIStatusError, match="Unknown sequence_id '999999:0'"):
        training.forward_backward([forged], "stable_reinforce").result(timeout=60)
    short = types.Datum(model_input=good.model_input, loss_fn_inputs=good.loss_fn_inputs,
                        model_input_spans=good.model_input_spans[:1], loss_fn_input_spans=good.loss_fn_input_spans)
    with pytest.raises(tinker.APIStatusError, match="Datum 0: the model_input provenance spans cover 6 positions"):
        training.forward_backward([short], "stable_reinforce").result(timeout=60)
    with pytest.raises(tinker.APIStatusError, match="Datum 0 has no provenance"):
        training.forward_backward([sampled_datum(sequences[0], 1.0, provenance=False)],
                                  "stable_reinforce").result(timeout=60)
    # Another session of the same tenant may not use them; another tenant does not even see them.
    other = service.create_lora_training_client(base_model="lilo/tiny-llama", rank=4).result(timeout=120)
    with tinker.ServiceClient(base_url=local_cluster.api_url, api_key="tml-local-test") as second_session:
        foreign = second_session.create_lora_training_client(base_model="lilo/tiny-llama", rank=4).result(timeout=120)
        with pytest.raises(tinker.APIStatusError, match="sampled in session .* same session"):
            foreign.forward_backward([good], "stable_reinforce").result(timeout=60)
    with tinker.ServiceClient(base_url=local_cluster.api_url, api_key=TENANT_KEYS["beta"]) as beta:
        theirs = beta.create_lora_training_client(base_model="lilo/tiny-llama", rank=4).result(timeout=120)
        with pytest.raises(tinker.APIStatusError, match=f"Unknown sequence_id '{sequences[0].sequence_id}'"):
            theirs.forward_backward([good], "stable_reinforce").result(timeout=60)
    # The refusals spent their seqs; the session's models go on.
    assert other.forward_backward([good], "stable_reinforce").result(timeout=120).metrics["loss:sum"] != 0
    assert training.forward_backward([good], "stable_reinforce").result(timeout=120).metrics["loss:sum"] != 0


def test_gspo_trains_with_and_without_a_sequence_ratio_mask(service):
    training = service.create_lora_training_client(base_model="lilo/tiny-llama", rank=4).result(timeout=120)
    sequences = sample(training.save_weights_and_get_sampling_client().result(timeout=120))
    data = [sampled_datum(s, a, provenance=False) for s, a in zip(sequences, [1.0, -1.0])]
    masked = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        **d.loss_fn_inputs, "sequence_ratio_mask": [0.0] * (len(PROMPT) - 1) + [1.0] * MAX_TOKENS}) for d in data]
    expected = -sum(a * len(s.tokens) for s, a in zip(sequences, [1.0, -1.0]))  # ratio 1 on every token
    for batch in (data, masked):
        result = training.forward_backward(batch, "gspo", {"clip_low_threshold": 0.8,
                                                           "clip_high_threshold": 1.2}).result(timeout=120)
        assert result.metrics["loss:sum"] == pytest.approx(expected, rel=1e-3)
    assert training.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120).metrics["grad_norm:mean"] > 0


def test_forward_backward_custom_trains_a_client_side_loss(service):
    """The SDK computes the loss client-side (a forward, then a forward_backward on the linearized loss); pulling
    every target's logprob up must raise them."""
    training = service.create_lora_training_client(base_model="lilo/tiny-llama", rank=8).result(timeout=120)
    tokens = list(range(30, 54))
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 23})

    def mean_squared_logprob(data, logprobs):
        loss = torch.stack([(lp ** 2).mean() for lp in logprobs]).sum()
        return loss, {"msq": float(loss.detach())}

    before = training.forward([datum], "cross_entropy").result(timeout=120).metrics["loss:sum"]
    for _ in range(4):
        result = training.forward_backward_custom([datum], mean_squared_logprob).result(timeout=120)
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)
    assert result.metrics["msq"] > 0
    after = training.forward([datum], "cross_entropy").result(timeout=120).metrics["loss:sum"]
    assert after < 0.9 * before
