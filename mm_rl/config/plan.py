"""Parallel layout planning and a per-device memory estimate.

The planner picks TP/PP for a cluster, splits ViT blocks and LLM layers over pipeline stages by compute cost
(ViT first, every stage with at least one LLM layer), and estimates per-device memory of the training phase.

Cost model (forward FLOPs ~ 2 x parameters x tokens): a ViT block sees ``merge^2`` patches per image token, an
LLM layer sees the whole sequence, and the output layer (vocab x hidden) costs as much as a few LLM layers; so
32 ViT blocks of Qwen2.5-VL-7B weigh about as much as 2-3 LLM layers, not 32.

Memory model per device (bytes): trainable parameters cost param + fp32 grad + (fp32 master + Adam m, v) / DP
with the distributed optimizer (2 + 4 + 12 / DP in bf16; 4 + 4 + 8 / DP in fp32), frozen ones only their
weights, the colocated reference model its weights; activations per layer and micro-batch follow
s*b*h*(10 + 24/t + 5*a*s/(h*t)) (the attention-score term vanishes with a fused attention: the LLM's always,
``mm_rl.models.qwen_vl.llm_attention``; the ViT's SDPA with use-flash-attn), with 1F1B keeping PP - stage
micro-batches in flight; the last stage adds fp32 logits and their gradient (of the response tokens only). The
colocated rollout engine's share (its weights and KV cache at ``gpu_memory_utilization``) is estimated beside the
training phase: it holds that share while it generates.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

from mm_rl.config.schema import JobConfig, LoRAConfig, ModelConfig, TextDecoderConfig
from mm_rl.config.topology import topology

GIB = 1024**3
OFFLOAD_KINDS = ("param", "grad", "optimizer")  # actor_config.offload_train_<kind>
# What the planner lets the actor offload during a colocated rollout, in order: gradients are dropped, not copied
# (free to move), optimizer state is only needed at the step's end, parameters are needed by the sync and the next
# forward.
OFFLOAD_LADDER: tuple[tuple[str, ...], ...] = ((), ("grad",), ("grad", "optimizer"), ("grad", "optimizer", "param"))
DEFAULT_DEVICE_MEMORY_GB = {"npu": 64.0, "cuda": 80.0, "cpu": 24.0}
# What a device loses besides the plan's weights, gradients, optimizer, reference, activations and the engine's
# share (env.DEVICE_MEMORY_RESERVE_GB): an "80 GB" H100 exposes ~79.6 GiB; each of the three processes on a device
# (actor rank, reference rank, engine worker) holds a CUDA / ACL context (~0.5-1 GiB); NCCL / HCCL keep buffers per
# communicator (HCCL_BUFFSIZE, 200 MB by default, several groups per rank); the caching allocators fragment; vLLM
# allocates a little outside its gpu_memory_utilization pool. 6 GiB covers these with room; a CPU host has none of
# them.
DEFAULT_RESERVE_GB = {"npu": 6.0, "cuda": 6.0, "cpu": 0.0}


@dataclass(frozen=True)
class LayerCounts:
    """Parameters of one block of each kind, and the model's fixed pieces."""

    vit_layer: int
    llm_layer: int  # without its experts
    llm_experts: int  # every routed expert of one MoE layer (0: dense); an EP rank holds 1 / EP of them
    projector: int
    embedding: int
    output_layer: int
    patch_embed: int


def linear_attention_share(text: TextDecoderConfig) -> float:
    """The share of LLM layers that are Gated DeltaNet (linear attention); the plan spreads them evenly."""
    kinds = text.layer_types
    return kinds.count("linear_attention") / len(kinds) if kinds else 0.0


def gated_delta_net_parameters(text: TextDecoderConfig) -> int:
    """One Gated DeltaNet mixer: in_proj (q, k, v, z, beta, alpha), the causal convolution, out_proj, A / dt, norm."""
    keys, values = (
        text.linear_num_key_heads * text.linear_key_head_dim,
        text.linear_num_value_heads * text.linear_value_head_dim,
    )
    heads = text.linear_num_value_heads
    conv = 2 * keys + values
    return (
        text.hidden_size * (conv + values + 2 * heads)
        + conv * text.linear_conv_kernel_dim
        + values * text.hidden_size
        + 2 * heads
        + text.linear_value_head_dim
    )


def recurrent_state_bytes(text: TextDecoderConfig, element: int = 2) -> int:
    """One sequence's Gated DeltaNet state in an engine, all layers: per layer the recurrent state (value heads x
    key dim x value dim) and the convolution's last kernel - 1 inputs, in the engine's precision (vLLM keeps them
    per running sequence, beside the KV cache of the full-attention layers)."""
    layers = text.layer_types.count("linear_attention")
    keys, values = (
        text.linear_num_key_heads * text.linear_key_head_dim,
        text.linear_num_value_heads * text.linear_value_head_dim,
    )
    state = text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim
    conv = (2 * keys + values) * (text.linear_conv_kernel_dim - 1)
    return layers * (state + conv) * element


