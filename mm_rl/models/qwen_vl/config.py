"""model.json (``ModelConfig``) + Megatron training flags -> megatron-core ``TransformerConfig`` for the LLM.

One function builds the text decoder's config so the actor, the reference model and tests agree on every
switch: activation, normalization, GQA, rotary base, mRoPE sections, biases, the pipeline split (as a
megatron ``pipeline_model_parallel_layout``, because MindSpeed-MM's per-stage lists are uneven) and the CPU
safety switches. The ViT's config is the vision module's business.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from mm_rl.config.schema import ModelConfig, TextDecoderConfig, TrainingFlags
from mm_rl.platform.device import cpu_safe_transformer_kwargs


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x), transformers' "quick_gelu" (kept local: megatron's is torch.jit-scripted)."""
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,  # exact (erf) GELU, as transformers' "gelu"
    "relu": F.relu,
    "quick_gelu": _quick_gelu,
}


def megatron_normalization(name: str) -> str:
    """megatron-core's name for a model.json norm; "FusedLayerNorm" is a kernel choice, not another norm."""
    return "LayerNorm" if name == "FusedLayerNorm" else name


def head_dim(text: TextDecoderConfig) -> int:
    """kv_channels when model.json sets it, else hidden_size / num_attention_heads."""
    return text.kv_channels or text.hidden_size // text.num_attention_heads


def query_groups(text: TextDecoderConfig) -> int:
    """KV heads: num_query_groups under GQA, else one per attention head (plain multi-head attention)."""
    return text.num_query_groups if text.group_query_attention else text.num_attention_heads


def rotary_dim(text: TextDecoderConfig) -> int:
    """The channels of each head the rotary turns (the first ones; the rest pass through)."""
    return int(head_dim(text) * text.rotary_percent)


