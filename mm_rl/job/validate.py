"""Every rule a job must satisfy, checked together before anything expensive starts.

Each rule is a small function yielding ``Violation``s (key path, value, rule, fix); ``validate`` runs them all,
so a config with five mistakes reports five.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from mm_rl.config.loader import Violation, relative_note, source_of
from mm_rl.config.plan import DEFAULT_DEVICE_MEMORY_GB, sharded_sizes, tp_choices
from mm_rl.config.schema import EP, LLM_PP_LAYERS, PP, TP, VIT_PP_LAYERS, JobConfig
from mm_rl.config.topology import topology
from mm_rl.models.family import HfConfigError, UnknownFamily
from mm_rl.models.registry import FAMILIES, family_for_hf, family_of
from mm_rl.rollout.base import GREEDY_BELOW

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
        "env.NNODES": cfg.env.NNODES,
        "env.NPROC_PER_NODE": cfg.env.NPROC_PER_NODE,
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
        f"{RL}.reward.num_workers": b.rl_config.reward.num_workers,
        f"{GEN}.max_num_seqs": b.generate_config.max_num_seqs,
        f"{RL}.dynamic_sampling.max_num_gen_batches": b.rl_config.dynamic_sampling.max_num_gen_batches,
    }
    for key, value in sizes.items():
        if value < 1:
            yield Violation(key, value, "must be at least 1", "use a positive integer")


@rule
def engine_runs_the_model(cfg: JobConfig) -> Iterator[Violation]:
    """model.json changes the rollout engine must follow (its config.json is the job's model's): vLLM's Qwen2 /
    Qwen3 MLP runs silu only (vllm/model_executor/models/qwen2.py, ``Qwen2MLP``: "Only silu is supported"), so
    another activation would have the engine sample from a model other than the one the actor trains."""
    b = cfg.backend_config
    activation = b.model.text_decoder.activation_func
    if b.generate_config.backend == "vllm" and activation != "silu":
        yield Violation(
            f"{TEXT}.activation_func", activation,
            "vLLM's Qwen MLP runs silu only: the engine could not build the model the actor trains",
            f"keep silu, or roll out with {GEN}.backend: hf (transformers runs any activation)",
        )  # fmt: skip


@rule
def value_ranges(cfg: JobConfig) -> Iterator[Violation]:
    """Values of the right type that no run can use: each found by a first try, then a traceback or a wrong run."""
    b = cfg.backend_config
    seed = b.training.seed
    if not 0 <= seed <= 2**32 - 1:
        yield Violation(f"{TRAIN}.seed", seed, "must lie in [0, 2^32 - 1] (numpy's and the engine's seed range)",
                        "use a non-negative seed below 4294967296, e.g. 42")  # fmt: skip
    if b.rl_config.val_freq < 0:
        yield Violation(f"{RL}.val_freq", b.rl_config.val_freq, "must be 0 (off) or a step count",
                        "use 0 to validate never, or N to validate every N steps")  # fmt: skip
    gamma = b.rl_config.gamma
    if not 0 < gamma <= 1:
        yield Violation(f"{RL}.gamma", gamma, "a discount lies in (0, 1]", "use 1.0 (no discount) or e.g. 0.99")
    logprobs = b.generate_config.sampling_config.logprobs
    if logprobs < 0:
        yield Violation(f"{GEN}.sampling_config.logprobs", logprobs, "must be 0 or a count of alternatives",
                        "use 0 (the sampled token's log-prob only)")  # fmt: skip
    memory, reserve = cfg.env.DEVICE_MEMORY_GB, cfg.env.DEVICE_MEMORY_RESERVE_GB
    if memory is not None and not memory > 0:
        yield Violation("env.DEVICE_MEMORY_GB", memory, "must be a positive size", "use the device's GiB, e.g. 80")
    if reserve is not None and not 0 <= reserve < (memory or DEFAULT_DEVICE_MEMORY_GB[cfg.env.DEVICE]):
        yield Violation("env.DEVICE_MEMORY_RESERVE_GB", reserve, "must lie in [0, the device memory)",
                        "leave it unset (6 GiB on cuda / npu, 0 on cpu) or give a few GiB")  # fmt: skip
    if not cfg.env.RAY_CONNECT_TIMEOUT_S > 0:
        yield Violation("env.RAY_CONNECT_TIMEOUT_S", cfg.env.RAY_CONNECT_TIMEOUT_S, "must be a positive time",
                        "use e.g. 30 (seconds)")  # fmt: skip
    if not 0 <= cfg.env.NODE_RANK < max(1, cfg.env.NNODES):
        yield Violation(
            "env.NODE_RANK",
            cfg.env.NODE_RANK,
            f"must be in [0, NNODES={cfg.env.NNODES})",
            "give the head node 0 and the others 1..NNODES-1",
        )


@rule
def rollout_engine_fits(cfg: JobConfig) -> Iterator[Violation]:
    g, env, key = cfg.backend_config.generate_config, cfg.env, f"{GEN}.infer_tensor_parallel_size"
    devices = env.NNODES * env.NPROC_PER_NODE
    if g.replicas < 0:
        yield Violation(f"{GEN}.replicas", g.replicas, "must be at least 0", "0 (one per device) or a count")
        return
    if env.DEVICE == "cpu" or g.infer_tensor_parallel_size < 1:
        return
    tp = g.infer_tensor_parallel_size
    if g.colocate and env.NPROC_PER_NODE % tp:
        yield Violation(
            key,
            tp,
            f"a colocated engine replica spans {tp} devices of one node beside the actor ranks "
            f"there, and a node's NPROC_PER_NODE = {env.NPROC_PER_NODE} devices do not split into "
            f"groups of {tp}",
            "use an engine TP that divides NPROC_PER_NODE",
        )
    elif g.colocate and g.replicas * tp > devices:
        yield Violation(
            f"{GEN}.replicas",
            g.replicas,
            f"colocated replicas take {tp} device(s) each (infer_tensor_parallel_size), and the job has {devices}",
            f"use at most {devices // tp} (0: every device)",
        )
    elif g.infer_tensor_parallel_size > env.NPROC_PER_NODE:
        yield Violation(
            key,
            g.infer_tensor_parallel_size,
            f"an engine replica runs on one node, which has NPROC_PER_NODE = {env.NPROC_PER_NODE} devices",
            "use a smaller engine TP",
        )
    elif topology(cfg).world_size < 1:
        yield Violation(
            f"{GEN}.colocate",
            g.colocate,
            f"the separate engine replicas take "
            f"{topology(cfg).rollout_devices} of the {devices} devices, leaving none for the actor",
            f"add devices (NNODES / NPROC_PER_NODE), fewer {GEN}.replicas, or colocate: true",
        )


@rule
def one_step_off_policy_needs_a_free_engine(cfg: JobConfig) -> Iterator[Violation]:
    """The next batch generates while the actor trains: the engine cannot sleep on the actor's devices then, and
    dynamic sampling's extra batches would have to wait for the update."""
    rl, g = cfg.backend_config.rl_config, cfg.backend_config.generate_config
    if not rl.one_step_off_policy:
        return
    if g.colocate and cfg.env.DEVICE != "cpu":
        yield Violation(
            f"{RL}.one_step_off_policy",
            True,
            "a colocated engine sleeps while the actor trains, so it cannot generate ahead",
            f"set {GEN}.colocate: false (the engine on devices of its own), or one_step_off_policy: false",
        )
    if rl.dynamic_sampling.enable:
        yield Violation(
            f"{RL}.dynamic_sampling.enable",
            True,
            "dynamic sampling draws its extra batches after "
            "seeing the first one's rewards, which the one-step-off-policy pipeline has not waited for",
            f"turn one of them off ({RL}.one_step_off_policy or dynamic_sampling.enable)",
        )


@rule
def world_divisible(cfg: JobConfig) -> Iterator[Violation]:
    topo = topology(cfg)
    model_parallel, world = topo.model_parallel, topo.world_size
    if world > 0 and model_parallel > 0 and world % model_parallel:
        engine = f" minus the separate engines' {topo.rollout_devices}" if topo.rollout_devices else ""
        yield Violation(
            "env.NPROC_PER_NODE",
            cfg.env.NPROC_PER_NODE,
            f"the actor's devices (NNODES x NPROC_PER_NODE{engine}) = {world} are not divisible by "
            f"TP x PP x CP = {model_parallel}",
            "change the device count or TP/PP/CP so that TP x PP x CP divides it",
        )


