"""Vision-language checkpoints served as text only (hf_config.TEXT_ONLY), beyond the match
with transformers at tp = 1, 2, 4 in test_tp_families.py (Mistral 3, LLaVA over Llama and
Qwen2, LLaVA-NeXT over Mistral, Qwen2-VL, Qwen2.5-VL tied; transformers runs the whole
vision-language model on input_ids alone):

- both tensor layouts load: the published names, which transformers' save_pretrained writes
  (language_model.model.*, language_model.lm_head.*, vision_tower.*; Qwen2-VL's model.*,
  visual.*) and which the family cases serve, and transformers 5's own names
  (save_original_format=False: model.language_model.*, lm_head.*, model.vision_tower.*),
  which give every rank the same parameters;
- a Mistral 3 config that leaves tie_word_embeddings to Mistral3Config's default (true) over
  a file storing its own head is served with that head, as transformers serves it;
- Qwen2-VL's multimodal rotary is Qwen2's 1-D rotary on text (the cos/sin tables, and
  transformers' own Qwen2 on the same weights), and the oracle would catch a rotary that
  turned the height/width sections by other positions or used another base;
- a LLaVA over a language model tpserve does not serve inside it, and other vision-language
  architectures, are refused naming what is served;
- the chat template kept beside the tokenizer (chat_template.json, chat_template.jinja) is
  the one the chat routes use; a message with an image part is a 422 saying images are not
  served."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from engine_utils import greedy, load_rank, make_engine, served_engine
from tiny_models import PROMPTS, auto_class, build_tokenizer, family_checkpoint, hf_greedy

from tpserve.hf_config import text_only
from tpserve.models.registry import model_class
from tpserve.weights import load_hf_config

VLMS = ["mistral3", "llava-llama", "llava-next-mistral", "qwen2-vl", "qwen2.5-vl-tied",
        "gemma3-vlm"]


def _names(path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())


def _resave(src, dst, **save):
    """src's model as transformers loads it, saved again (save: save_pretrained options),
    with src's tokenizer files."""
    model = auto_class(json.loads((src / "config.json").read_text())).from_pretrained(
        src, dtype=torch.float32)
    model.save_pretrained(dst, **save)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, dst / f.name)
    return dst


# What the published files (and transformers' default save) name the language model and the
# vision tower: the layout the family cases in test_tp_families.py serve.
PUBLISHED = {"mistral3": ("language_model.model.", "language_model.lm_head.", "vision_tower."),
             "llava-llama": ("language_model.model.", "language_model.lm_head.",
                             "vision_tower."),
             "llava-next-mistral": ("language_model.model.", "language_model.lm_head.",
                                    "image_newline"),
             "qwen2-vl": ("model.layers.", "lm_head.", "visual."),
             "qwen2.5-vl-tied": ("model.layers.", "model.embed_tokens.", "visual."),
             "gemma3-vlm": ("language_model.model.", "vision_tower.", "multi_modal_projector.")}


@pytest.mark.parametrize("name", VLMS)
def test_the_family_cases_serve_the_published_layout(models_dir, name):
    names = _names(family_checkpoint(models_dir, name))
    for prefix in PUBLISHED[name]:
        assert any(n.startswith(prefix) for n in names), (prefix, sorted(names)[:5])
    assert not any(n.startswith("model.language_model.") for n in names)


@pytest.mark.parametrize("name", VLMS)
def test_transformers_own_names_load_the_same_parameters(models_dir, tmp_path, name):
    """transformers 5's own names (save_original_format=False) put the language model under
    model.language_model.* and the tower under model.vision_tower.* / model.visual.*: each
    rank of tp = 2 gets the parameters the published layout gives it."""
    path = family_checkpoint(models_dir, name)
    own = _resave(path, tmp_path / name, save_original_format=False)
    names = _names(own)
    assert any(n.startswith("model.language_model.layers.") for n in names)
    assert any(n.startswith(("model.vision_tower.", "model.visual.")) for n in names)
    for rank in range(2):
        want, _ = load_rank(path, rank, 2)
        got, stats = load_rank(own, rank, 2)
        for (n, a), (_, b) in zip(want.named_parameters(), got.named_parameters(),
                                  strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=n)
        vision = [n for n in stats.full_bytes if "vision_tower." in n or "visual." in n]
        assert vision and not any(stats.read_bytes.get(n) for n in vision)  # never read


