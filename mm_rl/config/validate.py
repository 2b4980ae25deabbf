"""Every rule a job must satisfy, checked together before anything expensive starts.

Each rule is a small function yielding ``Violation``s (key path, value, rule, fix); ``validate`` runs them all,
so a config with five mistakes reports five.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mm_rl.config.loader import Violation
from mm_rl.config.schema import LLM_PP_LAYERS, PP, TP, VIT_PP_LAYERS, JobConfig
from mm_rl.config.topology import topology

Rule = Callable[[JobConfig], Iterator[Violation]]
RULES: list[Rule] = []

MODEL = "backend_config.model"
TEXT = f"{MODEL}.text_decoder"
VIT = f"{MODEL}.image_encoder.vision_encoder"
PROJ = f"{MODEL}.image_encoder.vision_projector"
TRAIN = "backend_config.training"
MT = "backend_config.megatron_training"
ACTOR = "backend_config.actor_config"
HF2MG = "backend_config.convert_ckpt_hf2mg.cfg"
MG2HF = "backend_config.convert_ckpt_mg2hf.cfg"
RL = "backend_config.rl_config"
GEN = "backend_config.generate_config"
DATA = "backend_config.data.dataset_param"


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def validate(cfg: JobConfig, check_paths: bool = True) -> list[Violation]:
    """All violations of ``cfg``; paths on disk and the HF checkpoint are checked when ``check_paths``."""
    found = [v for r in RULES for v in r(cfg)]
    if check_paths:
        found += [v for r in PATH_RULES for v in r(cfg)]
    return found


def head_dim(cfg: JobConfig) -> int:
    text = cfg.backend_config.model.text_decoder
    return text.kv_channels or text.hidden_size // max(1, text.num_attention_heads)


# --------------------------------------------------------------------------------------- sizes
@rule
def positive_sizes(cfg: JobConfig) -> Iterator[Violation]:
    b = cfg.backend_config
    sizes = {
        "env.NNODES": cfg.env.NNODES, "env.NPROC_PER_NODE": cfg.env.NPROC_PER_NODE,
        f"{ACTOR}.tensor_model_parallel_size": b.actor_config.tensor_model_parallel_size,
        f"{ACTOR}.pipeline_model_parallel_size": b.actor_config.pipeline_model_parallel_size,
        f"{TRAIN}.context-parallel-size": b.training.context_parallel_size,
        f"{ACTOR}.micro_batch_size": b.actor_config.micro_batch_size,
        f"{MT}.global_batch_size": b.megatron_training.global_batch_size,
        f"{MT}.train_iters": b.megatron_training.train_iters,
        f"{RL}.rollout_batch_size": b.rl_config.rollout_batch_size,
        f"{RL}.n_samples_per_prompt": b.rl_config.n_samples_per_prompt,
        f"{RL}.ppo_epochs": b.rl_config.ppo_epochs,
        f"{TRAIN}.seq-length": b.training.seq_length,
        f"{GEN}.sampling_config.max_tokens": b.generate_config.sampling_config.max_tokens,
        f"{GEN}.infer_tensor_parallel_size": b.generate_config.infer_tensor_parallel_size,
        f"{GEN}.max_images_per_prompt": b.generate_config.max_images_per_prompt,
        f"{TEXT}.num_layers": b.model.text_decoder.num_layers,
        f"{TRAIN}.make-vocab-size-divisible-by": b.training.make_vocab_size_divisible_by,
    }
    for key, value in sizes.items():
        if value < 1:
            yield Violation(key, value, "must be at least 1", "use a positive integer")
    if not 0 <= cfg.env.NODE_RANK < max(1, cfg.env.NNODES):
        yield Violation("env.NODE_RANK", cfg.env.NODE_RANK, f"must be in [0, NNODES={cfg.env.NNODES})",
                        "give the head node 0 and the others 1..NNODES-1")


@rule
def rollout_engine_fits(cfg: JobConfig) -> Iterator[Violation]:
    g, env, key = cfg.backend_config.generate_config, cfg.env, f"{GEN}.infer_tensor_parallel_size"
    if env.DEVICE == "cpu" or g.infer_tensor_parallel_size < 1:
        return
    if g.colocate and g.infer_tensor_parallel_size > 1:
        yield Violation(key, g.infer_tensor_parallel_size, "a colocated engine shares actor rank 0's device, so it "
                        "runs on one device", f"set {GEN}.colocate: false to give the engine devices of its own, or "
                        "infer_tensor_parallel_size: 1")
    elif g.infer_tensor_parallel_size > env.NPROC_PER_NODE:
        yield Violation(key, g.infer_tensor_parallel_size, f"a separate engine runs on one node, which has "
                        f"NPROC_PER_NODE = {env.NPROC_PER_NODE} devices", "use a smaller engine TP")
    elif topology(cfg).world_size < 1:
        yield Violation(f"{GEN}.colocate", g.colocate, f"a separate engine takes {topology(cfg).rollout_devices} of "
                        f"the {env.NNODES * env.NPROC_PER_NODE} devices, leaving none for the actor",
                        "add devices (NNODES / NPROC_PER_NODE) or set colocate: true")


@rule
def one_step_off_policy_needs_a_free_engine(cfg: JobConfig) -> Iterator[Violation]:
    """The next batch generates while the actor trains: the engine cannot sleep on the actor's devices then, and
    dynamic sampling's extra batches would have to wait for the update."""
    rl, g = cfg.backend_config.rl_config, cfg.backend_config.generate_config
    if not rl.one_step_off_policy:
        return
    if g.colocate and cfg.env.DEVICE != "cpu":
        yield Violation(f"{RL}.one_step_off_policy", True, "a colocated engine sleeps while the actor trains, so it "
                        "cannot generate ahead", f"set {GEN}.colocate: false (the engine on devices of its own), or "
                        "one_step_off_policy: false")
    if rl.dynamic_sampling.enable:
        yield Violation(f"{RL}.dynamic_sampling.enable", True, "dynamic sampling draws its extra batches after "
                        "seeing the first one's rewards, which the one-step-off-policy pipeline has not waited for",
                        f"turn one of them off ({RL}.one_step_off_policy or dynamic_sampling.enable)")