@rule
def gbs_multiple(cfg: JobConfig) -> Iterator[Violation]:
    """GBS splits into MBS x DP micro-batches. A fix is computed only from a DP that exists: while the actor's
    devices do not divide by TP x PP x CP, only a GBS that is not even a multiple of MBS is surely wrong."""
    mbs = cfg.backend_config.actor_config.micro_batch_size
    gbs = cfg.backend_config.megatron_training.global_batch_size
    topo = topology(cfg)
    world, model_parallel = topo.world_size, topo.model_parallel
    if mbs < 1:
        return  # positive_sizes
    if world < 1 or model_parallel < 1 or world % model_parallel:
        if gbs % mbs:
            yield Violation(
                f"{MT}.global_batch_size",
                gbs,
                f"must be a multiple of MBS x DP, so at least of MBS = "
                f"{mbs}; DP = the actor's devices / (TP x PP x CP) = {world} / {model_parallel} is not a "
                "positive whole number yet",
                "fix the device count or TP / PP / CP first (see their error), then use a multiple of MBS x DP",
            )
        return
    dp = topo.dp  # the devices divide by TP x PP x CP here
    if cfg.backend_config.actor_config.max_tokens_per_micro_batch is not None:  # cut by tokens: MBS plays no part
        if gbs < dp:
            yield Violation(
                f"{MT}.global_batch_size",
                gbs,
                f"gives each of the DP = {dp} replicas less than one sample",
                f"use at least {dp}",
            )
        return
    unit = mbs * dp
    if gbs % unit:
        yield Violation(
            f"{MT}.global_batch_size",
            gbs,
            f"must be a multiple of MBS x DP = {mbs} x {dp} = {unit}",
            "use " + " or ".join(map(str, _gbs_choices(cfg, gbs, unit))),
        )


def _gbs_choices(cfg: JobConfig, gbs: int, unit: int) -> list[int]:
    """The multiples of ``unit`` nearest ``gbs`` (below and above) to propose; while the mini-batch follows GBS, only
    those that also split a step's samples into whole mini-batches (``rollout_fills_minibatches``), so the fix does
    not break that rule."""
    below = gbs // unit * unit
    choices = [n for n in (below, below + unit) if n > 0]
    rl = cfg.backend_config.rl_config
    samples = rl.rollout_batch_size * rl.n_samples_per_prompt
    if rl.mini_batch_size != gbs or samples < 1:
        return choices
    fitting = [n for n in range(unit, samples + 1, unit) if samples % n == 0]
    lower, higher = [n for n in fitting if n < gbs], [n for n in fitting if n > gbs]
    return (lower[-1:] + higher[:1]) or choices


@rule
def rollout_fills_minibatches(cfg: JobConfig) -> Iterator[Violation]:
    """The trainer takes whole mini-batches (``rl_config.mini_batch_size``, which follows GBS) of a step's samples
    and drops the rest: a mini-batch larger than the step would train on nothing, and still exit 0. The key named
    is the one the value was set at."""
    b = cfg.backend_config
    rl, gbs = b.rl_config, b.megatron_training.global_batch_size
    samples, mini = rl.rollout_batch_size * rl.n_samples_per_prompt, rl.mini_batch_size
    key = f"{MT}.global_batch_size" if mini == gbs else f"{RL}.mini_batch_size"
    unit = b.actor_config.micro_batch_size * topology(cfg).dp
    if mini > 0 and unit > 0 and samples > 0 and samples % mini:
        effect = (
            "so no optimizer step would run at all"
            if mini > samples
            else f"the remaining {samples % mini} samples of every step would be dropped"
        )
        fits = [d for d in range(unit, samples + 1, unit) if samples % d == 0 and d <= mini]
        prompts = mini // math.gcd(mini, rl.n_samples_per_prompt)  # the rollout_batch_size step that fills it
        fix = f"use {fits[-1]} (a multiple of MBS x DP = {unit} that divides {samples}), or " if fits else ""
        yield Violation(
            key,
            mini,
            f"rollout_batch_size x n_samples_per_prompt = {rl.rollout_batch_size} x "
            f"{rl.n_samples_per_prompt} = {samples} samples per step must split into whole mini-batches "
            f"(one optimizer step each) of {mini}, {effect}",
            f"{fix}set {RL}.rollout_batch_size to a multiple of {prompts} "
            f"(e.g. {-(-rl.rollout_batch_size // prompts) * prompts})",
        )


# ---------------------------------------------------------------------------- tensor parallelism
@rule
def tp_divides(cfg: JobConfig) -> Iterator[Violation]:
    """One violation naming every size TP does not divide, with the one list of TPs that all the divisibility
    rules accept (a list per size would leave the user to intersect them)."""
    tp = cfg.backend_config.actor_config.tensor_model_parallel_size
    if tp < 1:
        return
    sizes = sharded_sizes(cfg)
    failed = [f"{key} = {size}" for key, size in sizes.items() if size % tp]
    if failed:
        unsure = (
            ""
            if f"{TEXT}.num_query_groups" in sizes
            else f"; {TEXT}.num_query_groups is left out: it does not divide the heads itself (see its error)"
        )
        yield Violation(
            f"{ACTOR}.tensor_model_parallel_size",
            tp,
            f"TP must divide {', '.join(failed)}",
            f"pick a TP that every divisibility rule (these sizes, the vocab padding, context-parallel "
            f"heads) accepts: one of {tp_choices(cfg)}{unsure}",
        )


def _query_groups(cfg: JobConfig) -> int:
    text = cfg.backend_config.model.text_decoder
    return text.num_query_groups if text.group_query_attention else text.num_attention_heads


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 64) + 1) if n % d == 0]


@rule
def query_groups_divide_heads(cfg: JobConfig) -> Iterator[Violation]:
    """The fix lists the group counts that divide the heads and that TP divides too (``tp_divides`` leaves wrong
    groups out of its TP list, so the two fixes agree)."""
    text = cfg.backend_config.model.text_decoder
    tp = cfg.backend_config.actor_config.tensor_model_parallel_size
    if text.group_query_attention and (text.num_query_groups < 1 or text.num_attention_heads % text.num_query_groups):
        divisors = _divisors(text.num_attention_heads)
        with_tp = [d for d in divisors if tp > 1 and d % tp == 0]
        yield Violation(
            f"{TEXT}.num_query_groups",
            text.num_query_groups,
            f"must divide num_attention_heads = {text.num_attention_heads}",
            f"use a divisor of the heads that TP = {tp} divides too: one of {with_tp}"
            if with_tp
            else f"use one of {divisors}",
        )


@rule
def vocab_padding(cfg: JobConfig) -> Iterator[Violation]:
    """Reported only where the padding unit is what is wrong: a TP that does not divide the vocab is
    ``tp_divides``'s (then no padding unit helps), so this fires with make-vocab-size-divisible-by > 1 only."""
    t = cfg.backend_config.training
    vocab = cfg.backend_config.model.text_decoder.vocab_size
    by, tp = t.make_vocab_size_divisible_by, t.tensor_model_parallel_size
    if by < 1 or tp < 1 or vocab % tp or vocab % (by * tp) == 0:
        return
    per_rank = vocab // tp
    best = max(d for d in range(1, min(by, per_rank) + 1) if per_rank % d == 0)
    yield Violation(
        f"{TRAIN}.make-vocab-size-divisible-by",
        by,
        f"the vocab ({vocab}, fixed by the checkpoint) must be divisible by make-vocab-size-divisible-by "
        f"x TP = {by} x {tp} = {by * tp}",
        f"use a divisor of vocab / TP = {per_rank}, e.g. {best}",
    )


