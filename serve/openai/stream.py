"""The answers of the OpenAI-compatible routes, built from one stream of text pieces whatever produces it.

A sampler yields ``Piece``s (the text a choice grows by, with the tokens that brought it) as it knows them:
``whole_generation`` turns a finished generation into pieces, a token at a time; a sampler that streams for real
can yield its own. ``cut_at_stops`` ends each choice before its first stop string, holding back text that may be
the start of one. ``sse`` writes the pieces as OpenAI's server-sent events (``data: {...}`` ... ``data: [DONE]``);
``collected`` gathers the same pieces into the one JSON answer, so a stream joined is the answer unstreamed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator, Callable, Sequence

import orjson

from lilo.errors import LiloError
from serve.openai.errors import error_body

Usage = dict[str, int]


@dataclasses.dataclass(frozen=True)
class Token:
    """One sampled token as the answer's logprobs show it."""

    text: str  # the token's own text (U+FFFD where it holds only part of a character)
    logprob: float
    top: tuple[tuple[str, float], ...] = ()  # its likeliest alternatives, likeliest first


@dataclasses.dataclass(frozen=True)
class Piece:
    """Text one choice's answer grows by, the tokens that brought it, and on a choice's last piece why it ended."""

    index: int
    text: str = ""
    tokens: tuple[Token, ...] = ()
    finish_reason: str | None = None  # "stop" or "length"


@dataclasses.dataclass(frozen=True)
class Choice:
    """One finished sample: the text each token adds (``lilo.backend.text.pieces``), its tokens for the logprobs
    (None: not asked for), and why it ended."""

    pieces: Sequence[str]
    tokens: Sequence[Token] | None
    finish_reason: str


async def whole_generation(choices: Sequence[Choice]) -> AsyncIterator[Piece]:
    """A finished generation, a token at a time (position by position over the choices), then each choice's end."""
    for position in range(max((len(choice.pieces) for choice in choices), default=0)):
        for index, choice in enumerate(choices):
            if position < len(choice.pieces):
                tokens = (choice.tokens[position],) if choice.tokens is not None else ()
                yield Piece(index, choice.pieces[position], tokens)
    for index, choice in enumerate(choices):
        yield Piece(index, finish_reason=choice.finish_reason)


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the earliest of ``stops`` begins in ``text``, or None."""
    found = [at for at in (text.find(stop) for stop in stops) if at >= 0]
    return min(found) if found else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many of ``text``'s last characters may be the start of a stop string (and so wait for more text)."""
    keep = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), keep, -1):
            if text.endswith(stop[:length]):
                keep = length
                break
    return keep


async def cut_at_stops(pieces: AsyncIterator[Piece], stops: Sequence[str]) -> AsyncIterator[Piece]:
    """``pieces`` with each choice ending before the first of ``stops`` in its text (finish reason "stop"). Text
    that may begin a stop string is held back until it is known not to; with no stops, nothing is."""
    held: dict[int, list[Piece]] = {}
    ended: set[int] = set()
    async for piece in pieces:
        if piece.index in ended:
            continue  # what a sampler yields after the stop string (it stops at it too, once it has sampled it)
        queue = held.setdefault(piece.index, [])
        if piece.text or piece.tokens:
            queue.append(dataclasses.replace(piece, finish_reason=None))
        text = "".join(part.text for part in queue)
        stop_at = first_stop(text, stops)
        if stop_at is not None:
            limit = stop_at
        elif piece.finish_reason is not None:
            limit = len(text)
        else:
            limit = len(text) - held_back(text, stops)
        start = 0
        # Released: the pieces that end by the limit, and the one the stop string begins in, cut before it.
        while queue and (start + len(queue[0].text) <= limit or (stop_at is not None and start < stop_at)):
            part = queue.pop(0)
            yield dataclasses.replace(part, text=part.text[:limit - start])
            start += len(part.text)
        if stop_at is not None or piece.finish_reason is not None:
            ended.add(piece.index)
            del held[piece.index]
            yield Piece(piece.index, finish_reason="stop" if stop_at is not None else piece.finish_reason)


