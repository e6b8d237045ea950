"""The protobuf half of the Tinker wire format (package ``tinker_public``, SDK 0.38.0).

``forward_backward`` requests arrive as protobuf (optionally zstd-compressed) and their results must go back as
protobuf; the schema is the SDK's own generated module, so the two sides cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np
import zstandard
from google.protobuf.message import DecodeError

from lilo.backend.provenance import PROMPT, RECORDED_INPUTS, SAMPLED, Provenance, Span
from lilo.backend.types import Datum, DatumImage, TrainInput
from lilo.backend.vision import PENDING
from lilo.errors import InvalidRequestError, TooLargeError
from lilo.protocol import tinker_schema

pb = tinker_schema.load()

INFLATE_CHUNK = 1 << 20  # inflated bytes read per step while counting against the limit
# What the SDK reads as "no token here" in a TopkLogprobs matrix (tinker.types.topk_logprobs): id 0, this logprob.
TOPK_MASK_LOGPROB = -99999.0
_NUMPY_BY_DTYPE = {pb.DTYPE_FLOAT32: np.dtype("<f4"), pb.DTYPE_INT64: np.dtype("<i8"), pb.DTYPE_INT32: np.dtype("<i4")}


@dataclasses.dataclass(frozen=True)
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    forward_only: bool
    train: TrainInput


def inflate(body: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    """The request body, zstd-decompressed when so encoded (every frame of it), refusing to inflate past
    ``max_bytes``: a bomb is stopped after ``max_bytes + INFLATE_CHUNK`` bytes at most, never inflated whole."""
    if not content_encoding or content_encoding == "identity":
        return body
    if content_encoding != "zstd":
        raise InvalidRequestError(f"Content-Encoding {content_encoding!r} is not supported; send zstd or none.")
    chunks, size = [], 0
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(body, read_across_frames=True)
        while chunk := reader.read(INFLATE_CHUNK):
            size += len(chunk)
            if size > max_bytes:
                raise TooLargeError(f"The body inflates past this server's limit of {max_bytes} bytes "
                                    "(LILO_MAX_BODY_MB); send smaller chunks.")
            chunks.append(chunk)
        _check_whole_frames(body)
    except zstandard.ZstdError as error:
        raise InvalidRequestError(f"The zstd body could not be decompressed ({error}); send whole zstd frames.") \
            from None
    return b"".join(chunks)


def _check_whole_frames(body: bytes) -> None:
    """Refuse a body whose last zstd frame is cut short: the stream reader returns such a frame's prefix without
    complaint. Called once the body is known to inflate within the limit, so walking it again is bounded too."""
    rest = body
    while rest:
        frame = zstandard.ZstdDecompressor().decompressobj()
        frame.decompress(rest)
        if not frame.eof:
            raise InvalidRequestError("The zstd body ends in the middle of a frame; send the whole compressed body.")
        rest = frame.unused_data


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except DecodeError:
        raise InvalidRequestError("The body is not a tinker_public.ForwardBackwardRequest protobuf.") from None
    if not message.model_id:
        raise InvalidRequestError("The request has no model_id; pass the model_id that create_model returned.")
    if message.seq_id < 1:
        raise InvalidRequestError(f"seq_id {message.seq_id} is not valid; training requests count from 1.")
    data = [_datum(n, datum) for n, datum in enumerate(message.data)]
    config: dict[str, Any] = dict(message.loss_fn_config)
    for key, value in message.loss_fn_config_v2.items():  # v2 wins; it is the only one that carries strings
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    train = TrainInput(data=data, loss_fn=message.loss_fn or "cross_entropy", loss_config=config)
    return ForwardBackwardCall(message.model_id, message.seq_id, message.forward_only, train)


def _datum(index: int, message: pb.Datum) -> Datum:
    tokens: list[np.ndarray] = []
    images: list[DatumImage] = []
    length = 0
    for number, chunk in enumerate(message.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind is None:
            raise InvalidRequestError(f"Datum {index} has an empty model_input chunk; send encoded_text chunks.")
        if kind == "image":
            image = _image(index, number, chunk.image, length)
            images.append(image)
            tokens.append(np.full(image.tokens or 0, PENDING, dtype=np.int32))
        elif kind == "encoded_text":
            if len(chunk.encoded_text.tokens) % 4:
                raise InvalidRequestError(f"Datum {index}: encoded_text tokens are {len(chunk.encoded_text.tokens)} "
                                          "bytes, not a whole number of int32 token ids.")
            tokens.append(np.frombuffer(chunk.encoded_text.tokens, dtype="<i4"))
        else:
            raise InvalidRequestError(f"Datum {index}, chunk {number}: {kind} (audio) chunks are not supported by "
                                      "this server; send text and images.")
        length += len(tokens[-1])
    inputs = {name: _tensor(index, name, tensor) for name, tensor in message.loss_fn_inputs.items()}
    reserved = sorted(set(inputs) & set(RECORDED_INPUTS))
    if reserved:
        raise InvalidRequestError(f"Datum {index}: {', '.join(reserved)} are filled in by the server from what the "
                                  "sampler recorded; leave them out.")
    return Datum(tokens=np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int32), loss_inputs=inputs,
                 provenance=_provenance(index, message), images=tuple(images))


def _image(index: int, number: int, message: pb.ImageChunk, offset: int) -> DatumImage:
    """An image chunk of a training datum: its targets and weights cover the positions it stands for, so the client
    says how many (``expected_tokens``; the ingress checks the count once it knows the base model)."""
    if not message.HasField("expected_tokens"):
        raise InvalidRequestError(f"Datum {index}, chunk {number}: the image chunk has no expected_tokens; a training "
                                  "datum's targets and weights cover the image's positions, so send how many (the "
                                  "cookbook's image_to_chunk computes it).")
    if message.HasField("override_dimensions"):
        raise InvalidRequestError(f"Datum {index}, chunk {number}: override_dimensions is not supported; resize the "
                                  "image itself.")
    return DatumImage(message.data, message.format, offset, message.expected_tokens)


def _provenance(index: int, message: pb.Datum) -> Provenance | None:
    if not message.model_input_spans and not message.loss_fn_input_spans:
        return None
    if not message.model_input_spans or not message.loss_fn_input_spans:
        raise InvalidRequestError(f"Datum {index}: provenance comes as a pair; send both model_input_spans and "
                                  "loss_fn_input_spans (Datum.with_provenance sets both), or neither.")
    return Provenance(_spans(index, message.model_input_spans), _spans(index, message.loss_fn_input_spans))


def _spans(index: int, messages: Sequence[Any]) -> tuple[Span, ...]:
    spans = []
    for message in messages:
        kind = message.WhichOneof("span")
        if kind is None:
            raise InvalidRequestError(f"Datum {index} has an empty provenance span; send prompt_tokens or "
                                      "sampled_tokens spans.")
        run = getattr(message, kind)
        if not run.sequence_id or run.offset < 0 or run.length < 0:
            raise InvalidRequestError(f"Datum {index}: a provenance span needs a sequence_id, an offset >= 0 and a "
                                      f"length >= 0; got {run.sequence_id!r}, {run.offset}, {run.length}.")
        spans.append(Span(PROMPT if kind == "prompt_tokens" else SAMPLED, run.sequence_id, run.offset, run.length))
    return tuple(spans)


def _tensor(index: int, name: str, tensor: pb.Tensor) -> np.ndarray:
    if tensor.WhichOneof("encoding") != "dense":
        raise InvalidRequestError(f"Datum {index}: {name} is sparse; this server takes dense tensors only.")
    dtype = _NUMPY_BY_DTYPE.get(tensor.dtype)
    if dtype is None:
        raise InvalidRequestError(f"Datum {index}: {name} has an unsupported dtype ({tensor.dtype}).")
    if len(tensor.dense) % dtype.itemsize:
        raise InvalidRequestError(f"Datum {index}: {name} has a byte length that is not a whole number of values.")
    values = np.frombuffer(tensor.dense, dtype=dtype)
    shape = list(tensor.shape)
    if len(shape) > 2:
        raise InvalidRequestError(f"Datum {index}: {name} has shape {shape}; send one value per token, or for "
                                  "cross_entropy's top-K form K values per token (shape (tokens, K)).")
    if len(shape) == 2:
        if shape[0] * shape[1] != len(values) or shape[1] < 1:
            raise InvalidRequestError(f"Datum {index}: {name} has shape {shape} but holds {len(values)} values; "
                                      "send a shape whose size matches the data.")
        return values.reshape(shape)
    return values


def encode_forward_backward_output(outputs: Sequence[Mapping[str, Sequence[float]]],
                                   metrics: Mapping[str, float]) -> bytes:
    """ArrayRecords with a float32 field per output name (``logprobs``, ``elementwise_loss``), one row per datum, as
    ``tinker.proto.response_conv`` reads them: one record per run of consecutive datums whose fields have the same
    trailing shape (``[]`` for a value per token, ``[K]`` for top-K cross-entropy's K per token)."""
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for name, value in metrics.items():
        message.metrics[name] = float(value)
    datums = [{name: np.asarray(value, dtype="<f4") for name, value in output.items()} for output in outputs]
    for run in _runs_of_trailing_shape(datums):
        record = message.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(run))
        for name in run[0]:
            arrays = [datum[name] for datum in run]
            offsets = np.cumsum([0] + [array.nbytes for array in arrays], dtype=np.int64)
            field = record.fields[name]
            field.data = b"".join(array.tobytes() for array in arrays)
            field.offsets = offsets.astype("<i8").tobytes()
            field.dtype = pb.DTYPE_FLOAT32
            field.trailing_shape.extend(arrays[0].shape[1:])
    if not datums:
        message.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=0)
    return message.SerializeToString()


