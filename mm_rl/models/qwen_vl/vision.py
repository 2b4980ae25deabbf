"""The Qwen-VL vision encoder (ViT) and patch-merger projector, built from megatron-core parts: Qwen2.5-VL's, and
Qwen2-VL's and Qwen3-VL's as model.json's switches configure it.

Why megatron-core parts: the ViT blocks are megatron ``TransformerLayer`` s (column-parallel ``linear_qkv`` /
``linear_fc1``, row-parallel ``linear_proj`` / ``linear_fc2``) inside a ``TransformerBlock``, so they shard over
tensor parallelism exactly like the LLM, and their state-dict names are MindSpeed-MM's::

    encoder.patch_embed.proj.weight                              Conv3d [hidden, C, T, P, P], no bias
    encoder.blocks.layers.{i}.input_layernorm.weight
    encoder.blocks.layers.{i}.self_attention.linear_qkv.{weight,bias}   per head [q_h; k_h; v_h]
    encoder.blocks.layers.{i}.self_attention.linear_proj.{weight,bias}
    encoder.blocks.layers.{i}.pre_mlp_layernorm.weight
    encoder.blocks.layers.{i}.mlp.linear_fc1.{weight,bias}       cat(gate, up) (per TP rank)
    encoder.blocks.layers.{i}.mlp.linear_fc2.{weight,bias}
    projector.layernorm.weight
    projector.encoder.linear_fc1.{weight,bias}
    projector.encoder.linear_fc2.{weight,bias}

(``{i}`` restarts at 0 on every pipeline stage; LayerNorm configs add ``.bias`` to the norms.) The full model
holds a :class:`QwenVisionModel` as ``image_encoder``.

What Qwen2.5-VL adds to a plain ViT, and where it lives here:

* Patch order: the image processor emits patches merge-block-major (each 2x2 group of patches that becomes
  one LLM token is contiguous). Window attention reorders these groups ("units") window by window
  (:func:`window_order`); the blocks run in that order; the merger's output is put back in the original order.
* 2D rotary: head_dim/4 frequencies times the patch row and the same times the patch column
  (:func:`vision_rotary`), handed to megatron's own ``apply_rotary_pos_emb`` (non-interleaved, rotate-half),
  which is exactly the Qwen2.5-VL formula.
* Attention restricted to windows, or to whole images in ``fullatt_block_indexes`` blocks: a custom core
  attention (:mod:`.vision_attention`) reading the segments from ``packed_seq_params``. ``window_size`` 0 is
  Qwen2-VL's ViT: no windows, every block attends to whole images.

Pipeline parallelism: a stage is built with ``num_layers`` ViT blocks starting at global block
``layer_offset``; ``pre_process`` (it holds the patch embedding) and ``post_process`` (it holds the merger).
Between stages the hidden state is [N_patches, 1, vit_hidden] in *window order* (3D so megatron's p2p can send
it); every stage also needs ``grid_thw`` (it recomputes windows and rotary from it). See :meth:`forward`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.activations import quick_gelu
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from torch import Tensor

from mm_rl.config.schema import VisionEncoderConfig, VisionProjectorConfig
from mm_rl.models.qwen_vl.layers import TorchNorm
from mm_rl.models.qwen_vl.vision_attention import (
    VisionFullAttention,
    VisionSegments,
    VisionWindowAttention,
)

VISION_ROPE_THETA = 10000.0  # Qwen2.5-VL's vision rotary base (fixed by the architecture, not in model.json)

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,  # exact (erf) GELU, as transformers' "gelu" and the merger's nn.GELU()
    "relu": F.relu,
    "quick_gelu": quick_gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),  # transformers' name (Qwen3-VL's ViT)
}

# Settings taken over from the LLM's config (precision, initialisation, fusions that work everywhere).
_INHERITED_FIELDS = (
    "params_dtype",
    "fp16",
    "bf16",
    "init_method_std",
    "perform_initialization",
    "use_cpu_initialization",
    "gradient_accumulation_fusion",
    "bias_dropout_fusion",
    "deterministic_mode",
)


# ------------------------------------------------------------------------------------------ configs
def _norm_name(normalization: str) -> str:
    """torch has LayerNorm and RMSNorm; FusedLayerNorm is LayerNorm computed by apex."""
    return "LayerNorm" if normalization == "FusedLayerNorm" else normalization


def _common_kwargs(base: TransformerConfig | None) -> dict:
    """What every ViT / merger config shares: inherited precision, this process's TP, no PP, no dropout.

    Pipeline stages of the ViT are explicit (``num_layers`` / ``layer_offset``), so megatron's own layer
    offset arithmetic must see one stage; sequence parallelism and RoPE / bias-activation fusions are off
    (the ViT is small next to the LLM).
    """
    inherited = {name: getattr(base, name) for name in _INHERITED_FIELDS} if base is not None else {}
    return {
        **inherited,
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": 1,
        "sequence_parallel": False,
        "apply_rope_fusion": False,
        "bias_activation_fusion": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    }


def vision_encoder_transformer_config(
    encoder: VisionEncoderConfig, num_layers: int, base: TransformerConfig | None = None
) -> TransformerConfig:
    """The megatron config of the ViT blocks on one stage (``num_layers`` of them)."""
    return TransformerConfig(
        num_layers=max(num_layers, 1),
        hidden_size=encoder.hidden_size,
        ffn_hidden_size=encoder.ffn_hidden_size,
        num_attention_heads=encoder.num_attention_heads,
        num_query_groups=encoder.num_query_groups,
        kv_channels=encoder.hidden_size // encoder.num_attention_heads,
        gated_linear_unit=encoder.swiglu,
        activation_func=ACTIVATIONS[encoder.activation_func],
        normalization=_norm_name(encoder.normalization),
        layernorm_epsilon=encoder.layernorm_epsilon,
        add_bias_linear=encoder.add_bias_linear,
        add_qkv_bias=encoder.add_qkv_bias,
        **_common_kwargs(base),
    )


def vision_projector_transformer_config(
    projector: VisionProjectorConfig, encoder: VisionEncoderConfig, base: TransformerConfig | None = None
) -> TransformerConfig:
    """The megatron config of the merger MLP: hidden_size is its output (the LLM hidden size).

    Head counts are unused by an MLP but validated by TransformerConfig; the ViT's (TP-divisible) are given.
    """
    return TransformerConfig(
        num_layers=1,
        hidden_size=projector.hidden_size,
        ffn_hidden_size=projector.ffn_hidden_size,
        num_attention_heads=encoder.num_attention_heads,
        kv_channels=encoder.hidden_size // encoder.num_attention_heads,
        gated_linear_unit=False,
        activation_func=ACTIVATIONS[projector.activation_func],
        normalization=_norm_name(projector.normalization),
        layernorm_epsilon=encoder.layernorm_epsilon,
        add_bias_linear=True,
        **_common_kwargs(base),
    )


def vision_layer_spec(full_attention: bool) -> ModuleSpec:
    """A local (non-Transformer-Engine) ViT block: pre-norm attention + pre-norm (Swi)GLU MLP, TP-sharded.

    Norms follow ``config.normalization`` (torch RMSNorm / LayerNorm); the core attention is restricted to
    windows, or to whole images for ``full_attention`` blocks.
    """
    core = VisionFullAttention if full_attention else VisionWindowAttention
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=TorchNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.no_mask},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=core,
                    linear_proj=RowParallelLinear,
                    q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=TorchNorm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )


# ------------------------------------------------------------------------- pipeline stage layout
@dataclass(frozen=True)
class VisionStage:
    """The part of the ViT one pipeline stage holds."""

    num_layers: int
    layer_offset: int
    pre_process: bool
    post_process: bool


def vision_stage(pipeline_num_layers: list[int], pp_rank: int) -> VisionStage | None:
    """This stage's ViT blocks from model.json's ``pipeline_num_layers``; None when it holds no ViT part.

    The patch embedding goes with the first stage that has blocks, the merger with the last one.
    """
    holders = [rank for rank, count in enumerate(pipeline_num_layers) if count > 0]
    if pp_rank not in holders:
        return None
    return VisionStage(
        num_layers=pipeline_num_layers[pp_rank],
        layer_offset=sum(pipeline_num_layers[:pp_rank]),
        pre_process=pp_rank == holders[0],
        post_process=pp_rank == holders[-1],
    )


# ------------------------------------------------------------------ per-batch positions and windows
def patch_positions(grid_thw: Tensor, merge: int) -> Tensor:
    """[N, 2] (row, column) of every patch, in the processor's merge-block-major patch order."""
    positions = []
    for t, h, w in grid_thw.tolist():
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        grid = torch.stack([rows, cols], dim=-1).permute(0, 2, 1, 3, 4).reshape(-1, 2)
        positions.append(grid.repeat(t, 1))
    return torch.cat(positions)