def layer_counts(model: ModelConfig) -> LayerCounts:
    text, vit = model.text_decoder, model.image_encoder.vision_encoder
    proj = model.image_encoder.vision_projector
    head_dim = text.kv_channels or text.hidden_size // text.num_attention_heads
    groups = text.num_query_groups if text.group_query_attention else text.num_attention_heads
    h, f = text.hidden_size, text.ffn_hidden_size
    gate = 2 if text.attention_output_gate else 1  # a gated attention's query projection also gives the gates
    attention = h * (gate * text.num_attention_heads + 2 * groups) * head_dim + text.num_attention_heads * head_dim * h
    linear = linear_attention_share(text)
    llm = round((1 - linear) * attention + linear * gated_delta_net_parameters(text))
    experts = text.num_moe_experts or 0
    if experts:  # the router, and the experts' SwiGLU MLPs in place of the dense one (and a gated shared expert)
        shared = text.moe_shared_expert_intermediate_size or 0
        llm += experts * h + 3 * h * shared + (h if text.moe_shared_expert_gate else 0)
    else:
        llm += (3 if text.swiglu else 2) * h * f
    hv, fv = vit.hidden_size, vit.ffn_hidden_size
    vit_layer = 4 * hv * hv + (3 if vit.swiglu else 2) * hv * fv
    merged = proj.ffn_hidden_size
    return LayerCounts(
        vit_layer=vit_layer,
        llm_layer=llm,
        llm_experts=experts * 3 * h * (text.moe_intermediate_size or 0),
        # the merger, and as many DeepStack mergers of its size (Qwen3-VL) on the same stage
        projector=(merged * merged + merged * proj.hidden_size) * (1 + len(vit.deepstack_visual_indexes)),
        embedding=text.vocab_size * h,
        output_layer=text.vocab_size * h,
        patch_embed=vit.in_channels * vit.temporal_patch_size * vit.patch_size**2 * hv
        + vit.num_position_embeddings * hv,
    )


def adapter_parameters(model: ModelConfig, lora: LoRAConfig, tp: int, ep: int = 1) -> tuple[float, float, float]:
    """LoRA adapter parameters on one rank: (per LLM layer, per ViT block, the merger). An adapter on a linear
    (in -> out) holds r x (in + out), its split half cut by TP (B of a column-parallel linear, A of a row-parallel
    one); the experts' count per EP rank."""
    text, vit = model.text_decoder, model.image_encoder.vision_encoder
    proj, r, targets = model.image_encoder.vision_projector, lora.rank, set(lora.target_modules)

    def column(name: str, n_in: float, n_out: float) -> float:
        return r * (n_in + n_out / tp) if name in targets else 0.0

    def row(name: str, n_in: float, n_out: float) -> float:
        return r * (n_in / tp + n_out) if name in targets else 0.0

    def mlp(n_in: int, n_hidden: int, swiglu: bool) -> float:
        return column("linear_fc1", n_in, (2 if swiglu else 1) * n_hidden) + row("linear_fc2", n_hidden, n_in)

    def attention(n_in: int, heads: int, groups: int, head_dim: int, gate: int) -> float:
        qkv = (gate * heads + 2 * groups) * head_dim
        return column("linear_qkv", n_in, qkv) + row("linear_proj", heads * head_dim, n_in)

    h, head_dim = text.hidden_size, text.kv_channels or text.hidden_size // text.num_attention_heads
    groups = text.num_query_groups if text.group_query_attention else text.num_attention_heads
    gate = 2 if text.attention_output_gate else 1
    values = text.linear_num_value_heads * text.linear_value_head_dim
    conv = 2 * text.linear_num_key_heads * text.linear_key_head_dim + values
    recurrent = column("in_proj", h, conv + values + 2 * text.linear_num_value_heads) + row("out_proj", values, h)
    share = linear_attention_share(text)
    llm = (1 - share) * attention(h, text.num_attention_heads, groups, head_dim, gate) + share * recurrent
    if text.num_moe_experts:
        llm += (
            mlp(h, text.moe_shared_expert_intermediate_size or 0, True)
            if text.moe_shared_expert_intermediate_size
            else 0
        )
        if lora.experts:  # expert TP is 1 (the check): whole adapters, this EP rank's experts
            llm += text.num_moe_experts / ep * r * (2 * h + 3 * (text.moe_intermediate_size or 0))  # fc1 + fc2
    else:
        llm += mlp(h, text.ffn_hidden_size, text.swiglu)
    if not lora.vision:
        return llm, 0.0, 0.0
    block = attention(
        vit.hidden_size, vit.num_attention_heads, vit.num_attention_heads, vit.hidden_size // vit.num_attention_heads, 1
    )
    block += mlp(vit.hidden_size, vit.ffn_hidden_size, vit.swiglu)
    merged = proj.ffn_hidden_size  # the merger: merged patches -> hidden -> the LLM's width (and DeepStack's alike)
    merger = column("linear_fc1", merged, merged) + row("linear_fc2", merged, proj.hidden_size)
    return llm, block, merger * (1 + len(vit.deepstack_visual_indexes))