# ------------------------------------------------------------------------------ pipeline layout
@rule
def pipeline_layers(cfg: JobConfig) -> Iterator[Violation]:
    pp = cfg.backend_config.actor_config.pipeline_model_parallel_size
    m = cfg.backend_config.model
    for key, layers, total in (
        (LLM_PP_LAYERS, m.text_decoder.pipeline_num_layers, m.text_decoder.num_layers),
        (VIT_PP_LAYERS, m.image_encoder.vision_encoder.pipeline_num_layers, m.image_encoder.vision_encoder.num_layers),
    ):
        if len(layers) != pp:
            yield Violation(
                key,
                layers,
                f"needs one entry per pipeline stage (PP = {pp}), has {len(layers)}",
                f"give {pp} entries summing to {total}",
            )
        elif sum(layers) != total or min(layers) < 0:
            yield Violation(
                key,
                layers,
                f"entries must be >= 0 and sum to num_layers = {total} (they sum to {sum(layers)})",
                f"adjust the entries to sum to {total}",
            )


@rule
def vit_first(cfg: JobConfig) -> Iterator[Violation]:
    vit = cfg.backend_config.model.image_encoder.vision_encoder.pipeline_num_layers
    llm = cfg.backend_config.model.text_decoder.pipeline_num_layers
    if len(vit) != len(llm):
        return
    first_llm_stage = next((i for i, n in enumerate(llm) if n > 0), len(llm))
    if any(n > 0 for n in vit[first_llm_stage + 1 :]):
        yield Violation(
            VIT_PP_LAYERS,
            vit,
            f"the ViT must finish before the LLM starts: stage {first_llm_stage} already holds LLM "
            f"layers ({llm}) but a later stage still holds ViT blocks",
            f"move all ViT blocks to the stages up to the first one with LLM layers, e.g. [{sum(vit)}, 0, ...]",
        )


@rule
def conversion_matches(cfg: JobConfig) -> Iterator[Violation]:
    b = cfg.backend_config
    expected: dict[str, Any] = {
        "tp_size": b.actor_config.tensor_model_parallel_size,
        "ep_size": b.actor_config.expert_model_parallel_size,
        "llm_pp_layers": b.model.text_decoder.pipeline_num_layers,
        "vit_pp_layers": b.model.image_encoder.vision_encoder.pipeline_num_layers,
    }
    source = {"tp_size": TP, "ep_size": EP, "llm_pp_layers": LLM_PP_LAYERS, "vit_pp_layers": VIT_PP_LAYERS}
    for stage, pc in (
        (HF2MG, b.convert_ckpt_hf2mg.cfg.parallel_config),
        (MG2HF, b.convert_ckpt_mg2hf.cfg.parallel_config),
    ):
        for name, want in expected.items():
            got = getattr(pc, name)
            if got != want:
                yield Violation(
                    f"{stage}.parallel_config.{name}",
                    got,
                    f"must equal {source[name]} = {want}",
                    f"remove the key so it follows {source[name]}, or set it to {want}",
                )
    t = b.training
    for flag, want_key in (("tensor_model_parallel_size", TP), ("pipeline_model_parallel_size", PP)):
        if getattr(t, flag) != getattr(b.actor_config, flag):
            yield Violation(
                f"{TRAIN}.{flag.replace('_', '-')}",
                getattr(t, flag),
                f"must equal {want_key} = {getattr(b.actor_config, flag)}",
                f"remove the key so it follows {want_key}",
            )


@rule
def expert_parallel(cfg: JobConfig) -> Iterator[Violation]:
    """EP spreads each MoE layer's experts over data-parallel ranks (megatron carves it out of DP x CP)."""
    b = cfg.backend_config
    ep, experts = b.actor_config.expert_model_parallel_size, b.model.text_decoder.num_moe_experts or 0
    key = f"{ACTOR}.expert_model_parallel_size"
    if ep < 1:
        yield Violation(key, ep, "must be at least 1", "use 1 for no expert parallelism")
        return
    if ep > 1 and not experts:
        yield Violation(key, ep, "the model has no experts (text_decoder.num_moe_experts is null)", "use 1")
    elif experts % ep:
        yield Violation(
            key,
            ep,
            f"must divide num_moe_experts = {experts} (each EP rank holds as many)",
            f"use one of {_divisors(experts)[:12]}",
        )
    topo = topology(cfg)
    replicas = topo.dp * topo.cp
    if ep > 1 and replicas > 0 and replicas % ep:
        yield Violation(
            key,
            ep,
            f"must divide DP x CP = {replicas} (the ranks that hold the same model-parallel "
            "shard share out the experts)",
            f"use one of {[d for d in _divisors(replicas) if d > 0][:12]}",
        )


# ---------------------------------------------------------------------------------- model shape
@rule
def model_family(cfg: JobConfig) -> Iterator[Violation]:
    """model_id names a family mm_rl has; the fields its checkpoints fix keep their values."""
    model = cfg.backend_config.model
    try:
        family = family_of(model)
    except UnknownFamily:
        known = ", ".join(f"{f.model_id} ({f.label})" for f in FAMILIES)
        yield Violation(f"{MODEL}.model_id", model.model_id, "is not a model family mm_rl knows", f"use one of {known}")
        return
    for key, value, why, fix in family.findings(model):
        yield Violation(f"{MODEL}.{key}", value, why, fix)


@rule
def mrope_sum(cfg: JobConfig) -> Iterator[Violation]:
    text = cfg.backend_config.model.text_decoder
    section, rotary = text.mrope_section, int(head_dim(cfg) * text.rotary_percent)
    if sum(section) * 2 != rotary:
        yield Violation(
            f"{TEXT}.mrope_section",
            section,
            f"must sum to the rotary dim / 2 = {rotary // 2} (head_dim {head_dim(cfg)} x rotary_percent "
            f"{text.rotary_percent} / 2; sums to {sum(section)})",
            "split it over (time, height, width), e.g. [16, 24, 24] for head_dim 128",
        )


@rule
def projector_sizes(cfg: JobConfig) -> Iterator[Violation]:
    m = cfg.backend_config.model
    text, proj, vit = m.text_decoder, m.image_encoder.vision_projector, m.image_encoder.vision_encoder
    if proj.hidden_size != text.hidden_size:
        yield Violation(
            f"{PROJ}.hidden_size",
            proj.hidden_size,
            f"the projector output must equal {TEXT}.hidden_size = {text.hidden_size}",
            f"set it to {text.hidden_size}",
        )
    if text.llm_hidden_size != text.hidden_size:
        yield Violation(
            f"{TEXT}.llm_hidden_size",
            text.llm_hidden_size,
            f"must equal {TEXT}.hidden_size = {text.hidden_size}",
            "remove the key so it follows",
        )
    if proj.input_size != vit.hidden_size:
        yield Violation(
            f"{PROJ}.input_size",
            proj.input_size,
            f"must equal {VIT}.hidden_size = {vit.hidden_size}",
            f"set it to {vit.hidden_size}",
        )
    if any(not 0 <= i < vit.num_layers for i in vit.fullatt_block_indexes):
        yield Violation(
            f"{VIT}.fullatt_block_indexes",
            vit.fullatt_block_indexes,
            f"indexes must lie in [0, num_layers = {vit.num_layers})",
            "drop the indexes past the end",
        )


@rule
def fused_kernels(cfg: JobConfig) -> Iterator[Violation]:
    t, text = cfg.backend_config.training, cfg.backend_config.model.text_decoder
    if t.use_fused_rmsnorm and text.normalization != "RMSNorm":
        yield Violation(
            f"{TRAIN}.use-fused-rmsnorm",
            True,
            f"needs normalization RMSNorm (is {text.normalization})",
            "turn use-fused-rmsnorm off or use RMSNorm",
        )
    if t.use_fused_swiglu and not text.swiglu:
        yield Violation(f"{TRAIN}.use-fused-swiglu", True, "needs swiglu", "turn use-fused-swiglu off or swiglu on")


@rule
def context_parallel(cfg: JobConfig) -> Iterator[Violation]:
    t = cfg.backend_config.training
    if t.context_parallel_algo is not None and t.context_parallel_size <= 1:
        yield Violation(
            f"{TRAIN}.context-parallel-algo",
            t.context_parallel_algo,
            "needs context-parallel-size > 1",
            "remove it or raise context-parallel-size",
        )
    heads = cfg.backend_config.model.text_decoder.num_attention_heads
    if t.context_parallel_size > 1 and heads % (t.context_parallel_size * t.tensor_model_parallel_size):
        yield Violation(
            f"{TRAIN}.context-parallel-size",
            t.context_parallel_size,
            f"Ulysses CP splits the heads: CP x TP must divide num_attention_heads = {heads}",
            "lower CP or TP",
        )


