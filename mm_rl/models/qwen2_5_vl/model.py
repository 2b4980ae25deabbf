"""Qwen2.5-VL on megatron-core: one pipeline stage of the ViT + merger and the mRoPE text decoder.

A stage holds what model.json's ``pipeline_num_layers`` give it (ViT first, then the LLM):

- the image encoder (``image_encoder.*``, the vision module's names) on the stage holding ViT blocks;
- the text decoder, a megatron ``GPTModel`` (``text_decoder.*``): word embeddings on the first stage holding
  LLM layers, this stage's LLM layers (indices restart at 0 on every stage), and on the last stage the final
  norm and the output layer (a copy of the word embeddings when they are tied and PP > 1).

These are MindSpeed-MM's converted-checkpoint names, so ``model.load_state_dict(torch.load(rank_file)["model"])``
loads hf2mg's output directly.

The stage with the word embeddings looks the tokens up, runs the ViT on the micro-batch's images and writes
the image embeddings over the image-token positions (in the order transformers uses: sample by sample,
left to right); the tensor handed between LLM stages is megatron's [S, B, H]. Positions are the 3D mRoPE ids
of :mod:`rope_index`, computed on every stage from the token ids (or passed in). The last stage turns its
vocab-parallel logits into the log-probs of given labels and the entropy (:mod:`logprobs`) without
gathering the vocabulary; given an ``output_mask`` (the response tokens), only those positions reach the output
layer (:class:`OutputRows`): a GRPO pass reads no prompt token's log-prob.

The samples of one prompt share its image. Given ``image_slots`` (which encoded image fills each image of the
micro-batch, in sample order), the ViT encodes each distinct image once (``pixel_values`` / ``encoded_grid_thw``)
and the first LLM stage copies its embeddings into every slot it fills (:func:`image_token_rows`); with the ViT
trained, autograd sums the slots' gradients into the one encoding.

Pipeline splits: the ViT fills stages 0..k, the LLM the stages from k (sharing stage k) or k + 1 on, no
stage empty (:func:`stage_layout`). Between ViT stages travel ViT hidden states [N_patches, 1, vit_hidden];
a ViT-only stage holding the merger sends the encoded images' embeddings [N_tokens, 1, llm_hidden]; a micro-batch
without images sends a one-row placeholder. When the word embeddings are not on stage 0, pass
:func:`embedding_ranks` to megatron's ``initialize_model_parallel`` (its default assumes stage 0).

Context parallelism (``context-parallel-algo: ulysses_cp_algo``): every CP rank runs the ViT and the
embeddings on the whole micro-batch, keeps a contiguous 1/cp of the tokens for the LLM, and attention
all-to-alls between "my tokens, all heads" and "all tokens, my heads" (:class:`UlyssesAttention`). The last
stage gathers log-probs / entropy / logits back to the whole sequence, so the loss code is the same with
and without CP; each rank's gradient covers its own tokens and megatron's loss x cp scaling with DP x CP
gradient averaging makes the sum exact.

Sequence parallelism (megatron's, on whenever TP > 1): between the LLM's tensor-parallel linears each TP rank
holds a contiguous 1/TP of its (CP rank's) tokens, so norms, residuals and the MoE router see only their share
(megatron's MoE layer trains under TP only this way). The first LLM stage splices the images in over the whole
sequence and then keeps its share of the embeddings and of the DeepStack additions; the column-parallel linears
all-gather the tokens (the output layer too, so the log-probs see the whole sequence), the row-parallel ones
reduce-scatter them, and the norms' gradients are summed over TP (:class:`TorchNorm`). The token row is padded to
a multiple of CP x TP.

Use, on one rank (after ``initialize_model_parallel(tp, pp, context_parallel_size=cp,
get_embedding_ranks=embedding_ranks(model_cfg))``)::

    model = build_model(model_cfg, flags, actor)         # this rank's stage, freeze switches applied
    model.load_state_dict(torch.load(rank_file, weights_only=True)["model"])

    def forward_step(data_iterator, model):               # for megatron's get_forward_backward_func()
        mb = next(data_iterator)                          # the whole micro-batch, on every stage
        out = model(mb["input_ids"], attention_mask=mb["attention_mask"], pixel_values=mb.get("pixel_values"),
                    image_grid_thw=mb.get("image_grid_thw"), labels=mb["labels"], temperature=t)
        return out, functools.partial(loss_func, mb)      # last stage: out = {"log_probs", "entropy"} [B, S]
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from mm_rl.config.schema import ActorConfig, ModelConfig, TrainingFlags
from mm_rl.models.qwen2_5_vl.config import megatron_normalization, padded_vocab_size, text_decoder_config
from mm_rl.models.qwen2_5_vl.llm_attention import PackedRows
from mm_rl.models.qwen2_5_vl.logprobs import log_probs_and_entropy
from mm_rl.models.qwen2_5_vl.rope_index import get_rope_index
from mm_rl.platform.device import current_device

Received = Literal["none", "vit", "image", "llm"]


@dataclass(frozen=True)
class StageLayout:
    """What one pipeline stage holds (global ViT block / LLM layer indices) and what it receives and sends.

    The ViT runs on stages ``0 .. last_vit`` (patch embedding on stage 0, merger on ``last_vit``), the LLM on
    ``first_llm .. pp_size - 1`` (word embeddings on ``first_llm``, final norm and output layer on the last
    stage), with ``first_llm`` equal to ``last_vit`` (a stage holds the end of the ViT and the start of the
    LLM) or ``last_vit + 1``.
    """

    pp_rank: int
    pp_size: int
    vit_layers: range
    llm_layers: range
    last_vit: int
    first_llm: int

    @property
    def has_vit(self) -> bool:
        return len(self.vit_layers) > 0

    @property
    def has_patch_embed(self) -> bool:
        return self.pp_rank == 0

    @property
    def has_merger(self) -> bool:
        return self.pp_rank == self.last_vit

    @property
    def has_llm(self) -> bool:
        return self.pp_rank >= self.first_llm

    @property
    def has_embedding(self) -> bool:
        return self.pp_rank == self.first_llm

    @property
    def has_output(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def received(self) -> Received:
        """What the previous stage sends: ViT hidden states [N_patches, 1, vit_hidden] (window order), image
        embeddings [N_tokens, 1, llm_hidden], or LLM hidden states [S, B, llm_hidden]."""
        if self.pp_rank == 0:
            return "none"
        if self.has_vit:
            return "vit"
        return "image" if self.has_embedding else "llm"


def _per_stage(layers: Sequence[int], total: int, pp_size: int, what: str) -> list[int]:
    """The per-stage layer counts for ``pp_size`` stages (one stage: everything), validated."""
    if pp_size == 1:
        return [total]
    if len(layers) != pp_size or min(layers) < 0 or sum(layers) != total:
        raise ValueError(f"{what}.pipeline_num_layers {list(layers)} must have {pp_size} entries >= 0 summing to "
                         f"{total}")
    return list(layers)


def _split(model: ModelConfig, pp_size: int) -> tuple[list[int], list[int], int, int]:
    """Per-stage ViT and LLM counts, the last ViT stage and the first LLM stage; ValueError for a split the
    pipeline cannot run (a stage holding nothing, a gap, or LLM stages before the ViT ends)."""
    vision = model.image_encoder.vision_encoder
    vit = _per_stage(vision.pipeline_num_layers, vision.num_layers, pp_size, "image_encoder.vision_encoder")
    llm = _per_stage(model.text_decoder.pipeline_num_layers, model.text_decoder.num_layers, pp_size,
                     "text_decoder")
    last_vit = max(i for i, n in enumerate(vit) if n)
    first_llm = min(i for i, n in enumerate(llm) if n)
    contiguous = all(vit[: last_vit + 1]) and all(llm[first_llm:])
    if not contiguous or first_llm not in (last_vit, last_vit + 1):
        raise ValueError(
            f"pipeline split vit {vit} / llm {llm}: the ViT must fill stages 0..k and the LLM the stages from k "
            f"or k + 1 on, with no stage left empty (e.g. vit {[sum(vit)] + [0] * (pp_size - 1)} / llm "
            f"[{max(llm[0], 1)}, ...])"
        )
    return vit, llm, last_vit, first_llm


def stage_layout(model: ModelConfig, pp_rank: int, pp_size: int) -> StageLayout:
    """The parts of stage ``pp_rank`` of ``pp_size`` from model.json's ``pipeline_num_layers``."""
    vit, llm, last_vit, first_llm = _split(model, pp_size)
    return StageLayout(
        pp_rank=pp_rank,
        pp_size=pp_size,
        vit_layers=range(sum(vit[:pp_rank]), sum(vit[: pp_rank + 1])),
        llm_layers=range(sum(llm[:pp_rank]), sum(llm[: pp_rank + 1])),
        last_vit=last_vit,
        first_llm=first_llm,
    )