def model_parameters(model: ModelConfig) -> int:
    """Parameters of the whole model (what a rollout engine holds, split over its TP ranks)."""
    counts, text, vit = layer_counts(model), model.text_decoder, model.image_encoder.vision_encoder
    head = counts.output_layer if text.untie_embeddings_and_output_weights else 0
    return (
        vit.num_layers * counts.vit_layer
        + counts.patch_embed
        + counts.projector
        + text.num_layers * (counts.llm_layer + counts.llm_experts)
        + counts.embedding
        + head
    )


ENGINE_WEIGHTS_SHARE = 0.9  # at most this much of a colocated engine's memory share may be weights (the rest: KV cache)


def engine_weights_gb(cfg: JobConfig) -> float:
    """GiB of the whole model in the engine's precision (bf16 unless ``generate_config.dtype`` is float32)."""
    g = cfg.backend_config.generate_config
    return model_parameters(cfg.backend_config.model) * (4 if g.dtype == "float32" else 2) / 2**30


def engine_state_gb(cfg: JobConfig) -> float:
    """GiB of the Gated DeltaNet states an engine holds for ``max_num_seqs`` running sequences (0 for a model
    without linear attention); vLLM takes them out of the same share as the KV cache."""
    g = cfg.backend_config.generate_config
    element = 4 if g.dtype == "float32" else 2
    return g.max_num_seqs * recurrent_state_bytes(cfg.backend_config.model.text_decoder, element) / 2**30


def colocated_engine_tp(cfg: JobConfig) -> int | None:
    """The smallest engine TP (a divisor of the devices per node) whose weight share per device (with the recurrent
    states of a hybrid model) leaves a KV cache room in a colocated engine's ``gpu_memory_utilization`` share; None
    when no TP within a node does."""
    share = cfg.backend_config.generate_config.gpu_memory_utilization * device_memory_gb(cfg)
    per_node = cfg.env.NPROC_PER_NODE
    held = engine_weights_gb(cfg) + engine_state_gb(cfg)
    fitting = [tp for tp in range(1, per_node + 1) if per_node % tp == 0 and held / tp <= ENGINE_WEIGHTS_SHARE * share]
    return fitting[0] if fitting else None


def micro_batch_tokens(cfg: JobConfig) -> int:
    """Positions (padding included) one training micro-batch holds on a rank: its token budget, or MBS rows of
    seq-length."""
    actor = cfg.backend_config.actor_config
    return actor.max_tokens_per_micro_batch or actor.micro_batch_size * cfg.backend_config.training.seq_length


def logit_tokens(cfg: JobConfig) -> int:
    """Positions of a training micro-batch that reach the output layer on one CP rank: only response tokens do (the
    model's output mask), at most MBS responses of max_tokens, which may all sit in one CP rank's chunk (they end
    their sequences); under a token budget the whole chunk (a budget may hold many short samples)."""
    b = cfg.backend_config
    chunk = micro_batch_tokens(cfg) // b.training.context_parallel_size
    if b.actor_config.max_tokens_per_micro_batch:
        return chunk
    return min(chunk, b.actor_config.micro_batch_size * b.response_tokens)


def micro_batch_limits(cfg: JobConfig, grad: bool) -> tuple[int | None, int]:
    """(token budget, samples) of a micro-batch of the update (``grad``) or of a no-grad log-prob pass (old,
    reference): a set budget (``max_tokens_per_micro_batch``, ``log_prob_max_tokens_per_micro_batch``) or None and
    at most ``samples`` rows. Unless its own budget is set, a log-prob pass takes :func:`log_prob_scale` of the
    update's micro-batches at once."""
    actor = cfg.backend_config.actor_config
    if grad:
        return actor.max_tokens_per_micro_batch, actor.micro_batch_size
    if actor.log_prob_max_tokens_per_micro_batch:
        return actor.log_prob_max_tokens_per_micro_batch, actor.micro_batch_size
    scale = log_prob_scale(cfg)
    budget = actor.max_tokens_per_micro_batch
    return (budget * scale if budget else None), actor.micro_batch_size * scale


