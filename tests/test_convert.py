"""hf2mg / mg2hf in MindSpeed-MM's layout: bit-exact round trips, the on-disk layout checked by hand, truncation,
foreign (MindSpeed-written, training) directories, the weight-sync API, and loading the result in transformers."""

from mm_rl.platform import cpu_wheels

cpu_wheels.install()  # transformers' Qwen2.5-VL imports torchvision utilities

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import zipfile  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from mm_rl.config.loader import load_section  # noqa: E402
from mm_rl.config.presets import MODEL_DIR  # noqa: E402
from mm_rl.config.schema import Hf2MgCfg, HfConfig, Mg2HfCfg, ModelConfig, ParallelConfig  # noqa: E402
from mm_rl.convert.errors import ConversionError  # noqa: E402
from mm_rl.convert.hf2mg import hf2mg  # noqa: E402
from mm_rl.convert.mapping import hf_to_megatron, megatron_to_hf, merge_tp_shards  # noqa: E402
from mm_rl.convert.mg2hf import mg2hf  # noqa: E402
from mm_rl.convert.model_config import model_config_from_hf  # noqa: E402
from mm_rl.convert.stages import plan_pipeline  # noqa: E402
from mm_rl.demo.tiny import build_tiny_checkpoint  # noqa: E402

torch.set_num_threads(1)


# ------------------------------------------------------------------------------------------- helpers
def randomize(src, dst, seed, dtype=None, files=2, rename=lambda name: name):
    """A copy of an HF checkpoint with every tensor redrawn (the tiny builder's zero biases and unit norms would
    hide layout mistakes), spread round-robin over ``files`` safetensors files with an index."""
    weights = hf_tensors(src)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json", "tiny_build.json"))
    generator = torch.Generator().manual_seed(seed)
    names = sorted(weights)
    new = {n: torch.randn(weights[n].shape, generator=generator).to(dtype or weights[n].dtype) for n in names}
    weight_map = {}
    for k in range(files):
        file = f"model-{k + 1:05d}-of-{files:05d}.safetensors"
        save_file({rename(n): new[n] for n in names[k::files]}, dst / file, metadata={"format": "pt"})
        weight_map.update({rename(n): file for n in names[k::files]})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def hf_tensors(hf_dir):
    index = hf_dir / "model.safetensors.index.json"
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {"model.safetensors"}
    out = {}
    for file in files:
        out.update(load_file(hf_dir / file))
    return out


def parallel(tp, vit, llm, ep=1):
    return ParallelConfig(tp_size=tp, ep_size=ep, vit_pp_layers=list(vit), llm_pp_layers=list(llm))


def model_for(hf_dir, vit, llm):
    model = model_config_from_hf(
        hf_dir,
        {"text_decoder": {"num_layers": sum(llm)}, "image_encoder": {"vision_encoder": {"num_layers": sum(vit)}}},
    )
    model.text_decoder.pipeline_num_layers, model.image_encoder.vision_encoder.pipeline_num_layers = llm, vit
    return model


def to_mg(hf_dir, mm_dir, tp, vit, llm, model=None, ep=1):
    cfg = Hf2MgCfg(
        mm_dir=str(mm_dir), hf_config=HfConfig(hf_dir=str(hf_dir)), parallel_config=parallel(tp, vit, llm, ep)
    )
    return hf2mg(cfg, model or model_for(hf_dir, vit, llm))


def to_hf(hf_dir, mm_dir, out_dir, tp, vit, llm, model=None, ep=1, **kwargs):
    cfg = Mg2HfCfg(load_dir=str(mm_dir), save_hf_dir=str(out_dir), parallel_config=parallel(tp, vit, llm, ep))
    return mg2hf(cfg, model or model_for(hf_dir, vit, llm), hf_dir, **kwargs)


def rank_state(mm_dir, tp_rank, pp_rank, pp, iteration="release"):
    name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
    return torch.load(mm_dir / iteration / name / "model_optim_rng.pt", weights_only=True)


def assert_same_tensors(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def tiny_untied(tmp_path_factory):
    built = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "untied", seed=0)
    return randomize(built, tmp_path_factory.mktemp("hf") / "untied", seed=10)


@pytest.fixture(scope="module")
def tiny_tied(tmp_path_factory):
    built = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tied", seed=1, tie_word_embeddings=True)
    return randomize(built, tmp_path_factory.mktemp("hf") / "tied", seed=11, files=3)


@pytest.fixture(params=["untied", "tied"])
def hf_dir(request, tiny_untied, tiny_tied):
    return tiny_untied if request.param == "untied" else tiny_tied