@rule
def world_divisible(cfg: JobConfig) -> Iterator[Violation]:
    topo = topology(cfg)
    model_parallel, world = topo.tp * topo.pp * topo.cp, topo.world_size
    if world > 0 and model_parallel > 0 and world % model_parallel:
        engine = f" minus the separate engine's {topo.rollout_devices}" if topo.rollout_devices else ""
        yield Violation("env.NPROC_PER_NODE", cfg.env.NPROC_PER_NODE,
                        f"the actor's devices (NNODES x NPROC_PER_NODE{engine}) = {world} are not divisible by "
                        f"TP x PP x CP = {model_parallel}",
                        "change the device count or TP/PP/CP so that TP x PP x CP divides it")


@rule
def gbs_multiple(cfg: JobConfig) -> Iterator[Violation]:
    mbs = cfg.backend_config.actor_config.micro_batch_size
    gbs = cfg.backend_config.megatron_training.global_batch_size
    dp = topology(cfg).dp
    unit = mbs * dp
    if unit > 0 and gbs % unit:
        yield Violation(f"{MT}.global_batch_size", gbs,
                        f"must be a multiple of MBS x DP = {mbs} x {dp} = {unit}",
                        f"use {max(unit, gbs // unit * unit)} or {(gbs // unit + 1) * unit}")


@rule
def rollout_fills_minibatches(cfg: JobConfig) -> Iterator[Violation]:
    rl = cfg.backend_config.rl_config
    samples = rl.rollout_batch_size * rl.n_samples_per_prompt
    gbs = cfg.backend_config.megatron_training.global_batch_size
    if gbs > 0 and samples % gbs:
        yield Violation(f"{MT}.global_batch_size", gbs,
                        f"rollout_batch_size x n_samples_per_prompt = {samples} samples per step must split into "
                        "whole optimizer steps of GBS samples", "make GBS divide the samples per step")