@rule
def recurrent_layers(cfg: JobConfig) -> Iterator[Violation]:
    """What a model with Gated DeltaNet layers (Qwen3.5) cannot run: context parallelism (a layer's recurrent state
    runs through the whole sequence; Ulysses would hand each rank whole heads over all tokens, which megatron-core
    0.16's GatedDeltaNet, with no CP of its own, and mm_rl's packed forward do not do yet), padded rows (a left-padded
    row would feed its padding into the state; packing cuts each sequence out), and a float32 engine on CPU
    (vLLM 0.32's CPU Gated DeltaNet kernel asserts bf16)."""
    b = cfg.backend_config
    if "linear_attention" not in b.model.text_decoder.layer_types:
        return
    why = "the model has Gated DeltaNet (linear-attention) layers"
    if b.training.context_parallel_size > 1:
        yield Violation(
            f"{TRAIN}.context-parallel-size",
            b.training.context_parallel_size,
            f"{why}, whose recurrent state spans the whole sequence: context parallelism is not supported for them",
            "set it to 1; for long sequences raise TP (sequence parallelism cuts the activations) or PP",
        )
    if not b.actor_config.remove_padding:
        yield Violation(
            f"{ACTOR}.remove_padding", False, f"{why}: they run packed sequences (each from a zero state)",
            "set it to true",
        )  # fmt: skip
    from mm_rl.platform.device import device_kind

    if b.generate_config.backend == "vllm" and b.generate_config.dtype == "float32" and device_kind() == "cpu":
        yield Violation(
            f"{GEN}.dtype", "float32", f"{why}: vLLM's CPU kernel for them runs bfloat16 only",
            "set it to auto (bfloat16 for this family on CPU) or bfloat16",
        )  # fmt: skip


@rule
def freeze_flags(cfg: JobConfig) -> Iterator[Violation]:
    enc = cfg.backend_config.model.image_encoder
    if not enc.vision_encoder.freeze:
        yield Violation(
            f"{VIT}.freeze",
            False,
            "model.json's freeze flag is not the switch for training the ViT",
            f"keep freeze: true and set {ACTOR}.unfreeze_vision_encoder: true (optionally {ACTOR}.vision_encoder_lr)",
        )
    if enc.vision_projector.freeze:
        yield Violation(
            f"{PROJ}.freeze",
            True,
            "model.json's freeze flag is not the switch for the projector",
            f"keep freeze: false and set {ACTOR}.freeze_vision_projector: true",
        )


@rule
def lora_settings(cfg: JobConfig) -> Iterator[Violation]:
    """What the adapters need: a rank, a positive alpha, known target linears that the model has, and splits this
    version supports."""
    from mm_rl.config.schema import LORA_TARGETS

    b = cfg.backend_config
    lora, key = b.actor_config.lora, f"{ACTOR}.lora"
    if lora.rank < 0:
        yield Violation(f"{key}.rank", lora.rank, "must be >= 0 (0: full-weight training)", "use e.g. 16, or 0")
    if not lora.enabled:
        return
    if lora.alpha <= 0:
        yield Violation(
            f"{key}.alpha", lora.alpha, "must be > 0 (the adapters' scale is alpha / rank)", "use e.g. 2 x rank"
        )
    if not 0 <= lora.dropout < 1:
        yield Violation(f"{key}.dropout", lora.dropout, "must lie in [0, 1)", "use 0 (or e.g. 0.05)")
    unknown = [name for name in lora.target_modules if name not in LORA_TARGETS]
    if unknown or not lora.target_modules:
        yield Violation(
            f"{key}.target_modules", list(lora.target_modules), f"names {unknown or 'nothing'}: megatron's linears "
            f"are {', '.join(LORA_TARGETS)}", "list some of those",
        )  # fmt: skip
    text = b.model.text_decoder
    recurrent = {"in_proj", "out_proj"}
    if set(lora.target_modules) <= recurrent and "linear_attention" not in text.layer_types:
        yield Violation(
            f"{key}.target_modules", list(lora.target_modules), "in_proj / out_proj are Gated DeltaNet layers' "
            "linears, which this model has none of", "add linear_qkv, linear_proj, linear_fc1, linear_fc2",
        )  # fmt: skip
    if lora.experts and not text.num_moe_experts:
        yield Violation(f"{key}.experts", True, "the model has no experts", "set it to false")
    if lora.experts and b.actor_config.tensor_model_parallel_size > 1:
        yield Violation(
            f"{key}.experts", True, "adapters on experts split over tensor parallelism are not supported",
            f"set it to false (adapters on attention and shared experts) or {ACTOR}.tensor_model_parallel_size: 1",
        )  # fmt: skip
    if b.actor_config.unfreeze_vision_encoder:
        yield Violation(
            f"{ACTOR}.unfreeze_vision_encoder", True, "LoRA keeps the whole base model frozen",
            f"set it to false; {key}.vision: true puts adapters on the ViT",
        )  # fmt: skip


# ------------------------------------------------------------------------------- optimisation / RL
@rule
def multi_turn_settings(cfg: JobConfig) -> Iterator[Violation]:
    """What the multi-turn loop needs: positive limits, tools that import as mm_rl Tools, a template that renders
    them; nothing is checked while it is off."""
    turns = cfg.backend_config.rl_config.multi_turn
    key = f"{RL}.multi_turn"
    if not turns.enable:
        return
    for name, value, least, fix in (
        ("max_turns", turns.max_turns, 1, "use e.g. 4 (1: one turn, tool calls are never answered)"),
        ("max_tokens", turns.max_tokens, 1, "use e.g. 4 x sampling_config.max_tokens"),
        ("max_tool_output_chars", turns.max_tool_output_chars, 1, "use e.g. 2000"),
        ("max_tool_images", turns.max_tool_images, 0, "use e.g. 2, or 0 for tools that answer in text"),
    ):
        if value < least:
            yield Violation(f"{key}.{name}", value, f"must be >= {least}", fix)
    if not turns.tool_timeout > 0:
        yield Violation(f"{key}.tool_timeout", turns.tool_timeout, "must be > 0 seconds", "use e.g. 10")
    if turns.tool_call_reward < 0:
        yield Violation(
            f"{key}.tool_call_reward", turns.tool_call_reward, "must be >= 0", "use e.g. 0.1, or 0 for none"
        )
    yield from _tools_load(key, turns.tools)
    if turns.chat_template:
        from mm_rl.data.tool_prompts import SHIPPED, template_file

        template = template_file(turns.chat_template)
        if not template.is_file():
            yield Violation(
                f"{key}.chat_template",
                turns.chat_template,
                "is neither a file nor a template mm_rl ships",
                f"give a jinja file, one of {sorted(SHIPPED)}, or '' for the checkpoint's / mm_rl's Qwen tool template",
            )
        elif "tools" not in template.read_text(encoding="utf-8", errors="replace"):
            yield Violation(
                f"{key}.chat_template",
                turns.chat_template,
                "does not render the tools (the template never reads `tools`)",
                "use a template with a tools branch, or '' for the checkpoint's / mm_rl's Qwen tool template",
            )


@rule
def video_settings(cfg: JobConfig) -> Iterator[Violation]:
    """Frame sampling and pixel bounds that can produce a clip, and an engine that takes videos when the engine
    reserves room for them (the data's own videos are counted by ``data_splits``)."""
    b = cfg.backend_config
    pre, key = b.data.dataset_param.preprocess_parameters, f"{DATA}.preprocess_parameters"
    if not pre.fps > 0:
        yield Violation(f"{key}.fps", pre.fps, "must be > 0 frames per second", "use e.g. 2.0")
    if not 1 <= pre.min_frames <= pre.max_frames:
        yield Violation(
            f"{key}.min_frames", pre.min_frames, f"need 1 <= min_frames <= max_frames = {pre.max_frames}",
            "use e.g. min_frames 4, max_frames 32",
        )  # fmt: skip
    if not 0 < pre.video_min_pixels <= pre.video_max_pixels:
        yield Violation(
            f"{key}.video_min_pixels", pre.video_min_pixels,
            f"need 0 < video_min_pixels <= video_max_pixels = {pre.video_max_pixels}",
            "use e.g. 100352 (128 x 28 x 28) and 602112 (768 x 28 x 28)",
        )  # fmt: skip
    videos = b.generate_config.max_videos_per_prompt
    if videos < 0:
        yield Violation(f"{GEN}.max_videos_per_prompt", videos, "must be >= 0", "use 0 without videos, else 1")
    if videos > 0 and b.generate_config.backend == "hf":
        yield Violation(
            f"{GEN}.backend", "hf", "the transformers engine takes images only, and the job reserves room for videos",
            "use backend vllm, or max_videos_per_prompt 0 for image data",
        )  # fmt: skip
    if videos > 0 and b.rl_config.multi_turn.enable:
        yield Violation(
            f"{RL}.multi_turn.enable", True, "multi-turn rollouts take image prompts only (not videos yet)",
            f"turn multi_turn off, or use image data with {GEN}.max_videos_per_prompt 0",
        )  # fmt: skip


