"""The OpenAI-compatible answers built from a stream of pieces (serve/openai/stream.py), without a cluster: stop
strings cut a choice wherever they fall across pieces, the stream joined is the unstreamed answer, and the events
are OpenAI's."""

import asyncio
import json

import pytest

from serve.openai.stream import (
    Choice, Piece, Reply, Token, collected, cut_at_stops, held_back, sse, whole_generation,
)

USAGE = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def run(coroutine):
    return asyncio.run(coroutine)


async def listed(pieces) -> list[Piece]:
    return [piece async for piece in pieces]


def choice(*pieces: str, finish: str = "length", logprobs: bool = False) -> Choice:
    tokens = [Token(piece or "\ufffd", -0.5, ((piece, -0.5), ("x", -1.5))) for piece in pieces] if logprobs else None
    return Choice(list(pieces), tokens, finish)


def texts(pieces: list[Piece]) -> dict[int, tuple[str, str | None]]:
    out: dict[int, tuple[str, str | None]] = {}
    for piece in pieces:
        text, finish = out.get(piece.index, ("", None))
        out[piece.index] = (text + piece.text, piece.finish_reason or finish)
    return out


@pytest.mark.parametrize(("parts", "stops", "text", "finish"), [
    (["Hel", "lo, wo", "rld"], ["lo, w"], "Hel", "stop"),  # a stop across pieces
    (["Hel", "lo", " world"], ["o w"], "Hell", "stop"),
    (["ab", "c"], ["x", "bc"], "a", "stop"),  # the earliest of several
    (["ab", "cd"], ["cde"], "abcd", "length"),  # a stop's start held back, then let go at the end
    (["ab", "cd"], [], "abcd", "length"),
    (["stop", "more"], ["stop"], "", "stop"),
])
def test_a_stop_string_ends_its_choice_before_it(parts, stops, text, finish):
    pieces = run(listed(cut_at_stops(whole_generation([choice(*parts)]), stops)))
    assert texts(pieces) == {0: (text, finish)}
    assert sum(piece.finish_reason is not None for piece in pieces) == 1


def test_text_that_may_begin_a_stop_waits_and_other_choices_go_on():
    pieces = run(listed(cut_at_stops(whole_generation([choice("a", "<", "/", "b"), choice("c", "d")]), ["</x>"])))
    # choice 0's "<" and "/" wait until "b" shows they begin no stop; choice 1 is not held up meanwhile.
    order = [(piece.index, piece.text) for piece in pieces if piece.text]
    assert order == [(0, "a"), (1, "c"), (1, "d"), (0, "<"), (0, "/"), (0, "b")]
    assert texts(pieces) == {0: ("a</b", "length"), 1: ("cd", "length")}


def test_held_back_is_the_longest_tail_that_begins_a_stop():
    assert held_back("abc</", ["</x>"]) == 2
    assert held_back("abc", ["cd", "bcx"]) == 2
    assert held_back("abc", ["abc"]) == 0  # a whole stop is found, not held


def test_tokens_go_with_the_text_they_brought_and_those_of_the_stop_are_dropped():
    pieces = run(listed(cut_at_stops(whole_generation([choice("a", "b", "END", "c", logprobs=True)]), ["END"])))
    assert [token.text for piece in pieces for token in piece.tokens] == ["a", "b"]


def events(reply: Reply, generation: list[Choice], usage=None) -> list:
    raw = b"".join(run(listed(sse(reply, whole_generation(generation), usage))))
    frames = raw.decode().split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""] and all(frame.startswith("data: ") for frame in frames[:-1])
    return [json.loads(frame[len("data: "):]) for frame in frames[:-2]]


@pytest.mark.parametrize("chat", [True, False])
def test_the_stream_joined_is_the_unstreamed_answer(chat):
    reply = Reply("id-1", 1, "m", chat, 2, True)
    generation = [choice("Hi", "", " there", logprobs=True), choice("Yo", finish="stop", logprobs=True)]
    answer = run(collected(reply, whole_generation(generation), USAGE))
    chunks = events(reply, generation, lambda: USAGE)
    assert answer["object"] == ("chat.completion" if chat else "text_completion") and answer["usage"] == USAGE
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk" if chat else "text_completion"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == USAGE
    assert all(chunk["usage"] is None for chunk in chunks[:-1])
    for index, expected in enumerate(answer["choices"]):
        mine = [part for chunk in chunks for part in chunk["choices"] if part["index"] == index]
        if chat:
            assert mine[0]["delta"] == {"role": "assistant", "content": ""}
            streamed = "".join(part["delta"].get("content", "") for part in mine)
            assert streamed == expected["message"]["content"]
            content = [entry for part in mine if part["logprobs"] for entry in part["logprobs"]["content"]]
            assert content == expected["logprobs"]["content"]
        else:
            assert "".join(part["text"] for part in mine) == expected["text"]
            tokens = [token for part in mine if part["logprobs"] for token in part["logprobs"]["tokens"]]
            assert tokens == expected["logprobs"]["tokens"]
        assert [part["finish_reason"] for part in mine if part["finish_reason"]] == [expected["finish_reason"]]
    first = answer["choices"][0]
    assert first["finish_reason"] == "length" and answer["choices"][1]["finish_reason"] == "stop"
    if chat:
        assert first["message"] == {"role": "assistant", "content": "Hi there"}
        hi = {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]}
        assert first["logprobs"]["content"][0] == {**hi, "top_logprobs": [hi, {"token": "x", "logprob": -1.5,
                                                                              "bytes": [120]}]}
    else:
        assert first["text"] == "Hi there"
        assert first["logprobs"] == {"tokens": ["Hi", "\ufffd", " there"], "token_logprobs": [-0.5] * 3,
                                     "top_logprobs": [{"Hi": -0.5, "x": -1.5}, {"": -0.5, "x": -1.5},
                                                      {" there": -0.5, "x": -1.5}],
                                     "text_offset": [0, 2, 2]}


def test_without_include_usage_no_chunk_has_a_usage_and_logprobs_are_null_unless_asked():
    chunks = events(Reply("id-2", 1, "m", True, 1, False), [choice("a", "b")])
    assert all("usage" not in chunk for chunk in chunks)
    assert all(part["logprobs"] is None for chunk in chunks for part in chunk["choices"])


def test_a_failure_mid_stream_ends_it_with_an_error_event():
    async def failing():
        yield Piece(0, "a")
        raise RuntimeError("the sampler died")

    raw = b"".join(run(listed(sse(Reply("id-3", 1, "m", False, 1, False), failing(), None)))).decode()
    last = json.loads(raw.strip().split("\n\n")[-1][len("data: "):])
    assert "[DONE]" not in raw and "the sampler died" in last["error"]["message"]