# ---------------------------------------------------------------------------- tensor parallelism
@rule
def tp_divides(cfg: JobConfig) -> Iterator[Violation]:
    m = cfg.backend_config.model
    tp = cfg.backend_config.actor_config.tensor_model_parallel_size
    if tp < 1:
        return
    text, vit = m.text_decoder, m.image_encoder.vision_encoder
    for key, value in ((f"{TEXT}.num_attention_heads", text.num_attention_heads),
                       (f"{TEXT}.num_query_groups", _query_groups(cfg)),
                       (f"{TEXT}.ffn_hidden_size", text.ffn_hidden_size),
                       (f"{VIT}.num_attention_heads", vit.num_attention_heads),
                       (f"{VIT}.ffn_hidden_size", vit.ffn_hidden_size)):
        if value % tp:
            yield Violation(f"{ACTOR}.tensor_model_parallel_size", tp, f"TP must divide {key} = {value}",
                            f"pick a TP among {_divisors(value)}")


def _query_groups(cfg: JobConfig) -> int:
    text = cfg.backend_config.model.text_decoder
    return text.num_query_groups if text.group_query_attention else text.num_attention_heads


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 64) + 1) if n % d == 0]


@rule
def query_groups_divide_heads(cfg: JobConfig) -> Iterator[Violation]:
    text = cfg.backend_config.model.text_decoder
    if text.group_query_attention and (text.num_query_groups < 1 or text.num_attention_heads % text.num_query_groups):
        yield Violation(f"{TEXT}.num_query_groups", text.num_query_groups,
                        f"must divide num_attention_heads = {text.num_attention_heads}",
                        f"use one of {_divisors(text.num_attention_heads)}")


@rule
def vocab_padding(cfg: JobConfig) -> Iterator[Violation]:
    t = cfg.backend_config.training
    vocab = cfg.backend_config.model.text_decoder.vocab_size
    unit = t.make_vocab_size_divisible_by * t.tensor_model_parallel_size
    if unit > 0 and vocab % unit:
        yield Violation(f"{TRAIN}.make-vocab-size-divisible-by", t.make_vocab_size_divisible_by,
                        f"padded vocab {vocab} must be divisible by make-vocab-size-divisible-by x TP = {unit}",
                        "lower make-vocab-size-divisible-by (the vocab is fixed by the checkpoint)")


# ------------------------------------------------------------------------------ pipeline layout
@rule
def pipeline_layers(cfg: JobConfig) -> Iterator[Violation]:
    pp = cfg.backend_config.actor_config.pipeline_model_parallel_size
    m = cfg.backend_config.model
    for key, layers, total in ((LLM_PP_LAYERS, m.text_decoder.pipeline_num_layers, m.text_decoder.num_layers),
                               (VIT_PP_LAYERS, m.image_encoder.vision_encoder.pipeline_num_layers,
                                m.image_encoder.vision_encoder.num_layers)):
        if len(layers) != pp:
            yield Violation(key, layers, f"needs one entry per pipeline stage (PP = {pp}), has {len(layers)}",
                            f"give {pp} entries summing to {total}")
        elif sum(layers) != total or min(layers) < 0:
            yield Violation(key, layers, f"entries must be >= 0 and sum to num_layers = {total} "
                            f"(they sum to {sum(layers)})", f"adjust the entries to sum to {total}")


@rule
def vit_first(cfg: JobConfig) -> Iterator[Violation]:
    vit = cfg.backend_config.model.image_encoder.vision_encoder.pipeline_num_layers
    llm = cfg.backend_config.model.text_decoder.pipeline_num_layers
    if len(vit) != len(llm):
        return
    first_llm_stage = next((i for i, n in enumerate(llm) if n > 0), len(llm))
    if any(n > 0 for n in vit[first_llm_stage + 1:]):
        yield Violation(VIT_PP_LAYERS, vit,
                        f"the ViT must finish before the LLM starts: stage {first_llm_stage} already holds LLM "
                        f"layers ({llm}) but a later stage still holds ViT blocks",
                        "move all ViT blocks to the stages up to the first one with LLM layers, e.g. "
                        f"[{sum(vit)}, 0, ...]")