def _tools_load(key: str, entries: list[str]) -> Iterator[Violation]:
    from mm_rl.tools.runner import load_tools

    if not entries:
        yield Violation(f"{key}.tools", entries, "a multi-turn job needs at least one tool", "e.g. [calculator]")
        return
    try:
        load_tools(entries)
    except (ImportError, TypeError, ValueError) as error:
        yield Violation(
            f"{key}.tools",
            entries,
            f"cannot be loaded ({error})",
            "name a built-in (calculator, crop_image) or an mm_rl.tools.Tool as 'module:attribute' installed in "
            "this Python environment",
        )


@rule
def optimizer_settings(cfg: JobConfig) -> Iterator[Violation]:
    """What the optimizer and its schedule would refuse (or silently turn into ascent) once the models are built."""
    a, t = cfg.backend_config.actor_config, cfg.backend_config.training
    if a.lr <= 0:
        yield Violation(f"{ACTOR}.lr", a.lr, "must be > 0 (the peak learning rate)", "use e.g. 1e-6")
    elif a.lr < a.min_lr:
        yield Violation(f"{ACTOR}.min_lr", a.min_lr, f"must not exceed lr = {a.lr}", "lower min_lr or raise lr")
    if a.min_lr < 0:
        yield Violation(f"{ACTOR}.min_lr", a.min_lr, "must be >= 0", "use 0 or e.g. lr / 10")
    if a.vision_encoder_lr is not None and a.vision_encoder_lr <= 0:
        yield Violation(
            f"{ACTOR}.vision_encoder_lr",
            a.vision_encoder_lr,
            "must be > 0",
            "remove it to train the ViT at lr, or keep unfreeze_vision_encoder: false",
        )
    if not 0 <= t.lr_warmup_fraction < 1:
        yield Violation(
            f"{TRAIN}.lr-warmup-fraction",
            t.lr_warmup_fraction,
            "must lie in [0, 1)",
            "use e.g. 0.1 (10% of train-iters)",
        )
    for key, value, fix in (
        ("clip-grad", t.clip_grad, "use e.g. 1.0, or 0 to disable clipping"),
        ("weight-decay", t.weight_decay, "use 0 or e.g. 0.01"),
    ):
        if value < 0:
            yield Violation(f"{TRAIN}.{key}", value, "must be >= 0", fix)
    for key, value in (("adam-beta1", t.adam_beta1), ("adam-beta2", t.adam_beta2)):
        if not 0 <= value < 1:
            yield Violation(
                f"{TRAIN}.{key}",
                value,
                "Adam's moment decay must lie in [0, 1)",
                "use 0.9 (beta1), 0.999 or 0.95 (beta2)",
            )


@rule
def logger_settings(cfg: JobConfig) -> Iterator[Violation]:
    if cfg.logger.generations_per_step < 0:
        yield Violation(
            "logger.generations_per_step",
            cfg.logger.generations_per_step,
            "must be >= 0 (prompts per step in generations.jsonl)",
            "use 0 to log none, or e.g. 2",
        )


@rule
def checkpoint_settings(cfg: JobConfig) -> Iterator[Violation]:
    mt = cfg.backend_config.megatron_training
    if mt.save_interval <= 0:
        yield Violation(
            f"{MT}.save_interval", mt.save_interval, "must be > 0", "use a step count; the last step is always saved"
        )
    if mt.max_keep_ckpts < 0:
        yield Violation(
            f"{MT}.max_keep_ckpts",
            mt.max_keep_ckpts,
            "must be >= 0 (the number of checkpoints kept)",
            "use 0 to keep all, or e.g. 2 to keep the last two",
        )


@rule
def rl_settings(cfg: JobConfig) -> Iterator[Violation]:
    rl, gen = cfg.backend_config.rl_config, cfg.backend_config.generate_config
    if rl.adv_estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline") and rl.n_samples_per_prompt < 2:
        yield Violation(
            f"{RL}.n_samples_per_prompt",
            rl.n_samples_per_prompt,
            f"{rl.adv_estimator} compares samples within a group: needs at least 2",
            "use 4 to 16",
        )
    for key in ("clip_ratio_low", "clip_ratio_high"):
        if getattr(rl, key) < 0:
            yield Violation(f"{RL}.{key}", getattr(rl, key), "must be >= 0", "use e.g. 0.2")
    if rl.clip_ratio_c <= 1:
        yield Violation(f"{RL}.clip_ratio_c", rl.clip_ratio_c, "dual clip needs a bound > 1", "use e.g. 3.0")
    if ":" not in rl.reward.function:
        yield Violation(
            f"{RL}.reward.function",
            rl.reward.function,
            "must be 'module:function'",
            "e.g. mm_rl.rewards.geo3k:compute_score",
        )
    buffer = rl.overlong_buffer
    if buffer.enable and not 0 < buffer.len <= cfg.backend_config.response_tokens:
        yield Violation(
            f"{RL}.overlong_buffer.len",
            buffer.len,
            f"must lie in (0, max_tokens = {cfg.backend_config.response_tokens}] when the buffer is enabled",
            "use e.g. a quarter of max_tokens, or disable the buffer",
        )
    if not 0 < gen.gpu_memory_utilization <= 1:
        yield Violation(
            f"{GEN}.gpu_memory_utilization", gen.gpu_memory_utilization, "must lie in (0, 1]", "use e.g. 0.6"
        )


@rule
def kl_settings(cfg: JobConfig) -> Iterator[Violation]:
    """A negative KL weight rewards moving away from the reference; the adaptive controller divides by its
    target and horizon (and refuses them <= 0 when the trainer starts)."""
    rl = cfg.backend_config.rl_config
    for key, value in (("kl_loss_coef", rl.kl_loss_coef), ("kl_ctrl.kl_coef", rl.kl_ctrl.kl_coef)):
        if value < 0:
            yield Violation(f"{RL}.{key}", value, "a KL weight must be >= 0", "use e.g. 0.01, or 0 for no KL")
    if rl.kl_ctrl.type == "adaptive":
        for key, value in (("target_kl", rl.kl_ctrl.target_kl), ("horizon", rl.kl_ctrl.horizon)):
            if value <= 0:
                yield Violation(
                    f"{RL}.kl_ctrl.{key}",
                    value,
                    "the adaptive KL controller needs it > 0",
                    "use e.g. target_kl 0.1, horizon 10000, or kl_ctrl.type: fixed",
                )


@rule
def sampling_settings(cfg: JobConfig) -> Iterator[Violation]:
    """What the rollout engine would refuse at its first request (vLLM's SamplingParams: temperature >= 0,
    top_p in (0, 1], top_k -1 or 0 for off or >= 1), and greedy groups, whose samples are all the same."""
    g, rl = cfg.backend_config.generate_config, cfg.backend_config.rl_config
    for key, s in (
        (f"{GEN}.sampling_config", g.sampling_config),
        (f"{GEN}.val_sampling_config", g.val_sampling_config),
    ):
        if s.temperature < 0:
            yield Violation(f"{key}.temperature", s.temperature, "must be >= 0", "use 1.0 for sampling, 0 for greedy")
        if not 0 < s.top_p <= 1:
            yield Violation(
                f"{key}.top_p",
                s.top_p,
                "must lie in (0, 1] (the probability mass sampled from)",
                "use 1.0 (off) or e.g. 0.9",
            )
        if s.top_k < -1:
            yield Violation(
                f"{key}.top_k", s.top_k, "must be -1 or 0 (off) or a positive count", "use -1 (off) or e.g. 50"
            )
    if g.val_sampling_config.n < 1:
        yield Violation(
            f"{GEN}.val_sampling_config.n",
            g.val_sampling_config.n,
            "must be at least 1",
            "use 1 (greedy validation gives one answer per prompt)",
        )
    if 0 <= g.sampling_config.temperature < GREEDY_BELOW and rl.n_samples_per_prompt > 1:
        yield Violation(
            f"{GEN}.sampling_config.temperature",
            g.sampling_config.temperature,
            f"greedy decoding gives the n_samples_per_prompt = {rl.n_samples_per_prompt} responses of a "
            "prompt identically: equal rewards, zero advantages, nothing learned",
            "use 1.0 (validation stays greedy: val_sampling_config.temperature)",
        )


