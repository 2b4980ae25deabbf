"""Benchmark the rollout engines against raw vLLM on the same prompts: tokens per second of each, in one run.

The tiny Qwen2.5-VL checkpoint and the synthetic geo3k prompts (one image each) go through
  (a) raw vLLM: ``vllm.LLM.generate`` with the text prompt and the images, built with the same engine arguments;
  (b) our vLLM engine, hosted in the Ray ``RolloutWorker`` actor, timed on the driver (so the Ray round trip,
      request and output serialisation included);
  (c) our HF engine in this process;
  (d) two replicas of (b), each with half the threads (the same cores in all), the prompts split between them by
      whole groups as the trainer splits them (``mm_rl.trainer.ray_roles.RayEngines``).
All four engines are set up first (they are idle when not called), each runs once untimed (first-call set-up), and
then ``--repeat`` rounds run a, b, c in turn, so load changes on a shared machine hit every variant alike; the
median wall time counts. All variants sample (temperature 1, n per prompt, log-probs of the sampled tokens on) with
the same thread budget: ``--threads`` torch threads here for (a) and (c), a Ray CPU reservation of the same size for
(b), and (d) splits that budget between its two replicas (``--threads 2`` or more for a fair split). Targets:
b >= 0.95 a; d / b is what a second replica on the same cores gives.

    python bench/rollout.py [--prompts 16] [--n 4] [--max-tokens 32] [--repeat 5] [--threads 2] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MIN_PIXELS, MAX_PIXELS = 56 * 56, 224 * 224


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch threads / Ray CPUs of every variant")
    parser.add_argument("--dir", type=Path, default=None, help="where the checkpoint and data go (default: temp)")
    parser.add_argument("--json", action="store_true", help="also print the results as one json line")
    return parser.parse_args(argv)


def prepare(root: Path, prompts: int) -> tuple[Path, list[Any]]:
    """The tiny checkpoint and ``prompts`` data-set items (built once, reused when already there)."""
    from mm_rl.data.dataset import PromptDataset, PromptProcessor
    from mm_rl.demo.synthetic import write_synthetic_geo3k
    from mm_rl.demo.tiny import build_tiny_checkpoint

    model = build_tiny_checkpoint(root / "tiny", seed=0)
    data = write_synthetic_geo3k(root / "geo3k", seed=0, train_size=8, test_size=max(prompts, 8))
    dataset = PromptDataset(data, "test", PromptProcessor(model, MIN_PIXELS, MAX_PIXELS), max_prompt_length=1024)
    return model, [dataset[i] for i in range(prompts)]


def generate_config(args: argparse.Namespace) -> Any:
    from mm_rl.config.schema import GenerateConfig, SamplingConfig

    sampling = SamplingConfig(max_tokens=args.max_tokens, temperature=1.0, n=args.n, seed=0)
    return GenerateConfig(max_model_len=1024, max_num_seqs=max(64, args.prompts * args.n), sampling_config=sampling)


class Variant:
    """A set-up engine: ``run()`` generates the batch once and returns the tokens generated; ``close()``."""

    def __init__(self, run: Callable[[], int], close: Callable[[], None]) -> None:
        self.run, self.close = run, close
        self.walls: list[float] = []
        self.tokens = 0
        self.extra: dict[str, Any] = {}  # filled in by ``close`` (e.g. the engine-side tok/s)

    def timed(self) -> None:
        start = time.perf_counter()
        self.tokens = self.run()
        self.walls.append(time.perf_counter() - start)

    def result(self) -> dict[str, Any]:
        wall = statistics.median(self.walls)
        return {
            "wall_s": wall,
            "tokens": self.tokens,
            "tok_per_s": self.tokens / wall,
            "walls": self.walls,
        } | self.extra


# -------------------------------------------------------------------------------------------------- variants
def raw_vllm(model: Path, items: list[Any], args: argparse.Namespace) -> Variant:
    """(a) ``vllm.LLM.generate`` as a user would call it: text prompts plus images, same engine arguments."""
    from vllm import SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from mm_rl.rollout.vllm_engine import build_llm, engine_kwargs

    kwargs = engine_kwargs(model, generate_config(args), min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, seed=0)
    llm = build_llm(kwargs, in_process=True)
    prompts = [{"prompt": item.prompt_text, "multi_modal_data": {"image": item.images}} for item in items]
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=1.0, logprobs=0)

    def run() -> int:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outputs for c in o.outputs)

    def close() -> None:
        llm.llm_engine.engine_core.shutdown()
        cleanup_dist_env_and_memory()

    return Variant(run, close)


def ray_vllm_engine(model: Path, items: list[Any], args: argparse.Namespace) -> Variant:
    """(b) our vLLM engine in the Ray actor, timed on the driver; ``engine_tok_per_s`` excludes the round trip."""
    return _replicas(model, items, args, 1)


def two_replicas(model: Path, items: list[Any], args: argparse.Namespace) -> Variant:
    """(d) two engine actors of half the threads each, the batch split over them as the trainer does."""
    return _replicas(model, items, args, 2)


def _replicas(model: Path, items: list[Any], args: argparse.Namespace, count: int) -> Variant:
    import ray

    from mm_rl.rollout.base import RolloutRequest, SamplingSpec
    from mm_rl.rollout.engine_worker import rollout_worker_actor
    from mm_rl.trainer.ray_roles import RayEngines

    config = generate_config(args)
    requests = [RolloutRequest.from_item(item) for item in items]  # images, no pixels: what crosses Ray
    threads = max(1, args.threads // count)
    engines = RayEngines(
        [
            rollout_worker_actor(num_cpus=threads).remote(
                str(model), config, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, backend="vllm", num_threads=threads
            )
            for _ in range(count)
        ]
    )
    sampling = SamplingSpec.of(config.sampling_config)
    inner: list[float] = []

    def run() -> int:
        outputs = engines.generate(requests, sampling, seed=0).result()
        inner.append(outputs.metrics.tok_per_s)
        return outputs.metrics.generated_tokens

    def close() -> None:
        variant.extra["engine_tok_per_s"] = statistics.median(inner[1:])
        variant.extra["threads"] = ray.get([engine.threads.remote() for engine in engines.actors])
        ray.get([engine.close.remote() for engine in engines.actors])
        for engine in engines.actors:
            ray.kill(engine)

    variant = Variant(run, close)
    return variant


def hf_engine(model: Path, items: list[Any], args: argparse.Namespace) -> Variant:
    """(c) our HF engine in this process (with the actor's pixels, as an in-process engine gets them)."""
    from mm_rl.rollout.base import RolloutRequest
    from mm_rl.rollout.hf_engine import HfEngine

    config = generate_config(args)
    engine = HfEngine(model, config, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    requests = [RolloutRequest.from_item(item, pixels=True) for item in items]
    return Variant(lambda: engine.generate(requests, config.sampling_config).metrics.generated_tokens, engine.close)


# ------------------------------------------------------------------------------------------------------ main
def report(results: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    print(
        f"\n{args.prompts} prompts x n={args.n} x <= {args.max_tokens} tokens, {args.threads} thread(s), "
        f"median of {args.repeat}"
    )
    names = {
        "a": "(a) raw vLLM LLM.generate",
        "b": "(b) vllm engine via Ray actor",
        "c": "(c) hf engine",
        "d": "(d) 2 vllm replicas via Ray",
    }
    for key, label in names.items():
        r = results[key]
        extra = f"  (engine-side {r['engine_tok_per_s']:.0f} tok/s)" if "engine_tok_per_s" in r else ""
        print(f"{label:32s} {r['tok_per_s']:8.0f} tok/s  {r['tokens']:5d} tokens  {r['wall_s']:.3f} s{extra}")
    base = results["a"]["tok_per_s"]
    ratio_b, ratio_c = results["b"]["tok_per_s"] / base, results["c"]["tok_per_s"] / base
    print(f"b/a = {ratio_b:.3f} (target >= 0.95: {'met' if ratio_b >= 0.95 else 'NOT met'})   c/a = {ratio_c:.3f}")
    ratio_d = results["d"]["tok_per_s"] / results["b"]["tok_per_s"]
    print(
        f"replicas: 2 x {results['d']['threads'][0]} threads vs 1 x {results['b']['threads'][0]} threads: "
        f"d/b = {ratio_d:.2f}x"
    )
    if args.json:
        print(json.dumps({"results": results, "b_over_a": ratio_b, "c_over_a": ratio_c, "d_over_b": ratio_d}))


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from mm_rl.platform import cpu_wheels

    cpu_wheels.install()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # vLLM keeps torch's thread count when this is set
    import ray
    import torch

    torch.set_num_threads(args.threads)
    # Ray starts workers at nice 15; (a) and (c) run here at nice 0, so on a shared machine the comparison would
    # measure scheduling priority rather than the engine. Workers get the driver's priority instead.
    ray.init(
        num_cpus=2 * args.threads,
        include_dashboard=False,
        log_to_driver=False,
        _system_config={"worker_niceness": os.getpriority(os.PRIO_PROCESS, 0)},
    )
    builds = (("a", raw_vllm), ("b", ray_vllm_engine), ("c", hf_engine), ("d", two_replicas))
    try:
        with tempfile.TemporaryDirectory(prefix="bench-rollout-") as scratch:
            model, items = prepare(args.dir or Path(scratch), args.prompts)
            variants = {key: build(model, items, args) for key, build in builds}
            for variant in variants.values():
                variant.run()  # first-call set-up, untimed
            for _ in range(args.repeat):  # interleaved, so load changes on a shared machine hit every variant alike
                for variant in variants.values():
                    variant.timed()
            for variant in variants.values():
                variant.close()
    finally:
        ray.shutdown()
    results = {key: variant.result() for key, variant in variants.items()}
    report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
