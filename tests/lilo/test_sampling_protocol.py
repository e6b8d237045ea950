"""The asample request and the SampleResponse, against the tinker SDK's own request type and decoder."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tinker import types
from tinker.proto.response_conv import deserialize_sample_response

from lilo.backend.types import PromptTargets
from lilo.errors import InvalidRequestError
from lilo.protocol.proto import encode_sample_response
from lilo.protocol.sampling import decode_sample_request

LIMITS = {"vocab_size": 1000, "max_context_length": 32, "eos_token_ids": [2], "base_only": False}


def sdk_body(prompt=(1, 2, 3), num_samples=2, **params) -> dict:
    """An asample body exactly as the SDK sends it (pydantic, nulls left out)."""
    request = types.SampleRequest(
        sampling_session_id="s:sample:0", seq_id=0, num_samples=num_samples,
        prompt=types.ModelInput.from_ints(list(prompt)),
        sampling_params=types.SamplingParams(**{"max_tokens": 5, **params}))
    return request.model_dump(mode="json", exclude_none=True)


def test_an_sdk_sample_request_decodes_into_our_request():
    request = decode_sample_request(sdk_body(temperature=0.7, top_k=50, top_p=0.9, seed=11, stop=[7, 9]), **LIMITS)
    assert list(request.prompt) == [1, 2, 3]
    assert (request.num_samples, request.max_tokens, request.temperature, request.top_k, request.top_p,
            request.seed) == (2, 5, 0.7, 50, 0.9, 11)
    assert request.stop == [[7], [9]] and not request.prompt_logprobs and not request.base_only


@pytest.mark.parametrize("stop, tokens, strings", [
    (None, [[2]], []),  # absent: the end-of-sequence token
    ([], [], []),  # nothing stops it but max_tokens
    ("\n\n", [], ["\n\n"]),
    (["User:", "###"], [], ["User:", "###"]),
])
def test_stop_means_what_the_tinker_docs_say(stop, tokens, strings):
    request = decode_sample_request(sdk_body(stop=stop), **LIMITS)
    assert (request.stop, list(request.stop_strings)) == (tokens, strings)


def test_without_max_tokens_a_sample_may_fill_the_context():
    assert decode_sample_request(sdk_body(max_tokens=None), **LIMITS).max_tokens == 32 - 3


def test_a_prompt_that_fills_the_context_is_scored_without_sampling():
    full = list(range(1, 33))  # the context holds 32
    request = decode_sample_request({**sdk_body(prompt=full, max_tokens=1), "prompt_logprobs": True}, **LIMITS)
    assert request.max_tokens == 0 and request.prompt_logprobs
    with pytest.raises(InvalidRequestError, match="no token fits after it; send a shorter prompt, or score it"):
        decode_sample_request(sdk_body(prompt=full, max_tokens=1), **LIMITS)
    with pytest.raises(InvalidRequestError, match="33 tokens and the context holds 32"):
        decode_sample_request({**sdk_body(prompt=full + [1]), "prompt_logprobs": True}, **LIMITS)


def test_record_stability_info_is_carried_to_the_sampler():
    assert decode_sample_request({**sdk_body(), "record_stability_info": True}, **LIMITS).record_stability_info
    assert not decode_sample_request({**sdk_body(), "record_stability_info": None}, **LIMITS).record_stability_info


def test_prompt_logprobs_last_n_scores_a_suffix_of_the_prompt():
    body = {**sdk_body(prompt=[1, 2, 3, 4]), "prompt_logprobs": True, "prompt_logprobs_last_n": 3}
    assert decode_sample_request(body, **LIMITS).prompt_logprobs_last_n == 3
    assert decode_sample_request({**body, "prompt_logprobs_last_n": None}, **LIMITS).prompt_logprobs_last_n is None


@pytest.mark.parametrize("body, message", [
    (sdk_body(prompt=[1, 1000]), "outside the vocabulary"),
    (sdk_body(prompt=[]), "prompt is empty"),
    (sdk_body(max_tokens=30), "ask for 1 to 29 tokens"),
    (sdk_body(num_samples=500), "num_samples 500 is out of range"),
    (sdk_body(temperature=-1.0), "temperature must be >= 0"),
    (sdk_body(stop=[5, 5000]), "list of token ids"),
    ({**sdk_body(), "record_stability_info": "yes"}, "record_stability_info must be true or false"),
    ({**sdk_body(), "prompt_alt_tokens_k": 21}, "prompt_alt_tokens_k 21 is out of range"),
    ({**sdk_body(), "target_prompt_logprobs": [1, 2]}, "must be an int64 tensor of token ids"),
    ({**sdk_body(), "target_prompt_logprobs": {"data": [1, 2], "dtype": "float32", "shape": [2, 1]}},
     r"int64 tensor of token ids, \[len\(prompt\) - 1, K\] = \[2, K\]; got dtype 'float32'"),
    ({**sdk_body(), "target_prompt_logprobs": {"data": [1, 2, 3], "dtype": "int64", "shape": [3, 1]}},
     "shape 3, 1|shape \\[3, 1\\]"),
    ({**sdk_body(), "target_prompt_logprobs": {"data": [1, 1000], "dtype": "int64", "shape": [2, 1]}},
     "token ids in \\[0, 1000\\), or -1 for none"),
    ({**sdk_body(), "target_prompt_logprobs": {"data": [1, 2, 3], "dtype": "int64", "shape": [2, 2]}},
     "holds 3 ids; its shape \\[2, 2\\] needs 4"),
    ({**sdk_body(), "target_prompt_logprobs": {"data": [1, 2], "dtype": "int64", "shape": [2, 2],
                                               "sparse_crow_indices": [0, 1, 2], "sparse_col_indices": [0, 2]}},
     "not a valid sparse CSR tensor"),
    ({**sdk_body(), "target_prompt_logprobs": {"data": [1, 2], "dtype": "int64", "shape": [2, 2],
                                               "sparse_crow_indices": [0, 2, 1], "sparse_col_indices": [0, 1]}},
     "not a valid sparse CSR tensor"),
    ({**sdk_body(), "topk_sample_logprobs": 21}, "topk_sample_logprobs 21 is out of range; ask for 0"),
    ({**sdk_body(), "topk_prompt_logprobs": -1}, "topk_prompt_logprobs -1 is out of range"),
    ({**sdk_body(), "topk_prompt_logprobs": 2.5}, "topk_prompt_logprobs 2.5 is out of range"),
    ({**sdk_body(), "prompt_logprobs_last_n": 1}, "applies to prompt logprobs; set prompt_logprobs too"),
    ({**sdk_body(), "prompt_logprobs": True, "prompt_logprobs_last_n": 3}, "ask for 1 to 2"),
    ({**sdk_body(), "prompt_logprobs": True, "prompt_logprobs_last_n": 0}, "ask for 1 to 2"),
    ({**sdk_body(), "prompt_logprobs": True, "prompt_logprobs_last_n": "2"}, "out of range"),
    ({**sdk_body(), "prompt": {"chunks": [{"type": "image", "data": "", "format": "png"}]}}, "takes no images"),
    ({**sdk_body(), "prompt": {"chunks": [{"type": "image", "data": "%%", "format": "png"}]}}, "is not base64"),
    ({**sdk_body(), "prompt": {"chunks": [{"type": "image_asset_pointer", "location": "s3://b/i.png",
                                           "format": "png"}]}}, "has s3 scheme; lilo resolves file:// URLs"),
    ({**sdk_body(), "prompt": {"chunks": [{"type": "dmel", "data": ""}]}}, "dmel chunks are not supported"),
    # Each of these was a 500 (found by probing asample with a real sampling session).
    ({**sdk_body(), "prompt": {"chunks": "abc"}}, "list of chunk objects"),
    ({**sdk_body(), "prompt": {"chunks": [1]}}, "list of chunk objects"),
    ({**sdk_body(), "prompt": {"chunks": [{"tokens": ["a"]}]}}, "list of integer token ids"),
    ({**sdk_body(), "prompt": {"chunks": [{"tokens": 5}]}}, "list of integer token ids"),
])
def test_a_request_that_cannot_run_is_refused_with_what_to_change(body, message):
    with pytest.raises(InvalidRequestError, match=message):
        decode_sample_request(body, **LIMITS)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                        max_size=3), max_leaves=8)
chunk_likes = st.fixed_dictionaries({}, optional={"type": st.sampled_from(["encoded_text", "image"]) | json_values,
                                                  "tokens": st.lists(st.integers(-5, 2000), max_size=4) | json_values})


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(prompt=st.fixed_dictionaries({}, optional={"chunks": st.lists(chunk_likes | json_values, max_size=3)
                                                  | json_values}))
def test_any_prompt_json_is_decoded_or_refused_with_a_message(prompt):
    """asample's prompt is free-form JSON the HTTP fuzzer cannot reach without a real sampling session."""
    try:
        decode_sample_request({**sdk_body(), "prompt": prompt}, **LIMITS)
    except InvalidRequestError:
        pass


