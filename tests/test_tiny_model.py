"""The tiny embedded Qwen2.5-VL checkpoint: deterministic build, loads and runs in transformers."""

from mm_rl.platform import cpu_wheels

cpu_wheels.install()  # AutoProcessor builds the Qwen2-VL video processor, which imports torchvision

import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from safetensors import safe_open  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from mm_rl.demo import tiny  # noqa: E402
from mm_rl.demo.tiny import build_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def processor(tiny_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def model(tiny_dir):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_dir).eval()


@pytest.fixture(scope="module")
def image_inputs(processor):
    # 224x168 -> a 12x16 patch grid -> 6x8 merged tokens: more than one 112-pixel window, so window attention,
    # its padding and the full-attention block all run.
    image = Image.new("RGB", (224, 168), (200, 40, 90))
    image.paste((10, 220, 60), (30, 20, 150, 120))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find the area."}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return prompt, processor(text=[prompt], images=[image], return_tensors="pt")


def _weights(path):
    with safe_open(path / "model.safetensors", "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def test_build_is_deterministic_per_seed(tiny_dir, tmp_path):
    again = build_tiny_checkpoint(tmp_path / "again", seed=0)
    other = build_tiny_checkpoint(tmp_path / "other", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (tiny_dir / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "other"]  # no staging directories left


def test_weights_layout_and_tied_variant(tiny_dir, tmp_path):
    weights = _weights(tiny_dir)
    assert weights["model.embed_tokens.weight"].shape == (tiny.VOCAB_SIZE, 128)
    assert weights["lm_head.weight"].shape == (tiny.VOCAB_SIZE, 128)
    assert weights["model.layers.3.self_attn.k_proj.weight"].shape == (64, 128)  # 2 KV groups x head_dim 32
    assert weights["visual.blocks.1.attn.qkv.weight"].shape == (192, 64)
    assert weights["visual.merger.mlp.2.weight"].shape == (128, 256)
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert torch.equal(weights["model.norm.weight"], torch.ones(128))
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.bias"], torch.zeros(128))
    assert abs(weights["model.layers.0.mlp.up_proj.weight"].std().item() - 0.02) < 0.002

    tied = _weights(build_tiny_checkpoint(tmp_path / "tied", seed=0, tie_word_embeddings=True))
    assert "lm_head.weight" not in tied
    assert torch.equal(tied["model.embed_tokens.weight"], weights["model.embed_tokens.weight"])
    config = json.loads((tmp_path / "tied" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True


def test_reuse_rebuild_and_refusals(tiny_dir, tmp_path):
    weights_file = tiny_dir / "model.safetensors"
    stamp = weights_file.stat().st_mtime_ns
    assert build_tiny_checkpoint(tiny_dir, seed=0) == tiny_dir
    assert weights_file.stat().st_mtime_ns == stamp  # same arguments: reused, not rebuilt

    out = build_tiny_checkpoint(tmp_path / "small", seed=0, num_hidden_layers=2)
    assert json.loads((out / "config.json").read_text())["text_config"]["num_hidden_layers"] == 2
    build_tiny_checkpoint(out, seed=0)  # other arguments: replaced in place
    assert json.loads((out / "config.json").read_text())["text_config"]["num_hidden_layers"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small"]

    with pytest.raises(TypeError, match="unknown"):
        build_tiny_checkpoint(tmp_path / "bad", num_layers=2)
    with pytest.raises(ValueError, match="mrope_section"):
        build_tiny_checkpoint(tmp_path / "bad", mrope_section=[8, 12, 12])
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_tiny_checkpoint(foreign)
    assert not (tmp_path / "bad").exists()


def test_config_ids(tiny_dir):
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["image_token_id"] == tiny.IMAGE_TOKEN_ID == 1006
    assert config["video_token_id"] == tiny.VIDEO_TOKEN_ID == 1007
    assert config["vision_start_token_id"] == tiny.VISION_START_TOKEN_ID == 1003
    assert config["vision_end_token_id"] == tiny.VISION_END_TOKEN_ID == 1004
    assert config["text_config"]["vocab_size"] == tiny.VOCAB_SIZE == 1024
    assert config["text_config"]["rope_parameters"]["mrope_section"] == [4, 6, 6]
    assert config["vision_config"]["fullatt_block_indexes"] == [1]
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"][0] == tiny.EOS_TOKEN_ID == 1002
    assert generation["pad_token_id"] == tiny.PAD_TOKEN_ID == 1000


def test_tokens_have_fixed_ids(tiny_dir, processor):
    tokenizer = processor.tokenizer
    assert len(tokenizer) == 1011
    fixed = tiny.SPECIAL_TOKENS + tiny.ADDED_TOKENS
    for token_id, token in enumerate(fixed, start=1000):
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id], token
        assert tokenizer.convert_tokens_to_ids(token) == token_id
    assert tokenizer.eos_token_id == tiny.IM_END_TOKEN_ID and tokenizer.pad_token_id == tiny.ENDOFTEXT_TOKEN_ID

    text = "<think> The triangle has angle 30 degrees. </think> So x = \\boxed{12}<|im_end|><|endoftext|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert {1008, 1009, 1010, 1002, 1000} <= set(ids) and max(ids) <= 1010
    assert tokenizer.decode(ids) == text
    kept = tokenizer.decode(ids, skip_special_tokens=True)
    assert kept == "<think> The triangle has angle 30 degrees. </think> So x = \\boxed{12}"

    # transformers' Qwen2Tokenizer rebuilds the pipeline from vocab + merges: it must agree with tokenizer.json.
    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    for sample in (text, "Héllo wörld 12345\n\n  tabs\tand spaces", "\\frac{1}{2} + \\sqrt{3}"):
        assert tokenizer.encode(sample, add_special_tokens=False) == raw.encode(sample).ids


def test_chat_template_places_image_tokens(processor, image_inputs):
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    prompt, inputs = image_inputs
    assert prompt == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Find the area.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    grid = inputs["image_grid_thw"]
    assert grid.tolist() == [[1, 12, 16]]
    ids = inputs["input_ids"][0].tolist()
    n_image = int(grid.prod()) // 4
    start = ids.index(tiny.VISION_START_TOKEN_ID)
    assert ids[start + 1 : start + 1 + n_image] == [tiny.IMAGE_TOKEN_ID] * n_image
    assert ids[start + 1 + n_image] == tiny.VISION_END_TOKEN_ID
    assert ids.count(tiny.IMAGE_TOKEN_ID) == n_image
    assert inputs["pixel_values"].shape == (int(grid.prod()), 3 * 2 * 14 * 14)

    no_prompt = processor.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert no_prompt.endswith("<|im_start|>user\nhi<|im_end|>\n")


def test_forward_and_generate(model, image_inputs):
    _, inputs = image_inputs
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], tiny.VOCAB_SIZE)
    assert torch.isfinite(logits).all()

    out = model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :]
    assert new.shape == (4,) and int(new.max()) < tiny.VOCAB_SIZE


def test_every_family_tiny_vocabulary_is_the_tiny_tokenizers():
    """The families' tiny sizes (in their own packages, below the demo) state the demo tokenizer's vocabulary."""
    from mm_rl.demo.tiny import VOCAB_SIZE
    from mm_rl.models.registry import FAMILIES

    sizes = {f.name: f.tiny_module().TEXT_CONFIG["vocab_size"] for f in FAMILIES if f.tiny}
    assert len(sizes) == 4 and set(sizes.values()) == {VOCAB_SIZE}


@pytest.mark.parametrize("family", ["qwen2_5vl", "qwen2vl", "qwen3_vl", "qwen3_5"])
def test_the_jobs_model_json_is_written_back_into_the_checkpoints_config(family, tmp_path):
    """What model.json may change (fewer LLM layers and ViT blocks, rope_theta, mrope_section, the activation) goes
    back into config.json where the family's checkpoint spells it, and reading that config gives the job's model
    again; an unchanged model.json leaves config.json as it is (byte-equal content)."""
    import dataclasses

    import budget

    from mm_rl.convert.model_config import model_config_from_hf
    from mm_rl.models.registry import family as by_id

    with budget.cache_build():
        hf_dir = build_tiny_checkpoint(tmp_path / "hf", seed=0, family=family)
    config = json.loads((hf_dir / "config.json").read_text())
    model = model_config_from_hf(hf_dir)
    assert by_id(family).hf_config(config, model) == config
    text = dataclasses.replace(model.text_decoder, num_layers=model.text_decoder.num_layers - 1,
                               pipeline_num_layers=[model.text_decoder.num_layers - 1], rope_theta=5e5,
                               mrope_section=[2, 7, 7], activation_func="gelu")  # fmt: skip
    vit = dataclasses.replace(model.image_encoder.vision_encoder, num_layers=1, pipeline_num_layers=[1])
    changed = dataclasses.replace(
        model, text_decoder=text, image_encoder=dataclasses.replace(model.image_encoder, vision_encoder=vit)
    )
    written = by_id(family).hf_config(config, changed)
    again = by_id(family).model_json(written)["text_decoder"]
    assert (again["num_layers"], again["rope_theta"], again["mrope_section"]) == (text.num_layers, 5e5, [2, 7, 7])
    assert by_id(family).model_json(written)["image_encoder"]["vision_encoder"]["num_layers"] == 1
    assert written.get("text_config", written)["hidden_act"] == "gelu"
