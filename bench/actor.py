"""The actor's three passes of a GRPO step (old log-probs, reference log-probs, update), the way before against now.

A workload bigger than the tiny demo: the tiny builder at LLM hidden 512 x 8 layers and a 4-layer ViT (random
weights, through hf2mg), ``--prompts`` prompts x n 8 samples, images of three sizes (16, 48 and 80 LLM tokens),
prompts of 40-130 tokens (20-50 of text beside the image), long-tailed responses (exponential, mean 32) up to
``--max-response`` with one sample per prompt at the limit. Each path runs in its own process (its own peak RSS) on
one rank with all cores:

- before: right-padded micro-batches of ``--mbs`` samples, each row with its prompt's pixel values (one ViT pass
  per sample), an old log-prob pass, a reference pass and the update;
- now: packed micro-batches (``remove_padding``) cut by token budgets (``--budget`` for the update,
  ``--log-prob-budget`` for the log-prob pass), each distinct image encoded once per rank and step (the frozen
  ViT's per-step cache; the reference pass runs as on ranks of its own, with their own cache), no old log-prob
  pass (the step is one mini-batch and one epoch: the update's own forward gives the old log-probs), the reference
  pass, the update; in every pass only the response tokens reach the output layer (the model's ``output_mask``).

With ``--lora R``, a third path: the new one training LoRA adapters of rank R on the LLM's linears (the base
frozen; the reference pass is the same rank with its adapters off), printed against the new path's full-weight
update as ``lora update: U.UUx the full-weight update``.

Both start from the same weights, so the update's loss and grad norm must agree (printed). Per path: wall time
per pass, tokens computed (padding included) against tokens needed, ViT images encoded against the distinct images
of its passes (the step's images, once per pass), peak RSS. The last line:
``actor passes: speedup S.SSx, padding P.P%, vit passes V of D`` (the new path's padding share and ViT images).

    python bench/actor.py [--prompts 4] [--mbs 4] [--budget 1024] [--log-prob-budget 2048] [--max-response 128]
                          [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

N = 8
GRIDS = [(1, 8, 8), (1, 12, 16), (1, 16, 20)]  # (t, h, w) patches: 16, 48 and 80 LLM tokens after the 2x2 merge
PATCH_DIM = 3 * 2 * 14 * 14
TEXT = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 1408,
    "mrope_section": [8, 12, 12],
}
VISION = {
    "depth": 4,
    "hidden_size": 256,
    "num_heads": 4,
    "intermediate_size": 512,
    "out_hidden_size": 512,
    "fullatt_block_indexes": [3],
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4, help="prompts of the step (n 8 samples each)")
    parser.add_argument("--mbs", type=int, default=4, help="micro-batch size of the padded path")
    parser.add_argument("--budget", type=int, default=1024, help="tokens per update micro-batch of the new path")
    parser.add_argument(
        "--log-prob-budget", type=int, default=2048, help="tokens per log-prob micro-batch of the new path"
    )
    parser.add_argument("--max-response", type=int, default=128, help="the response length limit")
    parser.add_argument("--lora", type=int, default=0, help="also the new path with LoRA adapters of this rank")
    parser.add_argument("--json", action="store_true", help="also print the results as one json line")
    parser.add_argument("--path", choices=["before", "now", "lora"], help=argparse.SUPPRESS)  # one path, in a child
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.mbs < 1 or args.max_response < 1:
        parser.error("--prompts, --mbs and --max-response must be at least 1")
    return args


# ------------------------------------------------------------------------------------------------ workload
def build_checkpoint(root: Path) -> Path:
    """The bench model as a Megatron TP1 directory (the tiny builder's weights at the sizes above)."""
    from mm_rl.config.schema import Hf2MgCfg, HfConfig, ParallelConfig
    from mm_rl.convert import hf2mg, model_config_from_hf
    from mm_rl.demo.tiny import build_tiny_checkpoint

    hf_dir = build_tiny_checkpoint(root / "hf", seed=0, vision_config=VISION, **TEXT)
    model = model_config_from_hf(hf_dir)
    parallel = ParallelConfig(tp_size=1, llm_pp_layers=[TEXT["num_hidden_layers"]], vit_pp_layers=[VISION["depth"]])
    hf2mg(Hf2MgCfg(mm_dir=str(root / "mm"), hf_config=HfConfig(hf_dir=str(hf_dir)), parallel_config=parallel), model)
    return hf_dir


def workload(prompts: int, max_response: int) -> tuple[list[Any], dict[int, Any]]:
    """The step's samples (group by group, as the trainer orders them) and their prompts' images."""
    import torch

    from mm_rl.demo.tiny import IMAGE_TOKEN_ID, VISION_END_TOKEN_ID, VISION_START_TOKEN_ID
    from mm_rl.trainer.batch import Sample

    g = torch.Generator().manual_seed(0)

    def text(n: int) -> list[int]:
        return torch.randint(0, 1000, (n,), generator=g).tolist()

    samples, items = [], {}
    for index in range(prompts):
        t, h, w = GRIDS[index % len(GRIDS)]
        items[index] = SimpleNamespace(
            pixel_values=torch.randn(t * h * w, PATCH_DIM, generator=g),
            image_grid_thw=torch.tensor([[t, h, w]]),
            mrope_time_steps=None,
        )
        image = [VISION_START_TOKEN_ID] + [IMAGE_TOKEN_ID] * (t * h * w // 4) + [VISION_END_TOKEN_ID]
        prompt = text(int(torch.randint(10, 41, (1,), generator=g))) + image + text(10)
        lengths = [max_response] + [
            min(max_response, 1 + int(torch.empty(1).exponential_(1 / 32, generator=g))) for _ in range(N - 1)
        ]
        for length in lengths:
            sample = Sample(index, index, prompt, text(length), "stop")
            sample.advantages = torch.randn(1, generator=g).expand(length).clone()
            samples.append(sample)
    return samples, items


# ------------------------------------------------------------------------------------------------ one path
def run_path(args: argparse.Namespace) -> dict[str, Any]:
    """The three passes of one path in this process; its measurements."""
    import warnings

    import torch
    from flops import computed_positions, matmul_peak, passes_flops

    from mm_rl.config.schema import ActorConfig, LoRAConfig, RLConfig
    from mm_rl.convert import model_config_from_hf
    from mm_rl.trainer.batch import (
        by_count,
        by_tokens,
        computed_tokens,
        micro_batches,
        response_values,
        step_images,
        tokens,
    )
    from mm_rl.workers.megatron_worker import WorkerSpec
    from mm_rl.workers.training import LossSpec, OptimizerSpec, TrainingWorker

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine|apex).* not installed")
    now, lora = args.path in ("now", "lora"), args.path == "lora"
    samples, items = workload(args.prompts, args.max_response)
    actor = ActorConfig(lora=LoRAConfig(rank=args.lora, alpha=2.0 * args.lora)) if lora else None
    spec = WorkerSpec(
        model_config_from_hf(args.root / "hf"), num_threads=os.cpu_count() or 1, remove_padding=now, actor=actor
    )
    worker = TrainingWorker(spec, 0)
    worker.init_distributed("127.0.0.1", _free_port())
    worker.build(str(args.root / "mm"))
    worker.setup_training(
        OptimizerSpec(
            lr=1e-5,
            min_lr=0.0,
            weight_decay=0.0,
            adam_beta1=0.9,
            adam_beta2=0.999,
            clip_grad=1.0,
            lr_decay_style="constant",
            warmup_steps=0,
            total_steps=1,
        )
    )
    if not now:  # the way before: every position's logits and log-probs, the prompts' too
        forward = worker.model.forward
        worker.model.forward = lambda *inputs, output_mask=None, **kwargs: forward(*inputs, **kwargs)
    images, encoder = step_images(samples, items), worker.model.image_encoder
    worker.set_images(images)  # now: a per-step cache of the frozen ViT's outputs
    encoded: list[int] = []  # images (one frame each) that reach the ViT blocks: a cache hit does not
    encoder.encoder.register_forward_hook(
        lambda module, args, out: encoded.append(len(args[1].segments.cu_full_seqlens) - 1)
    )

    def own_process() -> None:
        """The next pass as on a rank of its own role: the reference's ranks keep their own cache (the way before:
        no cache at all)."""
        worker.set_images(images)
        if not now:
            encoder.cache = None

    def cut(grad: bool) -> list[list[Any]]:
        if not now:
            return by_count(samples, args.mbs)
        return by_tokens(samples, args.budget if grad else args.log_prob_budget)

    def batches(runs: list[list[Any]], fields: tuple[str, ...]) -> list[dict[str, Any]]:
        built = micro_batches(runs, items, 0, fields)
        if now:
            passes.append(("update" if "advantages" in fields else "log_probs", built, 0.0))
            return built
        for batch, run in zip(built, runs, strict=True):  # the way before: a copy of the pixels in every row
            del batch["image_index"]
            batch["pixel_values"] = torch.cat([items[s.index].pixel_values for s in run])
        return built

    seconds: dict[str, float] = {}
    computed: dict[str, int] = {}
    passes: list[tuple[str, list[dict[str, Any]], float]] = []  # now: each pass's micro-batches (matmul work)

    def positions(runs: list[list[Any]], built: list[dict[str, Any]]) -> int:
        """Positions the LLM computes: padded rows x longest before, real tokens with shared prompts once now."""
        if not now:
            return sum(computed_tokens(run, False) for run in runs)
        return sum(computed_positions(batch)[0] for batch in built)

    def log_prob_pass(name: str) -> None:
        runs = cut(grad=False)
        built = batches(runs, ())
        start = time.perf_counter()
        rows = worker.compute_log_probs(built, adapters=not (lora and name == "ref_log_probs"))
        seconds[name] = time.perf_counter() - start
        computed[name] = positions(runs, built)
        for sample, values in zip(samples, response_values(runs, rows), strict=True):
            setattr(sample, name, values)

    own_process()
    if not now:
        log_prob_pass("old_log_probs")
    log_prob_pass("ref_log_probs")
    if not lora:  # LoRA: the reference pass ran on the actor's own rank (adapters off), its ViT cache serves both
        own_process()
    runs = cut(grad=True)
    fields = ("advantages", "ref_log_probs") + (() if now else ("old_log_probs",))
    loss = LossSpec(RLConfig(use_kl_loss=True, kl_loss_coef=0.01), args.max_response)
    built = batches(runs, fields)
    start = time.perf_counter()
    result = worker.train_mini_batch(built, loss, float(sum(s.response_len for s in samples)))
    seconds["update"] = time.perf_counter() - start
    computed["update"] = positions(runs, built)
    assert result is not None and result.metrics is not None
    trained = sum(p.numel() for p in worker.model.parameters() if p.requires_grad)
    worker.shutdown()
    flops, mean_positions = passes_flops(spec.model, passes) if now else (0.0, 0.0)
    return {
        "gflop": flops / 1e9,
        "peak_gflop_per_s": matmul_peak(spec.model, mean_positions, spec.num_threads) / 1e9 if now else 0.0,
        "seconds": seconds,
        "computed": computed,
        "needed": sum(map(tokens, samples)) * len(seconds),
        "vit_images": sum(encoded),
        "distinct_images": len(items) * len(seconds),
        "micro_batches": len(runs),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "loss": result.metrics["loss"],
        "grad_norm": result.metrics["grad_norm"],
        "trained_params": trained,
    }


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# ---------------------------------------------------------------------------------------------------- main
def child(args: argparse.Namespace, path: str, root: Path) -> dict[str, Any]:
    command = [
        sys.executable,
        __file__,
        "--path",
        path,
        "--root",
        str(root),
        "--prompts",
        str(args.prompts),
        "--mbs",
        str(args.mbs),
        "--budget",
        str(args.budget),
        "--log-prob-budget",
        str(args.log_prob_budget),
        "--max-response",
        str(args.max_response),
        "--lora",
        str(args.lora),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"the {path} path failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def report(before: dict[str, Any], now: dict[str, Any]) -> dict[str, float]:
    print(
        f"{'':>10} {'old_logp':>9} {'ref_logp':>9} {'update':>9} {'total':>9} {'computed':>10} {'needed':>9} "
        f"{'padding':>8} {'vit':>9} {'peak RSS':>9}"
    )
    for name, path in (("before", before), ("now", now)):
        s = path["seconds"]
        computed = sum(path["computed"].values())
        padding = max(0.0, 1 - path["needed"] / computed)
        print(
            f"{name:>10} {s.get('old_log_probs', 0.0):>8.2f}s {s['ref_log_probs']:>8.2f}s {s['update']:>8.2f}s "
            f"{sum(s.values()):>8.2f}s {computed:>10,} {path['needed']:>9,} {100 * padding:>7.1f}% "
            f"{path['vit_images']:>4} of {path['distinct_images']:<2} {path['peak_rss_gb']:>7.2f}GB"
        )
    speedup = sum(before["seconds"].values()) / sum(now["seconds"].values())
    padding = max(0.0, 1 - now["needed"] / sum(now["computed"].values()))
    achieved = now["gflop"] / sum(now["seconds"].values())
    print(
        f"now: {now['computed']['update']:,} positions computed for the update's {now['needed'] // 2:,} sample tokens "
        f"(shared prompts once); matmul work {now['gflop']:.1f} GFLOP -> {achieved:.1f} GFLOP/s vs torch.mm at the "
        f"same shapes {now['peak_gflop_per_s']:.1f} GFLOP/s -> {100 * achieved / now['peak_gflop_per_s']:.0f}% of "
        "the measured peak"
    )
    print(
        f"update at equal weights: loss {before['loss']:.6f} vs {now['loss']:.6f}, grad norm "
        f"{before['grad_norm']:.6f} vs {now['grad_norm']:.6f}"
    )
    print(
        f"actor passes: speedup {speedup:.2f}x, padding {100 * padding:.1f}%, vit passes {now['vit_images']} of "
        f"{now['distinct_images']}"
    )
    return {
        "speedup": speedup,
        "padding": padding,
        "vit_images": now["vit_images"],
        "distinct_images": now["distinct_images"],
        "seconds_before": sum(before["seconds"].values()),
        "seconds_now": sum(now["seconds"].values()),
        "gflop_per_s": achieved,
        "share_of_matmul_peak": achieved / now["peak_gflop_per_s"],
    }


def report_lora(full: dict[str, Any], lora: dict[str, Any], rank: int) -> dict[str, float]:
    """The LoRA path against the full-weight new path: pass times, trained parameters (grads + Adam state)."""
    f, a = full["seconds"], lora["seconds"]
    print(
        f"lora (rank {rank}): reference {a['ref_log_probs']:.2f}s vs {f['ref_log_probs']:.2f}s, update "
        f"{a['update']:.2f}s vs {f['update']:.2f}s; trained parameters {lora['trained_params']:,} vs "
        f"{full['trained_params']:,} ({100 * lora['trained_params'] / full['trained_params']:.1f}%); peak RSS "
        f"{lora['peak_rss_gb']:.2f} vs {full['peak_rss_gb']:.2f} GB"
    )
    ratio = a["update"] / f["update"]
    print(f"lora update: {ratio:.2f}x the full-weight update")
    return {"lora_update_ratio": ratio, "lora_trained_share": lora["trained_params"] / full["trained_params"]}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.path:
        print(json.dumps(run_path(args)))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench_actor_") as folder:
        root = Path(folder)
        build_checkpoint(root)
        samples, _ = workload(args.prompts, args.max_response)
        lengths = sorted(s.response_len for s in samples)
        print(
            f"{len(samples)} samples, responses {lengths[0]}-{lengths[-1]} tokens (median "
            f"{lengths[len(lengths) // 2]}), {args.prompts} images of {len(GRIDS)} sizes"
        )
        now = child(args, "now", root)
        results = report(child(args, "before", root), now)
        if args.lora:
            results.update(report_lora(now, child(args, "lora", root), args.lora))
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