@rule
def conversion_matches(cfg: JobConfig) -> Iterator[Violation]:
    b = cfg.backend_config
    expected: dict[str, Any] = {"tp_size": b.actor_config.tensor_model_parallel_size,
                                "llm_pp_layers": b.model.text_decoder.pipeline_num_layers,
                                "vit_pp_layers": b.model.image_encoder.vision_encoder.pipeline_num_layers}
    source = {"tp_size": TP, "llm_pp_layers": LLM_PP_LAYERS, "vit_pp_layers": VIT_PP_LAYERS}
    for stage, pc in ((HF2MG, b.convert_ckpt_hf2mg.cfg.parallel_config),
                      (MG2HF, b.convert_ckpt_mg2hf.cfg.parallel_config)):
        for name, want in expected.items():
            got = getattr(pc, name)
            if got != want:
                yield Violation(f"{stage}.parallel_config.{name}", got, f"must equal {source[name]} = {want}",
                                f"remove the key so it follows {source[name]}, or set it to {want}")
    t = b.training
    for flag, want_key in (("tensor_model_parallel_size", TP), ("pipeline_model_parallel_size", PP)):
        if getattr(t, flag) != getattr(b.actor_config, flag):
            yield Violation(f"{TRAIN}.{flag.replace('_', '-')}", getattr(t, flag),
                            f"must equal {want_key} = {getattr(b.actor_config, flag)}",
                            f"remove the key so it follows {want_key}")


# ---------------------------------------------------------------------------------- model shape
@rule
def mrope_sum(cfg: JobConfig) -> Iterator[Violation]:
    section = cfg.backend_config.model.text_decoder.mrope_section
    if sum(section) * 2 != head_dim(cfg):
        yield Violation(f"{TEXT}.mrope_section", section,
                        f"must sum to head_dim / 2 = {head_dim(cfg) // 2} (sums to {sum(section)})",
                        "split head_dim / 2 over (time, height, width), e.g. [16, 24, 24] for head_dim 128")


@rule
def projector_sizes(cfg: JobConfig) -> Iterator[Violation]:
    m = cfg.backend_config.model
    text, proj, vit = m.text_decoder, m.image_encoder.vision_projector, m.image_encoder.vision_encoder
    if proj.hidden_size != text.hidden_size:
        yield Violation(f"{PROJ}.hidden_size", proj.hidden_size,
                        f"the projector output must equal {TEXT}.hidden_size = {text.hidden_size}",
                        f"set it to {text.hidden_size}")
    if text.llm_hidden_size != text.hidden_size:
        yield Violation(f"{TEXT}.llm_hidden_size", text.llm_hidden_size,
                        f"must equal {TEXT}.hidden_size = {text.hidden_size}", "remove the key so it follows")
    if proj.input_size != vit.hidden_size:
        yield Violation(f"{PROJ}.input_size", proj.input_size, f"must equal {VIT}.hidden_size = {vit.hidden_size}",
                        f"set it to {vit.hidden_size}")
    if any(not 0 <= i < vit.num_layers for i in vit.fullatt_block_indexes):
        yield Violation(f"{VIT}.fullatt_block_indexes", vit.fullatt_block_indexes,
                        f"indexes must lie in [0, num_layers = {vit.num_layers})", "drop the indexes past the end")


@rule
def fused_kernels(cfg: JobConfig) -> Iterator[Violation]:
    t, text = cfg.backend_config.training, cfg.backend_config.model.text_decoder
    if t.use_fused_rmsnorm and text.normalization != "RMSNorm":
        yield Violation(f"{TRAIN}.use-fused-rmsnorm", True, f"needs normalization RMSNorm (is {text.normalization})",
                        "turn use-fused-rmsnorm off or use RMSNorm")
    if t.use_fused_swiglu and not text.swiglu:
        yield Violation(f"{TRAIN}.use-fused-swiglu", True, "needs swiglu", "turn use-fused-swiglu off or swiglu on")


