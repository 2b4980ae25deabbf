"""Benchmark hf2mg / mg2hf against a plain copy of the same bytes: wall time and peak memory of each.

Generates (random weights, one ``safetensors.torch.save_file`` per shard file) a Qwen2.5-VL checkpoint with the
7B widths (ViT hidden 1280 / 16 heads / ffn 3420; LLM hidden 3584 / 28 heads / 4 KV groups / ffn 18944; vocab
152064; bf16) but few layers (default 4 ViT + 3 LLM: about 3.8 GB, two thirds of it the untied embedding and
output layer), in shard files of at most a few hundred MB where the tensors allow. Then, each in its own child
process (so ``os.wait4`` gives that child's peak RSS): hf2mg at TP2 x PP2, mg2hf back, and ``shutil.copy`` of
the HF files. Targets: each direction <= 1.5x the copy's time; peak RSS <= the largest output file + the largest
input file (the memory a converter that holds one output file and maps one input file at a time needs).
Every step starts after ``os.sync()``; "time" is until the step returns (its writes may still sit in the page
cache), "+sync" until they are on disk; "process" adds the interpreter start and imports.

    python bench/convert.py [--dir DIR] [--vit-layers 4] [--llm-layers 3] [--repeat 3] [--keep] [--verify]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TP = 2
SHARD_BYTES = 400 * 10**6


def published_config(vit_layers: int, llm_layers: int) -> dict[str, Any]:
    """A Qwen2.5-VL-7B config.json (published spelling) with fewer layers."""
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": llm_layers,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 128000,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1e6,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "image_token_id": 151655,
        "vision_start_token_id": 151652,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vision_config": {
            "depth": vit_layers,
            "hidden_act": "silu",
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "in_chans": 3,
            "out_hidden_size": 3584,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [i for i in (7, 15, 23, 31) if i < vit_layers],
        },
    }


def generate(hf_dir: Path, vit_layers: int, llm_layers: int) -> None:
    """Random bf16 weights with the shapes the mapping table expects, grouped into shard files."""
    import torch
    from safetensors.torch import save_file

    from mm_rl.convert.mapping import hf_shape, model_dims, model_family
    from mm_rl.convert.model_config import model_config_from_hf

    config = published_config(vit_layers, llm_layers)
    model = model_config_from_hf(config)
    dims = model_dims(model)
    shapes: dict[str, tuple[int, ...]] = {}
    for entry in model_family(model).tensors:
        if entry.duplicate:
            continue
        layers = {"vit_layer": vit_layers, "llm_layer": llm_layers}.get(entry.scope, 1)
        for i in range(layers):
            for part, name in enumerate(entry.hf):
                shapes[name.format(i=i)] = hf_shape(entry, part, dims)
    hf_dir.mkdir(parents=True)
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(shapes):
        nbytes = 2 * int(torch.Size(shapes[name]).numel())
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    generator = torch.Generator().manual_seed(0)
    weight_map = {}
    for k, group in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(
            {n: torch.randn(shapes[n], generator=generator, dtype=torch.bfloat16) for n in group},
            hf_dir / file,
            metadata={"format": "pt"},
        )
        weight_map.update(dict.fromkeys(group, file))
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (hf_dir / "config.json").write_text(json.dumps(config, indent=2))
    (hf_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 151643, "eos_token_id": 151645}))


# ------------------------------------------------------------------------------------------ children
def child(op: str, work: Path, vit_layers: int, llm_layers: int, result: Path) -> None:
    """One measured operation; writes its own timing and its RSS before the work (imports) to ``result``."""
    if op == "generate":
        start = time.perf_counter()
        generate(work / "hf", vit_layers, llm_layers)
    elif op == "copy":
        start = time.perf_counter()
        out = work / "copy"
        out.mkdir()
        for path in sorted((work / "hf").iterdir()):
            shutil.copy(path, out / path.name)
    else:
        from mm_rl.config.schema import Hf2MgCfg, HfConfig, Mg2HfCfg, ParallelConfig
        from mm_rl.convert.hf2mg import hf2mg
        from mm_rl.convert.mg2hf import mg2hf
        from mm_rl.convert.model_config import model_config_from_hf

        hf = work / "hf"
        vit, llm = [vit_layers, 0], [1, llm_layers - 1]
        model = model_config_from_hf(hf)
        model.text_decoder.pipeline_num_layers, model.image_encoder.vision_encoder.pipeline_num_layers = llm, vit
        parallel = ParallelConfig(tp_size=TP, vit_pp_layers=vit, llm_pp_layers=llm)
        start = time.perf_counter()
        if op == "hf2mg":
            hf2mg(
                Hf2MgCfg(mm_dir=str(work / "mm"), hf_config=HfConfig(hf_dir=str(hf)), parallel_config=parallel), model
            )
        else:
            mg2hf(
                Mg2HfCfg(load_dir=str(work / "mm"), save_hf_dir=str(work / "back"), parallel_config=parallel), model, hf
            )
    seconds = time.perf_counter() - start
    os.sync()  # the same bytes reach the disk in every step; a step is durable only then
    durable = time.perf_counter() - start
    result.write_text(json.dumps({"seconds": seconds, "durable_seconds": durable, "baseline_kb": _baseline_kb}))


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


_baseline_kb = 0


def measure(op: str, work: Path, args: argparse.Namespace) -> dict[str, float]:
    """Run ``op`` in a child; its wall time (whole process and operation only) and peak RSS."""
    result = work / f"{op}.json"
    command = [
        sys.executable,
        __file__,
        "--child",
        op,
        "--dir",
        str(work),
        "--vit-layers",
        str(args.vit_layers),
        "--llm-layers",
        str(args.llm_layers),
        "--result",
        str(result),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    os.sync()  # start each step with no dirty pages of the previous one still being written back
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, cwd=Path(__file__).resolve().parents[1])
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if process.returncode:
        raise SystemExit(f"{op} failed with exit code {process.returncode}")
    inner = json.loads(result.read_text())
    return {
        "seconds": inner["seconds"],
        "durable_seconds": inner["durable_seconds"],
        "process_seconds": wall,
        "peak_mb": usage.ru_maxrss / 1024,
        "baseline_mb": inner["baseline_kb"] / 1024,
    }


def _largest_mb(paths: list[Path]) -> float:
    return max(p.stat().st_size for p in paths) / 2**20


def _total_mb(directory: Path) -> float:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) / 2**20


def main() -> None:
    global _baseline_kb
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="work directory (default: a new temporary one)")
    parser.add_argument("--vit-layers", type=int, default=4)
    parser.add_argument("--llm-layers", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3, help="rounds of copy, hf2mg, mg2hf (medians reported)")
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    parser.add_argument("--verify", action="store_true", help="check mg2hf's output equals the input, bit for bit")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.child in ("hf2mg", "mg2hf"):
            import torch  # noqa: F401 (imports count as the baseline, not as the conversion's memory)

            import mm_rl.convert.hf2mg  # noqa: F401
        _baseline_kb = _rss_kb()
        child(args.child, Path(args.dir), args.vit_layers, args.llm_layers, Path(args.result))
        return
    work = Path(args.dir or tempfile.mkdtemp(prefix="convert_bench_"))
    try:
        run(work, args)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def run(work: Path, args: argparse.Namespace) -> None:
    """Every step runs in a child: a child's peak RSS counts the parent's memory at fork, so the parent stays
    small (it never imports torch)."""
    seconds = measure("generate", work, args)["seconds"]
    inputs = sorted((work / "hf").glob("*.safetensors"))
    print(
        f"generated {_total_mb(work / 'hf'):.0f} MiB in {len(inputs)} files (largest {_largest_mb(inputs):.0f} "
        f"MiB) in {seconds:.1f} s; TP{TP} x PP2, vit [{args.vit_layers},0], llm [1,{args.llm_layers - 1}]"
    )
    rounds: dict[str, list[dict[str, float]]] = {"copy": [], "hf2mg": [], "mg2hf": []}
    for _ in range(args.repeat):  # interleaved rounds: the machine's load and write-back vary over time
        for op, output in (("copy", "copy"), ("hf2mg", "mm"), ("mg2hf", "back")):
            shutil.rmtree(work / output, ignore_errors=True)
            rounds[op].append(measure(op, work, args))
    results = {
        op: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        | {"peak_mb": max(r["peak_mb"] for r in runs)}
        for op, runs in rounds.items()
    }
    rank_files = sorted((work / "mm").rglob("model_optim_rng.pt"))
    outputs = sorted((work / "back").glob("*.safetensors"))
    budget = {
        "hf2mg": _largest_mb(rank_files) + _largest_mb(inputs),
        "mg2hf": _largest_mb(outputs) + _largest_mb(rank_files),
        "copy": 0.0,
    }
    copy = results["copy"]
    print(
        f"{'':6} {'time s':>7} {'x copy':>7} {'+sync s':>8} {'x copy':>7} {'process s':>10} {'peak RSS MiB':>13} "
        f"{'- imports':>10} {'target MiB':>11}"
    )
    for op, r in results.items():
        target = f"{budget[op]:11.0f}" if op != "copy" else f"{'':11}"
        print(
            f"{op:6} {r['seconds']:7.2f} {r['seconds'] / copy['seconds']:7.2f} {r['durable_seconds']:8.2f} "
            f"{r['durable_seconds'] / copy['durable_seconds']:7.2f} {r['process_seconds']:10.2f} "
            f"{r['peak_mb']:13.0f} {r['peak_mb'] - r['baseline_mb']:10.0f} {target}"
        )
    print(
        f"medians of {args.repeat} rounds (peak RSS: the largest); each round's time s:",
        {op: [round(r["seconds"], 1) for r in runs] for op, runs in rounds.items()},
    )
    print(
        f"rank files: largest {_largest_mb(rank_files):.0f} MiB; HF output: {len(outputs)} files, largest "
        f"{_largest_mb(outputs):.0f} MiB; input: largest {_largest_mb(inputs):.0f} MiB"
    )
    if args.verify:
        verify(work)


def verify(work: Path) -> None:
    import torch
    from safetensors import safe_open

    def index(directory: Path) -> dict[str, str]:
        return json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]

    source, back = index(work / "hf"), index(work / "back")
    assert sorted(source) == sorted(back)
    for name in sorted(source):
        with safe_open(work / "hf" / source[name], "pt") as a, safe_open(work / "back" / back[name], "pt") as b:
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name
    print(f"verified: {len(source)} tensors bit-exact")


if __name__ == "__main__":
    main()
