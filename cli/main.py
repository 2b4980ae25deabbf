"""`ascendfactory-cli`: write a job yaml (config), check it (check), convert checkpoints (convert), run the job
(train) or submit it to a Ray cluster (submit)."""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from mm_rl.config.loader import ConfigError
from mm_rl.config.schema import JobConfig

EPILOG = "Any --a.b.c=VALUE argument overrides that key of the job yaml."


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ascendfactory-cli", description="mm_rl: GRPO for multimodal models")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_config(commands)
    _add_check(commands)
    _add_convert(commands)
    _add_train(commands)
    _add_submit(commands)
    args, extra = parser.parse_known_args(argv)
    try:
        return args.run(args, extra)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


def _add_config(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("config", help="write a job yaml for a model and a cluster", epilog=EPILOG)
    p.add_argument("--backend", default="mm_rl", help="training backend (mm_rl)")
    p.add_argument(
        "--af_model_name",
        required=True,
        help="qwen2_5_vl_3b|7b|32b|72b, qwen2_vl_2b|7b|72b, qwen3_vl_2b|4b|8b|32b|30b_a3b|235b_a22b, "
        "qwen3_5_0_8b|2b|4b|9b|27b|35b_a3b|122b_a10b|397b_a17b, tiny, tiny_qwen2_vl, tiny_qwen3_vl, tiny_qwen3_vl_moe, "
        "tiny_qwen3_5 or tiny_qwen3_5_moe",
    )
    p.add_argument("--exp_name", default="mm_rl", help="experiment name")
    p.add_argument("--output_file_path", default="job.yaml", help="where to write the yaml")
    p.add_argument("--nnodes", type=int, default=1, help="machines in the cluster")
    p.add_argument("--nproc_per_node", type=int, default=None, help="devices per machine (8 on accelerators)")
    p.add_argument(
        "--device",
        choices=("npu", "cuda", "cpu"),
        default=None,
        help="accelerator kind (default: npu; cpu for the tiny model)",
    )
    p.add_argument("--device_memory_gb", type=float, default=None, help="memory of one device in GiB")
    p.add_argument("--model_path", default=None, help="HuggingFace checkpoint directory")
    p.add_argument("--dataset_dir", default=None, help="dataset directory (geo3k parquet, raw or jsonl)")
    p.add_argument(
        "--allow-oversubscribe",
        action="store_true",
        help="write the yaml even when the plan's memory estimate exceeds a device's memory",
    )
    p.set_defaults(run=_run_config)


def _run_config(args: argparse.Namespace, overrides: list[str]) -> int:
    from mm_rl.config.presets import load_preset, model_names
    from mm_rl.job.create import ClusterSpec, create_job, write_job

    embedded = args.af_model_name in model_names() and load_preset(args.af_model_name).embedded
    device = args.device or ("cpu" if embedded else "npu")
    nproc = args.nproc_per_node if args.nproc_per_node is not None else (1 if device == "cpu" else 8)
    cluster = ClusterSpec(args.nnodes, nproc, device, args.device_memory_gb)
    node, job, plan = create_job(
        args.af_model_name,
        args.exp_name,
        cluster,
        args.model_path,
        args.dataset_dir,
        overrides,
        args.backend,
        allow_oversubscribe=args.allow_oversubscribe,
    )
    path = write_job(node, plan, args.output_file_path, args.af_model_name)
    print(plan.describe())
    if load_preset(args.af_model_name).embedded:
        _materialise_embedded(job)
    print(f"wrote {path}; next: ascendfactory-cli check {path}")
    return 0


def _materialise_embedded(job: JobConfig) -> None:
    """The tiny default's model and data are built by mm_rl itself (seeded), so the written job runs as it is.

    The random tiny model never samples the answer format, so it gets a short warm-up (mm_rl.demo.tiny_warmup):
    GRPO then starts, like a real run from an instruct model, with the format right, a quarter of the sampled
    answers right and the greedy answer off by one.
    """
    from mm_rl.demo.synthetic import DEMO_TEMPLATES, write_synthetic_geo3k
    from mm_rl.demo.synthetic_video import write_synthetic_video
    from mm_rl.demo.tiny import build_tiny_checkpoint, tiny_overrides
    from mm_rl.demo.tiny_warmup import warm_up_format
    from mm_rl.demo.tool_warmup import TOOL_TEMPLATES, warm_up_tools

    b = job.backend_config
    tools = b.rl_config.multi_turn.enable  # the multi-turn demo: problems that need the calculator
    videos = b.generate_config.max_videos_per_prompt > 0  # the video demo: clips, warmed up on the figures
    variant = tiny_overrides(b.model)
    hf_dir = build_tiny_checkpoint(b.convert_ckpt_hf2mg.cfg.hf_config.hf_dir, family=b.model.model_id, **variant)
    dataset_dir = Path(b.data.dataset_param.basic_parameters.dataset_dir)
    data_dir = write_synthetic_geo3k(
        dataset_dir.with_name("geo3k_synthetic") if videos else dataset_dir,
        seed=b.training.seed,
        templates=TOOL_TEMPLATES if tools else DEMO_TEMPLATES,
    )
    print(f"embedded synthetic geo3k data: {data_dir}")
    if videos:
        print(f"embedded synthetic video data: {write_synthetic_video(dataset_dir, seed=b.training.seed)}")
    warm_up = warm_up_tools if tools else warm_up_format
    try:
        warm = warm_up(hf_dir, data_dir, report=print)
    except ValueError:  # warmed up by another mm_rl version: the tiny checkpoint is derived data, rebuild it
        _start_over(job)
        hf_dir = build_tiny_checkpoint(b.convert_ckpt_hf2mg.cfg.hf_config.hf_dir, family=b.model.model_id, **variant)
        warm = warm_up(hf_dir, data_dir, report=print)
    after = warm["after"]
    print(
        f"embedded tiny model: {hf_dir} ({'tool' if tools else 'format'} warm-up: format rate "
        f"{warm['before']['format']:.2f} -> {after['format']:.2f}, accuracy {after['accuracy']:.2f}"
        + (f", calculator calls {after['calculator']:.2f}" if tools else "")
        + ")"
    )


def _start_over(job: JobConfig) -> None:
    """Remove an embedded model built by another mm_rl version, with the checkpoints and metrics trained from it
    (resuming them onto the rebuilt model would mix two runs)."""
    b = job.backend_config
    stale = [
        Path(b.convert_ckpt_hf2mg.cfg.hf_config.hf_dir),
        Path(b.megatron_training.save),
        Path(job.af_output_dir) / "metrics.jsonl",
        Path(job.af_output_dir) / "tensorboard",
    ]
    print(
        f"the embedded tiny model in {stale[0]} was built by another mm_rl version: rebuilding it and removing "
        "the checkpoints and metrics trained from it"
    )
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _add_check(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("check", help="validate a job yaml and print its parallel layout", epilog=EPILOG)
    p.add_argument("job", help="job yaml")
    p.set_defaults(run=_run_check)


def _validated_job(path: str, overrides: list[str]) -> JobConfig:
    """The job yaml with the overrides, every rule checked (all problems raised at once, unknown keys and type
    errors included)."""
    from mm_rl.config.loader import load_checked
    from mm_rl.job.validate import validate

    return load_checked(path, overrides, validate)[1]


def _run_check(args: argparse.Namespace, overrides: list[str]) -> int:
    from mm_rl.config.plan import current_plan

    job = _validated_job(args.job, overrides)
    print("ok")
    print(current_plan(job).describe())
    return 0


def _add_convert(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "convert",
        help="convert a checkpoint: HuggingFace <-> Megatron shards (MindSpeed-MM layout)",
        epilog="With --job, any --a.b.c=VALUE overrides that key of the job yaml. Without --job, give the "
        "conversion keys as --cfg.KEY VALUE (hf2mg: --cfg.mm_dir, --cfg.hf_config.hf_dir; mg2hf: "
        "--cfg.load_dir, --cfg.save_hf_dir and --hf_dir; both: --cfg.parallel_config.tp_size, "
        "--cfg.parallel_config.llm_pp_layers '[1,10,10,7]', --cfg.parallel_config.vit_pp_layers) and "
        "model.json changes as --model.KEY VALUE; model.json comes from the HF config.json.",
    )
    p.add_argument("direction", choices=("hf2mg", "mg2hf"), help="hf2mg: HF -> Megatron; mg2hf: Megatron -> HF")
    p.add_argument("--job", default=None, help="job yaml holding backend_config.convert_ckpt_* and the model")
    p.add_argument(
        "--hf_dir",
        default=None,
        help="mg2hf: the HF checkpoint trained from (config, tokenizer, processor files are copied)",
    )
    p.add_argument("--iteration", default=None, help="mg2hf: 'release' or a step number (default: the latest)")
    p.add_argument("--max_shard_size", default=None, help="mg2hf: largest output safetensors file (default 2GiB)")
    p.set_defaults(run=_run_convert)


def _run_convert(args: argparse.Namespace, overrides: list[str]) -> int:
    from mm_rl.convert.cli import run_convert
    from mm_rl.convert.errors import ConversionError
    from mm_rl.convert.layout import describe_os_error

    try:
        path = run_convert(args.direction, args.job, overrides, args.hf_dir, args.iteration, args.max_shard_size)
    except ConversionError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # a full disk (hf2mg checks the space first), read-only or forbidden output
        if err.errno is None:
            raise
        print(f"error: {describe_os_error(err)}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


def _add_train(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("train", help="run the job: hf2mg, the GRPO loop, mg2hf", epilog=EPILOG)
    p.add_argument("job", help="job yaml")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="also print what the rollout engine, the ranks and Ray print (by default it goes to "
        "af_output_dir/logs/workers.log)",
    )
    p.set_defaults(run=_run_train)


def _run_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from mm_rl.job.run import failure_message, run_job, summary
    from mm_rl.trainer.runtime import Terminated, show_worker_output, stop_cleanly_on_sigterm

    show_worker_output(args.verbose)
    stop_cleanly_on_sigterm()
    job = _validated_job(args.job, overrides)
    try:
        result = run_job(job)
    except Exception as err:  # failure_message decides; a bug (None) keeps its traceback
        message = failure_message(err)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (Terminated): the roles are torn down already
        terminated = isinstance(stop, Terminated)
        print(f"{'terminated (SIGTERM)' if terminated else 'interrupted'}; run the same command again to resume from "
              "the last checkpoint", file=sys.stderr)  # fmt: skip
        return 143 if terminated else 130
    print(summary(result, args.job))
    return 0


def _add_submit(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "submit", help="submit the job to a running Ray cluster (Ray job submission)", epilog=EPILOG
    )
    p.add_argument("job", help="job yaml")
    p.add_argument("--address", required=True, help="the cluster's dashboard address, e.g. http://HEAD:8265")
    p.add_argument("--no-wait", action="store_true", help="return once submitted instead of streaming the logs")
    p.set_defaults(run=_run_submit)


def _run_submit(args: argparse.Namespace, overrides: list[str]) -> int:
    from mm_rl.job.submit import SubmitError, submit

    try:
        return submit(args.job, overrides, args.address, wait=not args.no_wait)
    except SubmitError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
