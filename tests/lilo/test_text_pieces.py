"""Token ids back to text a piece per token (lilo.backend.text), with SmolLM2's real tokenizer: the pieces join to
the decoded text, and a character whose bytes span several tokens comes whole with its last token."""

import pytest
from transformers import AutoTokenizer

from lilo.backend.models import smollm2_directory
from lilo.backend.text import INCOMPLETE, ModelText, pieces
from lilo.errors import InvalidRequestError

TEXTS = ["Hello, world!", "héllo 世界 🙂 done", "🙂🙂🙂", "  spaced\n\tout  ", "日本語のテキスト"]


@pytest.fixture(scope="module")
def text() -> ModelText:
    return ModelText.load(smollm2_directory(), "HuggingFaceTB/SmolLM2-135M-Instruct")


@pytest.mark.parametrize("sample", TEXTS)
def test_the_pieces_join_to_the_text_and_never_split_a_character(text, sample):
    context = text.encode("Say something:")
    tokens = text.encode(sample)
    out = pieces(context, tokens, text.decode)
    assert len(out) == len(tokens)
    assert "".join(out) == text.decode(tokens) == sample
    assert not any(INCOMPLETE in piece for piece in out)


def test_a_multi_byte_character_comes_with_its_last_token(text):
    tokens = text.encode(" 🙃")
    assert len(tokens) == 3 and all(INCOMPLETE in piece for piece in text.token_texts(tokens))  # its bytes spread
    assert pieces([], tokens, text.decode) == ["", "", " 🙃"]


def test_bytes_that_never_complete_a_character_still_come_out_as_decoding_makes_them(text):
    tokens = text.encode("a🙂")[:-1]  # the emoji cut short
    out = pieces([], tokens, text.decode)
    assert "".join(out) == text.decode(tokens) and out[-1].endswith(INCOMPLETE)


def test_the_end_of_sequence_token_adds_no_text(text):
    eos = AutoTokenizer.from_pretrained(smollm2_directory()).eos_token_id
    assert pieces([], text.encode("Hi") + [eos], text.decode)[-1] == ""


def test_chat_messages_render_with_the_template_and_its_generation_prompt(text):
    ids = text.render_chat([{"role": "user", "content": "Hi there"}])
    rendered = AutoTokenizer.from_pretrained(smollm2_directory()).decode(ids)
    assert "<|im_start|>user\nHi there<|im_end|>" in rendered and rendered.endswith("<|im_start|>assistant\n")


def test_a_model_without_a_tokenizer_says_so(tmp_path):
    with pytest.raises(InvalidRequestError, match="ships no tokenizer"):
        ModelText.load(tmp_path, "lilo/tiny-llama")