def test_a_sample_response_we_encode_is_what_the_sdk_reads():
    result = {"sequences": [{"tokens": [5, 6, 2], "logprobs": [-0.5, -1.0, -0.25], "stop_reason": "stop"},
                            {"tokens": [7], "logprobs": [-2.0], "stop_reason": "length"}],
              "prompt_logprobs": [None, -3.5, -0.75]}
    decoded = deserialize_sample_response(encode_sample_response(result))
    assert [s.tokens for s in decoded.sequences] == [[5, 6, 2], [7]]
    assert [s.logprobs for s in decoded.sequences] == [[-0.5, -1.0, -0.25], [-2.0]]
    assert [s.stop_reason for s in decoded.sequences] == ["stop", "length"]
    first, *rest = decoded.prompt_logprobs
    assert (first is None or math.isnan(first)) and rest == [-3.5, -0.75]
    assert decoded.topk_prompt_logprobs is None and decoded.sequences[0].topk_logprobs is None  # not asked for


def test_top_k_logprobs_we_encode_are_what_the_sdk_reads():
    result = {"sequences": [{"tokens": [5, 6], "logprobs": [-0.5, -1.0], "stop_reason": "length",
                             "topk_logprobs": [[(5, -0.5), (9, -1.5)], [(8, -0.25), (6, -1.0)]]}],
              "topk_prompt_logprobs": [None, [(3, -0.125), (4, -2.5)], [(0, -0.75), (2, -1.25)]]}
    decoded = deserialize_sample_response(encode_sample_response(result))
    assert decoded.sequences[0].topk_logprobs == [[(5, -0.5), (9, -1.5)], [(8, -0.25), (6, -1.0)]]
    assert decoded.topk_prompt_logprobs == [None, [(3, -0.125), (4, -2.5)], [(0, -0.75), (2, -1.25)]]