@rule
def context_parallel(cfg: JobConfig) -> Iterator[Violation]:
    t = cfg.backend_config.training
    if t.context_parallel_algo is not None and t.context_parallel_size <= 1:
        yield Violation(f"{TRAIN}.context-parallel-algo", t.context_parallel_algo,
                        "needs context-parallel-size > 1", "remove it or raise context-parallel-size")
    heads = cfg.backend_config.model.text_decoder.num_attention_heads
    if t.context_parallel_size > 1 and heads % (t.context_parallel_size * t.tensor_model_parallel_size):
        yield Violation(f"{TRAIN}.context-parallel-size", t.context_parallel_size,
                        f"Ulysses CP splits the heads: CP x TP must divide num_attention_heads = {heads}",
                        "lower CP or TP")


@rule
def freeze_flags(cfg: JobConfig) -> Iterator[Violation]:
    enc = cfg.backend_config.model.image_encoder
    if not enc.vision_encoder.freeze:
        yield Violation(f"{VIT}.freeze", False, "model.json's freeze flag is not the switch for training the ViT",
                        f"keep freeze: true and set {ACTOR}.unfreeze_vision_encoder: true "
                        f"(optionally {ACTOR}.vision_encoder_lr)")
    if enc.vision_projector.freeze:
        yield Violation(f"{PROJ}.freeze", True, "model.json's freeze flag is not the switch for the projector",
                        f"keep freeze: false and set {ACTOR}.freeze_vision_projector: true")


# ------------------------------------------------------------------------------- optimisation / RL
@rule
def learning_rate(cfg: JobConfig) -> Iterator[Violation]:
    a, t = cfg.backend_config.actor_config, cfg.backend_config.training
    if a.lr < a.min_lr:
        yield Violation(f"{ACTOR}.min_lr", a.min_lr, f"must not exceed lr = {a.lr}", "lower min_lr or raise lr")
    if not 0 <= t.lr_warmup_fraction < 1:
        yield Violation(f"{TRAIN}.lr-warmup-fraction", t.lr_warmup_fraction, "must lie in [0, 1)",
                        "use e.g. 0.1 (10% of train-iters)")
    if cfg.backend_config.megatron_training.save_interval <= 0:
        yield Violation(f"{MT}.save_interval", cfg.backend_config.megatron_training.save_interval,
                        "must be > 0", "use a step count; the last step is always saved")


@rule
def rl_settings(cfg: JobConfig) -> Iterator[Violation]:
    rl, gen = cfg.backend_config.rl_config, cfg.backend_config.generate_config
    if rl.adv_estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline") and rl.n_samples_per_prompt < 2:
        yield Violation(f"{RL}.n_samples_per_prompt", rl.n_samples_per_prompt,
                        f"{rl.adv_estimator} compares samples within a group: needs at least 2", "use 4 to 16")
    for key in ("clip_ratio_low", "clip_ratio_high"):
        if getattr(rl, key) < 0:
            yield Violation(f"{RL}.{key}", getattr(rl, key), "must be >= 0", "use e.g. 0.2")
    if rl.clip_ratio_c <= 1:
        yield Violation(f"{RL}.clip_ratio_c", rl.clip_ratio_c, "dual clip needs a bound > 1", "use e.g. 3.0")
    if ":" not in rl.reward.function:
        yield Violation(f"{RL}.reward.function", rl.reward.function, "must be 'module:function'",
                        "e.g. mm_rl.rewards.geo3k:compute_score")
    buffer = rl.overlong_buffer
    if buffer.enable and not 0 < buffer.len <= gen.sampling_config.max_tokens:
        yield Violation(f"{RL}.overlong_buffer.len", buffer.len,
                        f"must lie in (0, max_tokens = {gen.sampling_config.max_tokens}] when the buffer is enabled",
                        "use e.g. a quarter of max_tokens, or disable the buffer")
    if gen.sampling_config.temperature < 0:
        yield Violation(f"{GEN}.sampling_config.temperature", gen.sampling_config.temperature, "must be >= 0",
                        "use 1.0 for sampling, 0 for greedy")
    if not 0 < gen.gpu_memory_utilization <= 1:
        yield Violation(f"{GEN}.gpu_memory_utilization", gen.gpu_memory_utilization, "must lie in (0, 1]",
                        "use e.g. 0.6")