@rule
def policy_loss_settings(cfg: JobConfig) -> Iterator[Violation]:
    """Each policy loss's own parameters: a ratio band needs ``1 - clip_ratio_low > 0`` (CISPO alone may drop its
    lower bound), GSPO is a per-sequence objective, SAPO's gate divides by its temperatures."""
    rl = cfg.backend_config.rl_config
    if rl.policy_loss != "cispo" and rl.clip_ratio_low >= 1:
        yield Violation(
            f"{RL}.clip_ratio_low",
            rl.clip_ratio_low,
            f"{rl.policy_loss} clips the ratio below at 1 - clip_ratio_low, which must stay > 0",
            "use e.g. 0.2 (only cispo takes >= 1: no lower bound)",
        )
    if rl.policy_loss == "gspo" and rl.loss_agg_mode != "seq-mean-token-mean":
        yield Violation(
            f"{RL}.loss_agg_mode",
            rl.loss_agg_mode,
            "gspo's ratio and clip are per sequence: its objective weighs every sequence the same (GSPO's 1/G mean)",
            "set loss_agg_mode: seq-mean-token-mean",
        )
    for key in ("tau_pos", "tau_neg"):
        if getattr(rl, key) <= 0:
            yield Violation(
                f"{RL}.{key}",
                getattr(rl, key),
                "the SAPO gate (4 / tau) * sigmoid(tau * (r - 1)) needs tau > 0",
                "use the paper's tau_pos 1.0, tau_neg 1.05",
            )


@rule
def rollout_correction_settings(cfg: JobConfig) -> Iterator[Violation]:
    """The importance-sampling bound, and a correction that bypass mode would make a silent no-op."""
    rc = cfg.backend_config.rl_config.rollout_correction
    key = f"{RL}.rollout_correction"
    if rc.rollout_is_threshold <= 1:
        yield Violation(
            f"{key}.rollout_is_threshold",
            rc.rollout_is_threshold,
            "weights scatter around 1 (a matched "
            "token's is 1): a bound <= 1 cuts or drops about half the tokens even when the engine and the "
            "actor agree up to rounding",
            "use e.g. 2.0 (token) or 2.0-10.0 (sequence)",
        )
    if rc.bypass_mode and rc.rollout_is in ("token", "sequence"):
        yield Violation(
            f"{key}.rollout_is",
            rc.rollout_is,
            "bypass_mode takes the engine's log-probs as the old "
            "ones, so every weight pi_old / pi_engine is 1: the correction would do nothing",
            "set rollout_is: auto (or null) to bypass, or bypass_mode: false to correct (an old "
            "log-prob pass, then the weights)",
        )


@rule
def token_budgets(cfg: JobConfig) -> Iterator[Violation]:
    """A micro-batch token budget must hold the longest sample a step can have: no micro-batch could take it."""
    b = cfg.backend_config
    prompt = b.data.dataset_param.preprocess_parameters.max_prompt_length
    response = b.response_tokens
    for name in ("max_tokens_per_micro_batch", "log_prob_max_tokens_per_micro_batch"):
        budget = getattr(b.actor_config, name)
        if budget is not None and budget < prompt + response:
            yield Violation(
                f"{ACTOR}.{name}",
                budget,
                f"must hold the longest sample, max_prompt_length + "
                f"max_tokens = {prompt} + {response} = {prompt + response} tokens",
                f"use at least {prompt + response} (a few times that lets short samples share a "
                "micro-batch), or null to cut micro_batch_size samples at a time",
            )


@rule
def sequence_budget(cfg: JobConfig) -> Iterator[Violation]:
    b = cfg.backend_config
    prompt = b.data.dataset_param.preprocess_parameters.max_prompt_length
    response = b.response_tokens
    longest = b.model.text_decoder.max_position_embeddings
    if prompt + response > b.training.seq_length:
        fix = (
            f"raise seq-length to {prompt + response} or shorten prompts / responses"
            if prompt + response <= longest
            else f"lower max_prompt_length or max_tokens: the model holds at most "
            f"{longest} positions ({TEXT}.max_position_embeddings)"
        )
        yield Violation(
            f"{TRAIN}.seq-length",
            b.training.seq_length,
            f"must hold max_prompt_length + max_tokens = {prompt} + {response} = {prompt + response}",
            fix,
        )
    if b.training.seq_length > longest:
        yield Violation(
            f"{TRAIN}.seq-length",
            b.training.seq_length,
            f"must not exceed the model's {TEXT}.max_position_embeddings = {longest}",
            f"use at most {longest} (with max_prompt_length + max_tokens within it)",
        )
    pre = b.data.dataset_param.preprocess_parameters
    if pre.min_pixels > pre.max_pixels:
        yield Violation(
            f"{DATA}.preprocess_parameters.min_pixels",
            pre.min_pixels,
            f"must not exceed max_pixels = {pre.max_pixels}",
            "lower min_pixels",
        )


# ------------------------------------------------------------------------------- paths and the HF dir
def _must_exist(key: str, path: str, what: str) -> Iterator[Violation]:
    """``path`` names an existing directory (the data set, a checkpoint)."""
    if not path:
        yield Violation(key, path, f"{what} is required", f"set {key} to the {what}")
    elif not Path(path).exists():
        yield Violation(
            key, path, f"{what} does not exist{relative_note(path)}", f"point {source_of(key)} at an existing {what}"
        )
    elif not Path(path).is_dir():
        yield Violation(key, path, f"is a file, not a {what}", f"point {source_of(key)} at the directory that holds it")


def _writable(key: str, path: str, reported: set[Path]) -> Iterator[Violation]:
    """``path`` can be written: its nearest existing ancestor is a writable directory. A directory that blocks
    several outputs (af_output_dir and the paths under it) is reported once, on the first of them."""
    existing = Path(path).absolute()
    while not existing.exists():
        existing = existing.parent
    if existing not in reported and (not existing.is_dir() or not os.access(existing, os.W_OK)):
        reported.add(existing)
        yield Violation(
            key,
            path,
            f"cannot be written ({existing} is not a writable directory)",
            "choose a directory you can write to",
        )


def paths_exist(cfg: JobConfig) -> Iterator[Violation]:
    b = cfg.backend_config
    yield from _must_exist(
        f"{DATA}.basic_parameters.dataset_dir", b.data.dataset_param.basic_parameters.dataset_dir, "dataset directory"
    )
    if not b.megatron_training.tokenizer_name_or_path:
        yield Violation(
            f"{MT}.tokenizer_name_or_path",
            "",
            "the HuggingFace checkpoint to train is required",
            "set it to the checkpoint directory (hf_dir and the processor follow it)",
        )
    elif b.convert_ckpt_hf2mg.cfg.hf_config.hf_dir:
        yield from _must_exist(
            f"{HF2MG}.hf_config.hf_dir", b.convert_ckpt_hf2mg.cfg.hf_config.hf_dir, "HuggingFace checkpoint directory"
        )
    reported: set[Path] = set()
    for key, path in (
        ("af_output_dir", cfg.af_output_dir),
        (f"{HF2MG}.mm_dir", b.convert_ckpt_hf2mg.cfg.mm_dir),
        (f"{MT}.save", b.megatron_training.save),
        (f"{MG2HF}.save_hf_dir", b.convert_ckpt_mg2hf.cfg.save_hf_dir),
    ):
        yield from _writable(key, path, reported)


