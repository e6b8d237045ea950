"""Fuzzing ``forward_backward``'s protobuf body over real HTTP on the session cluster: random bytes, messages built
with the SDK's own generated module (lilo.protocol.proto.pb) then truncated or bit-flipped, fields sent with the
wrong wire type, length prefixes far past the body, and zstd bodies (garbage, compressed garbage, cut frames) under
``Content-Encoding: zstd``. Whatever arrives, the answer comes within ANSWER_BOUND_S, is never a 5xx, and every 4xx
is a JSON body whose ``detail`` is a sentence.

Bounded for CI: EXAMPLES derandomized examples per kind of body, no shrinking, no example database, all to 127.0.0.1.
No state is left: every model id is random, so even a well-formed request stops at "unknown model" (decoding, where
malformed bodies fail, runs before the model is looked up).
"""

from __future__ import annotations

import time

import httpx
import pytest
import zstandard
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from helpers import record_counts
from lilo.protocol.proto import pb

ANSWER_BOUND_S = 10.0
EXAMPLES = 300
PROTOBUF = {"Content-Type": "application/x-protobuf", "X-API-Key": "tml-local-test"}
DTYPES = [pb.DTYPE_UNSPECIFIED, pb.DTYPE_FLOAT32, pb.DTYPE_INT64, pb.DTYPE_INT32, pb.DTYPE_BFLOAT16, 99]

small_bytes = st.binary(max_size=64)


@st.composite
def tensors(draw) -> pb.Tensor:
    tensor = pb.Tensor(dtype=draw(st.sampled_from(DTYPES)), shape=draw(st.lists(st.integers(0, 2**40), max_size=3)))
    if draw(st.booleans()):
        tensor.dense = draw(small_bytes)
    else:
        tensor.sparse_csr.SetInParent()
    return tensor


@st.composite
def datums(draw) -> pb.Datum:
    datum = pb.Datum()
    for _ in range(draw(st.integers(0, 3))):
        chunk = datum.model_input.add()
        if draw(st.booleans()):
            chunk.encoded_text.tokens = draw(small_bytes)  # any length, not only whole int32s
        elif draw(st.booleans()):
            chunk.image.SetInParent()
    for name in draw(st.lists(st.sampled_from(["target_tokens", "weights", "advantages", "logprobs",
                                               "sequence_ratio_mask", "recorded_logprobs", ""]),
                              max_size=3)):
        datum.loss_fn_inputs[name].CopyFrom(draw(tensors()))
    for spans in (datum.model_input_spans, datum.loss_fn_input_spans):
        for _ in range(draw(st.integers(0, 2))):
            span = spans.add()
            kind = draw(st.sampled_from(["prompt_tokens", "sampled_tokens", None]))
            if kind is not None:  # None: a span with neither arm set
                run = getattr(span, kind)
                run.sequence_id = draw(st.sampled_from(["", "1:0", "999999:3", "x" * 300]))
                run.offset, run.length = draw(st.integers(-2**63, 2**63 - 1)), draw(st.integers(-2**63, 2**63 - 1))
    return datum


@st.composite
def requests(draw) -> pb.ForwardBackwardRequest:
    """A ForwardBackwardRequest with any field values, for an unknown model."""
    request = pb.ForwardBackwardRequest(
        # Mostly a plausible model id and seq id: a missing or negative one stops decoding before the data.
        model_id=draw(st.sampled_from(["fuzz:train:0", "fuzz:train:1", "", "x" * 300, "session-0:train:\x00"])),
        seq_id=draw(st.one_of(st.integers(1, 100), st.integers(-2**31, 2**31 - 1))),
        loss_fn=draw(st.sampled_from(["", "cross_entropy", "ppo", "gspo", "stable_reinforce", "??"])),
        forward_only=draw(st.booleans()))
    request.data.extend(draw(st.lists(datums(), max_size=3)))
    for key, value in draw(st.dictionaries(st.text(max_size=8), st.floats(), max_size=2)).items():
        request.loss_fn_config[key] = value
    for key, value in draw(st.dictionaries(st.text(max_size=8), st.one_of(st.floats(), st.text(max_size=8)),
                                           max_size=2)).items():
        if isinstance(value, str):
            request.loss_fn_config_v2[key].text = value
        else:
            request.loss_fn_config_v2[key].number = value
    return request


