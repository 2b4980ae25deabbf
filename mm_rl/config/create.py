"""`ascendfactory-cli config`: compose a job for a model and a cluster, plan its layout, and write the yaml."""

from __future__ import annotations

import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from mm_rl.config.loader import ConfigError, Violation, parse_overrides, to_job, unknown_keys
from mm_rl.config.plan import ParallelPlan, batch_sizes, current_plan, plan_parallel
from mm_rl.config.presets import BACKENDS, Preset, load_preset, model_names
from mm_rl.config.schema import JobConfig, defaults
from mm_rl.config.validate import validate
from mm_rl.config.writer import write_job_yaml


@dataclass(frozen=True)
class ClusterSpec:
    nnodes: int = 1
    nproc_per_node: int = 1
    device: str = "cpu"
    device_memory_gb: float | None = None


def create_job(model_name: str, exp_name: str, cluster: ClusterSpec, model_path: str | None = None,
               dataset_dir: str | None = None, overrides: Sequence[str] = (),
               backend: str = "mm_rl") -> tuple[DictConfig, JobConfig, ParallelPlan]:
    """The composed (unresolved) job, its typed form and its parallel plan; ConfigError on any problem."""
    if backend not in BACKENDS:
        raise ConfigError([Violation("--backend", backend, "unknown backend", f"use one of: {', '.join(BACKENDS)}")])
    try:
        preset = load_preset(model_name)
    except KeyError:
        raise ConfigError([Violation("--af_model_name", model_name, "unknown model",
                                     f"use one of: {', '.join(model_names())}")]) from None
    node = _compose(preset, exp_name, cluster, model_path, dataset_dir)
    _apply_plan(node, preset)
    user = OmegaConf.from_dotlist(parse_overrides(overrides))
    problems = unknown_keys(user)
    if problems:
        raise ConfigError(problems)
    node = typing.cast(DictConfig, OmegaConf.merge(node, user))
    job = to_job(node)
    problems = validate(job, check_paths=False)
    if problems:
        raise ConfigError(problems)
    return node, job, current_plan(job)


def _compose(preset: Preset, exp_name: str, cluster: ClusterSpec, model_path: str | None,
             dataset_dir: str | None) -> DictConfig:
    accelerated = cluster.device != "cpu"
    layer: dict = {
        "exp_name": exp_name,
        "env": {"NNODES": cluster.nnodes, "NPROC_PER_NODE": cluster.nproc_per_node, "DEVICE": cluster.device,
                "DEVICE_MEMORY_GB": cluster.device_memory_gb},
        "backend_config": {"model": preset.model,
                           "training": {"bf16": accelerated, "use-flash-attn": accelerated}},
    }
    paths: dict = {}
    if model_path:
        paths["megatron_training"] = {"tokenizer_name_or_path": str(model_path)}
    if dataset_dir:
        paths["data"] = {"dataset_param": {"basic_parameters": {"dataset_dir": str(dataset_dir)}}}
    return typing.cast(DictConfig, OmegaConf.merge(defaults(), layer, preset.run, {"backend_config": paths}))


def _apply_plan(node: DictConfig, preset: Preset) -> None:
    """Write the planned TP / PP / stage split and batch sizes into the source keys of ``node``."""
    job = to_job(node)
    plan = plan_parallel(job)
    b = node.backend_config
    b.actor_config.tensor_model_parallel_size = plan.tp
    b.actor_config.pipeline_model_parallel_size = plan.pp
    b.model.image_encoder.vision_encoder.pipeline_num_layers = plan.vit_pp_layers
    b.model.text_decoder.pipeline_num_layers = plan.llm_pp_layers
    for kind in plan.offload:
        b.actor_config[f"offload_train_{kind}"] = True
    gbs, prompts = batch_sizes(plan.dp, job.backend_config.actor_config.micro_batch_size,
                               job.backend_config.rl_config.n_samples_per_prompt, preset.target_gbs,
                               preset.target_prompts)
    b.megatron_training.global_batch_size = gbs
    b.rl_config.rollout_batch_size = prompts


def write_job(node: DictConfig, plan: ParallelPlan, path: str | Path, model_name: str) -> Path:
    header = (f"mm_rl job: {model_name}, written by `ascendfactory-cli config`.\n"
              "Keys marked ${...} follow another key: change the source once.\n"
              "Must edit for a real run: backend_config.megatron_training.tokenizer_name_or_path,\n"
              "backend_config.data.dataset_param.basic_parameters.dataset_dir, af_output_dir.\n"
              + plan.describe())
    return write_job_yaml(node, path, header)