@dataclasses.dataclass(frozen=True)
class Reply:
    """What every chunk of one answer repeats, and how its choices are shown."""

    id: str
    created: int
    model: str
    chat: bool  # chat.completion(s), else text_completion
    n: int
    logprobs: bool


class Logprobs:
    """One choice's logprobs in the route's format, a piece at a time (completions: ``text_offset`` is where the
    piece that brought each token begins)."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.offset = 0

    def of(self, piece: Piece) -> dict[str, Any]:
        tokens = piece.tokens
        if self.chat:
            return {"content": [{**token_entry(token.text, token.logprob),
                                 "top_logprobs": [token_entry(text, logprob) for text, logprob in token.top]}
                                for token in tokens]}
        entry = {"tokens": [token.text for token in tokens], "token_logprobs": [token.logprob for token in tokens],
                 "top_logprobs": [dict(token.top) for token in tokens], "text_offset": [self.offset] * len(tokens)}
        self.offset += len(piece.text)
        return entry


def token_entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def merged(into: dict[str, list] | None, entry: dict[str, Any]) -> dict[str, list]:
    if into is None:
        return {key: list(values) for key, values in entry.items()}
    for key, values in entry.items():
        into[key].extend(values)
    return into


def envelope(reply: Reply, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if reply.chat else "text_completion"
    return {"id": reply.id, "object": kind, "created": reply.created, "model": reply.model, "choices": choices}


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def sse(reply: Reply, pieces: AsyncIterator[Piece], usage: Callable[[], Usage] | None) -> AsyncIterator[bytes]:
    """The answer as OpenAI streams it; with ``usage`` (``stream_options.include_usage``) every chunk has a null
    usage and a last one, without choices, the request's. A failure once the stream has begun ends it with an
    error event (the ``openai`` client raises it)."""
    logprobs = [Logprobs(reply.chat) for _ in range(reply.n)]
    extra = {"usage": None} if usage else {}
    try:
        if reply.chat:
            yield event({**envelope(reply, [{"index": index, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}
                                            for index in range(reply.n)], True), **extra})
        async for piece in pieces:
            shown = logprobs[piece.index].of(piece) if reply.logprobs and piece.tokens else None
            if reply.chat:
                delta = {"content": piece.text} if piece.text or piece.tokens else {}
                choice = {"index": piece.index, "delta": delta, "logprobs": shown,
                          "finish_reason": piece.finish_reason}
            else:
                choice = {"index": piece.index, "text": piece.text, "logprobs": shown,
                          "finish_reason": piece.finish_reason}
            yield event({**envelope(reply, [choice], True), **extra})
        if usage:
            yield event({**envelope(reply, [], True), "usage": usage()})
    except LiloError as error:
        yield event(error_body(400, str(getattr(error, "cause", None) or error)))
        return
    except Exception as error:
        yield event(error_body(500, f"Sampling failed on the server ({type(error).__name__}: {error}); retry."))
        return
    yield b"data: [DONE]\n\n"


async def collected(reply: Reply, pieces: AsyncIterator[Piece], usage: Usage) -> dict[str, Any]:
    """The answer unstreamed: every choice's pieces joined."""
    texts: list[list[str]] = [[] for _ in range(reply.n)]
    finish: list[str | None] = [None] * reply.n
    logprobs = [Logprobs(reply.chat) for _ in range(reply.n)]
    shown: list[dict[str, list] | None] = [None] * reply.n
    async for piece in pieces:
        texts[piece.index].append(piece.text)
        if reply.logprobs and piece.tokens:
            shown[piece.index] = merged(shown[piece.index], logprobs[piece.index].of(piece))
        if piece.finish_reason is not None:
            finish[piece.index] = piece.finish_reason
    choices = []
    for index in range(reply.n):
        text = "".join(texts[index])
        empty = {"content": []} if reply.chat else {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                    "text_offset": []}
        choice_logprobs = (shown[index] or empty) if reply.logprobs else None
        if reply.chat:
            choices.append({"index": index, "message": {"role": "assistant", "content": text},
                            "logprobs": choice_logprobs, "finish_reason": finish[index]})
        else:
            choices.append({"index": index, "text": text, "logprobs": choice_logprobs,
                            "finish_reason": finish[index]})
    return {**envelope(reply, choices, False), "usage": usage}