def window_order(grid_thw: Tensor, merge: int, window_units: int) -> tuple[Tensor, Tensor]:
    """The window permutation of merge units and the window boundaries ``cu_window_seqlens`` (in patches).

    Each frame's grid of units is cut into ``window_units`` x ``window_units`` windows (the last row / column
    of windows may be smaller); windows are taken row by row, units inside a window row by row.
    """
    orders, lengths, offset = [], [], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        rows_of_windows, cols_of_windows = math.ceil(gh / window_units), math.ceil(gw / window_units)
        frame = torch.arange(t).view(t, 1, 1)
        row = torch.arange(gh).view(1, gh, 1)
        col = torch.arange(gw).view(1, 1, gw)
        window = (frame * rows_of_windows + row // window_units) * cols_of_windows + col // window_units
        inside = (row % window_units) * window_units + col % window_units
        orders.append(torch.argsort((window * window_units**2 + inside).reshape(-1)) + offset)
        counts = torch.bincount(window.reshape(-1), minlength=t * rows_of_windows * cols_of_windows)
        lengths.append(counts[counts > 0] * merge**2)
        offset += t * gh * gw
    cu_window_seqlens = F.pad(torch.cat(lengths).cumsum(0), (1, 0))
    return torch.cat(orders), cu_window_seqlens.to(torch.int32)


def image_cu_seqlens(grid_thw: Tensor) -> Tensor:
    """Boundaries (in patches) of each image frame: the segments of the full-attention blocks."""
    grid = grid_thw.to("cpu", torch.long)
    frames = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
    return F.pad(frames.cumsum(0), (1, 0)).to(torch.int32)


def vision_rotary(positions: Tensor, head_dim: int, theta: float = VISION_ROPE_THETA) -> Tensor:
    """Rotary angles [N, head_dim]: head_dim/4 frequencies times the row, the same times the column, twice.

    The layout [row_freqs, col_freqs, row_freqs, col_freqs] is what a rotate-half rotary (megatron's
    non-interleaved ``apply_rotary_pos_emb``) needs to rotate pairs (i, i + head_dim/2) by one angle.
    """
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))
    angles = (positions.to(torch.float32)[:, :, None] * inv_freq).flatten(1)  # [N, (row, col) x head_dim/4]
    return torch.cat([angles, angles], dim=-1)