@rule
def policy_loss_settings(cfg: JobConfig) -> Iterator[Violation]:
    """Each policy loss's own parameters: a ratio band needs ``1 - clip_ratio_low > 0`` (CISPO alone may drop its
    lower bound), GSPO is a per-sequence objective, SAPO's gate divides by its temperatures."""
    rl = cfg.backend_config.rl_config
    if rl.policy_loss != "cispo" and rl.clip_ratio_low >= 1:
        yield Violation(f"{RL}.clip_ratio_low", rl.clip_ratio_low, f"{rl.policy_loss} clips the ratio below at "
                        "1 - clip_ratio_low, which must stay > 0",
                        "use e.g. 0.2 (only cispo takes >= 1: no lower bound)")
    if rl.policy_loss == "gspo" and rl.loss_agg_mode != "seq-mean-token-mean":
        yield Violation(f"{RL}.loss_agg_mode", rl.loss_agg_mode, "gspo's ratio and clip are per sequence: its "
                        "objective weighs every sequence the same (GSPO's 1/G mean)",
                        "set loss_agg_mode: seq-mean-token-mean")
    for key in ("tau_pos", "tau_neg"):
        if getattr(rl, key) <= 0:
            yield Violation(f"{RL}.{key}", getattr(rl, key), "the SAPO gate (4 / tau) * sigmoid(tau * (r - 1)) needs "
                            "tau > 0", "use the paper's tau_pos 1.0, tau_neg 1.05")


@rule
def rollout_correction_settings(cfg: JobConfig) -> Iterator[Violation]:
    """The importance-sampling bound, and a correction that bypass mode would make a silent no-op."""
    rc = cfg.backend_config.rl_config.rollout_correction
    key = f"{RL}.rollout_correction"
    if rc.rollout_is_threshold <= 1:
        yield Violation(f"{key}.rollout_is_threshold", rc.rollout_is_threshold, "weights scatter around 1 (a matched "
                        "token's is 1): a bound <= 1 cuts or drops about half the tokens even when the engine and the "
                        "actor agree up to rounding",
                        "use e.g. 2.0 (token) or 2.0-10.0 (sequence)")
    if rc.bypass_mode and rc.rollout_is in ("token", "sequence"):
        yield Violation(f"{key}.rollout_is", rc.rollout_is, "bypass_mode takes the engine's log-probs as the old "
                        "ones, so every weight pi_old / pi_engine is 1: the correction would do nothing",
                        "set rollout_is: auto (or null) to bypass, or bypass_mode: false to correct (an old "
                        "log-prob pass, then the weights)")


@rule
def sequence_budget(cfg: JobConfig) -> Iterator[Violation]:
    b = cfg.backend_config
    prompt = b.data.dataset_param.preprocess_parameters.max_prompt_length
    response = b.generate_config.sampling_config.max_tokens
    if prompt + response > b.training.seq_length:
        yield Violation(f"{TRAIN}.seq-length", b.training.seq_length,
                        f"must hold max_prompt_length + max_tokens = {prompt} + {response} = {prompt + response}",
                        f"raise seq-length to {prompt + response} or shorten prompts / responses")
    pre = b.data.dataset_param.preprocess_parameters
    if pre.min_pixels > pre.max_pixels:
        yield Violation(f"{DATA}.preprocess_parameters.min_pixels", pre.min_pixels,
                        f"must not exceed max_pixels = {pre.max_pixels}", "lower min_pixels")


# ------------------------------------------------------------------------------- paths and the HF dir
def _must_exist(key: str, path: str, what: str) -> Iterator[Violation]:
    if not path:
        yield Violation(key, path, f"{what} is required", f"set {key} to the {what}")
    elif not Path(path).exists():
        yield Violation(key, path, f"{what} does not exist", f"point {key} at an existing {what}")


