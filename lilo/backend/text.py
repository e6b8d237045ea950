"""A base model's text side, for the OpenAI-compatible endpoint (serve/openai/): chat messages rendered with the
model's chat template, text to token ids, and token ids back to text a piece per token.

It runs where the model's files are (the trainer; transformers' tokenizer imports torch, which the API replicas
must not), and ``pieces`` is torch-free, so it is tested on its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from lilo.errors import InvalidRequestError

Decode = Callable[[Sequence[int]], str]
# Tokens of the prompt before the first sampled one that ``pieces`` decodes with it: a tokenizer may drop a
# sequence's leading space (SentencePiece does), which the sampled text keeps only when decoded after some context.
CONTEXT_TOKENS = 4
INCOMPLETE = "\ufffd"  # what decoding yields for the first bytes of a character split over several tokens


def pieces(context: Sequence[int], tokens: Sequence[int], decode: Decode) -> list[str]:
    """The text each of ``tokens`` adds after ``context``, so that the pieces joined are the tokens' text and a
    character whose bytes span several tokens is never split: its piece comes with its last token, and the earlier
    ones add "". Each step decodes a short window (from the last token that completed some text), not the whole
    prefix, so this is linear in the number of tokens."""
    ids = list(context[-CONTEXT_TOKENS:]) + list(tokens)
    prefix_offset, read_offset = 0, len(ids) - len(tokens)
    out: list[str] = []
    for end in range(read_offset + 1, len(ids) + 1):
        before = decode(ids[prefix_offset:read_offset])
        text = decode(ids[prefix_offset:end])
        if len(text) > len(before) and not text.endswith(INCOMPLETE):
            out.append(text[len(before):])
            prefix_offset, read_offset = read_offset, end
        else:
            out.append("")
    if read_offset < len(ids) and out:  # bytes that never completed a character: what decoding makes of them
        out[-1] += decode(ids[prefix_offset:])[len(decode(ids[prefix_offset:read_offset])):]
    return out


class ModelText:
    """A base model's tokenizer, with what the OpenAI-compatible endpoint asks of it."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        self._tokenizer = tokenizer
        self._name = name

    @classmethod
    def load(cls, directory: Path, name: str) -> ModelText:
        """The tokenizer in ``directory`` (a transformers model directory); a base model without one cannot take
        or give text, which the client is told."""
        if not (Path(directory) / "tokenizer_config.json").exists():
            raise InvalidRequestError(f"Base model {name!r} ships no tokenizer, so it cannot take or return text; "
                                      "use a model that has one, or sample it with token ids through the tinker SDK.")
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(directory), name)

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The token ids of ``messages`` in the model's chat template, ending with the assistant's turn begun."""
        if not getattr(self._tokenizer, "chat_template", None):
            raise InvalidRequestError(f"Base model {self._name!r} has no chat template; send a prompt to "
                                      "/completions instead.")
        try:
            text = self._tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        except Exception as error:  # the template's own check of the messages (roles, order)
            raise InvalidRequestError(f"The chat template of {self._name!r} refused these messages ({error}); "
                                      "check their roles and order.") from None
        # The template writes the special tokens itself (SmolLM2's <|im_start|>), so none are added.
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens (the end-of-sequence one) left out, as OpenAI's API answers."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def pieces(self, context: Sequence[int], sequences: Sequence[Sequence[int]]) -> list[list[str]]:
        """``pieces`` of each sequence sampled after the prompt ``context``."""
        return [pieces(context, tokens, self.decode) for tokens in sequences]

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Each token's own text (for logprobs: a token holding part of a character decodes to U+FFFD)."""
        return [self._tokenizer.decode([token]) for token in ids]