@dataclass
class VisionBatch:
    """Everything the ViT derives from ``grid_thw``: window permutation, rotary angles, attention segments."""

    unit_order: Tensor  # window order of the merge units (indices into the original unit order)
    unit_inverse: Tensor  # original order from window order
    rotary_pos_emb: Tensor  # [N, 1, 1, head_dim] fp32, window order (megatron's rotary layout)
    segments: VisionSegments

    @classmethod
    def build(cls, grid_thw: Tensor, encoder: VisionEncoderConfig, device: torch.device) -> VisionBatch:
        merge = encoder.spatial_merge_size
        if encoder.window_size:
            unit_order, cu_window = window_order(grid_thw, merge, encoder.window_size // merge // encoder.patch_size)
        else:  # no window attention (Qwen2-VL): the processor's order, every block attends to whole images
            unit_order = torch.arange(int(grid_thw.prod(-1).sum()) // merge**2)
            cu_window = image_cu_seqlens(grid_thw)
        head_dim = encoder.hidden_size // encoder.num_attention_heads
        rotary = vision_rotary(patch_positions(grid_thw, merge), head_dim)
        rotary = _to_window_order(rotary, unit_order, merge**2)
        return cls(
            unit_order=unit_order.to(device),
            unit_inverse=torch.argsort(unit_order).to(device),
            rotary_pos_emb=rotary[:, None, None, :].to(device),
            segments=VisionSegments.build(cu_window.to(device), image_cu_seqlens(grid_thw).to(device)),
        )


def _to_window_order(tokens: Tensor, unit_order: Tensor, unit: int) -> Tensor:
    """Permute [N, ...] patch rows by merge unit (the ``unit`` patches of a unit stay together)."""
    return tokens.reshape(-1, unit, *tokens.shape[1:])[unit_order].reshape(tokens.shape)


# ---------------------------------------------------------------------------------------- modules
class PatchEmbed(torch.nn.Module):
    """Patch embedding: a Conv3d whose kernel equals its stride, i.e. one linear map per flattened patch.

    Stored as a Conv3d weight (the checkpoint layout) but applied as a matmul on the processor's
    [N, C*T*P*P] rows, which is the same sum without the conv's reshapes.
    """

    def __init__(self, encoder: VisionEncoderConfig, dtype: torch.dtype) -> None:
        super().__init__()
        kernel = (encoder.temporal_patch_size, encoder.patch_size, encoder.patch_size)
        self.proj = torch.nn.Conv3d(
            encoder.in_channels,
            encoder.hidden_size,
            kernel_size=kernel,
            stride=kernel,
            bias=encoder.patch_embed_bias,
            dtype=dtype,
        )

    def forward(self, pixel_values: Tensor) -> Tensor:
        weight = self.proj.weight
        return F.linear(pixel_values.to(weight.dtype), weight.reshape(weight.size(0), -1), self.proj.bias)


def interpolated_positions(table: Tensor, grid_thw: Tensor, merge: int) -> Tensor:
    """Qwen3-VL's learned positions [N_patches, hidden]: the square table (side x side entries) resized
    bilinearly (corners aligned) to each image's patch grid, in the processor's merge-block-major patch order,
    repeated per frame."""
    side = math.isqrt(table.size(0))
    square = table.t().reshape(1, -1, side, side)
    out = []
    for t, h, w in grid_thw.tolist():
        grid = F.interpolate(square, size=(h, w), mode="bilinear", align_corners=True)[0].permute(1, 2, 0)
        blocks = grid.reshape(h // merge, merge, w // merge, merge, -1).permute(0, 2, 1, 3, 4)
        out.append(blocks.reshape(h * w, -1).repeat(t, 1))
    return torch.cat(out)


class VisionEncoder(MegatronModule):
    """The ViT part one stage holds: optionally the patch embedding, then ``num_layers`` blocks."""

    def __init__(
        self,
        encoder: VisionEncoderConfig,
        config: TransformerConfig,
        num_layers: int,
        layer_offset: int,
        pre_process: bool,
    ) -> None:
        super().__init__(config=config)
        self.patch_embed = PatchEmbed(encoder, config.params_dtype) if pre_process else None
        if pre_process and encoder.num_position_embeddings:
            self.pos_embed = torch.nn.Embedding(
                encoder.num_position_embeddings, encoder.hidden_size, dtype=config.params_dtype
            )
        full = set(encoder.fullatt_block_indexes)
        specs = [vision_layer_spec(not encoder.window_size or layer_offset + i in full) for i in range(num_layers)]
        self.blocks = (
            TransformerBlock(
                config=config,
                spec=TransformerBlockSubmodules(layer_specs=specs, layer_norm=None),
                post_layer_norm=False,
                pre_process=True,  # the stage hands its input over explicitly (see QwenVisionModel.forward)
                post_process=False,
            )
            if num_layers > 0
            else None
        )

    def forward(self, hidden_states: Tensor, batch: VisionBatch) -> Tensor:
        """[N, 1, hidden] in window order through this stage's blocks."""
        if self.blocks is None:
            return hidden_states
        return self.blocks(
            hidden_states,
            attention_mask=None,
            rotary_pos_emb=batch.rotary_pos_emb,
            packed_seq_params=batch.segments,
        )


class VisionProjector(MegatronModule):
    """The patch merger: norm each patch, concatenate each merge unit's patches, MLP into the LLM width."""

    def __init__(
        self,
        projector: VisionProjectorConfig,
        encoder: VisionEncoderConfig,
        config: TransformerConfig,
        postshuffle: bool = False,
    ):
        super().__init__(config=config)
        self.unit = encoder.spatial_merge_size**2
        self.postshuffle = postshuffle  # norm the concatenated unit (Qwen3-VL's DeepStack mergers), not each patch
        width = projector.input_size * (self.unit if postshuffle else 1)
        self.layernorm = TorchNorm(config, width, eps=config.layernorm_epsilon)
        self.encoder = MLP(
            config,
            MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            input_size=projector.input_size * self.unit,
            ffn_hidden_size=projector.ffn_hidden_size,
        )

    def forward(self, patches: Tensor) -> Tensor:
        """[N, input_size] patches (original order) -> [N / merge^2, llm_hidden]."""
        if self.postshuffle:
            units = self.layernorm(patches.reshape(-1, 1, patches.size(-1) * self.unit))
        else:
            units = self.layernorm(patches).reshape(-1, 1, patches.size(-1) * self.unit)
        out, bias = self.encoder(units)
        out = out.squeeze(1)
        return out if bias is None else out + bias


class QwenVisionModel(MegatronModule):
    """A Qwen-VL image encoder (ViT + patch merger), or the part of it one pipeline stage holds.

    Args:
        encoder_config / projector_config: model.json's ``image_encoder.vision_encoder`` / ``vision_projector``.
        llm_hidden_size: the text decoder's hidden size (the merger's output width; must equal
            ``projector_config.hidden_size``).
        base_config: the LLM's TransformerConfig; precision and initialisation settings are taken from it
            (None: fp32 defaults). TP size comes from ``parallel_state``.
        num_layers / layer_offset: the ViT blocks this stage holds (global blocks ``layer_offset`` ..
            ``layer_offset + num_layers - 1``; default all). See :func:`vision_stage`.
        pre_process / post_process: whether this stage holds the patch embedding / the merger.
        freeze_encoder: the default (``actor_config.unfreeze_vision_encoder`` false): ViT params get
            ``requires_grad=False`` and its forward runs under ``torch.no_grad`` (no activations kept).
        freeze_projector: ``actor_config.freeze_vision_projector``.

    A stage holding the whole frozen ViT may keep its output per image for a training step (:attr:`cache`, set to
    a dict by the rank when the step's images arrive, None: off): an image encoded for one micro-batch or pass is
    not encoded again in the step's other micro-batches or passes (the old log-prob pass and the update; a group
    split over micro-batches), and only the merger, which may train, runs each time. The ViT's frozen weights never
    change, and it encodes every image on its own (windows and full attention stay within an image), so a cached
    image's hidden states are those a new pass would compute.
    """

    def __init__(
        self,
        encoder_config: VisionEncoderConfig,
        projector_config: VisionProjectorConfig,
        llm_hidden_size: int,
        base_config: TransformerConfig | None = None,
        *,
        num_layers: int | None = None,
        layer_offset: int = 0,
        pre_process: bool = True,
        post_process: bool = True,
        freeze_encoder: bool = True,
        freeze_projector: bool = False,
    ) -> None:
        num_layers = encoder_config.num_layers - layer_offset if num_layers is None else num_layers
        _check(encoder_config, projector_config, llm_hidden_size, num_layers, layer_offset)
        config = vision_encoder_transformer_config(encoder_config, num_layers, base_config)
        super().__init__(config=config)
        self.encoder_config = encoder_config
        self.pre_process, self.post_process = pre_process, post_process
        self.freeze_encoder = freeze_encoder
        self.cache: dict[tuple[int, int], Tensor] | None = None  # image key -> its ViT output (original order)
        self.input_tensor: Tensor | None = None
        self.encoder: VisionEncoder | None = None
        self.projector: VisionProjector | None = None
        if pre_process or num_layers > 0:
            self.encoder = VisionEncoder(encoder_config, config, num_layers, layer_offset, pre_process)
            self.encoder.requires_grad_(not freeze_encoder)
        if post_process:
            projector_tc = vision_projector_transformer_config(projector_config, encoder_config, base_config)
            self.projector = VisionProjector(projector_config, encoder_config, projector_tc)
            self.projector.requires_grad_(not freeze_projector)
        self.deepstack: list[VisionProjector] = []  # DeepStack mergers, held by their blocks (MindSpeed-MM's names)
        self._captured: list[Tensor] = []
        for index in encoder_config.deepstack_visual_indexes:
            assert self.encoder is not None and self.encoder.blocks is not None and post_process
            layer = self.encoder.blocks.layers[index - layer_offset]
            layer.deepstack_layer = VisionProjector(projector_config, encoder_config, projector_tc, postshuffle=True)
            layer.deepstack_layer.requires_grad_(not freeze_projector)
            layer.register_forward_hook(self._capture)
            self.deepstack.append(layer.deepstack_layer)

    def set_input_tensor(self, input_tensor: Tensor | list[Tensor] | None) -> None:
        """For megatron's pipeline schedules: the hidden state received from the previous stage."""
        if isinstance(input_tensor, list):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    @property
    def caches(self) -> bool:
        """Whether this stage keeps its ViT output per image: the whole ViT here, frozen, and a cache set."""
        return (
            self.cache is not None
            and self.freeze_encoder
            and self.pre_process
            and self.post_process
            and self.encoder is not None
            and not self.deepstack
        )

    def forward(
        self,
        pixel_values: Tensor | None,
        grid_thw: Tensor,
        hidden_states: Tensor | None = None,
        image_keys: Tensor | None = None,
    ) -> Tensor:
        """Run this stage's part of the image encoder.

        Args:
            pixel_values: [N_patches, C*T*P*P] from the image processor (used when ``pre_process``).
            grid_thw: [num_images, 3] (t, h, w) patch grid per image; every stage needs it.
            hidden_states: on a stage without the patch embedding, the previous stage's output
                ([N_patches, 1, vit_hidden], window order); None reads ``set_input_tensor``'s.
            image_keys: [num_images, 2] a key per image (the step's prompt index, the image's place in it) under
                which :attr:`cache` keeps its ViT output; None: no caching.

        Returns:
            with ``post_process``: image embeddings [N_patches / merge^2, llm_hidden] in the original token
            order (one row per image-pad token, images in ``grid_thw`` order), as HF ``model.visual(...)``;
            otherwise the hidden state [N_patches, 1, vit_hidden] in window order for the next stage.
        """
        if image_keys is not None and self.caches:
            assert self.projector is not None and pixel_values is not None
            return self.projector(self._cached(pixel_values, grid_thw, image_keys))
        hidden, batch = self._encode(pixel_values, grid_thw, hidden_states)
        if not self.post_process:
            return hidden
        assert self.projector is not None
        embeddings = self.projector(self._original_order(hidden, batch))
        if not self.deepstack:
            return embeddings
        features = [
            merger(self._original_order(block_output, batch))
            for merger, block_output in zip(self.deepstack, self._captured, strict=True)
        ]
        return torch.cat([embeddings, *features], dim=-1)

    def _capture(self, module: torch.nn.Module, args: object, output: Tensor | tuple[Tensor, ...]) -> None:
        """A DeepStack block's output (window order), for its merger after the stage's blocks ran."""
        self._captured.append(output[0] if isinstance(output, tuple) else output)

    def _encode(
        self, pixel_values: Tensor | None, grid_thw: Tensor, hidden_states: Tensor | None
    ) -> tuple[Tensor, VisionBatch]:
        """This stage's ViT blocks (after the patch embedding on the first): hidden states [N_patches, 1,
        vit_hidden] in window order, and the batch layout they follow."""
        device = pixel_values.device if pixel_values is not None else self._stage_input(hidden_states).device
        batch = VisionBatch.build(grid_thw, self.encoder_config, device)
        self._captured = []
        with torch.no_grad() if self.freeze_encoder else nullcontext():
            if self.pre_process:
                if pixel_values is None:
                    raise ValueError("the stage holding the patch embedding needs pixel_values")
                assert self.encoder is not None and self.encoder.patch_embed is not None
                embedded = self.encoder.patch_embed(pixel_values)
                if self.encoder_config.num_position_embeddings:
                    embedded = embedded + interpolated_positions(
                        self.encoder.pos_embed.weight, grid_thw.cpu(), self.encoder_config.spatial_merge_size
                    )
                hidden = _to_window_order(embedded, batch.unit_order, self._unit).unsqueeze(1)
            else:
                hidden = self._stage_input(hidden_states)
            if self.encoder is not None:
                hidden = self.encoder(hidden, batch)
        return hidden, batch

    @property
    def _unit(self) -> int:
        return self.encoder_config.spatial_merge_size**2

    def _original_order(self, hidden: Tensor, batch: VisionBatch) -> Tensor:
        """Window-ordered hidden states [N, 1, H] as patches [N, H] in the original order (the merger's input)."""
        return _to_window_order(hidden.squeeze(1), batch.unit_inverse, self._unit)

    def _cached(self, pixel_values: Tensor, grid_thw: Tensor, image_keys: Tensor) -> Tensor:
        """The ViT output [N_patches, vit_hidden] of every image (original order), the images not in
        :attr:`cache` encoded together first and kept."""
        assert self.cache is not None
        keys = [tuple(key) for key in image_keys.tolist()]
        sizes = grid_thw.prod(-1).tolist()
        starts = [0, *itertools.accumulate(sizes)]
        missing = [i for i, key in enumerate(keys) if key not in self.cache]
        if missing:
            rows = torch.cat([torch.arange(starts[i], starts[i + 1], device=pixel_values.device) for i in missing])
            grids = grid_thw.index_select(0, torch.tensor(missing, device=grid_thw.device))
            hidden, batch = self._encode(pixel_values.index_select(0, rows), grids, None)
            parts = self._original_order(hidden, batch).split([sizes[i] for i in missing])
            for i, part in zip(missing, parts, strict=True):
                self.cache[keys[i]] = part
        return torch.cat([self.cache[key] for key in keys])

    def _stage_input(self, hidden_states: Tensor | None) -> Tensor:
        hidden = hidden_states if hidden_states is not None else self.input_tensor
        if hidden is None:
            raise ValueError("a stage without the patch embedding needs hidden_states (or set_input_tensor)")
        return hidden


def _check(
    encoder: VisionEncoderConfig,
    projector: VisionProjectorConfig,
    llm_hidden_size: int,
    num_layers: int,
    layer_offset: int,
) -> None:
    """Reject configs that would build a model HF checkpoints cannot fill (mis-sized merger, bad stage)."""
    if projector.hidden_size != llm_hidden_size:
        raise ValueError(f"vision_projector.hidden_size {projector.hidden_size} != LLM hidden {llm_hidden_size}")
    if projector.input_size != encoder.hidden_size:
        raise ValueError(f"vision_projector.input_size {projector.input_size} != ViT hidden {encoder.hidden_size}")
    if encoder.hidden_size % encoder.num_attention_heads or (encoder.hidden_size // encoder.num_attention_heads) % 4:
        raise ValueError("ViT head_dim must be an integer multiple of 4 (2D rotary over row and column)")
    if encoder.deepstack_visual_indexes and (layer_offset or num_layers != encoder.num_layers):
        raise ValueError("DeepStack (deepstack_visual_indexes) needs the whole ViT on one pipeline stage")
    if num_layers < 0 or layer_offset < 0 or layer_offset + num_layers > encoder.num_layers:
        raise ValueError(f"blocks {layer_offset}..{layer_offset + num_layers - 1} not in 0..{encoder.num_layers - 1}")
