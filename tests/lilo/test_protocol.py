"""The protobuf codec against the tinker SDK's own encoder and decoder."""

import tracemalloc

import numpy as np
import pytest
import tinker
import zstandard
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from lilo.errors import InvalidRequestError, TooLargeError
from lilo.protocol.proto import INFLATE_CHUNK, decode_forward_backward, encode_forward_backward_output, inflate, pb


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


def zstd_bomb(inflated_bytes: int) -> bytes:
    """A zstd body of ``inflated_bytes`` zeros, compressed without holding them all in memory."""
    compressor, zeros = zstandard.ZstdCompressor().compressobj(), bytes(1 << 20)
    return b"".join(compressor.compress(zeros) for _ in range(inflated_bytes >> 20)) + compressor.flush()


def test_zstd_bodies_inflate_and_other_encodings_are_refused():
    body = sdk_request()
    assert inflate(zstandard.ZstdCompressor().compress(body), "zstd", 1 << 20) == body
    with pytest.raises(InvalidRequestError, match="not supported"):
        inflate(body, "br", 1 << 20)


def test_a_zstd_bomb_is_refused_with_a_413_before_it_inflates_whole():
    bomb = zstd_bomb(64 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(TooLargeError, match="inflates past this server's limit of 1048576 bytes"):
            inflate(bomb, "zstd", 1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Inflating it whole would take 64 MiB; reading stops one chunk past the 1 MiB limit (1 MiB spare for the rest).
    assert peak < (1 << 20) + 2 * INFLATE_CHUNK + (1 << 20)  # and a 413: tests/serve/test_error_mapping.py


def test_every_zstd_frame_is_inflated_and_a_frame_cut_short_or_trailing_bytes_are_refused():
    compress = zstandard.ZstdCompressor().compress
    first, second = sdk_request()[:20], sdk_request()[20:]
    # Before: only the first frame was read, and a cut frame inflated to its prefix without a word.
    assert inflate(compress(first) + compress(second), "zstd", 1 << 20) == sdk_request()
    whole = compress(sdk_request())
    with pytest.raises(InvalidRequestError, match="ends in the middle of a frame"):
        inflate(whole[:-3], "zstd", 1 << 20)
    with pytest.raises(InvalidRequestError, match="could not be decompressed"):
        inflate(whole + b"junk", "zstd", 1 << 20)


@pytest.mark.parametrize(("build", "message"), [
    # Found by fuzzing: a 500 (numpy's "buffer size must be a multiple of element size").
    (lambda datum: setattr(datum.model_input.add().encoded_text, "tokens", b"abc"), "not a whole number of int32"),
    (lambda datum: datum.model_input.add(), "empty model_input chunk"),
])
def test_malformed_datums_are_refused_with_a_message(build, message):
    request = pb.ForwardBackwardRequest(model_id="s1:train:0", seq_id=1)
    build(request.data.add())
    with pytest.raises(InvalidRequestError, match=message):
        decode_forward_backward(request.SerializeToString())


def test_the_sdk_version_is_the_one_the_schema_comes_from():
    assert tinker.__version__ == "0.38.0"


def test_top_k_inputs_the_sdk_encodes_decode_in_their_shape():
    targets, weights = np.arange(12).reshape(4, 3), np.full((4, 3), 1 / 3, dtype=np.float32)
    datum = types.Datum(model_input=types.ModelInput.from_ints([10, 11, 12, 13]),
                        loss_fn_inputs={"target_tokens": targets, "weights": weights})
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id="s1:train:0", seq_id=1)
    (decoded,) = decode_forward_backward(forward_backward_request_to_proto(request).SerializeToString()).train.data
    assert decoded.loss_inputs["target_tokens"].tolist() == targets.tolist()
    assert decoded.loss_inputs["weights"].shape == (4, 3)


def test_a_shape_that_does_not_match_its_data_is_refused():
    request = pb.ForwardBackwardRequest(model_id="s1:train:0", seq_id=1)
    datum = request.data.add()
    datum.model_input.add().encoded_text.tokens = np.arange(4, dtype="<i4").tobytes()
    datum.loss_fn_inputs["weights"].CopyFrom(pb.Tensor(dense=np.ones(4, dtype="<f4").tobytes(),
                                                       dtype=pb.DTYPE_FLOAT32, shape=[4, 3]))
    with pytest.raises(InvalidRequestError, match=r"has shape \[4, 3\] but holds 4 values"):
        decode_forward_backward(request.SerializeToString())


def test_top_k_outputs_reach_the_sdk_in_their_shape_beside_one_value_per_token():
    outputs = [{"logprobs": [[-0.5, -1.0], [-2.0, -3.0]], "elementwise_loss": [[0.1, 0.2], [0.3, 0.4]]},
               {"logprobs": [[-1.5, -0.5]], "elementwise_loss": [[0.5, 0.0]]},
               {"logprobs": [-3.0, -4.0, -5.0], "elementwise_loss": [1.5, 0.0, 2.0]},
               {"logprobs": [[-1.0, -2.0, -3.0]], "elementwise_loss": [[1.0, 2.0, 3.0]]}]
    decoded = deserialize_forward_backward_output(encode_forward_backward_output(outputs, {"loss:sum": 1.0}))
    for sent, got in zip(outputs, decoded.loss_fn_outputs):
        for name in sent:
            np.testing.assert_allclose(got[name].to_numpy(), np.asarray(sent[name]), rtol=1e-6)
            assert got[name].shape == list(np.shape(sent[name]))
