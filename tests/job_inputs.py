"""Small stand-ins for a job's inputs, enough for ``validate``'s path rules: an HF checkpoint directory with the
files they look for (config.json as given, empty weights and processor files) and a jsonl data set."""

import json
from pathlib import Path


def hf_config_json(model: dict) -> dict:
    """The config.json (transformers 5 spelling) of a Qwen2.5-VL, Qwen2-VL, Qwen3-VL (-MoE) or Qwen3.5 checkpoint whose
    model.json is ``model``."""
    text, vit = model["text_decoder"], model["image_encoder"]["vision_encoder"]
    vision = {
        "depth": vit["num_layers"],
        "hidden_size": vit["hidden_size"],
        "num_heads": vit["num_attention_heads"],
        "intermediate_size": vit["ffn_hidden_size"],
        "out_hidden_size": text["hidden_size"],
    }
    model_type, architecture = "qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"
    if model["model_id"] == "qwen3_vl":
        model_type, architecture = "qwen3_vl", "Qwen3VLForConditionalGeneration"
        vision = {**vision, "deepstack_visual_indexes": vit["deepstack_visual_indexes"]}
    if model["model_id"] == "qwen2vl":
        model_type, architecture = "qwen2_vl", "Qwen2VLForConditionalGeneration"
        vision = {
            "depth": vit["num_layers"],
            "embed_dim": vit["hidden_size"],
            "hidden_size": text["hidden_size"],
            "num_heads": vit["num_attention_heads"],
            "mlp_ratio": vit["ffn_hidden_size"] // vit["hidden_size"],
        }
    if model["model_id"] == "qwen3_5":
        model_type, architecture = "qwen3_5", "Qwen3_5ForConditionalGeneration"
    hybrid = {key: text[key] for key in text if key == "layer_types" or key.startswith("linear_")}
    experts = {}
    if text.get("num_moe_experts") and model["model_id"] == "qwen3_5":
        model_type, architecture = "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration"
        experts = {"shared_expert_intermediate_size": text["moe_shared_expert_intermediate_size"]}
    elif text.get("num_moe_experts"):
        model_type, architecture = "qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration"
        experts = {
            "num_experts": text["num_moe_experts"],
            "num_experts_per_tok": text["moe_router_topk"],
            "moe_intermediate_size": text["moe_intermediate_size"],
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    if text.get("num_moe_experts"):
        experts.update(
            num_experts=text["num_moe_experts"],
            num_experts_per_tok=text["moe_router_topk"],
            moe_intermediate_size=text["moe_intermediate_size"],
        )
    return {
        "model_type": model_type,
        "architectures": [architecture],
        "image_token_id": model["img_context_token_id"],
        "vision_start_token_id": model["vision_start_token_id"],
        "text_config": {
            "hidden_size": text["hidden_size"],
            "num_hidden_layers": text["num_layers"],
            "num_attention_heads": text["num_attention_heads"],
            "num_key_value_heads": text["num_query_groups"],
            "intermediate_size": text["ffn_hidden_size"],
            "vocab_size": text["vocab_size"],
            "max_position_embeddings": text["max_position_embeddings"],
            "rope_parameters": {
                "rope_theta": text["rope_theta"],
                "mrope_section": text["mrope_section"],
                "mrope_interleaved": text.get("mrope_interleaved", False),
                **({"partial_rotary_factor": text["rotary_percent"]} if hybrid else {}),
            },
            "head_dim": text.get("kv_channels") or text["hidden_size"] // text["num_attention_heads"],
            "tie_word_embeddings": not text["untie_embeddings_and_output_weights"],
            **experts,
            **hybrid,
        },
        "vision_config": vision,
    }


def merged(base: dict, changes: dict) -> dict:
    out = dict(base)
    for key, value in changes.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def write_hf_dir(directory: Path, changes: dict | None = None, model: str = "tiny") -> Path:
    """The config.json of preset ``model``'s checkpoint with ``changes`` merged in, and empty weight / processor
    files."""
    from mm_rl.config.presets import load_preset

    directory.mkdir(parents=True, exist_ok=True)
    config = merged(hf_config_json(load_preset(model).model), changes or {})
    (directory / "config.json").write_text(json.dumps(config))
    for name in ("model.safetensors", "tokenizer.json", "preprocessor_config.json", "chat_template.jinja"):
        (directory / name).write_text("")
    return directory


def write_rows(path: Path, rows: int, answer_key: str = "answer") -> Path:
    """``rows`` text-only jsonl rows (a row needs no image to be usable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": f"{i} + 1 = ?", answer_key: str(i + 1)}) + "\n" for i in range(rows)))
    return path


def write_data_dir(directory: Path, rows: int = 64, splits: tuple[str, ...] = ("train", "test")) -> Path:
    for split in splits:
        write_rows(directory / f"{split}.jsonl", rows)
    return directory