def embedding_ranks(model: ModelConfig) -> Callable[..., list[int]]:
    """``get_embedding_ranks`` for megatron's ``initialize_model_parallel``: the stages holding the word
    embeddings and the output layer (megatron's default, first and last, is wrong when the ViT fills the
    first stages; tied embeddings are synchronised over this group)."""

    def ranks(pp_ranks: list[int], *_: Any) -> list[int]:
        first_llm = _split(model, len(pp_ranks))[3]
        return sorted({pp_ranks[first_llm], pp_ranks[-1]})

    return ranks


def padding_attention_mask(attention_mask: Tensor | None) -> Tensor | None:
    """The LLM's attention mask [B, 1, S, S] for causal attention that skips padding, in SDPA's convention (True =
    may attend), built once per forward for every layer (:class:`LLMCoreAttention`).

    None (plain causal attention, no S x S tensor) when every row is right-padded: real tokens never look
    ahead, so trailing padding cannot reach them. Left padding or holes need the explicit mask. A query that may
    see nothing (a left-padding position) sees itself: SDPA would give NaN there, which the backward would spread;
    its output is padding and never read.
    """
    if attention_mask is None:
        return None
    valid = attention_mask.bool()
    if not (valid[:, 1:] & ~valid[:, :-1]).any():
        return None
    seq = valid.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=valid.device).tril()
    itself = torch.eye(seq, dtype=torch.bool, device=valid.device)
    return (causal[None, None] & valid[:, None, None, :]) | itself


def image_token_rows(encoded_grid_thw: Tensor, image_slots: Tensor, merge: int) -> Tensor:
    """Rows of the encoded images' embeddings [N_tokens, H] that fill the image slots, slot after slot.

    The encoder emits image k's ``t * h * w / merge^2`` tokens as one block after image k - 1's; slot j takes the
    whole block of image ``image_slots[j]``."""
    tokens = encoded_grid_thw.prod(-1) // merge**2
    counts = tokens[image_slots]
    starts = (tokens.cumsum(0) - tokens)[image_slots]
    within = torch.arange(int(counts.sum()), device=counts.device) - (counts.cumsum(0) - counts).repeat_interleave(
        counts)
    return starts.repeat_interleave(counts) + within