def log_prob_scale(cfg: JobConfig) -> int:
    """How many of the update's micro-batches a log-prob pass takes at once: the most whose pass holds no more on
    any pipeline stage than one training micro-batch does, and no more than a DP replica's share of the step (a
    PP-th of it under pipeline parallelism, which needs a micro-batch per stage to keep every stage busy).
    Without a backward each layer's activations are freed as the next one runs, so only one layer's and the
    logits grow with the micro-batch, while a training micro-batch keeps every layer's until its backward;
    larger no-grad micro-batches run larger matmuls in fewer calls (verl's separate log-prob micro-batch size)."""
    b = cfg.backend_config
    t, model = b.training, b.model
    tp, pp, cp = t.tensor_model_parallel_size, t.pipeline_model_parallel_size, t.context_parallel_size
    vit_layers = model.image_encoder.vision_encoder.pipeline_num_layers
    llm_layers = model.text_decoder.pipeline_num_layers
    one = [[min(n, 1) for n in layers] for layers in (vit_layers, llm_layers)]  # a frozen ViT's count 0 either way
    logits = 4 * logit_tokens(cfg) * model.text_decoder.vocab_size / tp  # one fp32 copy of the response logits
    scales = []
    for s in range(pp):
        last = s == pp - 1
        kept = _stage_activations(cfg, s, vit_layers, llm_layers, tp, cp) + (2 * logits if last else 0.0)
        # the pass's peak: one layer's activations, and on the last stage the logits, their fp32 copy and the
        # exponentials of the log-softmax (mm_rl.models.qwen_vl.logprobs)
        passing = _stage_activations(cfg, s, *one, tp, cp) + (3 * logits if last else 0.0)
        if passing > 0:
            scales.append(int(kept // passing))
    # a replica's share of the step, in at least PP micro-batches: fewer would leave pipeline stages idle
    share = -(-b.rl_config.rollout_batch_size * b.rl_config.n_samples_per_prompt // topology(cfg).dp)
    return max(1, min([*scales, -(-share // pp // b.actor_config.micro_batch_size)]))


def image_tokens(cfg: JobConfig) -> int:
    """LLM tokens of a typical image: one at min_pixels (small geometry figures are scaled up to it)."""
    vit = cfg.backend_config.model.image_encoder.vision_encoder
    pixels = cfg.backend_config.data.dataset_param.preprocess_parameters.min_pixels
    return max(1, pixels // (vit.patch_size * vit.spatial_merge_size) ** 2)


def split_layers(model: ModelConfig, pp: int, seq_length: int, image_tokens: int) -> tuple[list[int], list[int]]:
    """(vit_pp_layers, llm_pp_layers): contiguous stages minimising the most expensive stage's cost."""
    counts = layer_counts(model)
    n_vit = model.image_encoder.vision_encoder.num_layers
    n_llm = model.text_decoder.num_layers
    merge2 = model.image_encoder.vision_encoder.spatial_merge_size**2
    vit_cost = counts.vit_layer * image_tokens * merge2
    llm_cost = counts.llm_layer * seq_length
    costs = [float(vit_cost)] * n_vit + [float(llm_cost)] * n_llm
    costs[-1] += counts.output_layer * seq_length
    # the ViT's stage holds at least one LLM layer, and every LLM layer that takes DeepStack features
    deepstack = len(model.image_encoder.vision_encoder.deepstack_visual_indexes)
    cuts = _min_max_partition(costs, pp, first_allowed=n_vit + max(1, deepstack))
    bounds = [0, *cuts, len(costs)]
    vit_split = [max(0, min(b, n_vit) - min(a, n_vit)) for a, b in zip(bounds, bounds[1:], strict=False)]
    llm_split = [(b - a) - v for (a, b), v in zip(zip(bounds, bounds[1:], strict=False), vit_split, strict=True)]
    return vit_split, llm_split


def _min_max_partition(costs: list[float], parts: int, first_allowed: int) -> list[int]:
    """Cut points splitting ``costs`` into ``parts`` contiguous runs, each holding at least one LLM layer.

    The first cut may not come before ``first_allowed`` (the ViT blocks plus the LLM layers the first stage must
    hold); every run after
    it holds at least one item. Classic dynamic programme over prefix sums: O(parts x n^2), n <= a few hundred.
    """
    n = len(costs)
    if parts <= 1:
        return []
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = math.inf
    # best[k][j]: minimal max-cost splitting the first j items into k runs (the first run ends >= first_allowed).
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    back = [[0] * (n + 1) for _ in range(parts + 1)]
    for j in range(first_allowed, n + 1):
        best[1][j] = prefix[j]
    for k in range(2, parts + 1):
        for j in range(first_allowed + k - 1, n + 1):
            for i in range(first_allowed + k - 2, j):
                cost = max(best[k - 1][i], prefix[j] - prefix[i])
                if cost < best[k][j]:
                    best[k][j], back[k][j] = cost, i
    cuts, j = [], n
    for k in range(parts, 1, -1):
        j = back[k][j]
        cuts.append(j)
    return cuts[::-1]


@dataclass(frozen=True)
class StageMemory:
    """Estimated memory of one device of a pipeline stage, in GiB."""

    stage: int
    weights: float
    grads: float
    optimizer: float
    reference: float
    activations: float
    rollout: float = 0.0  # while a colocated engine generates: what the actor keeps resident + the engine's share

    @property
    def training(self) -> float:
        return self.weights + self.grads + self.optimizer + self.reference + self.activations

    @property
    def total(self) -> float:
        """The peak of the two phases a device goes through (training, and rollout beside a colocated engine)."""
        return max(self.training, self.rollout)


def estimate_memory(cfg: JobConfig) -> list[StageMemory]:
    b = cfg.backend_config
    model, t = b.model, b.training
    tp, pp, cp = t.tensor_model_parallel_size, t.pipeline_model_parallel_size, t.context_parallel_size
    dp = topology(cfg).dp
    counts = layer_counts(model)
    low_precision = t.bf16 and cfg.env.DEVICE != "cpu"
    weight_bytes = 2 if low_precision else 4
    opt_bytes = (12 if low_precision else 8) / (dp if t.use_distributed_optimizer else 1)
    rows_tokens = micro_batch_tokens(cfg)
    micro_batches = max(1, -(-b.megatron_training.global_batch_size * t.seq_length // (rows_tokens * dp)))
    vit_layers = model.image_encoder.vision_encoder.pipeline_num_layers
    llm_layers = model.text_decoder.pipeline_num_layers
    out = []
    lora = b.actor_config.lora
    adapters = adapter_parameters(model, lora, tp, b.actor_config.expert_model_parallel_size) if lora.enabled else None
    for s in range(pp):
        frozen, trainable = _stage_params(cfg, counts, s, vit_layers, llm_layers)
        total_params, trained = (frozen + trainable) / tp, trainable / tp  # per rank
        reference = total_params * weight_bytes if b.rl_config.colocate_ref else 0.0
        if adapters is not None:  # the base frozen whole, only the adapters train; the reference: the actor without
            # them, unless a separate one is asked for
            trained = llm_layers[s] * adapters[0] + vit_layers[s] * adapters[1]
            trained += adapters[2] if s == max((i for i, n in enumerate(vit_layers) if n > 0), default=0) else 0.0
            total_params += trained
            reference = reference if lora.separate_reference else 0.0
        in_flight = min(pp - s, micro_batches)
        act = in_flight * _stage_activations(cfg, s, vit_layers, llm_layers, tp, cp)
        if s == pp - 1:
            act += 2 * 4 * logit_tokens(cfg) * model.text_decoder.vocab_size / tp
        stage = StageMemory(
            stage=s,
            weights=total_params * weight_bytes / GIB,
            grads=trained * 4 / GIB,
            optimizer=trained * opt_bytes / GIB,
            reference=reference / GIB,
            activations=act / GIB,
        )
        out.append(dataclasses.replace(stage, rollout=_rollout_phase(cfg, stage)))
    return out


def _rollout_phase(cfg: JobConfig, stage: StageMemory) -> float:
    """GiB a device needs while a colocated engine generates on it: the engine's ``gpu_memory_utilization`` share of
    the device (vLLM sizes weights + KV cache to it, and refuses to start or wake without it free) plus what the
    actor does not offload (``offload_train_*``; a colocated reference leaves with the parameters). Counted on every
    stage: an engine may sit beside any actor rank. Activations are gone between the phases."""
    b = cfg.backend_config
    if not b.generate_config.colocate or cfg.env.DEVICE == "cpu":
        return 0.0
    actor = b.actor_config
    kept = (
        (0.0 if actor.offload_train_param else stage.weights + stage.reference)
        + (0.0 if actor.offload_train_grad else stage.grads)
        + (0.0 if actor.offload_train_optimizer else stage.optimizer)
    )
    return kept + b.generate_config.gpu_memory_utilization * device_memory_gb(cfg)


def _stage_params(
    cfg: JobConfig, counts: LayerCounts, s: int, vit_layers: list[int], llm_layers: list[int]
) -> tuple[float, float]:
    """(frozen, trainable) parameter counts of stage ``s`` on one EP rank."""
    actor, model = cfg.backend_config.actor_config, cfg.backend_config.model
    vit = vit_layers[s] * counts.vit_layer + (counts.patch_embed if s == 0 else 0)
    last_vit_stage = max((i for i, n in enumerate(vit_layers) if n > 0), default=0)
    projector = counts.projector if s == last_vit_stage else 0
    llm = llm_layers[s] * (counts.llm_layer + counts.llm_experts / actor.expert_model_parallel_size)
    if s == 0:
        llm += counts.embedding
    if s == len(llm_layers) - 1 and (model.text_decoder.untie_embeddings_and_output_weights or s > 0):
        llm += counts.output_layer
    frozen = (0 if actor.unfreeze_vision_encoder else vit) + (projector if actor.freeze_vision_projector else 0)
    trainable = (vit if actor.unfreeze_vision_encoder else 0) + (0 if actor.freeze_vision_projector else projector)
    return float(frozen), float(trainable + llm)


def _stage_activations(cfg: JobConfig, s: int, vit_layers: list[int], llm_layers: list[int], tp: int, cp: int) -> float:
    """Bytes of activations one micro-batch leaves on stage ``s`` until its backward."""
    b = cfg.backend_config
    text, vit = b.model.text_decoder, b.model.image_encoder.vision_encoder

    def per_layer(total: float, row: float, hidden: int, heads: int, scores: bool, split: int) -> float:
        """``total`` tokens in rows of at most ``row`` (the attention scores grow with the row length); of the 34
        bytes per token and hidden unit, 24 are cut by TP and the other 10 (norm inputs, residuals) by ``split``
        (TP under sequence parallelism, else 1)."""
        score = 5 * heads * row / (hidden * tp) if scores else 0.0
        return total * hidden * (10 / split + 24 / tp + score)

    seq = b.training.seq_length / cp
    vit_tokens = image_tokens(cfg) * vit.spatial_merge_size**2
    # A frozen ViT runs without autograd: it keeps no activations for backward. Under a token budget a micro-batch
    # holds at most one image per image's worth of tokens.
    trains_vit = b.actor_config.trains_vision  # unfrozen, or adapted (LoRA): its activations stay for the backward
    turns = b.rl_config.multi_turn
    per_sample = 1 + (turns.max_tool_images if turns.enable else 0)  # a trajectory's tools may add images
    images = (
        b.actor_config.micro_batch_size * per_sample
        if b.actor_config.max_tokens_per_micro_batch is None
        else max(1, micro_batch_tokens(cfg) // image_tokens(cfg))
    )
    # a video's frames all pass the ViT (attention within a frame): at most max_frames at video_max_pixels each
    # (Qwen3-VL / Qwen3.5 cap the whole clip there: counted per frame, the estimate errs high)
    pre = b.data.dataset_param.preprocess_parameters
    frame_tokens = pre.video_max_pixels // vit.patch_size**2
    video_tokens = b.generate_config.max_videos_per_prompt * pre.max_frames * frame_tokens * images // per_sample
    vit_act = (
        per_layer(
            vit_tokens * images + video_tokens,
            max(vit_tokens, frame_tokens if video_tokens else 0),
            vit.hidden_size,
            vit.num_attention_heads,
            scores=not b.training.use_flash_attn,
            split=1,
        )
        if trains_vit
        else 0.0
    )
    # the LLM: sequence parallelism whenever TP > 1; fused attention keeps no S x S scores (a test checks)
    llm_act = per_layer(
        micro_batch_tokens(cfg) / cp, seq, text.hidden_size, text.num_attention_heads, scores=False, split=tp
    )
    # a Gated DeltaNet layer also keeps its chunked recurrent states for backward (fp32, one per 64 tokens: value
    # heads x key dim x value dim), cut by TP with the heads
    states = 4 * text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim / 64 / tp
    llm_act += linear_attention_share(text) * micro_batch_tokens(cfg) / cp * states
    return llm_layers[s] * llm_act + vit_layers[s] * vit_act


@dataclass(frozen=True)
class ParallelPlan:
    tp: int
    pp: int
    dp: int
    vit_pp_layers: list[int]
    llm_pp_layers: list[int]
    memory: list[StageMemory]
    device_memory_gb: float
    offload: tuple[str, ...] = ()  # what the actor offloads while a colocated engine generates (offload_train_*)
    engine_tp: int = 1  # a colocated engine's TP
    engine_weights: float = 0.0  # GiB of its weights per device (0: no colocated engine)
    engine_share: float = 0.0  # GiB of its gpu_memory_utilization share of a device
    ep: int = 1  # expert parallelism (MoE), within DP
    reserve_gb: float = 0.0  # of the device, left to what the estimate does not count (DEFAULT_RESERVE_GB)

    @property
    def usable_gb(self) -> float:
        """The device memory the plan may fill: all of it less the reserve."""
        return self.device_memory_gb - self.reserve_gb

    @property
    def margin_gb(self) -> float:
        """What the most loaded device keeps free of the usable memory, in its heavier phase (negative: over)."""
        return self.usable_gb - self.peak

    @property
    def peak(self) -> float:
        """GiB of the most loaded device, in its heavier phase."""
        return max(m.total for m in self.memory)

    @property
    def engine_fits(self) -> bool:
        """A colocated engine's weights leave its KV cache room in its share (vLLM refuses to start otherwise)."""
        return self.engine_weights <= ENGINE_WEIGHTS_SHARE * self.engine_share

    @property
    def fits(self) -> bool:
        return self.peak <= self.usable_gb and self.engine_fits

    def describe(self) -> str:
        experts = f" (EP {self.ep} within DP)" if self.ep > 1 else ""
        lines = [
            f"parallel layout: world {self.tp * self.pp * self.dp} = TP {self.tp} x PP {self.pp} x DP {self.dp}"
            f"{experts}; vit_pp_layers {self.vit_pp_layers}; llm_pp_layers {self.llm_pp_layers}",
            "estimated memory per device, GiB (training phase; rollout: beside a colocated engine):",
            "  stage  weights  grads  optimizer  reference  activations  training  rollout",
        ]
        for m in self.memory:
            lines.append(
                f"  {m.stage:>5}  {m.weights:7.2f}  {m.grads:5.2f}  {m.optimizer:9.2f}  "
                f"{m.reference:9.2f}  {m.activations:11.2f}  {m.training:8.2f}  {m.rollout:7.2f}"
            )
        lines.append(
            f"device: {self.device_memory_gb:.1f} GiB, of which {self.reserve_gb:.1f} reserved (contexts, collective "
            f"buffers, fragmentation: env.DEVICE_MEMORY_RESERVE_GB) -> {self.usable_gb:.1f} usable; margin at the "
            f"peak: {self.margin_gb:.1f} GiB"
        )
        if self.offload:
            lines.append(
                "colocated rollout: the actor offloads its "
                + ", ".join(self.offload)
                + " while the engine generates (actor_config.offload_train_*)"
            )
        if self.engine_weights:
            lines.append(
                f"colocated engine: TP {self.engine_tp}, {self.engine_weights:.1f} GiB of weights per device "
                f"in its {self.engine_share:.1f} GiB share (generate_config.gpu_memory_utilization)"
            )
        if not self.engine_fits:
            lines.append(
                f"WARNING: the engine's weights leave its KV cache less than {1 - ENGINE_WEIGHTS_SHARE:.0%} "
                "of its share: raise generate_config.infer_tensor_parallel_size (within a node) or "
                "gpu_memory_utilization, or give the engines devices of their own (colocate: false)"
            )
        if self.peak > self.usable_gb:
            lines.append(
                f"WARNING: the estimate ({self.peak:.1f} GiB) exceeds the device's usable memory "
                f"({self.usable_gb:.1f} GiB): raise TP/PP, enable use-distributed-optimizer, "
                "lower seq-length or micro_batch_size; in the rollout phase, set actor_config."
                "offload_train_* or lower generate_config.gpu_memory_utilization"
            )
        return "\n".join(lines)


def device_memory_gb(cfg: JobConfig) -> float:
    return cfg.env.DEVICE_MEMORY_GB or DEFAULT_DEVICE_MEMORY_GB[cfg.env.DEVICE]


def reserve_gb(cfg: JobConfig) -> float:
    reserve = cfg.env.DEVICE_MEMORY_RESERVE_GB
    return DEFAULT_RESERVE_GB[cfg.env.DEVICE] if reserve is None else reserve


def current_plan(cfg: JobConfig) -> ParallelPlan:
    t = cfg.backend_config.training
    tp, pp = t.tensor_model_parallel_size, t.pipeline_model_parallel_size
    dp = topology(cfg).dp
    m, actor = cfg.backend_config.model, cfg.backend_config.actor_config
    offload = tuple(kind for kind in OFFLOAD_KINDS if getattr(actor, f"offload_train_{kind}"))
    g = cfg.backend_config.generate_config
    colocated = g.colocate and cfg.env.DEVICE != "cpu"
    engine_tp = max(1, g.infer_tensor_parallel_size)
    return ParallelPlan(
        tp,
        pp,
        dp,
        list(m.image_encoder.vision_encoder.pipeline_num_layers),
        list(m.text_decoder.pipeline_num_layers),
        estimate_memory(cfg),
        device_memory_gb(cfg),
        offload,
        engine_tp,
        engine_weights_gb(cfg) / engine_tp if colocated else 0.0,
        g.gpu_memory_utilization * device_memory_gb(cfg) if colocated else 0.0,
        actor.expert_model_parallel_size,
        reserve_gb(cfg),
    )


def with_offload(cfg: JobConfig, kinds: tuple[str, ...]) -> JobConfig:
    """A copy of ``cfg`` whose actor offloads ``kinds`` (of :data:`OFFLOAD_KINDS`) during a colocated rollout."""
    out = copy.deepcopy(cfg)
    for kind in OFFLOAD_KINDS:
        setattr(out.backend_config.actor_config, f"offload_train_{kind}", kind in kinds)
    return out


_TEXT = "backend_config.model.text_decoder"
_VIT = "backend_config.model.image_encoder.vision_encoder"


def sharded_sizes(cfg: JobConfig) -> dict[str, int]:
    """Each size TP splits, by key (TP must divide every one): the attention heads, the key/value groups, the MLP
    widths and the vocab (fixed by the checkpoint). Groups that do not divide the heads are left out: they are wrong
    on their own (``query_groups_divide_heads``), and a TP fitted to them would be wrong too."""
    text, vit = cfg.backend_config.model.text_decoder, cfg.backend_config.model.image_encoder.vision_encoder
    sizes = {
        f"{_TEXT}.num_attention_heads": text.num_attention_heads,
        f"{_TEXT}.ffn_hidden_size": text.ffn_hidden_size,
        f"{_VIT}.num_attention_heads": vit.num_attention_heads,
        f"{_VIT}.ffn_hidden_size": vit.ffn_hidden_size,
        f"{_TEXT}.vocab_size": text.vocab_size,
    }
    groups = text.num_query_groups if text.group_query_attention else text.num_attention_heads
    if groups >= 1 and text.num_attention_heads % groups == 0:
        sizes[f"{_TEXT}.num_query_groups"] = groups
    if "linear_attention" in text.layer_types:  # Gated DeltaNet heads split over TP like attention heads
        sizes[f"{_TEXT}.linear_num_key_heads"] = text.linear_num_key_heads
        sizes[f"{_TEXT}.linear_num_value_heads"] = text.linear_num_value_heads
    return sizes


def tp_choices(cfg: JobConfig, limit: int = 64) -> list[int]:
    """Every TP up to ``limit`` that all the divisibility rules accept: it divides each sharded size, the vocab
    divides by make-vocab-size-divisible-by x TP, and the heads by context-parallel-size x TP (Ulysses). A rule
    whose other factor is already wrong on its own (e.g. a padding unit that does not divide the vocab) is left to
    its own error rather than leaving no TP at all."""
    t, text = cfg.backend_config.training, cfg.backend_config.model.text_decoder
    limits = list(sharded_sizes(cfg).values())
    for total, factor in (
        (text.vocab_size, t.make_vocab_size_divisible_by),
        (text.num_attention_heads, t.context_parallel_size),
    ):
        if factor >= 1 and total % factor == 0:
            limits.append(total // factor)
    return [tp for tp in range(1, limit + 1) if all(n % tp == 0 for n in limits)]


def tp_candidates(cfg: JobConfig) -> list[int]:
    """TP sizes within one node (dividing its device count) that the divisibility rules accept."""
    nproc = cfg.env.NPROC_PER_NODE
    return [tp for tp in tp_choices(cfg, nproc) if nproc % tp == 0]


def with_layout(
    cfg: JobConfig, tp: int, pp: int, vit_layers: list[int], llm_layers: list[int], ep: int = 1
) -> JobConfig:
    """A copy of ``cfg`` with another parallel layout (both the source keys and their resolved echoes)."""
    out = copy.deepcopy(cfg)
    b = out.backend_config
    b.actor_config.expert_model_parallel_size = ep
    b.actor_config.tensor_model_parallel_size = b.training.tensor_model_parallel_size = tp
    b.actor_config.pipeline_model_parallel_size = b.training.pipeline_model_parallel_size = pp
    b.model.image_encoder.vision_encoder.pipeline_num_layers = list(vit_layers)
    b.model.text_decoder.pipeline_num_layers = list(llm_layers)
    for stage in (b.convert_ckpt_hf2mg.cfg, b.convert_ckpt_mg2hf.cfg):
        stage.parallel_config.tp_size = tp
        stage.parallel_config.ep_size = ep
        stage.parallel_config.vit_pp_layers = list(vit_layers)
        stage.parallel_config.llm_pp_layers = list(llm_layers)
    return out


def plan_parallel(cfg: JobConfig) -> ParallelPlan:
    """The smallest model-parallel layout (TP inside a node first) whose memory estimate fits the device, each
    layout tried with the actor offloading nothing, then more and more of its state during a colocated rollout
    (:data:`OFFLOAD_LADDER`: what is cheapest to move back first).

    If none fits, the layout with the lowest peak estimate, whose ``describe()`` carries the warning.
    """
    world = topology(cfg).world_size
    cp = cfg.backend_config.training.context_parallel_size
    seq = cfg.backend_config.training.seq_length // cp
    model = cfg.backend_config.model
    experts = model.text_decoder.num_moe_experts or 0
    tps = [1] if experts else tp_candidates(cfg)  # MoE: EP spreads the experts whole; TP would cut each one
    options = sorted(
        (
            (tp, pp)
            for tp in tps
            for pp in range(1, world // tp + 1)
            if (world // tp) % (pp * cp) == 0 and pp <= model.text_decoder.num_layers
        ),
        key=lambda o: (o[0] * o[1], o[1]),
    )
    plans = []
    ladder = OFFLOAD_LADDER if cfg.backend_config.generate_config.colocate and cfg.env.DEVICE != "cpu" else ((),)
    for tp, pp in options:
        vit_layers, llm_layers = split_layers(model, pp, seq, image_tokens(cfg))
        layout = with_layout(cfg, tp, pp, vit_layers, llm_layers, expert_parallel(experts, world // (tp * pp)))
        for kinds in ladder:
            plan = current_plan(with_offload(layout, kinds))
            if plan.fits:
                return plan
            plans.append(plan)
    return min(plans, key=lambda p: p.peak)


def expert_parallel(experts: int, replicas: int) -> int:
    """The largest EP that divides both the experts and the DP x CP replicas (1 for a dense model)."""
    return max(d for d in range(1, replicas + 1) if replicas % d == 0 and (experts % d == 0 if experts else d == 1))


def batch_sizes(
    dp: int, micro_batch_size: int, n_samples: int, target_gbs: int, target_prompts: int
) -> tuple[int, int]:
    """(global_batch_size, rollout_batch_size) near the targets: GBS a multiple of MBS x DP, and the
    rollout's samples (prompts x n) a whole number of GBS-sized optimizer steps."""
    unit = micro_batch_size * dp
    gbs = max(1, math.ceil(target_gbs / unit)) * unit
    step = math.lcm(gbs, n_samples) // n_samples
    return gbs, max(1, math.ceil(target_prompts / step)) * step
