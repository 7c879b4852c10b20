"""The runtime tokenizer's incremental text (TextStream): token by token, over the real tokenizers of the three
model families (byte-level BPE: qwen2.5, smollm2; SentencePiece: gemma-3), it is exactly decode() of the ids so far,
waiting (None) only where that text ends inside a UTF-8 sequence."""
from __future__ import annotations

import pytest

from trtllm_microspec.llm import resolve_engine
from trtllm_microspec.models.registry import gguf_path
from trtllm_microspec.models.tokenizer import TextStream, Tokenizer

TEXT = "Hello wörld! 你好，世界。 Emoji: 🚀🔥 café naïve — “quotes”\n\tdef f(x):\n    return x ** 2  # ok\n"


QWEN = pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.skipif(
    not gguf_path("qwen2.5-coder-0.5b").exists(), reason="qwen2.5-coder-0.5b not cached (microspec models fetch)"))


@pytest.mark.parametrize("key", ["smollm2-135m", "gemma-3-270m", QWEN])
def test_text_stream_is_decode_token_by_token(key):
    tok = Tokenizer(resolve_engine(key))
    ids = tok.encode(TEXT * 2)
    text_of, waits = TextStream(tok), 0
    for n in range(1, len(ids)):
        text, full = text_of(ids[:n]), tok.decode(ids[:n])
        if text is None:
            waits += 1
            assert full.endswith("\ufffd")  # an emoji or CJK character split over tokens
        else:
            assert text == full
    assert text_of(ids, final=True) == tok.decode(ids) == TEXT * 2
    assert text_of.read == len(ids) and text_of.prefix < len(ids)  # (the last call decoded only its tail)


def test_text_stream_waits_then_gives_the_whole_character():
    tok = Tokenizer(resolve_engine("smollm2-135m"))
    ids = tok.encode("🚀")
    assert len(ids) > 1  # a byte-level vocabulary spells it in pieces
    text_of = TextStream(tok)
    assert [text_of(ids[:n]) for n in range(1, len(ids))] == [None] * (len(ids) - 1)
    assert text_of(ids) == "🚀"
    cut = TextStream(tok)
    assert cut(ids[:1], final=True) == tok.decode(ids[:1])  # final: the incomplete text as decode() has it


@pytest.mark.parametrize("key", ["smollm2-135m", "gemma-3-270m", QWEN])
def test_prompts_ids_in_one_call_are_each_prompts_own(key):
    """A batch of prompts, encoded in one call, gives each prompt the ids it gets alone: raw text, chat messages and
    a str as one user turn (gemma-3-270m, a base model, has no chat template)."""
    tok = Tokenizer(resolve_engine(key))
    texts = [TEXT, "Translate German to English: Pfandhäuser boomen in Singapur", "", "a " * 300]
    assert tok.prompts_ids(texts, False) == [tok.encode(t) for t in texts]
    if tok.chat_template is None:
        return
    chats = [[{"role": "user", "content": t}] for t in texts]
    want = [tok.encode(tok.apply_chat(m)) for m in chats]
    assert tok.prompts_ids(chats, True) == want == tok.prompts_ids(texts, True)
    assert [tok.prompt_ids(m, True) for m in chats] == want and len(set(map(len, want))) == len(want)