def splice_image_embeddings(
    embeddings: Tensor, input_ids: Tensor, image_embeds: Tensor, image_token_id: int
) -> Tensor:
    """Word embeddings [S, B, H] with the image-token positions replaced by ``image_embeds`` [N, H].

    Image tokens are filled sample by sample, left to right (transformers' masked_scatter over [B, S]),
    which is the order the ViT emits images in. Out of place, so gradients reach both inputs.
    """
    batch_index, seq_index = (input_ids == image_token_id).nonzero(as_tuple=True)
    if batch_index.numel() != image_embeds.shape[0]:
        raise ValueError(f"{batch_index.numel()} image tokens but {image_embeds.shape[0]} image embeddings")
    return embeddings.index_put((seq_index, batch_index), image_embeds.to(embeddings.dtype))


# ------------------------------------------------------------------------- Ulysses context parallelism
class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 (chunk i goes to rank i); its own adjoint, so backward is the same op."""

    @staticmethod
    def forward(ctx: Any, chunks: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        ctx.group = group
        chunks = chunks.contiguous()  # (empty_like of a permuted view would keep its strides)
        out = torch.empty_like(chunks)
        torch.distributed.all_to_all_single(out, chunks, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        torch.distributed.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def sequence_to_heads(x: Tensor, group: Any, size: int) -> Tensor:
    """[S/cp, B, h, d] (this rank's tokens, all its heads) -> [S, B, h/cp, d] (all tokens, its head block)."""
    seq, batch, heads, dim = x.shape
    chunks = x.reshape(seq, batch, size, heads // size, dim).permute(2, 0, 1, 3, 4)
    return _AllToAll.apply(chunks, group).reshape(size * seq, batch, heads // size, dim)  # type: ignore[no-any-return]


def heads_to_sequence(x: Tensor, group: Any, size: int) -> Tensor:
    """[S, B, h/cp * d] attention output of this rank's head block -> [S/cp, B, h * d] for its own tokens."""
    seq, batch, width = x.shape
    out = _AllToAll.apply(x.reshape(size, seq // size, batch, width), group)
    return out.permute(1, 2, 0, 3).reshape(seq // size, batch, size * width)  # type: ignore[no-any-return]


class UlyssesAttention(torch.nn.Module):
    """Core attention with DeepSpeed-Ulysses context parallelism (``context-parallel-algo: ulysses_cp_algo``).

    Each CP rank holds a contiguous 1/cp of the sequence. q, k, v go through one all-to-all each, from
    "my tokens, all heads" to "all tokens, 1/cp of the heads"; megatron's local attention then runs on the
    full sequence (causal or padding masks, or a packed row's segments, work unchanged), and one all-to-all brings
    the output back.
    KV groups are repeated to one per query head first when the CP size does not divide them.
    Built by megatron's layer spec with the arguments of any core attention.
    """

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        import dataclasses

        from megatron.core import parallel_state

        from mm_rl.models.qwen2_5_vl.llm_attention import LLMCoreAttention

        super().__init__()
        self.group = parallel_state.get_context_parallel_group()
        self.size = parallel_state.get_context_parallel_world_size()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        heads, groups = config.num_attention_heads // tp, config.num_query_groups // tp
        if heads % self.size:
            raise ValueError(f"Ulysses CP {self.size} must divide the attention heads per TP rank ({heads})")
        self.repeat_kv = 1 if groups % self.size == 0 else heads // groups
        inner = dataclasses.replace(config, num_attention_heads=config.num_attention_heads // self.size,
                                    num_query_groups=config.num_query_groups * self.repeat_kv // self.size)
        self.attention = LLMCoreAttention(inner, layer_number, attn_mask_type, attention_type,
                                          attention_dropout, softmax_scale, None, pg_collection)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: Any = None, attention_bias: Tensor | None = None,
                packed_seq_params: Any = None) -> Tensor:
        if self.repeat_kv > 1:
            key, value = (t.repeat_interleave(self.repeat_kv, dim=2) for t in (key, value))
        q, k, v = (sequence_to_heads(t, self.group, self.size) for t in (query, key, value))
        out = self.attention(q, k, v, attention_mask, attn_mask_type=attn_mask_type,
                             attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        return heads_to_sequence(out, self.group, self.size)


class _GatherSequence(torch.autograd.Function):
    """All-gather over CP along dim 1 ([B, S/cp, ...] -> [B, S, ...]); backward keeps this rank's slice.

    Every CP rank computes the same loss from the gathered tensor, so the gradient of its own slice is
    exactly its share (no sum); megatron's loss x cp and DP x CP gradient averaging complete it."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, rank: int, size: int) -> Tensor:  # type: ignore[override]
        ctx.rank, ctx.size = rank, size
        parts = [torch.empty_like(x) for _ in range(size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        return grad.chunk(ctx.size, dim=1)[ctx.rank].contiguous(), None, None, None


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in the CP group; its tokens are the contiguous chunk ``rank`` of ``size``."""

    group: Any
    rank: int
    size: int

    def local(self, x: Tensor, dim: int) -> Tensor:
        """This rank's chunk of ``x`` along ``dim``."""
        return x.chunk(self.size, dim=dim)[self.rank]

    def gather(self, x: Tensor) -> Tensor:
        """[B, S/cp, ...] -> [B, S, ...] (see _GatherSequence)."""
        return _GatherSequence.apply(x, self.group, self.rank, self.size)  # type: ignore[no-any-return]


def _sequence_parallel_share(x: Tensor) -> Tensor:
    """This TP rank's contiguous 1/TP of ``x`` [S, B, H] along S (megatron's scatter: the backward all-gathers);
    a copy, so the whole tensor is not kept alive by the view (megatron's embedding clones it for the same
    reason)."""
    from megatron.core import tensor_parallel

    return tensor_parallel.scatter_to_sequence_parallel_region(x).clone()  # type: ignore[no-any-return]


@dataclass(frozen=True)
class OutputRows:
    """The token positions of a micro-batch whose log-probs are wanted (the response tokens), and the rows of the
    hidden states that reach the output layer for them: only those, since a prompt's logits are never read and the
    output layer and the log-prob function are the widest steps of the LLM (vocab columns per token).

    Under sequence parallelism TP rank r holds the r-th contiguous share of the tokens and the output layer
    all-gathers the shares, so every rank keeps the same number of rows (``width``: its wanted rows, then unwanted
    ones of its share as fillers; every rank sees the whole mask, so all agree without talking) and the gathered
    rows come in rank order. ``kept`` are the gathered rows that are not fillers, ``positions`` their places in the
    [S, B] token grid flattened."""

    local: Tensor  # [width] rows of this rank's [S / shares * B] hidden states
    labels_at: Tensor  # [shares * width]: each gathered row's place in the flattened grid, fillers included
    kept: Tensor  # [wanted]
    positions: Tensor  # [wanted]
    shape: tuple[int, int]  # (B, S)

    @classmethod
    def of(cls, mask: Tensor, shares: int, rank: int) -> OutputRows:
        """``mask`` [B, S] (nonzero: wanted) of this rank's tokens (CP-local), cut into ``shares`` along S."""
        grid = (mask != 0).t().reshape(shares, -1)  # share r: its [S / shares, B] rows, as the hidden states hold them
        counts = grid.sum(1)
        width = max(int(counts.max()), 1)
        # the wanted rows of each share first, in order (a stable sort of "not wanted"), then fillers
        order = torch.sort((~grid).to(torch.uint8), dim=1, stable=True).indices[:, :width]
        valid = (torch.arange(width, device=mask.device) < counts[:, None]).reshape(-1)
        places = (order + torch.arange(shares, device=mask.device)[:, None] * grid.shape[1]).reshape(-1)
        kept = valid.nonzero().squeeze(1)
        return cls(order[rank], places, kept, places.index_select(0, kept), (mask.shape[0], mask.shape[1]))

    def pick(self, hidden: Tensor) -> Tensor:
        """[S / shares, B, H] -> [width, 1, H]."""
        return hidden.reshape(-1, hidden.shape[-1]).index_select(0, self.local).unsqueeze(1)

    def labels(self, labels: Tensor) -> Tensor:
        """[B, S] -> [1, shares * width], in the gathered rows' order."""
        return labels.t().reshape(-1).index_select(0, self.labels_at).unsqueeze(0)

    def place(self, values: Tensor) -> Tensor:
        """[1, shares * width] -> [B, S], zeros where nothing was wanted (out of place: gradients reach ``values``)."""
        rows, cols = self.shape
        out = values.new_zeros(cols * rows)
        out = out.index_put((self.positions,), values[0].index_select(0, self.kept))
        return out.reshape(cols, rows).t()


def _pad_sequence(x: Tensor | None, length: int, value: int, dim: int = -1) -> Tensor | None:
    """``x`` right-padded with ``value`` to ``length`` along ``dim`` (CP needs a multiple of its size)."""
    if x is None or x.shape[dim] == length:
        return x
    pad = list(x.shape)
    pad[dim] = length - x.shape[dim]
    return torch.cat([x, x.new_full(pad, value)], dim=dim)


def keep_in_graph(output: Tensor, received: Tensor | None) -> Tensor:
    """``output``, made a valid pipeline stage output for backward.

    megatron's schedule runs backward from every stage's output and sends the gradient of the received
    tensor back; a frozen ViT (run without a graph), a micro-batch without images or an unused input would
    leave either without a graph and stall or break the pipeline. Adding ``0 * received.sum()`` gives the
    received tensor a (zero) gradient; a still graph-less output becomes a leaf that accepts one.
    """
    if not torch.is_grad_enabled():
        return output
    if received is not None and received.requires_grad:
        output = output + 0.0 * received.sum()
    if not output.requires_grad:
        output = output.detach().requires_grad_()
    return output


class RoutingCounts:
    """MoE: per LLM layer, the tokens each expert received since :meth:`reset`, then the tokens routed (this
    rank's tokens, its stage's layers). Kept on the router's device (a forward hook per layer and micro-batch
    must not wait for a host copy); the reader all-reduces them and brings them to the host once."""

    def __init__(self, layers: int, experts: int) -> None:
        self.counts = torch.zeros(layers, experts + 1 if experts else 0, dtype=torch.int64)

    def add(self, layer: int, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Forward hook of megatron's ``TopKRouter`` (its output: probs, routing_map [T, E])."""
        routing_map = output[1].detach()
        if self.counts.device != routing_map.device:
            self.counts = self.counts.to(routing_map.device)
        self.counts[layer, :-1] += routing_map.sum(0, dtype=torch.int64)
        self.counts[layer, -1] += routing_map.shape[0]

    def reset(self) -> None:
        self.counts.zero_()


class Qwen2_5_VLModel(torch.nn.Module):
    """One pipeline stage of Qwen2.5-VL (see the module docstring); build it with :func:`build_model`.

    It exposes what megatron's schedules and ``finalize_model_grads`` look up on a model chunk
    (``config``, ``set_input_tensor``, ``pre_process``, ``share_embeddings_and_output_weights``,
    ``shared_embedding_or_output_weight``).
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        config: Any,
        layout: StageLayout,
        *,
        padded_vocab: int,
        image_encoder: torch.nn.Module | None,
        remove_padding: bool = True,
    ) -> None:
        super().__init__()
        self.remove_padding = remove_padding
        self.config = config
        self.model_cfg = model_cfg
        self.layout = layout
        self.vocab_size = model_cfg.text_decoder.vocab_size
        self.received: Tensor | None = None
        self.deepstack: list[Tensor] = []  # this micro-batch's DeepStack additions, [S, B, H] per early LLM layer
        self.routing = RoutingCounts(model_cfg.text_decoder.num_layers, model_cfg.text_decoder.num_moe_experts or 0)
        self.cp = _context_parallel()
        self.output_rows: OutputRows | None = None  # this micro-batch's, set per forward
        if image_encoder is not None:
            self.image_encoder = image_encoder
        if layout.has_llm:
            self.text_decoder = self._text_decoder(padded_vocab)
        from megatron.core.enums import ModelType

        self.model_type = ModelType.encoder_or_decoder

    def _text_decoder(self, padded_vocab: int) -> torch.nn.Module:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        text = self.model_cfg.text_decoder
        spec = llm_layer_spec(text.normalization, ulysses=self.cp is not None, qk_layernorm=text.qk_layernorm,
                              num_experts=text.num_moe_experts)
        decoder = GPTModel(
            config=self.config,
            transformer_layer_spec=TransformerBlockSubmodules(layer_specs=[spec] * len(self.layout.llm_layers),
                                                              layer_norm=spec.submodules.input_layernorm),
            vocab_size=padded_vocab,
            max_sequence_length=text.max_position_embeddings,
            pre_process=self.layout.has_embedding,
            post_process=self.layout.has_output,
            parallel_output=True,
            share_embeddings_and_output_weights=not text.untie_embeddings_and_output_weights,
            position_embedding_type="mrope",
            rotary_base=text.rope_theta,  # type: ignore[arg-type]  # megatron annotates int; rope_theta is float
            scatter_embedding_sequence_parallel=False,  # images are spliced in first (see decoder_input)
        )
        if text.mrope_interleaved:
            from mm_rl.models.qwen2_5_vl.rotary import InterleavedMultimodalRotaryEmbedding

            decoder.rotary_pos_emb = InterleavedMultimodalRotaryEmbedding(
                kv_channels=self.config.kv_channels, rotary_percent=1.0, rotary_base=text.rope_theta)
        if self.cp is not None:
            # positions arrive already cut to this rank's contiguous chunk: megatron must not re-slice the
            # rotary table for its own (load-balanced) CP layout
            decoder.rotary_pos_emb.cp_group = None
        if self.layout.has_output:
            decoder.output_layer.register_forward_pre_hook(self._pick_output_rows, with_kwargs=True)
        for local, layer in enumerate(decoder.decoder.layers):
            index = self.layout.llm_layers.start + local
            if text.num_moe_experts:
                layer.mlp.router.register_forward_hook(functools.partial(self.routing.add, index))
            if index < self.deepstack_layers:
                if not self.layout.has_embedding:
                    raise ValueError(f"LLM layer {index} takes DeepStack features: it must be on the stage holding "
                                     "the word embeddings (the first LLM stage)")
                layer.register_forward_hook(functools.partial(self._add_deepstack, index))
        return decoder

    @property
    def sequence_split(self) -> int:
        """The LLM's sequence is cut into this many contiguous shares: CP ranks x (under sequence parallelism)
        TP ranks; a micro-batch's token row is padded to a multiple of it."""
        sp = self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1
        return (self.cp.size if self.cp is not None else 1) * sp

    def _sequence_shares(self) -> tuple[int, int]:
        """(shares, this rank's share) of the LLM's (CP-local) tokens at the output layer: TP under sequence
        parallelism, else one."""
        from megatron.core import parallel_state

        if not self.config.sequence_parallel:
            return 1, 0
        return self.config.tensor_model_parallel_size, parallel_state.get_tensor_model_parallel_rank()

    def _pick_output_rows(self, module: torch.nn.Module, args: Any, kwargs: Any) -> Any:
        """The output layer's input cut to this micro-batch's wanted rows (see :class:`OutputRows`)."""
        if self.output_rows is None:
            return None
        return (self.output_rows.pick(args[0]), *args[1:]), kwargs

    @property
    def deepstack_layers(self) -> int:
        """How many first LLM layers get DeepStack features added to their output (0: none)."""
        return len(self.model_cfg.image_encoder.vision_encoder.deepstack_visual_indexes)

    def _add_deepstack(self, layer: int, module: torch.nn.Module, args: Any, output: Any) -> Any:
        """LLM layer ``layer``'s output plus its DeepStack features at the image positions (set per forward)."""
        if not self.deepstack:
            return output
        hidden, context = output if isinstance(output, tuple) else (output, None)
        hidden = hidden + self.deepstack[layer]
        return (hidden, context) if isinstance(output, tuple) else hidden

    # ------------------------------------------------------------------ what megatron looks up on a chunk
    @property
    def pre_process(self) -> bool:
        return self.layout.has_embedding

    @property
    def post_process(self) -> bool:
        return self.layout.has_output

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return self.layout.has_llm and bool(self.text_decoder.share_embeddings_and_output_weights)

    def shared_embedding_or_output_weight(self) -> Tensor | None:
        return self.text_decoder.shared_embedding_or_output_weight() if self.layout.has_llm else None

    def set_input_tensor(self, input_tensor: Tensor | list[Tensor] | None) -> None:
        """The previous stage's output (the schedule calls this before every forward); see StageLayout.received."""
        if isinstance(input_tensor, list):
            input_tensor = input_tensor[0] if input_tensor else None
        self.received = input_tensor
        if self.layout.received == "llm":
            self.text_decoder.set_input_tensor(input_tensor)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """torch's load_state_dict, accepting checkpoints without megatron's ``_extra_state`` entries.

        megatron's linear layers report an ``_extra_state`` (None for the local spec); MindSpeed-MM files
        and hf2mg's output hold tensors only, so the missing entries are filled with None first."""
        state = dict(state_dict)
        for key, value in self.state_dict(keep_vars=True).items():
            if key.endswith("._extra_state") and key not in state:
                state[key] = value
        return super().load_state_dict(state, strict=strict, assign=assign)

    # ------------------------------------------------------------------ pieces of forward
    def position_ids(self, input_ids: Tensor, image_grid_thw: Tensor | None, attention_mask: Tensor | None) -> Tensor:
        """The 3D mRoPE ids [3, B, S] of a micro-batch (see :func:`rope_index.get_rope_index`)."""
        positions, _ = get_rope_index(
            input_ids,
            image_grid_thw,
            attention_mask,
            image_token_id=self.model_cfg.img_context_token_id,
            spatial_merge_size=self.model_cfg.image_encoder.vision_encoder.spatial_merge_size,
        )
        return positions

    def image_embeddings(self, pixel_values: Tensor | None, image_grid_thw: Tensor,
                         image_keys: Tensor | None = None) -> Tensor:
        """This stage's part of the image encoder: image embeddings [N_tokens, H_llm] when it holds the
        merger, else ViT hidden states for the next stage. Without an autograd graph when nothing in it trains.
        ``image_keys``: the images' keys in the step (the frozen ViT's per-step cache)."""
        encoder = self.image_encoder
        trains = any(p.requires_grad for p in encoder.parameters())
        hidden = None if self.layout.has_patch_embed else self.received
        with torch.set_grad_enabled(trains and torch.is_grad_enabled()):
            return encoder(pixel_values if self.layout.has_patch_embed else None, image_grid_thw, hidden,
                           image_keys=image_keys)

    def _vision_stage_output(self, images: Tensor | None) -> Tensor:
        """What a stage holding only ViT blocks sends on: ViT hidden states or image embeddings [N, 1, H];
        a one-row zero placeholder for a micro-batch without images (the schedule sends something every time)."""
        if images is None:
            width = self.model_cfg.text_decoder.hidden_size * (1 + self.deepstack_layers) if self.layout.has_merger \
                else self.model_cfg.image_encoder.vision_encoder.hidden_size
            images = torch.zeros(1, 1, width, dtype=self.config.params_dtype, device=current_device())
        elif self.layout.has_merger:
            images = images.unsqueeze(1)
        return keep_in_graph(images, self.received)

    def decoder_input(self, input_ids: Tensor, images: Tensor | None, encoded_grid_thw: Tensor | None = None,
                      image_slots: Tensor | None = None) -> Tensor:
        """Word embeddings [S, B, H] with the image embeddings [N_tokens, H] spliced in (first LLM stage); with
        ``image_slots``, ``images`` are those of the encoded images (``encoded_grid_thw``), copied into every slot
        they fill first."""
        embeddings = self.text_decoder.embedding(input_ids=input_ids, position_ids=None)
        self.deepstack = []
        if images is not None:
            if image_slots is not None:
                assert encoded_grid_thw is not None  # _images refuses pixel values without their grids
                merge = self.model_cfg.image_encoder.vision_encoder.spatial_merge_size
                images = images.index_select(0, image_token_rows(encoded_grid_thw, image_slots, merge))
            image_token = self.model_cfg.img_context_token_id
            images, *deepstack = images.split(embeddings.size(-1), dim=-1)
            self.deepstack = [splice_image_embeddings(torch.zeros_like(embeddings), input_ids, features, image_token)
                              for features in deepstack]
            embeddings = splice_image_embeddings(embeddings, input_ids, images, image_token)
        return keep_in_graph(embeddings, self.received) if self.layout.received != "none" else embeddings

    def _images(self, pixel_values: Tensor | None, image_grid_thw: Tensor | None,
                image_keys: Tensor | None = None) -> Tensor | None:
        """This stage's image result (see image_embeddings) or the received image embeddings; None without
        images in the micro-batch or nothing image-related on this stage."""
        if pixel_values is None or pixel_values.numel() == 0:
            return None
        if image_grid_thw is None:
            raise ValueError("pixel_values need their grids (image_grid_thw; with image_slots, encoded_grid_thw)")
        if self.layout.has_vit:
            return self.image_embeddings(pixel_values, image_grid_thw, image_keys)
        if self.layout.received == "image" and self.received is not None:
            return self.received.squeeze(1)
        return None

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        pixel_values: Tensor | None = None,
        image_grid_thw: Tensor | None = None,
        labels: Tensor | None = None,
        *,
        encoded_grid_thw: Tensor | None = None,
        image_slots: Tensor | None = None,
        image_keys: Tensor | None = None,
        output_mask: Tensor | None = None,
        return_logits: bool = False,
        temperature: float = 1.0,
    ) -> Tensor | dict[str, Tensor]:
        """Run this stage on a micro-batch.

        Every stage gets the whole micro-batch: ``input_ids`` / ``attention_mask`` [B, S] (mask: 1 real, 0
        padding; None: no padding; positions and the padding mask come from them), ``pixel_values``
        [N_patches, C*T*P*P] and ``image_grid_thw`` [N_images, 3] as the Qwen2.5-VL processor gives them.
        Images shared by several samples may come once: then ``pixel_values`` are those of the distinct images,
        ``encoded_grid_thw`` [N_encoded, 3] their grids and ``image_slots`` [N_images] the encoded image of each
        image of ``image_grid_thw`` (which stays per sample: the positions need it); ``image_keys`` [N_encoded, 2]
        name the encoded images in the step (the frozen ViT's per-step cache, see ``Qwen2_5VisionModel``).
        ``position_ids`` [3, B, S] may be passed precomputed. ``labels`` [B, S]: labels[b, s] is the token
        that position s predicts; ``output_mask`` [B, S] (nonzero: wanted, e.g. the response mask) limits the
        log-probs and the entropy to those positions (0 elsewhere): the other tokens skip the output layer.

        Returns what the next stage receives (see StageLayout.received) on all but the last stage. The last
        stage returns a dict: ``log_probs`` and ``entropy`` [B, S] (fp32) when ``labels`` are given, and
        ``logits`` [B, S, V / TP] (this rank's vocab slice) when there are no labels or ``return_logits`` is
        set. ``temperature`` divides the logits before the log-probs and the entropy, as the sampler did.
        """
        encoded = image_grid_thw if image_slots is None else encoded_grid_thw
        images = (self._images(pixel_values, encoded, image_keys) if self.layout.has_vit or self.layout.has_embedding
                  else None)
        if not self.layout.has_llm:
            return self._vision_stage_output(images)
        packed = PackedRows.of(input_ids, attention_mask) if self.remove_padding else None
        if packed is not None:  # one row of the real tokens, each with the position it had in its own row
            if position_ids is None:
                position_ids = self.position_ids(input_ids, image_grid_thw, attention_mask)
            input_ids, labels, position_ids = packed.pack(input_ids), packed.pack(labels), packed.pack(position_ids)
            output_mask, attention_mask = packed.pack(output_mask), None
        seq = input_ids.shape[1]
        length = -(-seq // self.sequence_split) * self.sequence_split
        if length != seq:  # right padding to a multiple of CP x SP (invisible to real tokens)
            if attention_mask is None and packed is None:
                attention_mask = torch.ones_like(input_ids)
            input_ids, attention_mask, labels, output_mask = (
                _pad_sequence(t, length, 0) for t in (input_ids, attention_mask, labels, output_mask))
            position_ids = _pad_sequence(position_ids, length, 0)
        if position_ids is None:
            position_ids = self.position_ids(input_ids, image_grid_thw, attention_mask)
        segments = packed.segments(input_ids.shape[1]) if packed is not None else None
        decoder_input = self.decoder_input(input_ids, images, encoded, image_slots) if self.layout.has_embedding \
            else None
        if self.cp is not None:  # this rank's tokens; the attention mask stays whole (Ulysses sees all tokens)
            position_ids = self.cp.local(position_ids, dim=2)
            decoder_input = self.cp.local(decoder_input, dim=0) if decoder_input is not None else None
            self.deepstack = [self.cp.local(features, dim=0) for features in self.deepstack]
            labels = self.cp.local(labels, dim=1) if labels is not None else None
            output_mask = self.cp.local(output_mask, dim=1) if output_mask is not None else None
        if self.config.sequence_parallel:  # this TP rank's share of the tokens; the layers' linears gather them
            decoder_input = _sequence_parallel_share(decoder_input) if decoder_input is not None else None
            self.deepstack = [_sequence_parallel_share(features) for features in self.deepstack]
        wanted = self.layout.has_output and labels is not None and output_mask is not None and not return_logits
        self.output_rows = OutputRows.of(output_mask, *self._sequence_shares()) if wanted else None
        try:
            output = self.text_decoder(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=padding_attention_mask(attention_mask),
                decoder_input=decoder_input,
                packed_seq_params=segments,
            )
            if not self.layout.has_output:
                return output
            result = self._last_stage_outputs(output, labels, seq, return_logits, temperature)
        finally:
            self.output_rows = None
        return {key: packed.unpack(value) for key, value in result.items()} if packed is not None else result

    def _last_stage_outputs(
        self, logits: Tensor, labels: Tensor | None, seq: int, return_logits: bool, temperature: float
    ) -> dict[str, Tensor]:
        """log_probs / entropy (labels given) and logits (asked for, or no labels) of the ``seq`` tokens, whole
        sequence under CP."""
        result: dict[str, Tensor] = {}
        rows = self.output_rows
        if labels is not None:
            values = log_probs_and_entropy(logits, labels if rows is None else rows.labels(labels),
                                           vocab_size=self.vocab_size, temperature=temperature)
            result["log_probs"], result["entropy"] = values if rows is None else map(rows.place, values)
        if labels is None or return_logits:
            result["logits"] = logits
        if self.cp is not None:
            result = {key: self.cp.gather(value) for key, value in result.items()}
        return {key: value[:, :seq] for key, value in result.items()}  # without the CP / SP padding


def _context_parallel() -> ContextParallel | None:
    """This process's CP group from megatron's parallel state (None without context parallelism)."""
    from megatron.core import parallel_state

    size = parallel_state.get_context_parallel_world_size()
    if size == 1:
        return None
    return ContextParallel(parallel_state.get_context_parallel_group(), parallel_state.get_context_parallel_rank(),
                           size)


def _build_image_encoder(
    model_cfg: ModelConfig, config: Any, layout: StageLayout, actor: ActorConfig | None
) -> torch.nn.Module:
    """The vision module (ViT blocks of this stage + merger) with the actor's freeze switches.

    The ViT trains only with ``unfreeze_vision_encoder`` (model.json's ``freeze`` marker is not the switch),
    the merger unless ``freeze_vision_projector``; a frozen part runs without an autograd graph.
    """
    from mm_rl.models.qwen2_5_vl.vision import Qwen2_5VisionModel

    image = model_cfg.image_encoder
    return Qwen2_5VisionModel(
        image.vision_encoder,
        image.vision_projector,
        model_cfg.text_decoder.hidden_size,
        config,
        num_layers=len(layout.vit_layers),
        layer_offset=layout.vit_layers.start,
        pre_process=layout.has_patch_embed,
        post_process=layout.has_merger,
        freeze_encoder=not (actor and actor.unfreeze_vision_encoder),
        freeze_projector=bool(actor and actor.freeze_vision_projector),
    )


class TorchNorm:
    """torch's LayerNorm / RMSNorm, as megatron's ``WrappedTorchNorm`` builds them, also under sequence parallelism.

    ``WrappedTorchNorm`` refuses sequence parallelism only because it does not mark its parameters: with each TP
    rank normalising its own share of the tokens, a norm's gradient is that share's, and megatron's
    ``finalize_model_grads`` sums over TP exactly the parameters marked ``sequence_parallel``
    (``distributed/finalize_model_grads.py``, ``_allreduce_non_tensor_model_parallel_grads``; apex's
    ``FusedLayerNorm`` marks its own the same way)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:  # type: ignore[misc]
        norms = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in norms:
            raise ValueError(f"normalization {config.normalization!r}: the LLM takes one of {sorted(norms)}")
        norm = norms[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        return norm


def llm_layer_spec(normalization: str, ulysses: bool, qk_layernorm: bool = False,
                   num_experts: int | None = None) -> Any:
    """The LLM layer: megatron's local spec with :class:`LLMCoreAttention` (fused attention without S x S scores,
    packed rows per sequence), wrapped for Ulysses CP, and torch's norms as :class:`TorchNorm` (sequence
    parallelism); ``qk_layernorm``: megatron's per-head query / key norm (applied before the rotary, as Qwen3's
    q_norm / k_norm); ``num_experts``: megatron's MoE layer (router and local experts,
    ``mlp.experts.local_experts.E``, MindSpeed-MM's names) in place of the dense MLP."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from mm_rl.models.qwen2_5_vl.llm_attention import LLMCoreAttention

    spec = get_gpt_layer_local_spec(num_experts=num_experts, normalization=megatron_normalization(normalization),
                                    qk_layernorm=qk_layernorm)
    layer, attention = spec.submodules, spec.submodules.self_attention.submodules
    attention.core_attention = UlyssesAttention if ulysses else LLMCoreAttention
    for parent, slot in ((layer, "input_layernorm"), (layer, "pre_mlp_layernorm"), (attention, "q_layernorm"),
                         (attention, "k_layernorm")):
        if getattr(parent, slot) is WrappedTorchNorm:
            setattr(parent, slot, TorchNorm)
    return spec


def build_model(
    model_cfg: ModelConfig,
    flags: TrainingFlags | None = None,
    actor: ActorConfig | None = None,
    *,
    params_dtype: torch.dtype = torch.float32,
    remove_padding: bool = True,
    **config_overrides: Any,
) -> Qwen2_5_VLModel:
    """This rank's stage of the model, after megatron's ``initialize_model_parallel``.

    TP / PP sizes and ranks come from megatron's parallel state; ``flags`` give the vocab padding
    (``make-vocab-size-divisible-by``) and ``actor`` the freeze switches (default: ViT frozen, merger
    trained); ``remove_padding`` packs each micro-batch's rows (see :mod:`llm_attention`). ``config_overrides``
    reach the text decoder's ``TransformerConfig``.
    """
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    if cp > 1 and flags is not None and flags.context_parallel_algo not in (None, "ulysses_cp_algo"):
        raise NotImplementedError(f"context-parallel-algo {flags.context_parallel_algo!r}: only ulysses_cp_algo")
    layout = stage_layout(model_cfg, parallel_state.get_pipeline_model_parallel_rank(), pp)
    ep = parallel_state.get_expert_model_parallel_world_size()
    config = text_decoder_config(model_cfg, flags, tp=tp, pp=pp, ep=ep, params_dtype=params_dtype,
                                 **config_overrides)
    divisible_by = flags.make_vocab_size_divisible_by if flags is not None else 1
    padded = padded_vocab_size(model_cfg.text_decoder.vocab_size, divisible_by, tp)
    encoder = _build_image_encoder(model_cfg, config, layout, actor) if layout.has_vit else None
    return Qwen2_5_VLModel(model_cfg, config, layout, padded_vocab=padded, image_encoder=encoder,
                           remove_padding=remove_padding)
