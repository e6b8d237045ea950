"""Which requests the vLLM sampler answers as the torch sampler would, and how it asks vLLM for them: pure functions,
no vLLM needed (tests/cluster/test_vllm_sampler.py runs them on a real engine)."""

import dataclasses
import json

import pytest

from lilo.backend.types import PromptTargets, SamplingRequest
from lilo.backend.types import DatumImage
from lilo.backend.vllm_sampler import peft_rank, sample_seed, sampling_params_of, vllm_unsupported
from lilo.errors import InvalidRequestError

PLAIN = SamplingRequest(prompt=[1, 2, 3], max_tokens=8)


@pytest.mark.parametrize(("changes", "reason"), [
    ({}, None),
    ({"temperature": 0.0}, None),
    ({"temperature": 0.7, "seed": 3, "num_samples": 4}, None),
    ({"temperature": 0.0, "top_k": 5, "top_p": 0.5}, None),  # greedy: the filters change nothing
    ({"top_k": 0}, None),  # 0 and -1: every token
    ({"stop": [[2], [7]], "stop_strings": ["\n"]}, None),
    ({"topk_sample_logprobs": 20, "record_stability_info": True, "base_only": True}, None),
    ({"target_prompt_logprobs": PromptTargets(shape=(2, 1), values=[5, 6])}, "target_prompt_logprobs"),
    ({"prompt_alt_tokens_k": 2}, "prompt_alt_tokens_k"),
    ({"prompt_logprobs": True}, "prompt_logprobs"),
    ({"topk_prompt_logprobs": 3}, "prompt_logprobs"),
    ({"prompt_logprobs": True, "max_tokens": 0}, "prompt_logprobs"),
    ({"max_tokens": 0}, "max_tokens=0"),
    ({"temperature": 1e-6}, "temperature below"),
    ({"top_k": 50}, "top_k/top_p"),
    ({"top_p": 0.9, "temperature": 0.7}, "top_k/top_p"),
    ({"stop": [[2], [7, 8]]}, "several tokens"),
    ({"topk_sample_logprobs": 21}, "more than 20"),
    ({"images": (DatumImage(b"\xff\xd8\xff", "jpeg", 0, 4),)}, "images"),
])
def test_what_vllm_answers_as_the_torch_sampler_would(changes, reason):
    got = vllm_unsupported(dataclasses.replace(PLAIN, **changes))
    assert got is None if reason is None else reason in got


def test_a_request_beyond_the_engines_context_goes_to_the_torch_sampler():
    assert vllm_unsupported(PLAIN, max_model_len=11) is None
    assert "context of 10" in vllm_unsupported(PLAIN, max_model_len=10)


def test_each_sample_is_its_own_vllm_request_with_its_own_seed_and_lilos_stops_only():
    request = dataclasses.replace(PLAIN, temperature=0.5, top_k=-1, seed=9, num_samples=3, stop=[[2], []],
                                  stop_strings=["END"], topk_sample_logprobs=2)
    params = [sampling_params_of(request, k) for k in range(3)]
    assert [p["seed"] for p in params] == [sample_seed(9, k) for k in range(3)]
    assert len({p["seed"] for p in params}) == 3
    first = params[0]
    assert first["n"] == 1 and first["max_tokens"] == 8 and first["temperature"] == 0.5
    # The end-of-sequence token stops a sample only when it is among the request's stops.
    assert first["ignore_eos"] is True and first["stop_token_ids"] == [2]
    assert first["stop"] == ["END"] and first["include_stop_str_in_output"] and first["detokenize"]
    assert first["top_k"] == 0 and first["top_p"] == 1.0 and first["logprobs"] == 2


def test_greedy_and_unseeded_requests_leave_the_filters_and_seed_to_vllm():
    params = sampling_params_of(dataclasses.replace(PLAIN, temperature=0.0), 0)
    assert params["seed"] is None and "top_k" not in params and "top_p" not in params
    assert params["detokenize"] is False and "stop" not in params and params["logprobs"] == 0


def test_an_adapter_of_fused_moe_experts_is_not_handed_to_vllm(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "target_modules": ["q_proj"]}))
    assert peft_rank(tmp_path) == 4
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"r": 4, "target_modules": ["q_proj"], "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}))
    with pytest.raises(InvalidRequestError, match="trains fused MoE experts .*the torch sampler answers it"):
        peft_rank(tmp_path)
