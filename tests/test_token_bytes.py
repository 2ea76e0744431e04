"""tpserve.tokenizer.token_bytes: the bytes of each token of a character split across
several, for OpenAI's log-probability `bytes`, with the two ways tokenizers keep bytes:
byte-level BPE's alphabet (GPT-2, Llama 3) and SentencePiece's byte fallback (Llama 2,
Mistral). The oracle is the text's own UTF-8."""

from __future__ import annotations

import pytest
from tiny_models import build_tokenizer
from transformers import PreTrainedTokenizerFast

from tpserve.tokenizer import token_bytes

TEXT = "a 😀é中 b"


def _byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "▁": 1, "a": 2, "b": 3, "▁a": 4, "▁b": 5}
    vocab.update({f"<0x{b:02X}>": 6 + b for b in range(256)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a"), ("▁", "b")], unk_token="<unk>",
                               byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


@pytest.mark.parametrize("make", [lambda: build_tokenizer(300), _byte_fallback_tokenizer],
                         ids=["byte-level", "byte-fallback"])
def test_the_tokens_bytes_add_up_to_the_text(make):
    tok = make()
    ids = tok(TEXT, add_special_tokens=False).input_ids
    alone = [tok.decode([i]) for i in ids]
    assert "\ufffd" in alone  # some token holds part of a character
    got = b"".join(token_bytes(tok, i, text) for i, text in zip(ids, alone, strict=True))
    assert got == TEXT.encode("utf-8")
    # A whole token keeps its text's UTF-8.
    whole = [(i, t) for i, t in zip(ids, alone, strict=True) if "\ufffd" not in t]
    assert whole and all(token_bytes(tok, i, t) == t.encode() for i, t in whole)
