"""The Qwen-VL model on megatron-core: one pipeline stage of the ViT + merger and the mRoPE text decoder, the
model of Qwen2-VL, Qwen2.5-VL and Qwen3-VL (dense and MoE) as model.json's switches configure it, with the LLM
layers a family chooses (``ModelFamily.decoder_layer``, :mod:`layers`).

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

Pipeline splits (:mod:`pipeline`): the ViT fills stages 0..k, the LLM the stages from k (sharing stage k) or k + 1 on,
no stage empty (:func:`stage_layout`). Between ViT stages travel ViT hidden states [N_patches, 1, vit_hidden]; a
ViT-only stage holding the merger sends the encoded images' embeddings [N_tokens, 1, llm_hidden]; a micro-batch without
images sends a one-row placeholder. When the word embeddings are not on stage 0, pass :func:`embedding_ranks` to
megatron's ``initialize_model_parallel`` (its default assumes stage 0).

Context parallelism (``context-parallel-algo: ulysses_cp_algo``, :mod:`context_parallel`): every CP rank runs the ViT
and the embeddings on the whole micro-batch, keeps a contiguous 1/cp of the tokens for the LLM, and attention
all-to-alls between "my tokens, all heads" and "all tokens, my heads" (:class:`UlyssesAttention`). The last stage
gathers log-probs / entropy / logits back to the whole sequence, so the loss code is the same with and without CP; each
rank's gradient covers its own tokens and megatron's loss x cp scaling with DP x CP gradient averaging makes the sum
exact.

Sequence parallelism (megatron's, on whenever TP > 1, :mod:`sequence_parallel`): between the LLM's tensor-parallel
linears each TP rank holds a contiguous 1/TP of its (CP rank's) tokens, so norms, residuals and the MoE router see only
their share (megatron's MoE layer trains under TP only this way). The first LLM stage splices the images in over the
whole sequence and then keeps its share of the embeddings and of the DeepStack additions; the column-parallel linears
all-gather the tokens (the output layer too, so the log-probs see the whole sequence), the row-parallel ones
reduce-scatter them, and the norms' gradients are summed over TP (:class:`~layers.TorchNorm`). The token row is padded
to a multiple of CP x TP.

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
from typing import Any

import torch
from torch import Tensor

from mm_rl.config.schema import ActorConfig, ModelConfig, TrainingFlags
from mm_rl.models.family import DecoderLayer
from mm_rl.models.qwen_vl.config import padded_vocab_size, text_decoder_config
from mm_rl.models.qwen_vl.context_parallel import context_parallel
from mm_rl.models.qwen_vl.layers import decoder_layer as qwen_decoder_layer
from mm_rl.models.qwen_vl.llm_attention import PackedRows
from mm_rl.models.qwen_vl.logprobs import log_probs_and_entropy
from mm_rl.models.qwen_vl.pipeline import StageLayout, embedding_ranks, keep_in_graph, stage_layout
from mm_rl.models.qwen_vl.rope_index import get_rope_index
from mm_rl.models.qwen_vl.routing import RoutingCounts
from mm_rl.models.qwen_vl.sequence_parallel import OutputRows, sequence_parallel_share
from mm_rl.platform.device import current_device

__all__ = ["QwenVLModel", "build_model", "embedding_ranks"]


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
        counts
    )
    return starts.repeat_interleave(counts) + within


def vision_positions(input_ids: Tensor, vision_token_ids: tuple[int, ...]) -> Tensor:
    """[B, S] bool: the image and video tokens (the positions the vision encoder's embeddings fill); compared id by
    id, so no id tensor is made on the device for it."""
    return functools.reduce(torch.logical_or, (input_ids == token for token in vision_token_ids))


def splice_image_embeddings(embeddings: Tensor, where: tuple[Tensor, Tensor], image_embeds: Tensor) -> Tensor:
    """Word embeddings [S, B, H] with the image- and video-token positions ``where`` (``(batch, seq)`` indices of
    :func:`vision_positions`, found once for the main and the DeepStack splices) replaced by ``image_embeds`` [N, H].

    They are filled sample by sample, left to right (transformers' masked_scatter over [B, S]), which is the order
    the ViT emits images and videos in (``image_grid_thw`` lists them as their tokens appear). Out of place, so
    gradients reach both inputs.
    """
    batch_index, seq_index = where
    if batch_index.numel() != image_embeds.shape[0]:
        raise ValueError(f"{batch_index.numel()} image tokens but {image_embeds.shape[0]} image embeddings")
    return embeddings.index_put((seq_index, batch_index), image_embeds.to(embeddings.dtype))


def _pad_sequence(x: Tensor | None, length: int, value: int, dim: int = -1) -> Tensor | None:
    """``x`` right-padded with ``value`` to ``length`` along ``dim`` (CP needs a multiple of its size)."""
    if x is None or x.shape[dim] == length:
        return x
    pad = list(x.shape)
    pad[dim] = length - x.shape[dim]
    return torch.cat([x, x.new_full(pad, value)], dim=dim)


class QwenVLModel(torch.nn.Module):
    """One pipeline stage of a Qwen-VL model (see the module docstring); build it with :func:`build_model`.

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
        decoder_layer: DecoderLayer = qwen_decoder_layer,
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
        self.cp = context_parallel()
        self.output_rows: OutputRows | None = None  # this micro-batch's, set per forward
        if image_encoder is not None:
            self.image_encoder = image_encoder
        if layout.has_llm:
            self.text_decoder = self._text_decoder(padded_vocab, decoder_layer)
        from megatron.core.enums import ModelType

        self.model_type = ModelType.encoder_or_decoder

    def _text_decoder(self, padded_vocab: int, decoder_layer: DecoderLayer) -> torch.nn.Module:
        """megatron's ``GPTModel`` holding this stage's LLM layers, each built from the family's layer spec (the
        final norm is the first layer's input norm kind: one norm throughout the decoder)."""
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        text = self.model_cfg.text_decoder
        specs = [decoder_layer(text, index, self.cp is not None) for index in self.layout.llm_layers]
        decoder = GPTModel(
            config=self.config,
            transformer_layer_spec=TransformerBlockSubmodules(
                layer_specs=specs, layer_norm=specs[0].submodules.input_layernorm
            ),
            vocab_size=padded_vocab,
            max_sequence_length=text.max_position_embeddings,
            pre_process=self.layout.has_embedding,
            post_process=self.layout.has_output,
            parallel_output=True,
            share_embeddings_and_output_weights=not text.untie_embeddings_and_output_weights,
            position_embedding_type="mrope",
            rotary_base=text.rope_theta,  # type: ignore[arg-type]  # megatron annotates int; rope_theta is float
            rotary_percent=text.rotary_percent,
            scatter_embedding_sequence_parallel=False,  # images are spliced in first (see decoder_input)
        )
        if text.mrope_interleaved:
            from mm_rl.models.qwen_vl.rotary import InterleavedMultimodalRotaryEmbedding

            decoder.rotary_pos_emb = InterleavedMultimodalRotaryEmbedding(
                kv_channels=self.config.kv_channels, rotary_percent=text.rotary_percent, rotary_base=text.rope_theta
            )
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
                    raise ValueError(
                        f"LLM layer {index} takes DeepStack features: it must be on the stage holding "
                        "the word embeddings (the first LLM stage)"
                    )
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
    @property
    def vision_token_ids(self) -> tuple[int, int]:
        """The image and video pad ids: the positions the vision encoder's outputs fill."""
        return self.model_cfg.img_context_token_id, self.model_cfg.video_token_id

    def position_ids(
        self,
        input_ids: Tensor,
        image_grid_thw: Tensor | None,
        attention_mask: Tensor | None,
        time_steps: Tensor | None = None,
    ) -> Tensor:
        """The 3D mRoPE ids [3, B, S] of a micro-batch (see :func:`rope_index.get_rope_index`)."""
        positions, _ = get_rope_index(
            input_ids,
            image_grid_thw,
            attention_mask,
            image_token_id=self.model_cfg.img_context_token_id,
            spatial_merge_size=self.model_cfg.image_encoder.vision_encoder.spatial_merge_size,
            video_token_id=self.model_cfg.video_token_id,
            time_steps=time_steps,
        )
        return positions

    def image_embeddings(
        self, pixel_values: Tensor | None, image_grid_thw: Tensor, image_keys: Tensor | None = None
    ) -> Tensor:
        """This stage's part of the image encoder: image embeddings [N_tokens, H_llm] when it holds the
        merger, else ViT hidden states for the next stage. Without an autograd graph when nothing in it trains.
        ``image_keys``: the images' keys in the step (the frozen ViT's per-step cache)."""
        encoder = self.image_encoder
        trains = any(p.requires_grad for p in encoder.parameters())
        hidden = None if self.layout.has_patch_embed else self.received
        with torch.set_grad_enabled(trains and torch.is_grad_enabled()):
            return encoder(
                pixel_values if self.layout.has_patch_embed else None, image_grid_thw, hidden, image_keys=image_keys
            )

    def _vision_stage_output(self, images: Tensor | None) -> Tensor:
        """What a stage holding only ViT blocks sends on: ViT hidden states or image embeddings [N, 1, H];
        a one-row zero placeholder for a micro-batch without images (the schedule sends something every time)."""
        if images is None:
            width = (
                self.model_cfg.text_decoder.hidden_size * (1 + self.deepstack_layers)
                if self.layout.has_merger
                else self.model_cfg.image_encoder.vision_encoder.hidden_size
            )
            images = torch.zeros(1, 1, width, dtype=self.config.params_dtype, device=current_device())
        elif self.layout.has_merger:
            images = images.unsqueeze(1)
        return keep_in_graph(images, self.received)

    def decoder_input(
        self,
        input_ids: Tensor,
        images: Tensor | None,
        encoded_grid_thw: Tensor | None = None,
        image_slots: Tensor | None = None,
        image_rows: Tensor | None = None,
    ) -> Tensor:
        """Word embeddings [S, B, H] with the image embeddings [N_tokens, H] spliced in (first LLM stage); with
        ``image_slots``, ``images`` are those of the encoded images (``encoded_grid_thw``), copied into every slot
        they fill first; ``image_rows``: the image tokens ``input_ids`` still hold (shared prompts packed once)."""
        embeddings = self.text_decoder.embedding(input_ids=input_ids, position_ids=None)
        self.deepstack = []
        if images is not None:
            if image_slots is not None:
                assert encoded_grid_thw is not None  # _images refuses pixel values without their grids
                merge = self.model_cfg.image_encoder.vision_encoder.spatial_merge_size
                images = images.index_select(0, image_token_rows(encoded_grid_thw, image_slots, merge))
            if image_rows is not None:
                images = images.index_select(0, image_rows.to(images.device))
            where = vision_positions(input_ids, self.vision_token_ids).nonzero(as_tuple=True)
            images, *deepstack = images.split(embeddings.size(-1), dim=-1)
            self.deepstack = [
                splice_image_embeddings(torch.zeros_like(embeddings), where, features) for features in deepstack
            ]
            embeddings = splice_image_embeddings(embeddings, where, images)
        return keep_in_graph(embeddings, self.received) if self.layout.received != "none" else embeddings

    def _images(
        self, pixel_values: Tensor | None, image_grid_thw: Tensor | None, image_keys: Tensor | None = None
    ) -> Tensor | None:
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
        mrope_time_steps: Tensor | None = None,
        output_mask: Tensor | None = None,
        shared_prompt: Tensor | None = None,
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
        name the encoded images in the step (the frozen ViT's per-step cache, see ``QwenVisionModel``).
        Videos come the same way, their tokens (``video_token_id``) among the image tokens in order, their grids in
        ``image_grid_thw`` where their tokens appear; ``mrope_time_steps`` [N_images] (float64) the time-axis step of
        each entry's positions (a Qwen2.5-VL video's; None: all 1). ``position_ids`` [3, B, S] may be passed
        precomputed. ``labels`` [B, S]: labels[b, s] is the token
        that position s predicts; ``output_mask`` [B, S] (nonzero: wanted, e.g. the response mask) limits the
        log-probs and the entropy to those positions (0 elsewhere): the other tokens skip the output layer.
        ``shared_prompt`` [B] (packed rows with an ``output_mask`` only): row b's leading tokens that equal the row
        before it, ids and images (a GRPO group's prompt): computed once (:class:`PackedRows`); the values at
        those positions of the later rows come back as 0, which the output mask leaves out anyway.

        Returns what the next stage receives (see StageLayout.received) on all but the last stage. The last
        stage returns a dict: ``log_probs`` and ``entropy`` [B, S] (fp32) when ``labels`` are given, and
        ``logits`` [B, S, V / TP] (this rank's vocab slice) when there are no labels or ``return_logits`` is
        set. ``temperature`` divides the logits before the log-probs and the entropy, as the sampler did.
        """
        encoded = image_grid_thw if image_slots is None else encoded_grid_thw
        images = (
            self._images(pixel_values, encoded, image_keys)
            if self.layout.has_vit or self.layout.has_embedding
            else None
        )
        if not self.layout.has_llm:
            return self._vision_stage_output(images)
        packed = (
            PackedRows.of(input_ids, attention_mask, self._sharing(shared_prompt, output_mask, return_logits))
            if self.remove_padding
            else None
        )
        image_rows = None
        if packed is not None:  # one row of the real tokens, each with the position it had in its own row
            if position_ids is None:
                position_ids = self.position_ids(input_ids, image_grid_thw, attention_mask, mrope_time_steps)
            if images is not None:
                image_rows = packed.image_rows(vision_positions(input_ids, self.vision_token_ids))
            input_ids, labels, position_ids = packed.pack(input_ids), packed.pack(labels), packed.pack(position_ids)
            output_mask, attention_mask = packed.pack(output_mask), None
        seq = input_ids.shape[1]
        length = -(-seq // self.sequence_split) * self.sequence_split
        if length != seq:  # right padding to a multiple of CP x SP (invisible to real tokens)
            if attention_mask is None and packed is None:
                attention_mask = torch.ones_like(input_ids)
            input_ids, attention_mask, labels, output_mask = (
                _pad_sequence(t, length, 0) for t in (input_ids, attention_mask, labels, output_mask)
            )
            position_ids = _pad_sequence(position_ids, length, 0)
        if position_ids is None:
            position_ids = self.position_ids(input_ids, image_grid_thw, attention_mask, mrope_time_steps)
        segments = packed.segments(input_ids.shape[1]) if packed is not None else None
        decoder_input = (
            self.decoder_input(input_ids, images, encoded, image_slots, image_rows)
            if self.layout.has_embedding
            else None
        )
        if self.cp is not None:  # this rank's tokens; the attention mask stays whole (Ulysses sees all tokens)
            position_ids = self.cp.local(position_ids, dim=2)
            decoder_input = self.cp.local(decoder_input, dim=0) if decoder_input is not None else None
            self.deepstack = [self.cp.local(features, dim=0) for features in self.deepstack]
            labels = self.cp.local(labels, dim=1) if labels is not None else None
            output_mask = self.cp.local(output_mask, dim=1) if output_mask is not None else None
        if self.config.sequence_parallel:  # this TP rank's share of the tokens; the layers' linears gather them
            decoder_input = sequence_parallel_share(decoder_input) if decoder_input is not None else None
            self.deepstack = [sequence_parallel_share(features) for features in self.deepstack]
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

    def _sharing(self, shared_prompt: Tensor | None, output_mask: Tensor | None, return_logits: bool) -> Tensor | None:
        """``shared_prompt`` where computing a shared prompt once changes nothing the caller reads: only the
        output mask's positions are returned, and no router loss counts tokens (megatron's load-balancing and
        z-losses average over the tokens routed, which the shared ones would then weigh once, not once per row), and no
        layer is recurrent (a Gated DeltaNet sample would need the state at the end of the shared prompt)."""
        aux = self.config.moe_aux_loss_coeff  # a float, or one per load-balancing type
        router_loss = any(aux if isinstance(aux, list) else [aux]) or self.config.moe_z_loss_coeff
        recurrent = "linear_attention" in self.model_cfg.text_decoder.layer_types  # a state, not keys, per prompt
        if shared_prompt is None or output_mask is None or return_logits or router_loss or recurrent:
            return None
        return shared_prompt

    def _last_stage_outputs(
        self, logits: Tensor, labels: Tensor | None, seq: int, return_logits: bool, temperature: float
    ) -> dict[str, Tensor]:
        """log_probs / entropy (labels given) and logits (asked for, or no labels) of the ``seq`` tokens, whole
        sequence under CP."""
        result: dict[str, Tensor] = {}
        rows = self.output_rows
        if labels is not None:
            values = log_probs_and_entropy(
                logits,
                labels if rows is None else rows.labels(labels),
                vocab_size=self.vocab_size,
                temperature=temperature,
            )
            result["log_probs"], result["entropy"] = values if rows is None else map(rows.place, values)
        if labels is None or return_logits:
            result["logits"] = logits
        if self.cp is not None:
            result = {key: self.cp.gather(value) for key, value in result.items()}
        return {key: value[:, :seq] for key, value in result.items()}  # without the CP / SP padding


def _build_image_encoder(
    model_cfg: ModelConfig, config: Any, layout: StageLayout, actor: ActorConfig | None
) -> torch.nn.Module:
    """The vision module (ViT blocks of this stage + merger) with the actor's freeze switches.

    The ViT trains only with ``unfreeze_vision_encoder`` or LoRA adapters on it (model.json's ``freeze`` marker is
    not the switch), the merger unless ``freeze_vision_projector`` or LoRA without ``vision``; a frozen part runs
    without an autograd graph.
    """
    from mm_rl.models.qwen_vl.vision import QwenVisionModel

    image = model_cfg.image_encoder
    return QwenVisionModel(
        image.vision_encoder,
        image.vision_projector,
        model_cfg.text_decoder.hidden_size,
        config,
        num_layers=len(layout.vit_layers),
        layer_offset=layout.vit_layers.start,
        pre_process=layout.has_patch_embed,
        post_process=layout.has_merger,
        freeze_encoder=not (actor and actor.trains_vision),
        # with LoRA the base is frozen: the merger trains only through its adapters (``lora.vision``)
        freeze_projector=bool(
            actor and (actor.freeze_vision_projector or (actor.lora.enabled and not actor.lora.vision))
        ),
    )


def build_model(
    model_cfg: ModelConfig,
    flags: TrainingFlags | None = None,
    actor: ActorConfig | None = None,
    *,
    decoder_layer: DecoderLayer = qwen_decoder_layer,
    params_dtype: torch.dtype = torch.float32,
    remove_padding: bool = True,
    **config_overrides: Any,
) -> QwenVLModel:
    """This rank's stage of the model, after megatron's ``initialize_model_parallel``.

    TP / PP sizes and ranks come from megatron's parallel state; ``flags`` give the vocab padding
    (``make-vocab-size-divisible-by``) and ``actor`` the freeze switches (default: ViT frozen, merger
    trained), ``decoder_layer`` the family's LLM layer spec; ``remove_padding`` packs each micro-batch's rows
    (see :mod:`llm_attention`). ``config_overrides`` reach the text decoder's ``TransformerConfig``.
    """
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    if cp > 1 and flags is not None and flags.context_parallel_algo not in (None, "ulysses_cp_algo"):
        raise NotImplementedError(f"context-parallel-algo {flags.context_parallel_algo!r}: only ulysses_cp_algo")
    layout = stage_layout(model_cfg, parallel_state.get_pipeline_model_parallel_rank(), pp)
    ep = parallel_state.get_expert_model_parallel_world_size()
    config = text_decoder_config(model_cfg, flags, tp=tp, pp=pp, ep=ep, params_dtype=params_dtype, **config_overrides)
    divisible_by = flags.make_vocab_size_divisible_by if flags is not None else 1
    padded = padded_vocab_size(model_cfg.text_decoder.vocab_size, divisible_by, tp)
    encoder = _build_image_encoder(model_cfg, config, layout, actor) if layout.has_vit else None
    return QwenVLModel(
        model_cfg,
        config,
        layout,
        padded_vocab=padded,
        image_encoder=encoder,
        decoder_layer=decoder_layer,
        remove_padding=remove_padding,
    )
