"""Benchmark the weight sync (Megatron worker actors -> running vLLM engine) against a plain memcpy of the same bytes.

A tiny-architecture Qwen2.5-VL with large widths (default: LLM hidden 1024, ffn 4096, 8 heads / 2 KV groups,
4 layers, vocab 16384, untied; fp32: ~0.38 GB) is built, converted with hf2mg at the actor layout (default TP2 x PP2),
loaded by the Megatron worker actors, and a vLLM engine (fp32, in its ``RolloutWorker`` actor) is started from the
same HF directory. Then, in one run:

  memcpy   ``dst.copy_(src)`` of the synced byte count in this process (one torch thread);
  sync     ``sync_weights`` from the workers into the engine (``--bucket-mb`` buckets) through Ray's object store,
           timed on the driver;
  sync_pg  the same device to device (``join_device_sync``): over each stage's process group with the engine's
           loading processes (gloo here; nccl / hccl, or an IPC handle on the sender's device, on devices). With
           ``--engine-tp 2`` the engine's two vLLM workers each receive the broadcast, while ``sync`` goes through
           the engine's host process and a file per bucket to them: the ratio of the two is printed.
  engine   the engine alone: the same HF tensors, bucketed the same way and put in the object store beforehand,
           loaded bucket by bucket through ``update_weights`` (deserialise + vLLM reload + cache resets);
  engine_once  the same inside one weight-update session (``begin_weight_update`` .. ``end_weight_update``, as the
           sync calls it): vLLM's layerwise reload set up and finalised once, not per bucket.

Each runs once untimed, then ``--repeat`` rounds in turn (load changes on a shared machine hit all alike); the median
counts. The sync's time is split per pipeline stage as its sender saw it: TP gather, merge + rename + bucketing,
put into the object store, waiting for the engine. Target: sync >= 50% of memcpy bandwidth.

    python bench/sync.py [--tp 2] [--pp 2] [--hidden 1024] [--ffn 4096] [--layers 4] [--vocab 16384]
                         [--bucket-mb 64] [--engine-tp 1] [--repeat 3] [--dir DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MIN_PIXELS, MAX_PIXELS = 56 * 56, 224 * 224


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--max-in-flight", type=int, default=1)
    parser.add_argument("--engine-tp", type=int, default=1, help="the vLLM engine's TP (worker processes)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where checkpoints go (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------------- set-up
def build_checkpoint(root: Path, args: argparse.Namespace) -> Path:
    """The tiny builder with large widths (head_dim 128, so mRoPE sections [16, 24, 24])."""
    from mm_rl.demo.tiny import build_tiny_checkpoint

    heads = args.hidden // 128
    return build_tiny_checkpoint(
        root / "hf",
        seed=0,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        vocab_size=args.vocab,
        mrope_section=[16, 24, 24],
        vision_config={"out_hidden_size": args.hidden},
    )


def split(total: int, parts: int) -> list[int]:
    """``total`` layers over ``parts`` stages, the first stage one lighter (it also holds the ViT)."""
    base = [total // parts] * parts
    for i in range(total % parts):
        base[parts - 1 - i] += 1
    return base


def convert(hf_dir: Path, root: Path, args: argparse.Namespace) -> tuple[Any, Path]:
    """model.json at the actor layout (ViT on stage 0) and hf2mg's output."""
    from mm_rl.config.schema import Hf2MgCfg, HfConfig, ParallelConfig
    from mm_rl.convert.hf2mg import hf2mg
    from mm_rl.convert.model_config import model_config_from_hf

    overrides: dict[str, Any] = {}
    if args.pp > 1:
        vit = model_config_from_hf(hf_dir).image_encoder.vision_encoder.num_layers
        overrides = {
            "text_decoder": {"pipeline_num_layers": split(args.layers, args.pp)},
            "image_encoder": {"vision_encoder": {"pipeline_num_layers": [vit] + [0] * (args.pp - 1)}},
        }
    model = model_config_from_hf(hf_dir, overrides)
    parallel = ParallelConfig(
        tp_size=args.tp,
        llm_pp_layers=list(model.text_decoder.pipeline_num_layers),
        vit_pp_layers=list(model.image_encoder.vision_encoder.pipeline_num_layers),
    )
    mm_dir = root / f"mm_tp{args.tp}_pp{args.pp}"
    if not (mm_dir / "latest_checkpointed_iteration.txt").exists():
        hf2mg(Hf2MgCfg(mm_dir=str(mm_dir), hf_config=HfConfig(hf_dir=str(hf_dir)), parallel_config=parallel), model)
    return model, mm_dir


def start_engine(hf_dir: Path, bucket_mb: int, tp: int) -> Any:
    from mm_rl.config.schema import GenerateConfig, SamplingConfig, ValSamplingConfig
    from mm_rl.rollout.engine_worker import rollout_worker_actor

    config = GenerateConfig(
        max_model_len=256,
        max_num_seqs=2,
        sync_bucket_mb=bucket_mb,
        infer_tensor_parallel_size=tp,
        sampling_config=SamplingConfig(max_tokens=8, n=1),
        val_sampling_config=ValSamplingConfig(max_tokens=8),
    )
    return rollout_worker_actor(num_cpus=1).remote(
        str(hf_dir), config, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, backend="vllm", dtype="float32"
    )