# ------------------------------------------------------------------------------------------ round trips
LAYOUTS = {
    "tp1": (1, [2], [4]),
    "tp2": (2, [2], [4]),
    "pp2": (1, [2, 0], [2, 2]),
    "tp2pp2": (2, [2, 0], [2, 2]),
    "vit_llm_shared_stage": (2, [2, 0], [1, 3]),
    "vit_split_llm_late": (2, [1, 1], [0, 4]),
    "tp2pp4": (2, [2, 0, 0, 0], [1, 1, 1, 1]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_is_bit_exact(hf_dir, layout, tmp_path):
    tp, vit, llm = LAYOUTS[layout]
    mm_dir = to_mg(hf_dir, tmp_path / "mm", tp, vit, llm)
    out = to_hf(hf_dir, mm_dir, tmp_path / "hf", tp, vit, llm)
    assert_same_tensors(hf_tensors(hf_dir), hf_tensors(out))
    assert json.loads((out / "config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "preprocessor_config.json",
        "chat_template.jinja",
        "generation_config.json",
    ):
        assert (out / name).read_bytes() == (hf_dir / name).read_bytes()


def test_bf16_stays_bf16(tiny_untied, tmp_path):
    hf = randomize(tiny_untied, tmp_path / "bf16", seed=3, dtype=torch.bfloat16, files=1)
    mm_dir = to_mg(hf, tmp_path / "mm", 2, [2, 0], [1, 3])
    assert all(t.dtype == torch.bfloat16 for t in rank_state(mm_dir, 1, 1, 2)["model"].values())
    assert_same_tensors(hf_tensors(hf), hf_tensors(to_hf(hf, mm_dir, tmp_path / "back", 2, [2, 0], [1, 3])))


# -------------------------------------------------------------------------------------- layout by hand
def vit_keys(i):
    p = f"image_encoder.encoder.blocks.layers.{i}."
    return {
        p + k
        for k in (
            "input_layernorm.weight",
            "self_attention.linear_qkv.weight",
            "self_attention.linear_qkv.bias",
            "self_attention.linear_proj.weight",
            "self_attention.linear_proj.bias",
            "pre_mlp_layernorm.weight",
            "mlp.linear_fc1.weight",
            "mlp.linear_fc1.bias",
            "mlp.linear_fc2.weight",
            "mlp.linear_fc2.bias",
        )
    }


def llm_keys(i):
    p = f"text_decoder.decoder.layers.{i}."
    return {
        p + k
        for k in (
            "input_layernorm.weight",
            "self_attention.linear_qkv.weight",
            "self_attention.linear_qkv.bias",
            "self_attention.linear_proj.weight",
            "pre_mlp_layernorm.weight",
            "mlp.linear_fc1.weight",
            "mlp.linear_fc2.weight",
        )
    }


MERGER = {
    "image_encoder.projector.layernorm.weight",
    "image_encoder.projector.encoder.linear_fc1.weight",
    "image_encoder.projector.encoder.linear_fc1.bias",
    "image_encoder.projector.encoder.linear_fc2.weight",
    "image_encoder.projector.encoder.linear_fc2.bias",
}


def test_on_disk_layout_tp2_pp2(tiny_untied, tmp_path):
    hf = hf_tensors(tiny_untied)
    mm_dir = to_mg(tiny_untied, tmp_path / "mm", 2, [2, 0], [1, 3])
    assert (mm_dir / "latest_checkpointed_iteration.txt").read_bytes() == b"release"
    assert sorted(p.name for p in mm_dir.iterdir()) == ["latest_checkpointed_iteration.txt", "release"]
    assert sorted(p.name for p in (mm_dir / "release").iterdir()) == [
        "hf2mg_source.json",
        "mp_rank_00_000",
        "mp_rank_00_001",
        "mp_rank_01_000",
        "mp_rank_01_001",
    ]
    stage0 = (
        {"image_encoder.encoder.patch_embed.proj.weight", "text_decoder.embedding.word_embeddings.weight"}
        | vit_keys(0)
        | vit_keys(1)
        | MERGER
        | llm_keys(0)
    )
    stage1 = (
        llm_keys(0)
        | llm_keys(1)
        | llm_keys(2)
        | {"text_decoder.decoder.final_layernorm.weight", "text_decoder.output_layer.weight"}
    )
    for tp_rank in (0, 1):
        for pp_rank, keys in ((0, stage0), (1, stage1)):
            saved = rank_state(mm_dir, tp_rank, pp_rank, 2)
            assert type(saved) is dict and sorted(saved) == ["checkpoint_version", "model"]
            assert saved["checkpoint_version"] == 3.0 and type(saved["model"]) is dict
            assert set(saved["model"]) == keys
            # every tensor is saved with a storage of its own size (no whole HF tensor behind a slice)
            size = (mm_dir / "release" / f"mp_rank_{tp_rank:02d}_{pp_rank:03d}" / "model_optim_rng.pt").stat().st_size
            assert size < sum(t.nbytes for t in saved["model"].values()) + 100 * 1024
    s1 = rank_state(mm_dir, 1, 1, 2)["model"]
    s0 = rank_state(mm_dir, 0, 0, 2)["model"]
    # LLM qkv, TP rank 1 holds query group 1: q heads 2 and 3 (head_dim 32), then k_1, v_1. Stage 1 layer 0 is HF 1.
    h = "model.layers.1.self_attn."
    want = torch.cat([hf[h + "q_proj.weight"][64:128], hf[h + "k_proj.weight"][32:64], hf[h + "v_proj.weight"][32:64]])
    assert torch.equal(s1["text_decoder.decoder.layers.0.self_attention.linear_qkv.weight"], want)
    want = torch.cat([hf[h + "q_proj.bias"][64:128], hf[h + "k_proj.bias"][32:64], hf[h + "v_proj.bias"][32:64]])
    assert torch.equal(s1["text_decoder.decoder.layers.0.self_attention.linear_qkv.bias"], want)
    # fc1 = cat(gate, up), split separately: rank 1 holds cat(gate[128:], up[128:]).
    m = "model.layers.1.mlp."
    want = torch.cat([hf[m + "gate_proj.weight"][128:], hf[m + "up_proj.weight"][128:]])
    assert torch.equal(s1["text_decoder.decoder.layers.0.mlp.linear_fc1.weight"], want)
    assert torch.equal(s1["text_decoder.decoder.layers.0.mlp.linear_fc2.weight"], hf[m + "down_proj.weight"][:, 128:])
    assert torch.equal(
        s1["text_decoder.decoder.layers.0.self_attention.linear_proj.weight"], hf[h + "o_proj.weight"][:, 64:]
    )
    assert torch.equal(s1["text_decoder.output_layer.weight"], hf["lm_head.weight"][512:])
    assert torch.equal(s1["text_decoder.decoder.final_layernorm.weight"], hf["model.norm.weight"])
    # ViT qkv per head: fused [Q; K; V] (hidden 64, 4 heads of 16) -> [q_0, k_0, v_0, q_1, k_1, v_1] on rank 0.
    qkv = hf["visual.blocks.1.attn.qkv.weight"]
    want = torch.cat([qkv[0:16], qkv[64:80], qkv[128:144], qkv[16:32], qkv[80:96], qkv[144:160]])
    assert torch.equal(s0["image_encoder.encoder.blocks.layers.1.self_attention.linear_qkv.weight"], want)
    v = "visual.blocks.1.mlp."
    want = torch.cat([hf[v + "gate_proj.bias"][:64], hf[v + "up_proj.bias"][:64]])
    assert torch.equal(s0["image_encoder.encoder.blocks.layers.1.mlp.linear_fc1.bias"], want)
    assert torch.equal(s0["image_encoder.encoder.blocks.layers.1.mlp.linear_fc2.bias"], hf[v + "down_proj.bias"])
    assert torch.equal(s0["image_encoder.projector.encoder.linear_fc1.weight"], hf["visual.merger.mlp.0.weight"][:128])
    assert torch.equal(
        s0["image_encoder.projector.encoder.linear_fc2.weight"], hf["visual.merger.mlp.2.weight"][:, :128]
    )
    assert torch.equal(s0["text_decoder.embedding.word_embeddings.weight"], hf["model.embed_tokens.weight"][:512])
    assert torch.equal(
        s0["text_decoder.decoder.layers.0.input_layernorm.weight"], hf["model.layers.0.input_layernorm.weight"]
    )


def test_rank_files_are_valid_zips_with_checksums_on_request(tiny_untied, tmp_path):
    cfg = Hf2MgCfg(
        mm_dir=str(tmp_path / "mm"), hf_config=HfConfig(hf_dir=str(tiny_untied)), parallel_config=parallel(2, [2], [4])
    )
    mm_dir = hf2mg(cfg, model_for(tiny_untied, [2], [4]), zip_crc32=True)
    with zipfile.ZipFile(mm_dir / "release" / "mp_rank_01" / "model_optim_rng.pt") as archive:
        assert archive.testzip() is None
    assert torch.serialization.get_crc32_options()  # the global torch setting is restored


def test_tied_embeddings_output_copy(tiny_tied, tmp_path):
    embed = hf_tensors(tiny_tied)["model.embed_tokens.weight"]
    mm_dir = to_mg(tiny_tied, tmp_path / "pp2", 2, [2, 0], [1, 3])
    for rank in (0, 1):  # PP > 1: the last stage holds a copy of its vocab shard of the word embeddings
        assert torch.equal(
            rank_state(mm_dir, rank, 1, 2)["model"]["text_decoder.output_layer.weight"],
            embed[rank * 512 : (rank + 1) * 512],
        )
    mm_dir = to_mg(tiny_tied, tmp_path / "pp1", 2, [2], [4])
    assert not any("output_layer" in k for r in (0, 1) for k in rank_state(mm_dir, r, 0, 1)["model"])
    mm_dir = to_mg(tiny_tied, tmp_path / "same_stage", 1, [1, 1], [0, 4])  # embeddings and output on stage 1
    last = rank_state(mm_dir, 0, 1, 2)["model"]
    assert "text_decoder.embedding.word_embeddings.weight" in last and "text_decoder.output_layer.weight" not in last


def test_fewer_layers_keep_the_bottom_ones(tiny_untied, tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    mm_dir = to_mg(tiny_untied, tmp_path / "mm", 1, [1, 0], [1, 1])
    hf = hf_tensors(tiny_untied)
    assert torch.equal(
        rank_state(mm_dir, 0, 1, 2)["model"]["text_decoder.decoder.layers.0.mlp.linear_fc2.weight"],
        hf["model.layers.1.mlp.down_proj.weight"],
    )
    out = to_hf(tiny_untied, mm_dir, tmp_path / "hf", 1, [1, 0], [1, 1])
    kept = {k: v for k, v in hf.items() if not k.startswith(("model.layers.2.", "model.layers.3.", "visual.blocks.1."))}
    assert_same_tensors(kept, hf_tensors(out))
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["num_hidden_layers"] == 2 and len(config["text_config"]["layer_types"]) == 2
    assert config["vision_config"]["depth"] == 1
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(out)
    assert len(model.model.language_model.layers) == 2 and len(model.model.visual.blocks) == 1


def test_a_narrower_llm_is_cut_alike_by_hf2mg_the_engine_checkpoint_and_mg2hf(tiny_untied, tmp_path):
    """model.json cuts the LLM (width 64 of 128, 2 of 4 heads, MLP 160 of 256, both KV groups serving the first
    two heads: group 1 becomes a copy of group 0): at TP2 x PP2 hf2mg then mg2hf gives exactly the tensors of the
    engine's start checkpoint (``job_model_dir``), whose config.json says the new sizes."""
    from mm_rl.convert.hf_writer import job_model_dir

    model = model_for(tiny_untied, [2, 0], [1, 3])
    text = model.text_decoder
    text.hidden_size, text.num_attention_heads, text.num_query_groups, text.ffn_hidden_size = 64, 2, 2, 160
    model.image_encoder.vision_projector.hidden_size = 64
    engine = job_model_dir(tiny_untied, model, tmp_path / "engine")
    mm_dir = to_mg(tiny_untied, tmp_path / "mm", 2, [2, 0], [1, 3], model)
    out = to_hf(tiny_untied, mm_dir, tmp_path / "hf", 2, [2, 0], [1, 3], model)
    cut, full = hf_tensors(out), hf_tensors(tiny_untied)
    assert_same_tensors(hf_tensors(engine), cut)
    k_full, k_cut = full["model.layers.0.self_attn.k_proj.weight"], cut["model.layers.0.self_attn.k_proj.weight"]
    assert torch.equal(k_cut, torch.cat([k_full[:32, :64], k_full[:32, :64]]))  # 2 groups of 32 rows, both group 0
    assert torch.equal(cut["model.layers.0.mlp.up_proj.weight"], full["model.layers.0.mlp.up_proj.weight"][:160, :64])
    text_config = json.loads((out / "config.json").read_text())["text_config"]
    assert [text_config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads")] == [64, 2, 2]
    assert json.loads((out / "config.json").read_text())["vision_config"]["out_hidden_size"] == 64


def test_key_value_heads_regroup_as_the_query_heads_used_them():
    """Query head h used group h // (heads / groups): more groups (or GQA off) copy, fewer average."""
    from mm_rl.convert.reshape import kv_sources, regroup_kv

    have = {"heads": 4, "groups": 2, "hd": 1}
    assert [dict(s) for s in kv_sources(have, {"heads": 4, "groups": 4})] == [{0: 1}, {0: 1}, {1: 1}, {1: 1}]
    assert [dict(s) for s in kv_sources(have, {"heads": 4, "groups": 1})] == [{0: 2, 1: 2}]
    assert [dict(s) for s in kv_sources(have, {"heads": 3, "groups": 1})] == [{0: 2, 1: 1}]
    kv = torch.tensor([[1.0, 2.0], [4.0, 8.0]])  # 2 groups x hd 1 rows, 2 input columns
    assert torch.equal(regroup_kv(kv, 0, have, {"heads": 4, "groups": 4}), kv[[0, 0, 1, 1]])
    assert torch.allclose(regroup_kv(kv, 0, have, {"heads": 3, "groups": 1}), torch.tensor([[2.0, 4.0]]))


# ----------------------------------------------------------------------------------- foreign directories
def mindspeed_rank(hf, tp_rank):
    """MindSpeed-MM's TP2 x PP2 files for vit [2, 0] / llm [1, 3], written from the layout facts alone."""

    def chunk(t, dim=0):
        return t.chunk(2, dim)[tp_rank]

    stage0 = {"image_encoder.encoder.patch_embed.proj.weight": hf["visual.patch_embed.proj.weight"]}
    for i in range(2):
        v, m = f"visual.blocks.{i}.", f"image_encoder.encoder.blocks.layers.{i}."
        per_head_w = hf[v + "attn.qkv.weight"].view(3, 4, 16, 64).transpose(0, 1).reshape(192, 64)
        per_head_b = hf[v + "attn.qkv.bias"].view(3, 4, 16).transpose(0, 1).reshape(192)
        stage0 |= {
            m + "input_layernorm.weight": hf[v + "norm1.weight"],
            m + "pre_mlp_layernorm.weight": hf[v + "norm2.weight"],
            m + "self_attention.linear_qkv.weight": chunk(per_head_w),
            m + "self_attention.linear_qkv.bias": chunk(per_head_b),
            m + "self_attention.linear_proj.weight": chunk(hf[v + "attn.proj.weight"], 1),
            m + "self_attention.linear_proj.bias": hf[v + "attn.proj.bias"],
            m + "mlp.linear_fc1.weight": torch.cat(
                [chunk(hf[v + "mlp.gate_proj.weight"]), chunk(hf[v + "mlp.up_proj.weight"])]
            ),
            m + "mlp.linear_fc1.bias": torch.cat(
                [chunk(hf[v + "mlp.gate_proj.bias"]), chunk(hf[v + "mlp.up_proj.bias"])]
            ),
            m + "mlp.linear_fc2.weight": chunk(hf[v + "mlp.down_proj.weight"], 1),
            m + "mlp.linear_fc2.bias": hf[v + "mlp.down_proj.bias"],
        }
    p = "image_encoder.projector."
    stage0 |= {
        p + "layernorm.weight": hf["visual.merger.ln_q.weight"],
        p + "encoder.linear_fc1.weight": chunk(hf["visual.merger.mlp.0.weight"]),
        p + "encoder.linear_fc1.bias": chunk(hf["visual.merger.mlp.0.bias"]),
        p + "encoder.linear_fc2.weight": chunk(hf["visual.merger.mlp.2.weight"], 1),
        p + "encoder.linear_fc2.bias": hf["visual.merger.mlp.2.bias"],
        "text_decoder.embedding.word_embeddings.weight": chunk(hf["model.embed_tokens.weight"]),
    }
    stage1 = {
        "text_decoder.decoder.final_layernorm.weight": hf["model.norm.weight"],
        "text_decoder.output_layer.weight": chunk(hf["lm_head.weight"]),
    }
    for layer in range(4):
        h, m = f"model.layers.{layer}.", f"text_decoder.decoder.layers.{layer if layer == 0 else layer - 1}."
        grouped = [
            torch.cat(
                [
                    hf[h + "self_attn.q_proj." + kind].view(2, 64, -1),
                    hf[h + "self_attn.k_proj." + kind].view(2, 32, -1),
                    hf[h + "self_attn.v_proj." + kind].view(2, 32, -1),
                ],
                1,
            ).reshape(256, -1)
            for kind in ("weight", "bias")
        ]
        state = {
            m + "input_layernorm.weight": hf[h + "input_layernorm.weight"],
            m + "pre_mlp_layernorm.weight": hf[h + "post_attention_layernorm.weight"],
            m + "self_attention.linear_qkv.weight": chunk(grouped[0]),
            m + "self_attention.linear_qkv.bias": chunk(grouped[1]).reshape(-1),
            m + "self_attention.linear_proj.weight": chunk(hf[h + "self_attn.o_proj.weight"], 1),
            m + "mlp.linear_fc1.weight": torch.cat(
                [chunk(hf[h + "mlp.gate_proj.weight"]), chunk(hf[h + "mlp.up_proj.weight"])]
            ),
            m + "mlp.linear_fc2.weight": chunk(hf[h + "mlp.down_proj.weight"], 1),
        }
        (stage0 if layer == 0 else stage1).update(state)
    return [{k: v.clone() for k, v in stage.items()} for stage in (stage0, stage1)]


def test_mindspeed_written_directory_converts(tiny_untied, tmp_path):
    hf = hf_tensors(tiny_untied)
    root = tmp_path / "mindspeed"
    for tp_rank in (0, 1):
        for pp_rank, state in enumerate(mindspeed_rank(hf, tp_rank)):
            path = root / "release" / f"mp_rank_{tp_rank:02d}_{pp_rank:03d}" / "model_optim_rng.pt"
            path.parent.mkdir(parents=True)
            torch.save({"model": state, "checkpoint_version": 3.0}, path)
    (root / "latest_checkpointed_iteration.txt").write_text("release")
    out = to_hf(tiny_untied, root, tmp_path / "hf", 2, [2, 0], [1, 3])
    assert_same_tensors(hf, hf_tensors(out))
    ours = to_mg(tiny_untied, tmp_path / "ours", 2, [2, 0], [1, 3])  # and hf2mg writes the same files' content
    for tp_rank in (0, 1):
        for pp_rank in (0, 1):
            assert_same_tensors(
                rank_state(root, tp_rank, pp_rank, 2)["model"], rank_state(ours, tp_rank, pp_rank, 2)["model"]
            )


def test_training_iteration_with_optimizer_state(tiny_untied, tmp_path):
    mm_dir = to_mg(tiny_untied, tmp_path / "mm", 2, [2, 0], [1, 3])
    ckpt = tmp_path / "ckpt"
    for tp_rank in (0, 1):
        for pp_rank in (0, 1):
            model = rank_state(mm_dir, tp_rank, pp_rank, 2)["model"]
            path = ckpt / "iter_0000007" / f"mp_rank_{tp_rank:02d}_{pp_rank:03d}" / "model_optim_rng.pt"
            path.parent.mkdir(parents=True)
            torch.save(
                {
                    "model": model,
                    "checkpoint_version": 3.0,
                    "iteration": 7,
                    "optimizer": {
                        "state": {
                            i: {"exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.ones_like(t)}
                            for i, t in enumerate(model.values())
                        },
                        "param_groups": [{"lr": 1e-6}],
                    },
                    "opt_param_scheduler": {"num_steps": 7},
                    "args": argparse.Namespace(tensor_model_parallel_size=2, params_dtype=torch.float32),
                    "rng_state": [
                        {
                            "random_rng_state": (3, (1, 2), None),
                            "np_rng_state": np.random.get_state(),
                            "torch_rng_state": torch.get_rng_state(),
                        }
                    ],
                },
                path,
            )
    (ckpt / "latest_checkpointed_iteration.txt").write_text("7")
    out = to_hf(tiny_untied, ckpt, tmp_path / "hf", 2, [2, 0], [1, 3])
    assert_same_tensors(hf_tensors(tiny_untied), hf_tensors(out))


def test_published_names_under_newer_spellings(tiny_untied, tmp_path):
    def nested(name):
        return name.replace("model.", "model.language_model.", 1).replace("visual.", "model.visual.", 1)

    hf = randomize(tiny_untied, tmp_path / "nested", seed=10, rename=nested)
    mm_dir = to_mg(hf, tmp_path / "mm", 2, [2], [4])
    assert_same_tensors(hf_tensors(tiny_untied), hf_tensors(to_hf(hf, mm_dir, tmp_path / "hf", 2, [2], [4])))


# ------------------------------------------------------------------------------------ output and API
def test_output_shards_are_bounded(tiny_untied, tmp_path):
    mm_dir = to_mg(tiny_untied, tmp_path / "mm", 2, [2], [4])
    out = to_hf(tiny_untied, mm_dir, tmp_path / "hf", 2, [2], [4], max_shard_bytes=600_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    tensors = hf_tensors(out)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    for file in files:
        loaded = load_file(out / file)
        assert len(loaded) == 1 or sum(t.nbytes for t in loaded.values()) <= 600_000
    assert_same_tensors(hf_tensors(tiny_untied), tensors)


def test_weight_sync_api(hf_dir, tmp_path):
    tp, vit, llm = LAYOUTS["tp2pp2"]
    mm_dir = to_mg(hf_dir, tmp_path / "mm", tp, vit, llm)
    model = model_for(hf_dir, vit, llm)
    pipeline = plan_pipeline(model, parallel(tp, vit, llm))
    original = hf_tensors(hf_dir)
    synced = {}
    for pp_rank in range(2):
        shards = [rank_state(mm_dir, r, pp_rank, 2)["model"] for r in range(tp)]
        full = [(name, merge_tp_shards(name, [s[name] for s in shards], model)) for name in shards[0]]
        for name, tensor in megatron_to_hf(full, model, pipeline, pp_rank):
            assert name not in synced
            synced[name] = tensor
        for tp_rank in range(tp):  # and the in-memory direction gives the files' content
            assert_same_tensors(hf_to_megatron(original, model, pipeline, pp_rank, tp_rank), shards[tp_rank])
    assert_same_tensors(original, synced)


def test_transformers_loads_the_result_with_the_same_logits(hf_dir, tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    tp, vit, llm = LAYOUTS["tp2pp2"]
    out = to_hf(hf_dir, to_mg(hf_dir, tmp_path / "mm", tp, vit, llm), tmp_path / "hf", tp, vit, llm)
    original = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir).eval()
    converted = Qwen2_5_VLForConditionalGeneration.from_pretrained(out).eval()
    assert_same_tensors(original.state_dict(), converted.state_dict())
    input_ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(original(input_ids=input_ids).logits, converted(input_ids=input_ids).logits)


# ------------------------------------------------------------------------------------------ model.json
def test_model_config_from_hf_matches_the_presets(tiny_untied):
    tiny = json.loads((MODEL_DIR / "tiny.json").read_text())
    assert model_config_from_hf(tiny_untied) == load_section(ModelConfig, tiny)
    published_7b = {  # the published Qwen2.5-VL-7B-Instruct config.json (flat text fields, rope_scaling, in_chans)
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 128000,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "image_token_id": 151655,
        "vision_start_token_id": 151652,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vision_config": {
            "depth": 32,
            "hidden_act": "silu",
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "in_chans": 3,
            "out_hidden_size": 3584,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
            "tokens_per_second": 2,
        },
    }
    preset = json.loads((MODEL_DIR / "qwen2_5_vl_7b.json").read_text())
    assert model_config_from_hf(published_7b) == load_section(ModelConfig, preset)


def test_a_conversion_is_reused_only_when_source_model_and_layout_match(tiny_untied, tmp_path):
    """``train`` skips hf2mg only when the recorded source files, model.json and layout are the current ones."""
    import os

    from mm_rl.convert.hf2mg import reusable_conversion

    mm_dir = tmp_path / "mm"
    cfg = Hf2MgCfg(
        mm_dir=str(mm_dir), hf_config=HfConfig(hf_dir=str(tiny_untied)), parallel_config=parallel(2, [2, 0], [1, 3])
    )
    model = model_for(tiny_untied, [2, 0], [1, 3])
    assert "no complete conversion" in reusable_conversion(cfg, model)
    hf2mg(cfg, model)
    assert reusable_conversion(cfg, model) is None
    other_layout = Hf2MgCfg(mm_dir=str(mm_dir), hf_config=cfg.hf_config, parallel_config=parallel(1, [2, 0], [1, 3]))
    assert "other tp" in reusable_conversion(other_layout, model)
    weights = sorted(tiny_untied.glob("*.safetensors"))[0]
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # the checkpoint was rewritten
    try:
        assert "other files" in reusable_conversion(cfg, model)
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    (mm_dir / "release" / "mp_rank_01_001").rename(mm_dir / "release" / "gone")
    assert "mp_rank_01_001" in reusable_conversion(cfg, model)


# ------------------------------------------------------------------------------------------- Qwen2-VL
@pytest.fixture(scope="module")
def tiny_qwen2_vl(tmp_path_factory):
    built = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen2_vl", seed=2, family="qwen2vl")
    return randomize(built, tmp_path_factory.mktemp("hf") / "qwen2_vl", seed=12)


@pytest.mark.parametrize("layout", ["tp1", "tp2pp2", "vit_split_llm_late"])
def test_qwen2_vl_round_trip_is_bit_exact(tiny_qwen2_vl, layout, tmp_path):
    tp, vit, llm = LAYOUTS[layout]
    mm_dir = to_mg(tiny_qwen2_vl, tmp_path / "mm", tp, vit, llm)
    out = to_hf(tiny_qwen2_vl, mm_dir, tmp_path / "hf", tp, vit, llm)
    assert_same_tensors(hf_tensors(tiny_qwen2_vl), hf_tensors(out))


def test_qwen2_vl_layout_is_mindspeed_mms(tiny_qwen2_vl, tmp_path):
    """MindSpeed-MM's qwen2vl names: the ViT norms and merger norm keep their biases, ``fc1`` / ``fc2`` become
    ``linear_fc1`` (rows split over TP) / ``linear_fc2`` (columns split)."""
    hf = hf_tensors(tiny_qwen2_vl)
    mm_dir = to_mg(tiny_qwen2_vl, tmp_path / "mm", 2, [2], [4])
    ranks = [rank_state(mm_dir, r, 0, 1)["model"] for r in range(2)]
    vit = "image_encoder.encoder.blocks.layers.1."
    for mg, name in (("input_layernorm.bias", "norm1.bias"), ("pre_mlp_layernorm.weight", "norm2.weight")):
        assert torch.equal(ranks[1][vit + mg], hf[f"visual.blocks.1.{name}"])
    fc1, fc2 = hf["visual.blocks.1.mlp.fc1.weight"], hf["visual.blocks.1.mlp.fc2.weight"]
    assert torch.equal(torch.cat([r[vit + "mlp.linear_fc1.weight"] for r in ranks]), fc1)
    assert torch.equal(torch.cat([r[vit + "mlp.linear_fc2.weight"] for r in ranks], 1), fc2)
    assert torch.equal(ranks[0]["image_encoder.projector.layernorm.bias"], hf["visual.merger.ln_q.bias"])
    assert not any("gate" in name for name in ranks[0])


def test_model_config_from_a_published_qwen2_vl_config_is_the_preset():
    published_7b = {  # the published Qwen2-VL-7B-Instruct config.json
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "image_token_id": 151655,
        "vision_start_token_id": 151652,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vision_config": {
            "depth": 32,
            "embed_dim": 1280,
            "mlp_ratio": 4,
            "num_heads": 16,
            "in_chans": 3,
            "hidden_size": 3584,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    }
    preset = json.loads((MODEL_DIR / "qwen2_vl_7b.json").read_text())
    assert model_config_from_hf(published_7b) == load_section(ModelConfig, preset)


# ------------------------------------------------------------------------------------------- Qwen3-VL
@pytest.fixture(scope="module")
def tiny_qwen3_vl(tmp_path_factory):
    built = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen3_vl", seed=3, family="qwen3_vl")
    return randomize(built, tmp_path_factory.mktemp("hf") / "qwen3_vl", seed=13)


@pytest.mark.parametrize("layout", ["tp1", "tp2", "tp2pp2"])
def test_qwen3_vl_round_trip_is_bit_exact(tiny_qwen3_vl, layout, tmp_path):
    tp, _, llm = LAYOUTS[layout]
    vit = [3] + [0] * (len(llm) - 1)  # DeepStack keeps the ViT on one stage
    mm_dir = to_mg(tiny_qwen3_vl, tmp_path / "mm", tp, vit, llm)
    out = to_hf(tiny_qwen3_vl, mm_dir, tmp_path / "hf", tp, vit, llm)
    assert_same_tensors(hf_tensors(tiny_qwen3_vl), hf_tensors(out))


def test_qwen3_vl_layout_is_mindspeed_mms(tiny_qwen3_vl, tmp_path):
    """MindSpeed-MM's qwen3vl names: the position table beside the patch embedding, DeepStack merger k under
    ViT block deepstack_visual_indexes[k], q / k norms as q_layernorm / k_layernorm, fc1 split by rows."""
    hf = hf_tensors(tiny_qwen3_vl)
    mm_dir = to_mg(tiny_qwen3_vl, tmp_path / "mm", 2, [3], [4])
    ranks = [rank_state(mm_dir, r, 0, 1)["model"] for r in range(2)]
    assert torch.equal(ranks[1]["image_encoder.encoder.pos_embed.weight"], hf["model.visual.pos_embed.weight"])
    deep = "image_encoder.encoder.blocks.layers.1.deepstack_layer."
    assert torch.equal(ranks[0][deep + "layernorm.weight"], hf["model.visual.deepstack_merger_list.1.norm.weight"])
    fc1 = hf["model.visual.deepstack_merger_list.1.linear_fc1.weight"]
    assert torch.equal(torch.cat([r[deep + "encoder.linear_fc1.weight"] for r in ranks]), fc1)
    assert not any("blocks.layers.2.deepstack" in name for name in ranks[0])  # block 2 feeds no LLM layer
    q_norm = hf["model.language_model.layers.3.self_attn.q_norm.weight"]
    assert torch.equal(ranks[1]["text_decoder.decoder.layers.3.self_attention.q_layernorm.weight"], q_norm)
    assert "text_decoder.decoder.layers.0.self_attention.linear_qkv.bias" not in ranks[0]


def test_model_config_from_a_qwen3_vl_config_is_the_preset():
    """The Qwen3-VL-8B-Instruct config.json (transformers' spelling) gives the qwen3_vl_8b preset."""
    config = {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "image_token_id": 151655,
        "vision_start_token_id": 151652,
        "tie_word_embeddings": False,
        "text_config": {
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 262144,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5000000,
                "mrope_interleaved": True,
                "mrope_section": [24, 20, 20],
            },
        },
        "vision_config": {
            "depth": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_heads": 16,
            "patch_size": 16,
            "out_hidden_size": 4096,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [8, 16, 24],
            "hidden_act": "gelu_pytorch_tanh",
        },
    }
    preset = json.loads((MODEL_DIR / "qwen3_vl_8b.json").read_text())
    assert model_config_from_hf(config) == load_section(ModelConfig, preset)


# ------------------------------------------------------------------------------------------ Qwen3-VL-MoE
_MOE = "model.language_model.layers.{}.mlp."


@pytest.fixture(scope="module")
def tiny_qwen3_vl_moe(tmp_path_factory):
    built = build_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny") / "qwen3_vl_moe", seed=4, family="qwen3_vl", num_experts=4
    )
    return randomize(built, tmp_path_factory.mktemp("hf") / "qwen3_vl_moe", seed=17)


@pytest.mark.parametrize("layout", ["tp1", "ep2", "ep4", "tp2pp2ep2"])
def test_qwen3_vl_moe_round_trip_is_bit_exact(tiny_qwen3_vl_moe, layout, tmp_path):
    """hf2mg then mg2hf gives back every tensor, the fused experts in the published layout ([E, H, 2F] and
    [E, F, H]), whatever the TP / PP / EP split."""
    tp, vit, llm, ep = {
        "tp1": (1, [3], [4], 1),
        "ep2": (1, [3], [4], 2),
        "ep4": (1, [3], [4], 4),
        "tp2pp2ep2": (2, [3, 0], [2, 2], 2),
    }[layout]
    mm_dir = to_mg(tiny_qwen3_vl_moe, tmp_path / "mm", tp, vit, llm, ep=ep)
    out = to_hf(tiny_qwen3_vl_moe, mm_dir, tmp_path / "hf", tp, vit, llm, ep=ep)
    assert_same_tensors(hf_tensors(tiny_qwen3_vl_moe), hf_tensors(out))


def test_qwen3_vl_moe_layout_is_mindspeed_mms(tiny_qwen3_vl_moe, tmp_path):
    """MindSpeed-MM's qwen3vl MoE names: the router as mlp.router, expert e's fc1 = its [H, 2F] slice of
    gate_up_proj transposed (gate rows, then up), fc2 = its down_proj slice transposed; EP rank r holds experts
    r * E / EP onwards, numbered from 0, in mp_rank_TT_EEE."""
    hf = hf_tensors(tiny_qwen3_vl_moe)
    mm_dir = to_mg(tiny_qwen3_vl_moe, tmp_path / "mm", 1, [3], [4], ep=2)
    assert sorted(p.name for p in (mm_dir / "release").iterdir() if p.is_dir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    second = torch.load(mm_dir / "release" / "mp_rank_00_001" / "model_optim_rng.pt", weights_only=True)["model"]
    layer = "text_decoder.decoder.layers.3.mlp."
    assert torch.equal(second[layer + "router.weight"], hf[_MOE.format(3) + "gate.weight"])
    assert torch.equal(
        second[layer + "experts.local_experts.0.linear_fc1.weight"], hf[_MOE.format(3) + "experts.gate_up_proj"][2].T
    )
    assert torch.equal(
        second[layer + "experts.local_experts.1.linear_fc2.weight"], hf[_MOE.format(3) + "experts.down_proj"][3].T
    )
    assert not any(
        "local_experts.2" in name or name.startswith("text_decoder") and name.endswith("mlp.linear_fc1.weight")
        for name in second
    )  # two experts per rank, no dense MLP


def test_qwen3_vl_moe_reads_transformers_in_memory_layout(tiny_qwen3_vl_moe, tmp_path):
    """transformers 5.19 re-saves a loaded Qwen3-VL-MoE with its in-memory expert layout ([E, 2F, H], [E, H, F]);
    hf2mg reads that too, and mg2hf writes the published layout."""
    published = hf_tensors(tiny_qwen3_vl_moe)
    source = tmp_path / "in_memory"
    shutil.copytree(tiny_qwen3_vl_moe, source, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file(
        {
            n: t.transpose(1, 2).contiguous() if n.endswith(("gate_up_proj", "down_proj")) else t
            for n, t in published.items()
        },
        source / "model.safetensors",
        metadata={"format": "pt"},
    )
    mm_dir = to_mg(source, tmp_path / "mm", 1, [3], [4], ep=2)
    out = to_hf(source, mm_dir, tmp_path / "hf", 1, [3], [4], ep=2)
    assert_same_tensors(published, hf_tensors(out))


def test_model_config_from_a_qwen3_vl_moe_config_is_the_preset():
    """The Qwen3-VL-30B-A3B-Instruct config.json gives the qwen3_vl_30b_a3b preset (128 experts, top 8)."""
    config = {
        "architectures": ["Qwen3VLMoeForConditionalGeneration"],
        "model_type": "qwen3_vl_moe",
        "image_token_id": 151655,
        "vision_start_token_id": 151652,
        "tie_word_embeddings": False,
        "text_config": {
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "vocab_size": 151936,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 262144,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 768,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "rope_scaling": {"rope_type": "default", "mrope_interleaved": True, "mrope_section": [24, 20, 20]},
            "rope_theta": 5000000,
        },
        "vision_config": {
            "depth": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_heads": 16,
            "patch_size": 16,
            "out_hidden_size": 2048,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [8, 16, 24],
            "hidden_act": "gelu_pytorch_tanh",
        },
    }
    preset = json.loads((MODEL_DIR / "qwen3_vl_30b_a3b.json").read_text())
    assert model_config_from_hf(config) == load_section(ModelConfig, preset)
    with pytest.raises(ConversionError, match="mixes dense and MoE layers"):
        model_config_from_hf({**config, "text_config": {**config["text_config"], "mlp_only_layers": [0]}})


# -------------------------------------------------------------------------------------------- Qwen3.5
@pytest.fixture(scope="module")
def tiny_qwen3_5(tmp_path_factory):
    """The tiny Qwen3.5, redrawn, with a multi-token-prediction tensor as published checkpoints carry."""
    built = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen3_5", seed=3, family="qwen3_5")
    out = randomize(built, tmp_path_factory.mktemp("hf") / "qwen3_5", seed=17, files=1)
    weights = hf_tensors(out)
    weights["mtp.fc.weight"] = torch.randn(128, 256)
    save_file(weights, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("layout", ["tp1", "tp2", "tp2pp2"])
def test_qwen3_5_round_trip_is_bit_exact(tiny_qwen3_5, layout, tmp_path):
    """hf2mg -> mg2hf gives the checkpoint back bit for bit, less its multi-token-prediction tensors (not part of
    the RL model)."""
    tp, vit, llm = LAYOUTS[layout]
    mm_dir = to_mg(tiny_qwen3_5, tmp_path / "mm", tp, vit, llm)
    out = to_hf(tiny_qwen3_5, mm_dir, tmp_path / "hf", tp, vit, llm)
    want = {name: t for name, t in hf_tensors(tiny_qwen3_5).items() if not name.startswith("mtp.")}
    assert_same_tensors(want, hf_tensors(out))


def test_qwen3_5_layout_is_mindspeed_mms(tiny_qwen3_5, tmp_path):
    """MindSpeed-MM's Qwen3.5 layer layout at TP 2: a Gated DeltaNet's ``in_proj`` per rank [q_r, k_r, v_r, z_r, b_r,
    a_r] and its ``conv1d`` [q_r, k_r, v_r]; the gated attention's ``linear_qkv`` per query group [q heads, their
    gates, k, v]; zero-centred norms as stored; only the layers of each kind hold its tensors."""
    hf = hf_tensors(tiny_qwen3_5)
    mm_dir = to_mg(tiny_qwen3_5, tmp_path / "mm", 2, [2], [4])
    ranks = [rank_state(mm_dir, r, 0, 1)["model"] for r in range(2)]
    g, a = "model.language_model.layers.0.linear_attn.", "model.language_model.layers.3.self_attn."
    qkv = hf[g + "in_proj_qkv.weight"]  # [q (256); k (256); v (256)], two heads of 128 each
    for r, state in enumerate(ranks):

        def rows(t: torch.Tensor, n: int, r: int = r) -> torch.Tensor:
            return t.view(2, n, *t.shape[1:])[r]  # rank r's head of a two-head block

        want = torch.cat([rows(qkv[:256], 128), rows(qkv[256:512], 128), rows(qkv[512:], 128),
                          rows(hf[g + "in_proj_z.weight"], 128), rows(hf[g + "in_proj_b.weight"], 1),
                          rows(hf[g + "in_proj_a.weight"], 1)])  # fmt: skip
        assert torch.equal(state["text_decoder.decoder.layers.0.self_attention.in_proj.weight"], want)
        conv = hf[g + "conv1d.weight"]
        want = torch.cat([rows(conv[:256], 128), rows(conv[256:512], 128), rows(conv[512:], 128)])
        assert torch.equal(state["text_decoder.decoder.layers.0.self_attention.conv1d.weight"], want)
        q = hf[a + "q_proj.weight"].view(4, 2, 64, -1)  # 4 heads x (query, gate) x 64; group r: heads 2r, 2r + 1
        k, v = (hf[a + f"{x}_proj.weight"].view(2, 64, -1)[r] for x in "kv")
        want = torch.cat([q[2 * r, 0], q[2 * r + 1, 0], q[2 * r, 1], q[2 * r + 1, 1], k, v])
        assert torch.equal(state["text_decoder.decoder.layers.3.self_attention.linear_qkv.weight"], want)
    norm = hf["model.language_model.layers.3.self_attn.q_norm.weight"]
    assert torch.equal(ranks[0]["text_decoder.decoder.layers.3.self_attention.q_layernorm.weight"], norm)
    kinds = ("decoder.layers.3.self_attention.in_proj", "decoder.layers.0.self_attention.linear_qkv")
    assert not any(kind in name for kind in kinds for name in ranks[0])


@pytest.mark.parametrize(("tp", "ep"), [(2, 1), (1, 2)])
def test_qwen3_5_moe_round_trip_is_bit_exact(tmp_path_factory, tp, ep, tmp_path):
    """The tiny Qwen3.5-MoE (experts stored one tensor each, a gated shared expert) through hf2mg -> mg2hf at TP 2 and
    at EP 2 (each rank two of the four experts)."""
    built = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "moe", seed=3, family="qwen3_5", num_experts=4)
    hf = randomize(built, tmp_path / "hf_in", seed=19)
    model = model_for(hf, [2], [4])
    mm_dir = to_mg(hf, tmp_path / "mm", tp, [2], [4], model, ep)
    out = to_hf(hf, mm_dir, tmp_path / "hf", tp, [2], [4], model, ep)
    assert_same_tensors(hf_tensors(hf), hf_tensors(out))
    assert any(".mlp.shared_expert_gate." in name for name in hf_tensors(out))
