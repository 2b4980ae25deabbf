"""The LLM decoder layers of the Qwen-VL stage, as megatron-core layer specs: the seam a family fills
(``ModelFamily.decoder_layer``: a hybrid family picks another spec per layer index).

Imports megatron-core and torch only when a spec is built: a family module names :func:`decoder_layer` without
loading either.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from mm_rl.config.schema import TextDecoderConfig


class TorchNorm:
    """torch's LayerNorm / RMSNorm, as megatron's ``WrappedTorchNorm`` builds them, also under sequence parallelism.

    ``WrappedTorchNorm`` refuses sequence parallelism only because it does not mark its parameters: with each TP
    rank normalising its own share of the tokens, a norm's gradient is that share's, and megatron's
    ``finalize_model_grads`` sums over TP exactly the parameters marked ``sequence_parallel``
    (``distributed/finalize_model_grads.py``, ``_allreduce_non_tensor_model_parallel_grads``; apex's
    ``FusedLayerNorm`` marks its own the same way)."""

    zero_centered: bool | None = None  # None: as the config's ``layernorm_zero_centered_gamma``

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:  # type: ignore[misc]
        import torch

        norms = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in norms:
            raise ValueError(f"normalization {config.normalization!r}: one of {sorted(norms)} is needed")
        # in the model's dtype, as megatron's own norms: an fp32 weight on bf16 activations makes torch's rms_norm /
        # layer_norm take their unfused path (ATen native/layer_norm.cpp, "Cannot dispatch to fused implementation")
        zero_centered = config.layernorm_zero_centered_gamma if cls.zero_centered is None else cls.zero_centered
        if zero_centered and config.normalization != "RMSNorm":
            raise ValueError("a zero-centred norm weight is taken for RMSNorm only")
        kind = _zero_centered_rms_norm() if zero_centered else norms[config.normalization]
        norm = kind(hidden_size, eps=eps, dtype=config.params_dtype)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        return norm


class PlainNorm(TorchNorm):
    """:class:`TorchNorm` with its weight as it is (a Gated DeltaNet's output norm in a zero-centred model)."""

    zero_centered = False


@functools.cache
def _zero_centered_rms_norm() -> type:
    import torch

    class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
        """RMSNorm whose weight is stored as an offset from one: y = x / rms(x) * (1 + w), in fp32 then cast back
        (Qwen3-Next's and Qwen3.5's norms; megatron's ``layernorm_zero_centered_gamma``, which its torch norms
        refuse). The weight starts at zero, as megatron initialises a zero-centred gamma."""

        def reset_parameters(self) -> None:
            if self.weight is not None:
                torch.nn.init.zeros_(self.weight)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            normed = torch.nn.functional.rms_norm(x.float(), self.normalized_shape, eps=self.eps)
            return (normed * (1.0 + self.weight.float())).type_as(x)

    return ZeroCenteredRMSNorm


def llm_layer_spec(
    normalization: str, ulysses: bool, qk_layernorm: bool = False, num_experts: int | None = None
) -> Any:
    """The LLM layer: megatron's local spec with :class:`LLMCoreAttention` (fused attention without S x S scores,
    packed rows per sequence), wrapped for Ulysses CP, and torch's norms as :class:`TorchNorm` (sequence
    parallelism); ``qk_layernorm``: megatron's per-head query / key norm (applied before the rotary, as Qwen3's
    q_norm / k_norm); ``num_experts``: megatron's MoE layer (router and local experts,
    ``mlp.experts.local_experts.E``, MindSpeed-MM's names) in place of the dense MLP."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from mm_rl.models.qwen_vl.config import megatron_normalization
    from mm_rl.models.qwen_vl.context_parallel import UlyssesAttention
    from mm_rl.models.qwen_vl.llm_attention import LLMCoreAttention

    spec = get_gpt_layer_local_spec(
        num_experts=num_experts, normalization=megatron_normalization(normalization), qk_layernorm=qk_layernorm
    )
    layer, attention = spec.submodules, spec.submodules.self_attention.submodules
    attention.core_attention = UlyssesAttention if ulysses else LLMCoreAttention
    for parent, slot in (
        (layer, "input_layernorm"),
        (layer, "pre_mlp_layernorm"),
        (attention, "q_layernorm"),
        (attention, "k_layernorm"),
    ):
        if getattr(parent, slot) is WrappedTorchNorm:
            setattr(parent, slot, TorchNorm)
    return spec


def decoder_layer(text: TextDecoderConfig, index: int, ulysses: bool) -> Any:
    """Every LLM layer of the Qwen-VL families (``index``, the layer's global number, does not matter to them):
    attention with mRoPE and a dense or MoE MLP, as model.json's ``text_decoder`` describes it."""
    return llm_layer_spec(text.normalization, ulysses, qk_layernorm=text.qk_layernorm, num_experts=text.num_moe_experts)
