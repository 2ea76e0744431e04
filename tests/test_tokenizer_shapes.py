"""Tokenizers as real checkpoints ship them, beside the byte-level BPE of tiny_models.py:
SentencePiece's byte fallback (Llama, Mistral and Gemma's tokenizer.json, or a
tokenizer.model alone), ByT5's byte tokenizer with no vocabulary file, and T5's spiece.model
alone. Outputs are compared with transformers' (float32, CPU) under the same tokenizer."""

from __future__ import annotations

import pytest


def byte_fallback_tokenizer():
    """A Llama-style tokenizer.json: SentencePiece BPE pieces ("▁" for a space), a <0xNN>
    token for each byte the pieces miss, and Llama's decoder (ByteFallback, then Fuse)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ("c", "H", "▁", "e", "▁H", "He"):
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("H", "e")], unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def test_byte_fallback_run_that_is_not_utf8_streams_without_error():
    """A byte token ("[" as <0x5B>) then bytes that make no UTF-8 with it: decoded together
    the "[" becomes U+FFFD, and tokenizers' DecodeStream raised "Invalid prefix encountered
    while decoding stream" out of the engine's step (any model with byte fallback, on any
    such sampled or greedy run). The text streamed is decode()'s, character for character,
    but where one of them holds U+FFFD (what was streamed cannot be taken back)."""
    from tokenizers.decoders import DecodeStream

    from tpserve.engine.detokenizer import IncrementalDetokenizer

    tok = byte_fallback_tokenizer()
    pieces = ["<0x1A>", "c", "<0x5B>", "<0xD3>", "<0xF6>", "<0x45>", "<0xD3>", "H", "He",
              "<0xC3>", "<0xA9>"]
    ids = tok.convert_tokens_to_ids(pieces)
    assert tok.unk_token_id not in ids
    stream = DecodeStream(skip_special_tokens=True)  # guards the case: the stream refuses it
    with pytest.raises(Exception, match="Invalid prefix"):
        for i in ids:
            stream.step(tok.backend_tokenizer, i)
    d = IncrementalDetokenizer(tok, frozenset(tok.all_special_ids))
    text = "".join(d.add(i) for i in ids) + d.flush()
    want = tok.decode(ids, skip_special_tokens=True)
    assert len(text) == len(want) and text.endswith("HHeé"), (text, want)
    assert all(a == b or "\ufffd" in (a, b) for a, b in zip(text, want, strict=True))


@pytest.mark.parametrize(("file", "cls"), [("tokenizer.model", "LlamaTokenizer"),
                                           ("spiece.model", "T5Tokenizer")])
def test_sentencepiece_model_alone_without_the_package_names_it(tmp_path, file, cls):
    """A Llama or Mistral repository with tokenizer.model and no tokenizer.json (T5's with
    spiece.model) where sentencepiece is not installed (tpserve does not require it):
    transformers said "`tiktoken` is required to read a `tiktoken` file", a package and a
    format the checkpoint has nothing to do with. Run where sentencepiece cannot import."""
    import json
    import subprocess
    import sys

    (tmp_path / file).write_bytes(b"\n\x0b\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": cls}))
    code = ("import sys; sys.modules['sentencepiece'] = None\n"
            "from tpserve.errors import CheckpointError\n"
            "from tpserve.tokenizer import load_tokenizer\n"
            "try:\n"
            f"    load_tokenizer({str(tmp_path)!r})\n"
            "except CheckpointError as exc:\n"
            "    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"SentencePiece model ({file})" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "pip install sentencepiece" in out.stdout and "tiktoken" not in out.stdout


def _without_tokenizer_files(path):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    return path


def _serves_as_transformers(path, tp: int, new_tokens: int = 8) -> None:
    """tpserve at tp tokenizes PROMPTS as transformers' tokenizer of `path` does and
    continues them with transformers' greedy tokens; the oracle's continuations vary."""
    from engine_utils import greedy, make_engine
    from tiny_models import PROMPTS, hf_greedy
    from transformers import AutoTokenizer

    assert not (path / "tokenizer.json").exists()
    ref = hf_greedy(path, PROMPTS, new_tokens)
    assert sum(len(set(t)) > 3 for t in ref) >= 3, ref
    tok = AutoTokenizer.from_pretrained(path)
    engine = make_engine(path, tp, local=tp == 1, forked=tp > 1)
    try:
        assert [engine.tokenize(p) for p in PROMPTS] == [tok(p).input_ids for p in PROMPTS]
        assert greedy(engine, PROMPTS, new_tokens) == ref
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def byt5(models_dir):
    """A Flan-style T5 of ByT5's vocabulary (256 bytes, 3 specials, 125 sentinels) with
    ByT5Tokenizer saved beside it: tokenizer_config.json and added_tokens.json only."""
    from tiny_models import save_t5_model, t5_config
    from transformers import ByT5Tokenizer

    path = _without_tokenizer_files(save_t5_model(t5_config(True, vocab_size=384),
                                                  models_dir / "byt5"))
    ByT5Tokenizer().save_pretrained(path)
    return path


# tp = 2 (~30 s with the Ray start on two cores) runs in the slow job.
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_byt5_byte_tokenizer_serves_as_transformers(byt5, tp):
    from transformers import AutoTokenizer

    assert type(AutoTokenizer.from_pretrained(byt5)).__name__ == "ByT5Tokenizer"
    _serves_as_transformers(byt5, tp)


def _sentencepiece_model(out) -> None:
    """A SentencePiece BPE of 400 pieces with byte fallback, as Llama's, trained here."""
    import io

    spm = pytest.importorskip("sentencepiece")
    from tiny_models import CORPUS

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_writer=buf,
                                   vocab_size=400, model_type="bpe", byte_fallback=True,
                                   unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    out.write_bytes(buf.getvalue())


def test_llama_with_tokenizer_model_alone_serves_as_transformers(models_dir):
    """LlamaTokenizer read from tokenizer.model (no tokenizer.json). Its random model emits
    byte tokens that make no UTF-8 together, which the streamed text must survive."""
    from tiny_models import llama_config, save_model
    from transformers import LlamaTokenizer

    path = _without_tokenizer_files(save_model(llama_config(vocab_size=400),
                                               models_dir / "llama-sp", std=0.3))
    _sentencepiece_model(path / "tokenizer.model")
    LlamaTokenizer(vocab_file=str(path / "tokenizer.model")).save_pretrained(path)
    (path / "tokenizer.json").unlink(missing_ok=True)
    _serves_as_transformers(path, 1)


def test_t5_with_spiece_model_alone_serves_as_transformers(models_dir):
    from tiny_models import save_t5_model, t5_config
    from transformers import T5Tokenizer

    path = _without_tokenizer_files(save_t5_model(t5_config(True, vocab_size=400),
                                                  models_dir / "t5-sp"))
    _sentencepiece_model(path / "spiece.model")
    T5Tokenizer(vocab_file=str(path / "spiece.model"), extra_ids=0).save_pretrained(path)
    (path / "tokenizer.json").unlink(missing_ok=True)
    _serves_as_transformers(path, 1)
