"""`ascendfactory-cli`: write a job yaml (config), check it (check)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mm_rl.config.loader import ConfigError
from mm_rl.config.schema import JobConfig

EPILOG = "Any --a.b.c=VALUE argument overrides that key of the job yaml."


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ascendfactory-cli", description="mm_rl: GRPO for multimodal models")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_config(commands)
    _add_check(commands)
    args, extra = parser.parse_known_args(argv)
    try:
        return args.run(args, extra)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


def _add_config(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("config", help="write a job yaml for a model and a cluster", epilog=EPILOG)
    p.add_argument("--backend", default="mm_rl", help="training backend (mm_rl)")
    p.add_argument("--af_model_name", required=True, help="qwen2_5_vl_3b, _7b, _32b, _72b or tiny")
    p.add_argument("--exp_name", default="mm_rl", help="experiment name")
    p.add_argument("--output_file_path", default="job.yaml", help="where to write the yaml")
    p.add_argument("--nnodes", type=int, default=1, help="machines in the cluster")
    p.add_argument("--nproc_per_node", type=int, default=None, help="devices per machine (8 on accelerators)")
    p.add_argument("--device", choices=("npu", "cuda", "cpu"), default=None,
                   help="accelerator kind (default: npu; cpu for the tiny model)")
    p.add_argument("--device_memory_gb", type=float, default=None, help="memory of one device in GiB")
    p.add_argument("--model_path", default=None, help="HuggingFace checkpoint directory")
    p.add_argument("--dataset_dir", default=None, help="dataset directory (geo3k parquet, raw or jsonl)")
    p.set_defaults(run=_run_config)


def _run_config(args: argparse.Namespace, overrides: list[str]) -> int:
    from mm_rl.config.create import ClusterSpec, create_job, write_job
    from mm_rl.config.presets import load_preset

    device = args.device or ("cpu" if args.af_model_name == "tiny" else "npu")
    nproc = args.nproc_per_node or (1 if device == "cpu" else 8)
    cluster = ClusterSpec(args.nnodes, nproc, device, args.device_memory_gb)
    node, job, plan = create_job(args.af_model_name, args.exp_name, cluster, args.model_path, args.dataset_dir,
                                 overrides, args.backend)
    path = write_job(node, plan, args.output_file_path, args.af_model_name)
    print(plan.describe())
    if load_preset(args.af_model_name).embedded:
        _materialise_embedded(job)
    print(f"wrote {path}; next: ascendfactory-cli check {path}")
    return 0


def _materialise_embedded(job: JobConfig) -> None:
    """The tiny default's model and data are built by mm_rl itself (seeded), so the written job runs as it is."""
    from mm_rl.data.synthetic import write_synthetic_geo3k
    from mm_rl.models.tiny import build_tiny_checkpoint

    b = job.backend_config
    print(f"embedded tiny model: {build_tiny_checkpoint(b.convert_ckpt_hf2mg.cfg.hf_config.hf_dir)}")
    data_dir = b.data.dataset_param.basic_parameters.dataset_dir
    print(f"embedded synthetic geo3k data: {write_synthetic_geo3k(data_dir, seed=b.training.seed)}")


def _add_check(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("check", help="validate a job yaml and print its parallel layout", epilog=EPILOG)
    p.add_argument("job", help="job yaml")
    p.set_defaults(run=_run_check)


def _run_check(args: argparse.Namespace, overrides: list[str]) -> int:
    from mm_rl.config.loader import load_job
    from mm_rl.config.plan import current_plan
    from mm_rl.config.validate import validate

    job = load_job(args.job, overrides)
    problems = validate(job)
    if problems:
        raise ConfigError(problems)
    print("ok")
    print(current_plan(job).describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
