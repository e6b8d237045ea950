"""The protobuf codec against the tinker SDK's own encoder and decoder."""

import numpy as np
import pytest
import tinker
import zstandard
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from lilo.errors import InvalidRequestError
from lilo.protocol.proto import decode_forward_backward, encode_forward_backward_output, inflate


def sdk_request(forward_only_config=None, loss_fn="cross_entropy") -> bytes:
    data = [
        types.Datum(model_input=types.ModelInput.from_ints([10, 11, 12, 13]),
                    loss_fn_inputs={"target_tokens": [11, 12, 13, 14], "weights": [0.0, 1.0, 1.0, 1.0]}),
        types.Datum(model_input=types.ModelInput.from_ints([5, 6]),
                    loss_fn_inputs={"target_tokens": [6, 7], "weights": [1.0, 0.5]}),
    ]
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn,
                                                          loss_fn_config=forward_only_config),
        model_id="s1:train:0", seq_id=3)
    return forward_backward_request_to_proto(request).SerializeToString()


def test_a_request_the_sdk_encodes_decodes_into_our_types():
    call = decode_forward_backward(sdk_request({"clip_low_threshold": 0.7, "mode": "strict"}, loss_fn="ppo"))
    assert (call.model_id, call.seq_id, call.forward_only) == ("s1:train:0", 3, False)
    assert call.train.loss_fn == "ppo" and call.train.loss_config == {"clip_low_threshold": 0.7, "mode": "strict"}
    first, second = call.train.data
    assert first.tokens.tolist() == [10, 11, 12, 13]
    assert first.loss_inputs["target_tokens"].tolist() == [11, 12, 13, 14]
    assert first.loss_inputs["weights"].tolist() == [0.0, 1.0, 1.0, 1.0]
    assert second.loss_inputs["weights"].dtype == np.float32
    assert call.train.tokens == 6


def test_outputs_we_encode_are_what_the_sdk_reads():
    outputs = [{"logprobs": [-0.5, -1.25, -2.0], "elementwise_loss": [0.0, 1.25, 2.0]},
               {"logprobs": [-3.0], "elementwise_loss": [1.5]}]
    decoded = deserialize_forward_backward_output(encode_forward_backward_output(outputs, {"loss:sum": 4.75}))
    assert decoded.metrics == {"loss:sum": 4.75}
    assert [d["logprobs"].tolist() for d in decoded.loss_fn_outputs] == [[-0.5, -1.25, -2.0], [-3.0]]
    assert decoded.loss_fn_outputs[1]["elementwise_loss"].tolist() == [1.5]


@pytest.mark.parametrize(("body", "message"), [
    (b"\xff\xff\xff", "not a tinker_public.ForwardBackwardRequest"),
    (b"", "no model_id"),
])
def test_malformed_bodies_are_refused_with_a_message(body, message):
    with pytest.raises(InvalidRequestError, match=message):
        decode_forward_backward(body)


def test_zstd_bodies_inflate_and_a_bomb_is_refused_before_it_inflates_whole():
    body = sdk_request()
    assert inflate(zstandard.ZstdCompressor().compress(body), "zstd", 1 << 20) == body
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))
    with pytest.raises(InvalidRequestError, match="inflates past 1048576 bytes"):
        inflate(bomb, "zstd", 1 << 20)
    with pytest.raises(InvalidRequestError, match="not supported"):
        inflate(body, "br", 1 << 20)


def test_the_sdk_version_is_the_one_the_schema_comes_from():
    assert tinker.__version__ == "0.38.0"