def _runs_of_trailing_shape(datums: Sequence[Mapping[str, np.ndarray]]) -> list[list[Mapping[str, np.ndarray]]]:
    runs: list[list[Mapping[str, np.ndarray]]] = []
    last: dict | None = None
    for datum in datums:
        shapes = {name: array.shape[1:] for name, array in datum.items()}
        if runs and shapes == last:
            runs[-1].append(datum)
        else:
            runs.append([datum])
        last = shapes
    return runs


def encode_sample_response(result: Mapping[str, Any]) -> bytes:
    """A ``SampleResponse``: per sequence its int32 tokens, float32 logprobs, stop reason and top-k logprobs; the
    prompt's float32 logprobs with NaN where there is none (the first token), its top-k logprobs, the logprobs of its
    target tokens (in the request's dense or CSR layout) and its alternative tokens, as
    ``tinker.proto.response_conv`` reads them."""
    message = pb.SampleResponse()
    for sequence in result["sequences"]:
        sampled = message.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if sequence["stop_reason"] == "stop" else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(sequence["tokens"], dtype="<i4").tobytes(),
            logprobs=np.asarray(sequence["logprobs"], dtype="<f4").tobytes())
        if "topk_logprobs" in sequence:
            sampled.topk_sampled_logprobs.CopyFrom(_topk_logprobs(sequence["topk_logprobs"]))
    prompt_logprobs = result.get("prompt_logprobs")
    if prompt_logprobs is not None:
        message.prompt_logprobs = np.asarray([np.nan if value is None else value for value in prompt_logprobs],
                                             dtype="<f4").tobytes()
    if "topk_prompt_logprobs" in result:
        message.topk_prompt_logprobs.CopyFrom(_topk_logprobs(result["topk_prompt_logprobs"]))
    if "target_prompt_logprobs" in result:
        message.target_prompt_logprobs.CopyFrom(_target_tensor(result["target_prompt_logprobs"]))
    if "prompt_alt_tokens" in result:
        alternatives = result["prompt_alt_tokens"]
        shape = (-1, alternatives["k"])  # (positions after the first, k), also for a one-token prompt
        message.prompt_alt_tokens.tokens.CopyFrom(
            _dense(np.asarray(alternatives["tokens"], dtype="<i8").reshape(shape), pb.DTYPE_INT64))
        message.prompt_alt_tokens.logprobs.CopyFrom(
            _dense(np.asarray(alternatives["logprobs"], dtype="<f4").reshape(shape), pb.DTYPE_FLOAT32))
    return message.SerializeToString()


