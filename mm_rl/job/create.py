"""`ascendfactory-cli config`: compose a job for a model and a cluster, plan its layout, and write the yaml."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from mm_rl.config.loader import ConfigError, Violation, check_job, read_layers, relative_note, to_job
from mm_rl.config.plan import (
    DEFAULT_DEVICE_MEMORY_GB,
    ParallelPlan,
    batch_sizes,
    colocated_engine_tp,
    current_plan,
    plan_parallel,
)
from mm_rl.config.presets import BACKENDS, Preset, load_preset, model_names
from mm_rl.config.schema import JobConfig, defaults
from mm_rl.config.writer import write_job_yaml
from mm_rl.job.validate import validate


@dataclass(frozen=True)
class ClusterSpec:
    nnodes: int = 1
    nproc_per_node: int = 1
    device: str = "cpu"
    device_memory_gb: float | None = None

    def problems(self) -> list[Violation]:
        """Flags that describe no cluster: the planner needs at least one device of some memory."""
        out = [
            Violation(flag, n, "must be at least 1", f"give the number of {what}, e.g. {flag} {example}")
            for flag, n, what, example in (
                ("--nnodes", self.nnodes, "machines", 2),
                ("--nproc_per_node", self.nproc_per_node, "devices per machine", 8),
            )
            if n < 1
        ]
        if self.device_memory_gb is not None and self.device_memory_gb <= 0:
            default = DEFAULT_DEVICE_MEMORY_GB.get(self.device)
            out.append(
                Violation(
                    "--device_memory_gb",
                    self.device_memory_gb,
                    "must be > 0 (one device's memory)",
                    f"give it in GiB, or leave the flag out (default for {self.device}: {default} GiB)",
                )
            )
        return out


MAX_NODES = 64  # how far a plan that does not fit looks for a node count that does


def create_job(
    model_name: str,
    exp_name: str,
    cluster: ClusterSpec,
    model_path: str | None = None,
    dataset_dir: str | None = None,
    overrides: Sequence[str] = (),
    backend: str = "mm_rl",
    allow_oversubscribe: bool = True,
) -> tuple[DictConfig, JobConfig, ParallelPlan]:
    """The composed (unresolved) job, its typed form and its parallel plan; ConfigError on any problem, and, unless
    ``allow_oversubscribe``, when the plan's memory estimate exceeds the device."""
    if backend not in BACKENDS:
        raise ConfigError([Violation("--backend", backend, "unknown backend", f"use one of: {', '.join(BACKENDS)}")])
    try:
        preset = load_preset(model_name)
    except KeyError:
        raise ConfigError(
            [Violation("--af_model_name", model_name, "unknown model", f"use one of: {', '.join(model_names())}")]
        ) from None
    if problems := cluster.problems():
        raise ConfigError(problems)
    node = _compose(preset, exp_name, cluster, model_path, dataset_dir)
    _apply_plan(node, preset)
    node, job = check_job(node, read_layers(None, overrides), lambda cfg: validate(cfg, check_paths=False))
    plan = current_plan(job)
    if not (plan.fits or allow_oversubscribe):

        def plan_for(nodes: int) -> ParallelPlan:
            bigger = dataclasses.replace(cluster, nnodes=nodes)
            return create_job(model_name, exp_name, bigger, model_path, dataset_dir, overrides, backend)[2]

        raise ConfigError([_oversubscribed(plan, cluster.nnodes, plan_for)])
    return node, job, plan


def _oversubscribed(plan: ParallelPlan, nnodes: int, plan_for: Callable[[int], ParallelPlan]) -> Violation:
    """The refusal of a plan estimated above the device memory, naming the smallest node count (doubling, up to
    ``MAX_NODES``) whose plan is estimated to fit."""
    fitting = next((n for n in _more_nodes(nnodes) if _fits(plan_for, n)), None)
    more = (
        f"use more nodes: --nnodes {fitting} is estimated to fit"
        if fitting
        else f"no plan of up to {MAX_NODES} nodes is estimated to fit: lower seq-length or micro_batch_size"
    )
    return Violation(
        "--nnodes",
        nnodes,
        f"the plan's memory estimate is {plan.peak:.0f} GiB per device, more than "
        f"a device's {plan.device_memory_gb:.0f} GiB (--device_memory_gb)",
        f"{more}; or pass --allow-oversubscribe to write the yaml anyway",
    )


