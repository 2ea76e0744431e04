"""google/flan-t5-xxl on the meta device: every rank's parameters at tp = 1, 2, 4, 8 put
back together give the checkpoint's tensors, shape for shape (nothing is allocated)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tpserve.config import EngineConfig, ModelConfig, ParallelConfig
from tpserve.distributed import tp_context
from tpserve.models.t5 import T5ForConditionalGeneration
from tpserve.worker.build import build_model

CONFIG = Path(__file__).parent / "data" / "configs" / "flan-t5-xxl.json"
# Published sizes; the config file must agree (it is what the checks below build from).
XXL = {"d_model": 4096, "num_heads": 64, "d_kv": 64, "d_ff": 10240, "num_layers": 24,
       "num_decoder_layers": 24, "vocab_size": 32128, "feed_forward_proj": "gated-gelu"}


def xxl_config():
    from transformers import T5Config

    return T5Config.from_dict(json.loads(CONFIG.read_text()))


def checkpoint_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape as transformers lays the model out (its state dict holds the
    tied copies of `shared` too; tpserve skips them, as it does when loading)."""
    from transformers import T5ForConditionalGeneration as HFT5

    with torch.device("meta"):
        model = HFT5(cfg)
    skip = T5ForConditionalGeneration.skip_tensors
    return {n: tuple(t.shape) for n, t in model.state_dict().items()
            if not any(s in n for s in skip)}


def rank_shapes(cfg, tp: int, rank: int) -> dict[str, tuple[int, ...]]:
    engine_cfg = EngineConfig(model=ModelConfig(path="", model_id="flan-t5-xxl",
                                                dtype="bfloat16", max_model_len=512),
                              parallel=ParallelConfig(tp_size=tp))
    with tp_context(rank, tp):
        model = build_model(engine_cfg, cfg, torch.device("meta"))
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def param_of(tensor: str) -> str:
    """The (possibly fused) parameter a checkpoint tensor loads into, as load_into maps it."""
    for fused, part, _ in T5ForConditionalGeneration.stacked_params:
        if part in tensor:
            return tensor.replace(part, fused)
    return tensor


def split_dim(name: str) -> int | None:
    """Which dimension tp splits: None for the replicated norms, 1 for row-parallel
    projections and the per-head relative bias, 0 for the rest (column / vocab parallel)."""
    if "layer_norm" in name:
        return None
    if name.endswith((".o.weight", ".wo.weight", "relative_attention_bias.weight")):
        return 1
    return 0


def test_config_file_is_flan_t5_xxl():
    cfg = xxl_config()
    assert {k: getattr(cfg, k) for k in XXL} == XXL
    assert json.loads(CONFIG.read_text())["tie_word_embeddings"] is False
    assert cfg.scale_decoder_outputs is False  # Flan: own lm_head, unscaled output


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_rank_shapes_sum_to_the_checkpoint(tp):
    cfg = xxl_config()
    parts: dict[str, list[tuple[int, ...]]] = {}
    for name, shape in checkpoint_shapes(cfg).items():
        parts.setdefault(param_of(name), []).append(shape)
    ranks = [rank_shapes(cfg, tp, r) for r in range(tp)]
    assert all(set(r) == set(parts) for r in ranks), set(parts) ^ set(ranks[0])
    assert "lm_head.weight" in parts  # Flan's head is its own tensor, not the embedding
    for name, shapes in parts.items():
        # Fused parameters (q/k/v, cross k/v, wi_0/wi_1) stack their parts on dim 0.
        whole = (sum(s[0] for s in shapes), *shapes[0][1:])
        dim = split_dim(name)
        per_rank = {r[name] for r in ranks}
        assert len(per_rank) == 1, f"{name}: uneven shards {per_rank}"
        (mine,) = per_rank
        expected = list(whole)
        if dim is not None:
            expected[dim] = whole[dim] // tp
            assert expected[dim] * tp == whole[dim]
        assert mine == tuple(expected), f"{name} at tp={tp}: {mine}, expected {expected}"
    # Spot checks against the published sizes (64 heads of 64, d_ff 10240, vocab 32128).
    r0 = ranks[0]
    block = "decoder.block.5.layer"
    assert r0[f"{block}.0.SelfAttention.qkv.weight"] == (3 * 4096 // tp, 4096)
    assert r0[f"{block}.1.EncDecAttention.kv.weight"] == (2 * 4096 // tp, 4096)
    assert r0[f"{block}.2.DenseReluDense.wi.weight"] == (2 * 10240 // tp, 4096)
    assert r0["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] == (
        32, 64 // tp)
    assert r0["shared.weight"] == r0["lm_head.weight"] == (32128 // tp, 4096)
    # Encoder layer: q k v o, wi_0 wi_1 wo, 2 norms; decoder layer: 4 more attention and
    # a norm; then 2 relative biases, shared, lm_head and 2 final norms.
    assert sum(len(v) for v in parts.values()) == 24 * 9 + 24 * 14 + 6


@pytest.mark.parametrize("arch", ["T5EncoderModel", "MT5EncoderModel", "UMT5EncoderModel"])
def test_an_encoder_only_checkpoint_is_refused_saying_it_has_no_decoder(tmp_path, arch):
    """sentence-t5 and the text encoders of image models ship T5EncoderModel: no decoder
    weights. tpserve refused it among 'unsupported model architecture' with the list of
    every family, which never said what was wrong with a T5."""
    import transformers
    from engine_utils import make_engine
    from tiny_models import build_tokenizer, t5_config

    cfg = t5_config(True)
    cfg.architectures = [arch]
    torch.manual_seed(0)
    getattr(transformers, arch)(cfg).save_pretrained(tmp_path)  # what such a repo holds
    build_tokenizer(cfg.vocab_size).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"{arch}: an encoder alone .* no decoder") as info:
        make_engine(tmp_path, 1, local=True)
    assert f"{arch.removesuffix('EncoderModel')}ForConditionalGeneration" in str(info.value)


def test_an_encoder_saved_without_architectures_is_refused_saying_it_has_no_decoder(tmp_path):
    """Without `architectures` the config's model_type makes it a T5ForConditionalGeneration,
    and the load listed the first 8 of the decoder's missing tensors."""
    import json

    import transformers
    from engine_utils import make_engine
    from tiny_models import build_tokenizer, t5_config

    from tpserve.errors import CheckpointError

    cfg = t5_config(True)
    torch.manual_seed(0)
    transformers.T5EncoderModel(cfg).save_pretrained(tmp_path)
    build_tokenizer(cfg.vocab_size).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("architectures", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"no decoder weights .* encoder alone") as info:
        make_engine(tmp_path, 1, local=True)
    assert "T5ForConditionalGeneration" in str(info.value)