def _has_chat_template(directory: Path) -> bool:
    """transformers reads the chat template from chat_template.jinja / .json, or from tokenizer_config.json."""
    if any((directory / name).is_file() for name in ("chat_template.jinja", "chat_template.json")):
        return True
    try:
        return "chat_template" in json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False


def _has_file(*patterns: str) -> Callable[[Path], bool]:
    return lambda directory: any(next(directory.glob(pattern), None) is not None for pattern in patterns)


# (what, found in a directory?) for the HF checkpoint hf2mg converts and for the prompt processor's source.
CHECKPOINT_FILES: tuple[tuple[str, Callable[[Path], bool]], ...] = (
    ("config.json", _has_file("config.json")),
    ("the weights (*.safetensors)", _has_file("*.safetensors")),
)
PROCESSOR_FILES: tuple[tuple[str, Callable[[Path], bool]], ...] = (
    (
        "a tokenizer (tokenizer.json, tokenizer.model or vocab.json)",
        _has_file("tokenizer.json", "tokenizer.model", "vocab.json"),
    ),
    ("an image processor (preprocessor_config.json)", _has_file("preprocessor_config.json", "processor_config.json")),
    ("a chat template (chat_template.jinja / .json or tokenizer_config.json)", _has_chat_template),
)


def hf_checkpoint_files(cfg: JobConfig) -> Iterator[Violation]:
    """hf2mg converts config.json and the safetensors; the prompts need the tokenizer, image processor and chat
    template. Without config.json the checks of ``hf_checkpoint_matches`` cannot run either, so a missing file is
    reported here, before anything starts. A directory that does not exist is ``paths_exist``'s to report."""
    b = cfg.backend_config
    hf_dir = b.convert_ckpt_hf2mg.cfg.hf_config.hf_dir
    processor_dir = b.data.dataset_param.preprocess_parameters.model_name_or_path
    processor_key = f"{DATA}.preprocess_parameters.model_name_or_path"
    if processor_dir and processor_dir != hf_dir:
        yield from _must_exist(processor_key, processor_dir, "processor (tokenizer) directory")
    for key, directory, wanted, use in (
        (f"{HF2MG}.hf_config.hf_dir", hf_dir, CHECKPOINT_FILES, "hf2mg converts the checkpoint from them"),
        (processor_key, processor_dir, PROCESSOR_FILES, "the prompts are built with them"),
    ):
        if not directory or not Path(directory).is_dir():
            continue
        missing = [what for what, found in wanted if not found(Path(directory))]
        if missing:
            yield Violation(
                key,
                directory,
                f"is not a complete HuggingFace checkpoint: it lacks {', '.join(missing)}; {use}",
                f"point {MT}.tokenizer_name_or_path (which it follows unless set) at the "
                "directory of a downloaded checkpoint of a family mm_rl trains",
            )
    config_file = Path(hf_dir or ".") / "config.json"
    if hf_dir and config_file.is_file() and _read_json(config_file) is None:
        yield Violation(
            f"{HF2MG}.hf_config.hf_dir",
            hf_dir,
            f"{config_file} is not a JSON object",
            "restore config.json from the checkpoint's source",
        )


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def hf_checkpoint_matches(cfg: JobConfig) -> Iterator[Violation]:
    """The seed forbids changing token ids and vocab; layers may shrink, never grow; sizes must match."""
    config_file = Path(cfg.backend_config.convert_ckpt_hf2mg.cfg.hf_config.hf_dir or ".") / "config.json"
    hf = _read_json(config_file) if config_file.is_file() else None
    if hf is None:
        return  # hf_checkpoint_files / paths_exist report it
    m = cfg.backend_config.model
    try:
        checkpoint_family = family_for_hf(hf)
        want = checkpoint_family.model_json(hf)
    except (UnknownFamily, HfConfigError) as err:
        yield Violation(
            f"{HF2MG}.hf_config.hf_dir",
            str(config_file.parent),
            str(err),
            "point it at a checkpoint of a family mm_rl trains",
        )
        return
    if checkpoint_family.model_id != m.model_id:
        yield Violation(
            f"{MODEL}.model_id",
            m.model_id,
            f"the checkpoint {config_file} is {checkpoint_family.label}",
            f"set it to {checkpoint_family.model_id} (config --af_model_name writes the whole model.json)",
        )
        return
    text, vit = m.text_decoder, m.image_encoder.vision_encoder
    text_hf, vit_hf = want["text_decoder"], want["image_encoder"]["vision_encoder"]
    same = [
        (f"{MODEL}.{key}", getattr(m, key), want.get(key))
        for key in ("img_context_token_id", "video_token_id", "vision_start_token_id")
    ]
    same += [
        (f"{TEXT}.{key}", getattr(text, key), text_hf.get(key))
        for key in ("vocab_size", "untie_embeddings_and_output_weights")
    ]
    same += [
        (f"{VIT}.{key}", getattr(vit, key), vit_hf.get(key))
        for key in ("hidden_size", "ffn_hidden_size", "num_attention_heads")
    ]
    for key, ours, theirs in same:
        if theirs is not None and ours != theirs:
            yield Violation(key, ours, f"must match the checkpoint's {config_file} ({theirs})", f"set it to {theirs}")
    for key in ("num_moe_experts", "moe_intermediate_size"):  # absent on both sides: a dense model
        ours, theirs = getattr(text, key) or None, text_hf.get(key)
        if ours != theirs:
            kind = f"{theirs}" if theirs is not None else "none: a dense model"
            yield Violation(f"{TEXT}.{key}", ours, f"must match the checkpoint's {config_file} ({kind})",
                            f"set it to {theirs}" if theirs is not None else "remove it (null)")  # fmt: skip
    yield from _narrower_llm(cfg, text_hf, config_file)
    layers, positions = "layers may be removed, never added", "positions beyond it were never trained"
    for key, ours, theirs, why in (
        (f"{TEXT}.num_layers", text.num_layers, text_hf.get("num_layers"), layers),
        (f"{VIT}.num_layers", vit.num_layers, vit_hf.get("num_layers"), layers),
        (
            f"{TEXT}.max_position_embeddings",
            text.max_position_embeddings,
            text_hf.get("max_position_embeddings"),
            positions,
        ),
    ):
        if theirs is not None and ours > theirs:
            yield Violation(key, ours, f"the checkpoint has only {theirs} ({why})", f"use at most {theirs}")


def _narrower_llm(cfg: JobConfig, text_hf: Mapping[str, Any], config_file: Path) -> Iterator[Violation]:
    """The LLM may be cut narrower than its checkpoint (``mm_rl.convert.reshape``: width, MLP width and heads
    keep their leading part, key/value heads are regrouped), never wider; heads keep their size; the engine's Qwen
    decoders derive the head size from the width where the checkpoint does; MoE experts are stored fused and keep
    the checkpoint's width."""
    text = cfg.backend_config.model.text_decoder
    cut = "the LLM may be cut narrower than its checkpoint (the leading part is kept), never wider"
    for key in ("hidden_size", "ffn_hidden_size", "num_attention_heads"):
        theirs = text_hf.get(key)
        if theirs is not None and getattr(text, key) > theirs:
            yield Violation(f"{TEXT}.{key}", getattr(text, key), f"{cut}: {config_file} has {theirs}",
                            f"use at most {theirs}")  # fmt: skip
    hd, theirs_hd = head_dim(cfg), text_hf.get("kv_channels")
    if theirs_hd is not None and hd != theirs_hd:
        yield Violation(f"{TEXT}.kv_channels", hd, f"heads keep the checkpoint's size ({theirs_hd})",
                        f"set kv_channels to {theirs_hd} and cut heads instead (num_attention_heads)")  # fmt: skip
        return
    derived = text_hf.get("hidden_size") == text_hf.get("num_attention_heads", 0) * (theirs_hd or 0)
    if derived and text.hidden_size != text.num_attention_heads * hd:
        yield Violation(
            f"{TEXT}.num_attention_heads",
            text.num_attention_heads,
            f"the engine's and transformers' decoder of this family derive the head size from hidden_size / "
            f"num_attention_heads, which must stay {hd}",
            f"set num_attention_heads to {text.hidden_size // hd} (hidden_size {text.hidden_size} / {hd}), with "
            "hidden_size a multiple of it",
        )
    if text.num_moe_experts and text.hidden_size != text_hf.get("hidden_size", text.hidden_size):
        yield Violation(f"{TEXT}.hidden_size", text.hidden_size,
                        "the checkpoint stores its experts fused: a MoE LLM keeps its width",
                        f"set it to {text_hf['hidden_size']}")  # fmt: skip