def _writable(key: str, path: str) -> Iterator[Violation]:
    existing = Path(path).absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        yield Violation(key, path, f"cannot be created ({existing} is not a writable directory)",
                        "choose a directory you can write to")


def paths_exist(cfg: JobConfig) -> Iterator[Violation]:
    b = cfg.backend_config
    yield from _must_exist(f"{DATA}.basic_parameters.dataset_dir", b.data.dataset_param.basic_parameters.dataset_dir,
                           "dataset directory")
    if not b.megatron_training.tokenizer_name_or_path:
        yield Violation(f"{MT}.tokenizer_name_or_path", "", "the HuggingFace checkpoint to train is required",
                        "set it to the checkpoint directory (hf_dir and the processor follow it)")
    elif b.convert_ckpt_hf2mg.cfg.hf_config.hf_dir:
        yield from _must_exist(f"{HF2MG}.hf_config.hf_dir", b.convert_ckpt_hf2mg.cfg.hf_config.hf_dir,
                               "HuggingFace checkpoint directory")
    for key, path in (("af_output_dir", cfg.af_output_dir), (f"{HF2MG}.mm_dir", b.convert_ckpt_hf2mg.cfg.mm_dir),
                      (f"{MG2HF}.save_hf_dir", b.convert_ckpt_mg2hf.cfg.save_hf_dir)):
        yield from _writable(key, path)


def hf_checkpoint_matches(cfg: JobConfig) -> Iterator[Violation]:
    """The seed forbids changing token ids and vocab; layers may shrink, never grow; sizes must match."""
    config_file = Path(cfg.backend_config.convert_ckpt_hf2mg.cfg.hf_config.hf_dir or ".") / "config.json"
    if not config_file.is_file():
        return
    hf = json.loads(config_file.read_text())
    text_hf, vit_hf = hf.get("text_config", hf), hf.get("vision_config", {})
    m = cfg.backend_config.model
    text, vit = m.text_decoder, m.image_encoder.vision_encoder
    same = [
        (f"{MODEL}.img_context_token_id", m.img_context_token_id, hf.get("image_token_id")),
        (f"{MODEL}.vision_start_token_id", m.vision_start_token_id, hf.get("vision_start_token_id")),
        (f"{TEXT}.vocab_size", text.vocab_size, text_hf.get("vocab_size")),
        (f"{TEXT}.hidden_size", text.hidden_size, text_hf.get("hidden_size")),
        (f"{TEXT}.ffn_hidden_size", text.ffn_hidden_size, text_hf.get("intermediate_size")),
        (f"{TEXT}.num_attention_heads", text.num_attention_heads, text_hf.get("num_attention_heads")),
        (f"{TEXT}.num_query_groups", _query_groups(cfg), text_hf.get("num_key_value_heads")),
        (f"{VIT}.hidden_size", vit.hidden_size, vit_hf.get("hidden_size")),
        (f"{VIT}.ffn_hidden_size", vit.ffn_hidden_size, vit_hf.get("intermediate_size")),
        (f"{VIT}.num_attention_heads", vit.num_attention_heads, vit_hf.get("num_heads")),
    ]
    tied = text_hf.get("tie_word_embeddings", hf.get("tie_word_embeddings"))
    if tied is not None:
        same.append((f"{TEXT}.untie_embeddings_and_output_weights", text.untie_embeddings_and_output_weights,
                     not tied))
    for key, ours, theirs in same:
        if theirs is not None and ours != theirs:
            yield Violation(key, ours, f"must match the checkpoint's {config_file} ({theirs})", f"set it to {theirs}")
    for key, ours, theirs in ((f"{TEXT}.num_layers", text.num_layers, text_hf.get("num_hidden_layers")),
                              (f"{VIT}.num_layers", vit.num_layers, vit_hf.get("depth"))):
        if theirs is not None and ours > theirs:
            yield Violation(key, ours, f"the checkpoint has only {theirs} (layers may be removed, never added)",
                            f"use at most {theirs}")


PATH_RULES: list[Rule] = [paths_exist, hf_checkpoint_matches]