@st.composite
def damaged(draw, messages: st.SearchStrategy[bytes]) -> bytes:
    """A message cut short or with bits flipped."""
    body = bytearray(draw(messages))
    if body and draw(st.booleans()):
        return bytes(body[:draw(st.integers(0, len(body) - 1))])
    for _ in range(draw(st.integers(1, 4))):
        if body:
            body[draw(st.integers(0, len(body) - 1))] ^= 1 << draw(st.integers(0, 7))
    return bytes(body)


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


@st.composite
def wrong_wire_types(draw) -> bytes:
    """Known fields of ForwardBackwardRequest (1-7) under a wire type they do not have, then a valid tail."""
    field, wire = draw(st.integers(1, 7)), draw(st.sampled_from([0, 1, 2, 5]))
    payload = {0: varint(draw(st.integers(0, 2**64 - 1))), 1: draw(st.binary(min_size=8, max_size=8)),
               2: varint(3) + b"abc", 5: draw(st.binary(min_size=4, max_size=4))}[wire]
    return varint(field << 3 | wire) + payload + pb.ForwardBackwardRequest(model_id="fuzz:train:0").SerializeToString()


@st.composite
def huge_lengths(draw) -> bytes:
    """A length-delimited field (model_id, data, a datum's chunk) whose declared length is far past the body."""
    declared = draw(st.sampled_from([2**31 - 1, 2**32, 2**62, 2**64 - 1, 10**6]))
    field = draw(st.sampled_from([1, 3, 4, 5, 7]))
    return varint(field << 3 | 2) + varint(declared) + draw(st.binary(max_size=32))


valid_requests = requests().map(lambda request: request.SerializeToString())
plain_bodies = st.one_of(st.binary(max_size=512), valid_requests, damaged(valid_requests), wrong_wire_types(),
                         huge_lengths())
compress = zstandard.ZstdCompressor().compress
zstd_bodies = st.one_of(
    st.binary(max_size=256),  # not zstd at all
    plain_bodies.map(compress),  # compressed garbage, or a compressed request
    damaged(plain_bodies.map(compress)),  # a zstd frame cut short or bit-flipped
    st.tuples(valid_requests, small_bytes).map(lambda pair: compress(pair[0]) + pair[1]),  # trailing bytes
)


@pytest.mark.parametrize(("bodies", "encoding"), [(plain_bodies, None), (zstd_bodies, "zstd")],
                         ids=["protobuf", "zstd"])
def test_malformed_forward_backward_bodies_get_a_prompt_4xx_with_a_sentence(local_cluster, bodies, encoding):
    records_before = record_counts(local_cluster.settings.futures_db)
    headers = PROTOBUF | ({"Content-Encoding": encoding} if encoding else {})
    url = f"{local_cluster.api_url}/api/v1/forward_backward"

    with httpx.Client(timeout=ANSWER_BOUND_S) as http:
        @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), print_blob=False)
        @given(body=bodies)
        def fuzz(body: bytes) -> None:
            started = time.monotonic()
            try:
                response = http.post(url, content=body, headers=headers)
            except httpx.TimeoutException:
                raise AssertionError(f"no answer within {ANSWER_BOUND_S} s to {body[:64]!r}") from None
            assert time.monotonic() - started < ANSWER_BOUND_S
            assert 400 <= response.status_code < 500, (response.status_code, response.text[:500], body[:64])
            detail = response.json().get("detail")
            assert isinstance(detail, str) and len(detail.split()) >= 3, (response.text[:500], body[:64])

        fuzz()
    assert record_counts(local_cluster.settings.futures_db) == records_before  # not one future recorded