def linear_attention_kwargs(text: TextDecoderConfig) -> dict[str, Any]:
    """megatron's Gated DeltaNet sizes (read by ``GatedDeltaNet`` from the config) when any layer has one."""
    if "linear_attention" not in text.layer_types:
        return {}
    return {
        "linear_conv_kernel_dim": text.linear_conv_kernel_dim,
        "linear_key_head_dim": text.linear_key_head_dim,
        "linear_value_head_dim": text.linear_value_head_dim,
        "linear_num_key_heads": text.linear_num_key_heads,
        "linear_num_value_heads": text.linear_num_value_heads,
    }


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Embedding rows after Megatron's padding to a multiple of ``divisible_by * tp`` (each TP rank an equal
    slice). Rows past ``vocab_size`` are never real tokens; the log-prob code masks them out."""
    multiple = max(divisible_by, 1) * tp
    return -(-vocab_size // multiple) * multiple


def pipeline_layout(llm_layers: Sequence[int]) -> list[list[str]] | None:
    """MindSpeed-MM's per-stage LLM layer counts as a megatron layout (None for a single stage).

    The embedding goes to the first stage holding LLM layers, the loss (final norm + output layer) to the
    last stage; megatron then builds exactly ``llm_layers[rank]`` decoder layers on each rank."""
    if len(llm_layers) <= 1:
        return None
    first = next((i for i, n in enumerate(llm_layers) if n), 0)
    layout: list[list[str]] = [["decoder"] * n for n in llm_layers]
    layout[first].insert(0, "embedding")
    layout[-1].append("loss")
    return layout


def moe_kwargs(text: TextDecoderConfig, ep: int) -> dict[str, Any]:
    """megatron's MoE switches for model.json's experts (none for a dense model).

    Routing as Qwen3-VL-MoE (transformers' ``Qwen3VLMoeTextTopKRouter``): softmax over the experts, the top k,
    renormalised. megatron's softmax router without ``moe_router_pre_softmax`` takes the softmax of the top-k
    logits, which is the same renormalised distribution; with ``norm_topk_prob`` false the softmax comes first
    (pre-softmax) and the top-k weights are kept as they are. No capacity factor: no token is dropped. The
    load-balancing and z losses are off unless model.json sets their weights."""
    if not text.num_moe_experts:
        return {}
    return {
        "num_moe_experts": text.num_moe_experts,
        "moe_router_topk": text.moe_router_topk,
        "moe_ffn_hidden_size": text.moe_intermediate_size,
        "moe_router_pre_softmax": not text.norm_topk_prob,
        "moe_router_score_function": "softmax",
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "aux_loss" if text.moe_aux_loss_coeff else "none",
        "moe_aux_loss_coeff": text.moe_aux_loss_coeff,
        "moe_z_loss_coeff": text.moe_z_loss_coeff,
        "moe_grouped_gemm": False,  # megatron's local experts (SequentialMLP): no TE / grouped-gemm kernels needed
        "moe_permute_fusion": False,
        "expert_model_parallel_size": ep,
        "moe_shared_expert_intermediate_size": text.moe_shared_expert_intermediate_size,
        "moe_shared_expert_gate": text.moe_shared_expert_gate,
    }


def text_decoder_config(
    model: ModelConfig,
    flags: TrainingFlags | None = None,
    *,
    tp: int | None = None,
    pp: int | None = None,
    ep: int = 1,
    params_dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> Any:
    """The megatron ``TransformerConfig`` of the Qwen-VL text decoder.

    ``tp`` / ``pp`` default to the flags' values (then to 1); ``pp`` must equal the number of entries of
    ``text_decoder.pipeline_num_layers`` when > 1. ``context_parallel_size`` stays 1 whatever the CP size:
    the model's Ulysses attention does context parallelism around megatron's local attention (megatron's
    own CP needs Transformer Engine); ``sequence_parallel`` is on when TP > 1 (see ``model.TorchNorm``). Dropout is
    off (RL recomputes log-probs and must be deterministic);
    ``overrides`` go last.
    """
    from megatron.core.transformer import TransformerConfig

    text = model.text_decoder
    tp = tp or (flags.tensor_model_parallel_size if flags and flags.tensor_model_parallel_size else 1)
    pp = pp or (flags.pipeline_model_parallel_size if flags and flags.pipeline_model_parallel_size else 1)
    if pp > 1 and len(text.pipeline_num_layers) != pp:
        raise ValueError(f"text_decoder.pipeline_num_layers {text.pipeline_num_layers} needs {pp} entries (PP={pp})")
    if sum(text.pipeline_num_layers) != text.num_layers:
        raise ValueError(
            f"text_decoder.pipeline_num_layers {text.pipeline_num_layers} must sum to num_layers {text.num_layers}"
        )
    if text.activation_func not in ACTIVATIONS:
        raise ValueError(f"activation_func {text.activation_func!r} is not one of {sorted(ACTIVATIONS)}")
    dim = head_dim(text)
    if sum(text.mrope_section) * 2 != rotary_dim(text):
        raise ValueError(f"mrope_section {text.mrope_section} must sum to the rotary dim / 2 = {rotary_dim(text) // 2}")
    kwargs: dict[str, Any] = {
        "num_layers": text.num_layers,
        "hidden_size": text.hidden_size,
        "ffn_hidden_size": text.ffn_hidden_size,
        "num_attention_heads": text.num_attention_heads,
        "num_query_groups": query_groups(text),
        "kv_channels": dim,
        "normalization": megatron_normalization(text.normalization),
        "layernorm_epsilon": text.layernorm_epsilon,
        "activation_func": ACTIVATIONS[text.activation_func],
        "gated_linear_unit": text.swiglu,
        "add_qkv_bias": text.add_qkv_bias,
        # megatron's finalize_model_grads sums the per-head q / k norms' gradients over TP (each rank's heads)
        "qk_layernorm": text.qk_layernorm,
        "add_bias_linear": not text.disable_bias_linear,
        "layernorm_zero_centered_gamma": text.layernorm_zero_centered_gamma,
        "attention_output_gate": text.attention_output_gate,
        "mrope_section": list(text.mrope_section),  # GPTModel takes the type ("mrope") and rope_theta itself
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "params_dtype": params_dtype,
        "pipeline_dtype": params_dtype,
        "bf16": params_dtype == torch.bfloat16,
        "fp16": params_dtype == torch.float16,
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "pipeline_model_parallel_layout": pipeline_layout(text.pipeline_num_layers) if pp > 1 else None,
        "context_parallel_size": 1,
        # megatron's sequence parallelism whenever there is TP: activations between the TP linears cut by TP,
        # and megatron's MoE layer refuses TP in training without it (moe/moe_layer.py, MoELayer.forward)
        "sequence_parallel": tp > 1,
        "variable_seq_lengths": True,  # prompts + responses differ per micro-batch: exchange shapes first
        "moe_token_dispatcher_type": "alltoall",  # megatron rejects its default (allgather) with variable lengths
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        **cpu_safe_transformer_kwargs(),
    }
    kwargs.update(moe_kwargs(text, ep))
    kwargs.update(linear_attention_kwargs(text))
    if flags is not None and flags.no_gradient_accumulation_fusion:
        kwargs["gradient_accumulation_fusion"] = False
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)