# ------------------------------------------------------------------------------------------------ variants
def memcpy_seconds(nbytes: int) -> float:
    """One ``copy_`` of ``nbytes`` between two resident buffers (pages touched first)."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    start = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - start


def engine_buckets(hf_dir: Path, bucket_bytes: int) -> list[Any]:
    """The HF checkpoint's tensors in HF order, bucketed like the sync, each already in the object store."""
    import ray
    from safetensors.torch import load_file

    from mm_rl.sync.buckets import bucket_by_group
    from mm_rl.sync.transport import SharedBucket

    tensors = load_file(str(hf_dir / "model.safetensors"))
    return [ray.put(SharedBucket(bucket)) for bucket in bucket_by_group(tensors.items(), bucket_bytes)]


def engine_seconds(engine: Any, refs: list[Any], session: bool = False) -> float:
    """Load the buckets one after another through the engine actor's ``update_weights`` (in one session)."""
    import ray

    start = time.perf_counter()
    if session:
        ray.get(engine.begin_weight_update.remote())
    for ref in refs:
        ray.get(engine.update_weights.remote(ref))
    if session:
        ray.get(engine.end_weight_update.remote())
    return time.perf_counter() - start


# ------------------------------------------------------------------------------------------------ reporting
def gb_per_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def stage_rows(report: Any) -> list[dict[str, Any]]:
    """Per-stage sender breakdown of one sync."""
    return [
        {
            "pp_rank": s.pp_rank,
            "tensors": s.tensors,
            "MB": round(s.bytes / 1e6, 1),
            "buckets": s.buckets,
            "max_bucket_MB": round(s.max_bucket_bytes / 1e6, 1),
            "gather_s": round(s.gather_s, 3),
            "merge_s": round(s.merge_s, 3),
            "put_s": round(s.put_s, 3),
            "wait_engine_s": round(s.wait_s, 3),
            "total_s": round(s.total_s, 3),
        }
        for s in report.stages
    ]


def print_results(results: dict[str, Any]) -> None:
    nbytes = results["bytes"]
    print(
        f"\nmodel {nbytes / 1e9:.3f} GB fp32, actor TP{results['tp']} x PP{results['pp']}, "
        f"engine TP{results['engine_tp']}, "
        f"buckets {results['bucket_mb']} MB, median of {results['repeat']}"
    )
    print(f"{'variant':<12}{'bytes':>12}{'seconds':>10}{'GB/s':>9}{'vs memcpy':>11}")
    memcpy = results["seconds"]["memcpy"]
    for name, seconds in results["seconds"].items():
        ratio = memcpy / seconds if seconds > 0 else 0.0
        print(f"{name:<12}{nbytes:>12,}{seconds:>10.3f}{gb_per_s(nbytes, seconds):>9.2f}{ratio:>10.1%}")
    once = results["seconds"]["engine"] / results["seconds"]["engine_once"]
    print(f"engine load per sync: set-up once vs per bucket {once:.2f}x faster")
    device = results["seconds"]["sync"] / results["seconds"]["sync_pg"]
    print(f"device route vs object store: {device:.2f}x (object-store time / device-route time; gloo on CPU)")
    for name, rows in results["stages"].items():
        print(f"{name}, per stage (sender's view, median run):")
        for row in rows:
            print("  " + ", ".join(f"{key} {value}" for key, value in row.items()))


# ------------------------------------------------------------------------------------------------------ main
def main(argv: list[str]) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import ray
    import torch

    from mm_rl.sync.driver import join_device_sync, sync_weights
    from mm_rl.workers.group import WorkerGroup
    from mm_rl.workers.megatron_worker import WorkerSpec

    args = parse_args(argv)
    torch.set_num_threads(1)
    root = args.dir or Path(tempfile.mkdtemp(prefix="bench_sync_"))
    hf_dir = build_checkpoint(root, args)
    model, mm_dir = convert(hf_dir, root, args)
    bucket_bytes = args.bucket_mb << 20
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        engine = start_engine(hf_dir, args.bucket_mb, args.engine_tp)
        group = WorkerGroup(WorkerSpec(model, tp=args.tp, pp=args.pp), cpus_per_worker=0.5)
        group.build(str(mm_dir))
        ray.get(engine.ready.remote())
        route = join_device_sync(group, [engine])
        transports = {"sync": None, "sync_pg": route}
        for route_of in transports.values():  # untimed first rounds
            report = sync_weights(group, [engine], bucket_bytes, args.max_in_flight, route=route_of)
        refs = engine_buckets(hf_dir, bucket_bytes)
        engine_seconds(engine, refs)
        engine_seconds(engine, refs, session=True)
        memcpy_seconds(report.bytes)
        times: dict[str, list[float]] = {
            "memcpy": [],
            **{name: [] for name in transports},
            "engine": [],
            "engine_once": [],
        }
        reports: dict[str, list[Any]] = {name: [] for name in transports}
        for _ in range(args.repeat):
            times["memcpy"].append(memcpy_seconds(report.bytes))
            for name, route_of in transports.items():
                reports[name].append(sync_weights(group, [engine], bucket_bytes, args.max_in_flight, route=route_of))
                times[name].append(reports[name][-1].seconds)
            times["engine"].append(engine_seconds(engine, refs))
            times["engine_once"].append(engine_seconds(engine, refs, session=True))
        median_runs = {name: sorted(runs, key=lambda r: r.seconds)[len(runs) // 2] for name, runs in reports.items()}
        results = {
            "bytes": report.bytes,
            "tensors": report.tensors,
            "tp": args.tp,
            "pp": args.pp,
            "engine_tp": args.engine_tp,
            "bucket_mb": args.bucket_mb,
            "repeat": args.repeat,
            "seconds": {name: statistics.median(values) for name, values in times.items()},
            "all_seconds": times,
            "stages": {name: stage_rows(run) for name, run in median_runs.items()},
        }
        print_results(results)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        group.shutdown()
        ray.get(engine.close.remote())
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