def reward_function_imports(cfg: JobConfig) -> Iterator[Violation]:
    """The trainer imports the reward function after hf2mg and the engine start: import it now instead."""
    from mm_rl.rewards import load_reward_function

    function = cfg.backend_config.rl_config.reward.function
    if ":" not in function:
        return  # rl_settings reports the form
    try:
        load_reward_function(function)
    except (ImportError, TypeError, ValueError) as err:
        yield Violation(
            f"{RL}.reward.function",
            function,
            f"cannot be loaded ({err})",
            "install its module in this Python environment or fix the module:function path, e.g. "
            "mm_rl.rewards.geo3k:compute_score",
        )


def data_splits(cfg: JobConfig) -> Iterator[Violation]:
    """Every split the run reads must exist and fill its batches: counted the way the data set checks its rows,
    less the image decode and the prompt length (``count_usable_rows``), and only as far as needed, so `check`
    stays fast on a real data set. A directory that does not exist is ``paths_exist``'s to report."""
    b = cfg.backend_config
    basic, rl = b.data.dataset_param.basic_parameters, b.rl_config
    if not basic.dataset_dir or not Path(basic.dataset_dir).is_dir():
        return
    yield from _split_rows(cfg, "train_split", rl.rollout_batch_size)
    if rl.validates:
        yield from _split_rows(cfg, "val_split", 1)


def _split_rows(cfg: JobConfig, which: str, need: int) -> Iterator[Violation]:
    from mm_rl.data.dataset import count_usable_rows, find_split, sample_decodes
    from mm_rl.data.video import VideoSampling

    data = cfg.backend_config.data.dataset_param
    basic, split, key = data.basic_parameters, getattr(data.basic_parameters, which), f"{DATA}.basic_parameters"
    validation_off = (
        "" if which == "train_split" else f", or turn validation off ({RL}.val_freq: 0, val_before_train: false)"
    )
    try:
        files = find_split(basic.dataset_dir, split)
    except ValueError as err:
        yield Violation(
            f"{key}.{which}",
            split,
            str(err),
            f"set {which} to the stem of the split's file, or add "
            f"{split}.parquet or {split}.jsonl to dataset_dir{validation_off}",
        )
        return
    try:
        stats = count_usable_rows(files, basic, data.preprocess_parameters.instruction, need)
    except ValueError as err:
        yield Violation(
            f"{key}.dataset_dir", basic.dataset_dir, f"split '{split}': {err}", "rewrite the file (or remove it)"
        )
        return
    where = f"split '{split}' ({', '.join(p.name for p in files.paths)})"
    room = cfg.backend_config.generate_config.max_videos_per_prompt
    if stats.most_videos > room >= 0:  # (a negative room is video_settings' to report)
        yield Violation(
            f"{GEN}.max_videos_per_prompt", room,
            f"{where}: rows hold up to {stats.most_videos} video(s) (of the first {stats.rows} read); the engine "
            "would skip them all",
            f"set it to {stats.most_videos}",
        )  # fmt: skip
    if stats.kept >= need:
        pre = data.preprocess_parameters
        sampling = VideoSampling(pre.fps, pre.min_frames, pre.max_frames)
        for kind, advice in (("image", "truncated, or not an image"), ("video", "unreadable, or no frames")):
            failed, tried = sample_decodes(files, basic, pre.instruction, kind=kind, sampling=sampling)
            if tried and failed == tried:
                yield Violation(
                    f"{key}.dataset_dir",
                    basic.dataset_dir,
                    f"{where}: none of the first {tried} {kind}s of its rows decodes ({advice})",
                    f"re-export the {kind}s, or point dataset_dir at another data set",
                )
        return
    if stats.rows == 0:
        yield Violation(
            f"{key}.dataset_dir",
            basic.dataset_dir,
            f"{where} holds no rows",
            f"fill the file, or point dataset_dir at the data set{validation_off}",
        )
    elif stats.kept == 0:
        reason = stats.bad.most_common(1)[0][0]
        field = next(
            (f for f in ("prompt_key", "answer_key", "image_key") if reason == f"missing field '{getattr(basic, f)}'"),
            None,
        )
        rule = f"{where} has no usable row: {stats.rows} read, {stats.bad_summary()}"
        if field is None:
            yield Violation(
                f"{key}.dataset_dir",
                basic.dataset_dir,
                rule,
                "fix the rows named (see the reasons), or point dataset_dir at another data set",
            )
        elif getattr(basic, field).split(".")[0] in stats.columns:  # the key is right: the rows lack its value
            yield Violation(
                f"{key}.dataset_dir",
                basic.dataset_dir,
                rule,
                f"the rows have the column {getattr(basic, field).split('.')[0]!r} but not the value {field} names: "
                "fill it in those rows, or drop them",
            )
        else:
            yield Violation(
                f"{key}.{field}",
                getattr(basic, field),
                rule,
                f"set {field} to the column that holds it; the rows have {stats.columns}",
            )
    else:
        yield Violation(
            f"{RL}.rollout_batch_size",
            cfg.backend_config.rl_config.rollout_batch_size,
            f"{where} has only {stats.kept} usable rows ({stats.rows} read"
            + (f"; {stats.bad_summary()}" if stats.bad else "")
            + "), fewer than one rollout batch",
            f"use rollout_batch_size <= {stats.kept} (with GBS dividing rollout_batch_size x "
            "n_samples_per_prompt), or add rows",
        )


def resume_checkpoint(cfg: JobConfig) -> Iterator[Violation]:
    """The checkpoint a run would resume from must exist and have the job's TP x PP: found here rather than after
    hf2mg and the models' start, where the trainer can only stop."""
    mt, actor = cfg.backend_config.megatron_training, cfg.backend_config.actor_config
    mode, key = mt.resume_mode, f"{MT}.resume_mode"
    start_fresh = f"set {key}: disable, or another {MT}.save, to start afresh"
    if mode == "disable" or (mode == "auto" and (not mt.save or next(Path(mt.save).glob("iter_*"), None) is None)):
        return  # nothing to resume (and torch stays unimported)
    if mode != "auto" and not Path(mode).exists():
        yield Violation(
            key,
            mode,
            "is neither auto, disable nor an existing checkpoint directory",
            f"use auto (resume from {MT}.save = {mt.save} when it holds a checkpoint), disable, or the "
            "path of an iter_NNNNNNN directory in it",
        )
        return
    from mm_rl.checkpoint import CheckpointError, CheckpointManager, CheckpointRefused

    manager = CheckpointManager(mt.save, keep_last=0)
    try:
        step, _ = manager.resume_point(mode)  # its notes on checkpoints passed over are logged at the resume
        saved = None if step is None else manager.grid(step)
    except CheckpointRefused as err:
        yield Violation(key, mode, err.rule, err.fix)
        return
    except CheckpointError as err:
        yield Violation(
            key, mode, str(err), f"point it at a complete iter_NNNNNNN directory in {mt.save}, or {start_fresh}"
        )
        return
    job = (actor.tensor_model_parallel_size, actor.pipeline_model_parallel_size, actor.expert_model_parallel_size)
    if saved is not None and saved != job:
        bad = next(key for key, a, b in zip((TP, PP, EP), saved, job, strict=True) if a != b)
        yield Violation(
            bad,
            job[(TP, PP, EP).index(bad)],
            f"the checkpoint to resume (step {step} in {mt.save}, resume_mode {mode}) was saved with "
            f"TP {saved[0]} x PP {saved[1]} x EP {saved[2]}, and a checkpoint loads only into the layout "
            f"it was saved with (this job: TP {job[0]} x PP {job[1]} x EP {job[2]})",
            f"set {TP}: {saved[0]}, {PP}: {saved[1]} (with pipeline_num_layers of {saved[1]} "
            f"entries) and {EP}: {saved[2]}, or {start_fresh}",
        )


PATH_RULES: list[Rule] = [
    paths_exist,
    hf_checkpoint_files,
    hf_checkpoint_matches,
    reward_function_imports,
    data_splits,
    resume_checkpoint,
]