def _more_nodes(nnodes: int) -> Iterator[int]:
    n = nnodes * 2
    while n <= MAX_NODES:
        yield n
        n *= 2


def _fits(plan_for: Callable[[int], ParallelPlan], nodes: int) -> bool:
    try:
        return plan_for(nodes).fits
    except ConfigError:  # the user's overrides (a fixed TP, say) may not suit that many nodes
        return False


def _compose(
    preset: Preset, exp_name: str, cluster: ClusterSpec, model_path: str | None, dataset_dir: str | None
) -> DictConfig:
    accelerated = cluster.device != "cpu"
    layer: dict = {
        "exp_name": exp_name,
        "env": {
            "NNODES": cluster.nnodes,
            "NPROC_PER_NODE": cluster.nproc_per_node,
            "DEVICE": cluster.device,
            "DEVICE_MEMORY_GB": cluster.device_memory_gb,
        },
        "backend_config": {"model": preset.model, "training": {"bf16": accelerated, "use-flash-attn": accelerated}},
    }
    paths: dict = {}
    if model_path:
        paths["megatron_training"] = {"tokenizer_name_or_path": str(model_path)}
    if dataset_dir:
        paths["data"] = {"dataset_param": {"basic_parameters": {"dataset_dir": str(dataset_dir)}}}
    return typing.cast(DictConfig, OmegaConf.merge(defaults(), layer, preset.run, {"backend_config": paths}))


def _apply_plan(node: DictConfig, preset: Preset) -> None:
    """Write the planned TP / PP / stage split and batch sizes into the source keys of ``node``."""
    job, b = to_job(node), node.backend_config
    engine_tp = (
        colocated_engine_tp(job) if job.env.DEVICE != "cpu" and job.backend_config.generate_config.colocate else None
    )
    if engine_tp:  # the smallest engine TP whose weights leave its KV cache room beside the actor
        b.generate_config.infer_tensor_parallel_size = engine_tp
        job = to_job(node)
    plan = plan_parallel(job)
    b.actor_config.tensor_model_parallel_size = plan.tp
    if plan.ep > 1:
        b.actor_config.expert_model_parallel_size = plan.ep
    b.actor_config.pipeline_model_parallel_size = plan.pp
    b.model.image_encoder.vision_encoder.pipeline_num_layers = plan.vit_pp_layers
    b.model.text_decoder.pipeline_num_layers = plan.llm_pp_layers
    for kind in plan.offload:
        b.actor_config[f"offload_train_{kind}"] = True
    gbs, prompts = batch_sizes(
        plan.dp,
        job.backend_config.actor_config.micro_batch_size,
        job.backend_config.rl_config.n_samples_per_prompt,
        preset.target_gbs,
        preset.target_prompts,
    )
    b.megatron_training.global_batch_size = gbs
    b.rl_config.rollout_batch_size = prompts


def write_job(node: DictConfig, plan: ParallelPlan, path: str | Path, model_name: str) -> Path:
    """The commented yaml at ``path`` (``--output_file_path``); a ConfigError when it cannot be written."""
    path = Path(path)
    header = (
        f"mm_rl job: {model_name}, written by `ascendfactory-cli config`.\n"
        "Keys marked ${...} follow another key: change the source once.\n"
        "Must edit for a real run: backend_config.megatron_training.tokenizer_name_or_path,\n"
        "backend_config.data.dataset_param.basic_parameters.dataset_dir, af_output_dir.\n" + plan.describe()
    )
    if path.is_dir():
        raise _unwritable(path, f"it is a directory (name a file in it, e.g. {path / 'job.yaml'})")
    try:
        return write_job_yaml(node, path, header)
    except OSError as err:
        raise _unwritable(path, _why_unwritable(path, err)) from None


def _unwritable(path: Path, why: str) -> ConfigError:
    return ConfigError(
        [
            Violation(
                "--output_file_path",
                str(path),
                f"cannot be written{relative_note(path)}: {why}",
                "choose a file in a directory you can write to",
            )
        ]
    )


def _why_unwritable(path: Path, err: OSError) -> str:
    """The cause in the user's terms: a file where a directory is needed reads "File exists" in ``err``."""
    existing = path.absolute().parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a directory"
    return f"{err.strerror}: {err.filename}" if err.strerror and err.filename else str(err)