def _dense(array: np.ndarray, dtype: int) -> Any:
    return pb.Tensor(dense=array.tobytes(), dtype=dtype, shape=list(array.shape))


def _target_tensor(target: Mapping[str, Any]) -> Any:
    """The float32 logprobs of ``target_prompt_logprobs``, in the layout the request had."""
    values = np.asarray(target["values"], dtype="<f4")
    if target["crow_indices"] is None:
        return _dense(values.reshape(target["shape"]), pb.DTYPE_FLOAT32)
    return pb.Tensor(sparse_csr=pb.SparseCsr(values=values.tobytes(),
                                             crow_indices=np.asarray(target["crow_indices"], dtype="<i8").tobytes(),
                                             col_indices=np.asarray(target["col_indices"], dtype="<i8").tobytes()),
                     dtype=pb.DTYPE_FLOAT32, shape=list(target["shape"]))


def _topk_logprobs(positions: Sequence[Sequence[tuple[int, float]] | None]) -> Any:
    """A ``TopkLogprobs``: (positions, k) int32 ids and float32 logprobs, the SDK's mask where a position has
    fewer tokens or none (None)."""
    k = max((len(tokens) for tokens in positions if tokens), default=1)
    ids = np.zeros((len(positions), k), dtype="<i4")
    logprobs = np.full((len(positions), k), TOPK_MASK_LOGPROB, dtype="<f4")
    for row, tokens in enumerate(positions):
        for column, (token, logprob) in enumerate(tokens or ()):
            ids[row, column], logprobs[row, column] = token, logprob
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=logprobs.tobytes(), k=k, length=len(positions))