def test_a_stored_head_is_served_where_the_config_ties_by_default(models_dir, tmp_path):
    """Mistral3Config ties the head by default; a config.json that does not say (written
    before transformers 5 looked at the outer flag) over a file that stores
    language_model.lm_head.weight: transformers does not tie tensors the file holds both of
    (and different), so it serves the stored head, and so does tpserve."""
    src = family_checkpoint(models_dir, "mistral3")
    path = tmp_path / "mistral3-default-tie"
    shutil.copytree(src, path)
    config = json.loads((path / "config.json").read_text())
    config.pop("tie_word_embeddings")
    config["text_config"].pop("tie_word_embeddings", None)
    (path / "config.json").write_text(json.dumps(config))
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(path).tie_word_embeddings is True  # the case is real
    assert load_hf_config(path).tie_word_embeddings is False
    ref = hf_greedy(path, PROMPTS, 12)
    assert ref == hf_greedy(src, PROMPTS, 12)  # transformers serves the stored head
    engine = make_engine(path, 1, local=True)
    try:
        assert greedy(engine, PROMPTS, 12) == ref
    finally:
        engine.shutdown()


def test_a_tied_vision_language_model_without_a_head_stays_tied(models_dir):
    assert load_hf_config(family_checkpoint(models_dir, "qwen2.5-vl-tied")).tie_word_embeddings


# --- Qwen2-VL's multimodal rotary on text ------------------------------------------------

def _qwen2_vl(models_dir, **kw):
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    path = family_checkpoint(models_dir, "qwen2-vl")
    model = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32, **kw)
    return path, model.eval(), AutoTokenizer.from_pretrained(path)


def _last_logits(model, tok, positions=None) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt").input_ids
            pos = None if positions is None else positions(ids.shape[1])
            out.append(model(input_ids=ids, position_ids=pos).logits[0, -1])
    return out