def test_target_prompt_logprobs_decode_dense_or_sparse():
    dense = {"data": [4, -1, 7, 9], "dtype": "int64", "shape": [2, 2]}
    assert decode_sample_request({**sdk_body(), "target_prompt_logprobs": dense}, **LIMITS).target_prompt_logprobs \
        == PromptTargets((2, 2), [4, -1, 7, 9])
    sparse = {"data": [4, 9], "dtype": "int64", "shape": [2, 3], "sparse_crow_indices": [0, 1, 2],
              "sparse_col_indices": [2, 0]}
    targets = decode_sample_request({**sdk_body(), "target_prompt_logprobs": sparse}, **LIMITS).target_prompt_logprobs
    assert targets == PromptTargets((2, 3), [4, 9], [0, 1, 2], [2, 0])
    assert targets.value_rows().tolist() == [0, 1] and PromptTargets((2, 2), [4, -1, 7, 9]).value_rows().tolist() \
        == [0, 0, 1, 1]


def test_target_logprobs_and_alternative_tokens_we_encode_are_what_the_sdk_reads():
    sequences = [{"tokens": [5], "logprobs": [-0.5], "stop_reason": "length"}]
    dense = {"shape": [2, 2], "values": [-0.5, 0.0, -1.5, -2.0], "crow_indices": None, "col_indices": None}
    alternatives = {"k": 3, "tokens": [[1, 2, 2], [7, 7, 8]], "logprobs": [[-0.25, -1.0, -1.0], [-0.5, -0.5, -3.0]]}
    decoded = deserialize_sample_response(encode_sample_response(
        {"sequences": sequences, "target_prompt_logprobs": dense, "prompt_alt_tokens": alternatives}))
    assert decoded.target_prompt_logprobs.shape == [2, 2] and decoded.target_prompt_logprobs.tolist() == [
        [-0.5, 0.0], [-1.5, -2.0]]
    assert decoded.prompt_alt_tokens.tokens.tolist() == [[1, 2, 2], [7, 7, 8]]
    assert decoded.prompt_alt_tokens.logprobs.tolist() == [[-0.25, -1.0, -1.0], [-0.5, -0.5, -3.0]]
    sparse = {"shape": [2, 3], "values": [-0.5, -2.0], "crow_indices": [0, 1, 2], "col_indices": [2, 0]}
    decoded = deserialize_sample_response(encode_sample_response({"sequences": sequences,
                                                                  "target_prompt_logprobs": sparse}))
    tensor = decoded.target_prompt_logprobs
    assert (tensor.sparse_crow_indices, tensor.sparse_col_indices) == ([0, 1, 2], [2, 0])
    assert tensor.to_numpy().tolist() == [[0.0, 0.0, -0.5], [-2.0, 0.0, 0.0]]
    one_token = {"k": 2, "tokens": [], "logprobs": []}  # a one-token prompt has no position to draw at
    decoded = deserialize_sample_response(encode_sample_response({"sequences": sequences,
                                                                  "prompt_alt_tokens": one_token}))
    assert decoded.prompt_alt_tokens.tokens.shape == [0, 2]


def test_top_k_counts_are_decoded():
    request = decode_sample_request({**sdk_body(), "topk_prompt_logprobs": 4, "topk_sample_logprobs": 2}, **LIMITS)
    assert (request.topk_prompt_logprobs, request.topk_sample_logprobs, request.prompt_logprobs) == (4, 2, False)
    full = decode_sample_request({**sdk_body(prompt=list(range(1, 33))), "topk_prompt_logprobs": 1}, **LIMITS)
    assert full.max_tokens == 0  # a prompt filling the context is scored: top-k alone asks for that too
