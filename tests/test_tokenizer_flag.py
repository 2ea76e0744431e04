"""`tpserve launch --tokenizer`: a model saved without tokenizer files serves with the tokenizer
of a directory or a hub id (its tokenizer files only), and generates what transformers does;
a tokenizer with more tokens than the model's vocabulary is refused at start."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import FakeHub
from test_hub import hub_env
from tiny_models import PROMPTS, hf_greedy, llama_config, save_model

from tpserve.errors import CheckpointError
from tpserve.tokenizer_files import has_tokenizer

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def _without_tokenizer(llama_dir: Path, out: Path) -> Path:
    """llama_dir's config and weights only, with a chat template beside them."""
    out.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(llama_dir / name, out / name)
    (out / "chat_template.jinja").write_text(TEMPLATE)
    assert not has_tokenizer(out)
    return out


def _tokenizer_only(llama_dir: Path, out: Path) -> Path:
    out.mkdir()
    for f in llama_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def _args(*argv: str):
    from tpserve.cli import build_parser

    return build_parser().parse_args(["launch", "--device", "cpu", *argv])


def test_a_model_without_tokenizer_serves_with_tokenizer_flag(tmp_path, llama_dir):
    from engine_utils import greedy

    from tpserve.cli import engine_config
    from tpserve.engine.engine import Engine
    from tpserve.executor.factory import build_executor

    model = _without_tokenizer(llama_dir, tmp_path / "weights-only")
    tok = _tokenizer_only(llama_dir, tmp_path / "tok")
    with pytest.raises(CheckpointError, match="--tokenizer ID_OR_DIR"):
        engine_config(_args("--model", str(model)))
    cfg = engine_config(_args("--model", str(model), "--tokenizer", str(tok),
                              "--num-blocks", "64"))
    assert cfg.model.tokenizer == str(tok) and cfg.model.tokenizer_path == str(tok)
    assert cfg.model.path == str(model) and cfg.model.tokenizer_id == str(tok)
    engine = Engine(cfg, build_executor(cfg, in_process=True))
    try:
        ours = greedy(engine, PROMPTS[:2], 8)
        # The tokenizer has no template; the model directory's chat_template.jinja serves.
        assert engine.tokenizer.chat_template == TEMPLATE
    finally:
        engine.shutdown()
    assert ours == hf_greedy(llama_dir, PROMPTS[:2], 8)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, llama_dir):
    from transformers import AutoTokenizer

    small = save_model(llama_config(vocab_size=64), tmp_path / "vocab64")
    size = len(AutoTokenizer.from_pretrained(llama_dir))
    assert size > 64
    out = subprocess.run([sys.executable, "-m", "tpserve.cli", "launch", "--model", str(small),
                          "--tokenizer", str(llama_dir)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    err = out.stderr.strip().splitlines()[-1]
    assert f"the tokenizer {llama_dir} has {size} tokens but the model {small} has 64 " \
        "(vocab_size, its embedding rows)" in err, err
    assert "Traceback" not in out.stderr and "Ray" not in out.stderr


def test_a_tokenizer_from_the_hub_brings_its_tokenizer_files_only(tmp_path, llama_dir):
    model = _without_tokenizer(llama_dir, tmp_path / "weights-only")
    with FakeHub.from_dir("acme/tok", llama_dir) as hub:  # weights too: never fetched
        code = ("from tpserve.cli import build_parser, engine_config; "
                "cfg = engine_config(build_parser().parse_args(['launch', '--device', 'cpu', "
                f"'--model', {str(model)!r}, '--tokenizer', 'acme/tok', "
                "'--tokenizer-revision', 'main'])); print(cfg.model.tokenizer)")
        out = subprocess.run([sys.executable, "-c", code], env=hub_env(tmp_path, hub),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        got = hub.downloaded()
    path = Path(out.stdout.strip().splitlines()[-1])
    assert path.is_relative_to(tmp_path / "hub-cache") and (path / "tokenizer.json").is_file()
    assert {"tokenizer.json", "tokenizer_config.json"} <= got
    assert not any(f.endswith(".safetensors") for f in got), got
    # The weights-only directory, its tokenizer from the hub: nothing else was needed.
    assert not has_tokenizer(model)