def _far(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def test_qwen2_vl_rotary_on_text_is_tpserves_1d_table(models_dir):
    """The time, height and width sections (mrope_section [2, 3, 3]) each turn by the
    token's position on text, so transformers' cos/sin are those of one 1-D table: the one
    tpserve's Qwen2 builds from the same config."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

    from tpserve.config import EngineConfig, ModelConfig
    from tpserve.distributed import tp_context
    from tpserve.worker.build import build_model

    path, model, _ = _qwen2_vl(models_dir)
    rotary = Qwen2VLRotaryEmbedding(model.config.text_config)
    n = 512
    positions = torch.arange(n).view(1, 1, n).expand(3, 1, n)  # as generate builds them
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    cfg = EngineConfig(model=ModelConfig(path=str(path), model_id="t", max_model_len=n))
    with tp_context(0, 1):
        ours = build_model(cfg, load_hf_config(path), torch.device("cpu"))
    table = ours.model.rotaries["all"]
    torch.testing.assert_close(table.cos[:n], cos[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(table.sin[:n], sin[0], rtol=0, atol=2e-6)


def test_qwen2_vl_on_text_is_transformers_qwen2(models_dir, tmp_path):
    """transformers' own Qwen2ForCausalLM, given Qwen2-VL's language model (its weights and
    text config), computes Qwen2-VL's logits for the prompts: on text the model is Qwen2
    with 1-D rotary, which is how tpserve serves it."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path, model, tok = _qwen2_vl(models_dir)
    text = model.config.text_config.to_dict()
    rope = {k: v for k, v in text.pop("rope_parameters").items()
            if k in ("rope_type", "rope_theta")}
    keep = Qwen2Config().to_dict().keys() - {"architectures", "model_type", "dtype"}
    qwen2 = Qwen2Config(**{k: v for k, v in text.items() if k in keep},
                        rope_parameters=rope, tie_word_embeddings=False)
    weights = {n: t for n, t in load_file(str(path / "model.safetensors")).items()
               if not n.startswith("visual.")}
    out = tmp_path / "as-qwen2"
    qwen2.save_pretrained(out)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    plain = Qwen2ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    for a, b in zip(_last_logits(plain, tok), _last_logits(model, tok), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("wrong", ["height-width-at-zero", "rope-theta-1e4"])
def test_a_wrong_rotary_would_fail_the_qwen2_vl_match(models_dir, wrong):
    """Guards the oracle: transformers' logits for the prompts move when the height and
    width sections turn by another position than the token's (here 0, as a rotary that
    turned only the time section would) or when the base is 10,000 rather than the config's
    1e6 (what a rotary that dropped rope_theta would use), so the tp = 1, 2, 4 matches in
    test_tp_families.py check both."""
    _, model, tok = _qwen2_vl(models_dir)
    ref = _last_logits(model, tok)
    if wrong == "height-width-at-zero":
        def positions(n):
            pos = torch.zeros(3, 1, n, dtype=torch.long)
            pos[0, 0] = torch.arange(n)
            return pos
        got = _last_logits(model, tok, positions)
    else:
        cfg = model.config
        cfg.text_config.rope_parameters = {**cfg.text_config.rope_parameters,
                                           "rope_theta": 10000.0}
        _, other, _ = _qwen2_vl(models_dir, config=cfg)
        got = _last_logits(other, tok)
    assert _far(got, ref) > 0.05


# --- what is refused ----------------------------------------------------------------------

def test_a_llava_over_a_language_model_tpserve_does_not_serve_inside_it_is_refused():
    from tiny_models import gemma_config, llava_config

    with pytest.raises(ValueError) as err:
        text_only(llava_config(gemma_config))
    msg = str(err.value)
    for needle in ("LlavaForConditionalGeneration", "'gemma'", "'llama' or 'mistral' or "
                   "'qwen2'", "docs/models.md"):
        assert needle in msg, msg


def test_mistral3_over_another_language_model_is_refused():
    from transformers import Mistral3Config

    cfg = Mistral3Config(text_config={"model_type": "ministral3"})
    cfg.architectures = ["Mistral3ForConditionalGeneration"]
    with pytest.raises(ValueError, match="'ministral3'.*tpserve does not serve inside it"):
        text_only(cfg)


@pytest.mark.parametrize(("model_type", "arch"), [
    ("paligemma", "PaliGemmaForConditionalGeneration"),
    ("qwen3_vl", "Qwen3VLForConditionalGeneration"),
    ("idefics3", "Idefics3ForConditionalGeneration")])
def test_other_vision_language_models_stay_refused(model_type, arch):
    from transformers import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[model_type](architectures=[arch])
    with pytest.raises(ValueError) as err:
        model_class(text_only(cfg))
    msg = str(err.value)
    assert f"unsupported model architecture ['{arch}']" in msg
    for served in ("Qwen2VLForConditionalGeneration (qwen2_vl_text)",
                   "LlavaForConditionalGeneration (llama, mistral, qwen2)", "served as text only"):
        assert served in msg, msg


def test_a_qwen2_vl_config_written_flat_is_served_as_qwen2():
    """Qwen2-VL-7B-Instruct's config.json keeps the language model's settings at the top
    level (no text_config) with rope_scaling {"type": "mrope", ...}: tpserve builds Qwen2
    from them, with the base of 1e6 and without the multimodal sections mattering."""
    from transformers import CONFIG_MAPPING

    from tpserve.hf_config import ConfigData, rope_parameters, snapshot

    outer = CONFIG_MAPPING["qwen2_vl"].from_dict({
        "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
        "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
        "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 152064,
        "rope_theta": 1000000.0, "max_position_embeddings": 32768, "torch_dtype": "bfloat16",
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "tie_word_embeddings": False, "use_sliding_window": False,
        "vision_config": {"depth": 32, "embed_dim": 1280, "hidden_size": 3584}})
    text = ConfigData(snapshot(text_only(outer)))
    assert text.architectures == ["Qwen2ForCausalLM"]
    assert (text.hidden_size, text.num_attention_heads, text.num_key_value_heads) == (3584, 28, 4)
    assert text.tie_word_embeddings is False and text.dtype == "bfloat16"
    rope = rope_parameters(text)
    assert (rope["rope_type"], rope["rope_theta"]) == ("default", 1000000.0)
    assert model_class(text).__name__ == "Qwen2ForCausalLM"


# --- the chat template beside the tokenizer, and images --------------------------------

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.mark.parametrize("layout", ["json", "json-list", "jinja", "none"])
def test_the_chat_template_beside_the_tokenizer_is_loaded(tmp_path, layout):
    from tpserve.tokenizer import load_tokenizer

    build_tokenizer(301).save_pretrained(tmp_path)
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    if layout == "json":
        (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    elif layout == "json-list":
        (tmp_path / "chat_template.json").write_text(json.dumps(
            {"chat_template": [{"name": "default", "template": TEMPLATE}]}))
    elif layout == "jinja":
        (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    tok = load_tokenizer(tmp_path)
    if layout == "none":
        assert not tok.chat_template
        return
    got = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                  add_generation_prompt=True)
    assert got == "[user] hi\n[assistant]"


def test_the_chat_routes_use_chat_template_json(models_dir, tmp_path):
    """A vision-language checkpoint whose template is only in chat_template.json: OpenAI's
    chat, TGI's client's chat and the tokenize route render it; the chat continues the
    rendered prompt exactly as a completion of its token ids does."""
    import httpx
    from text_generation import Client as TGIClient
    from text_generation.types import Message

    path = tmp_path / "llava-qwen2"
    shutil.copytree(family_checkpoint(models_dir, "llava-qwen2"), path)
    (path / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    messages = [{"role": "user", "content": "The quick brown fox"}]
    rendered = "[user] The quick brown fox\n[assistant]"
    ids = build_tokenizer(301)(rendered, add_special_tokens=False).input_ids
    with served_engine(path, "vlm", max_model_len=128, max_concurrent_requests=4) as (_, url), \
            httpx.Client(base_url=url, timeout=60) as http:
        counted = http.post("/tokenize", json={"messages": messages})
        assert counted.status_code == 200, counted.text
        assert counted.json()["tokens"] == ids
        chat = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8,
                                                       "temperature": 0})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] == len(ids)
        plain = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 8,
                                                   "temperature": 0})
        text = chat.json()["choices"][0]["message"]["content"]
        assert text == plain.json()["choices"][0]["text"] and text
        tgi = TGIClient(url, timeout=60).chat([Message(**m) for m in messages], max_tokens=8,
                                              temperature=0.0)
        assert tgi.choices[0].message.content == text


IMAGE_PARTS = [
    [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}],
    [{"type": "text", "text": "what is in it?"},
     {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}],
    [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}],
]


@pytest.mark.parametrize("parts", IMAGE_PARTS, ids=["image", "text-and-image", "audio"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_with_an_image_is_a_422_that_says_images_are_not_served(server, backend,
                                                                       parts, stream):
    import httpx

    before = len(backend.calls)
    with httpx.Client(base_url=server[1], timeout=10) as http:
        r = http.post("/v1/chat/completions", json={
            "messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": parts}],
            "max_tokens": 3, "stream": stream})
    assert r.status_code == 422, r.text
    msg = r.json()["error"]
    assert r.json()["error_type"] == "validation"
    kind, j = parts[-1]["type"], len(parts) - 1
    assert msg.startswith(f"`messages.1.content` has a part of type '{kind}' (content[{j}])")
    assert "images, audio and files are not served" in msg
    assert "Input should be" not in msg  # pydantic's own words, which named no image
    assert len(backend.calls) == before


def test_the_openai_client_sees_the_422(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.UnprocessableEntityError) as err:
        client.chat.completions.create(model="m", max_tokens=3, messages=[
            {"role": "user", "content": IMAGE_PARTS[1]}])
    assert "images, audio and files are not served" in err.value.response.json()["error"]
