"""Where a GRPO step's time goes: per-phase wall time and throughput of ``GRPOTrainer`` steps on the tiny job.

The job (default ``output/tiny_grpo/job.yaml``, written by ``make demo``) runs with its outputs in a temporary
``af_output_dir`` (hf2mg there too; no checkpoint is written): ``--steps`` calls of ``GRPOTrainer.train_step``, the
first one a warm-up that is not counted. Printed: per phase (the trainer's ``timing/*``: sync, rollout, reward, images,
old_logp, ref_logp, advantages, update) the median seconds and share of the step, the time no phase accounts for,
the medians of ``throughput/*``, and one baseline from the same run: the last step's prompts generated again
straight on the rollout engine (same sampling and seed, ``--repeat`` times, median), whose tokens per second the
rollout phase's are compared with (1.00x = the trainer adds nothing around the engine). Then the tensor bytes the
driver hands the roles per step (every log-prob pass and update, and the step's images, measured at the roles
boundary) beside what the same passes would have shipped with a copy of the prompt's pixel values in every sample's
row (the micro-batches before the image hand-off). Then the actor's passes (old log-probs, reference, update) beside
two baselines, both in this process with the actor's thread count and measured right after each step on that
step's micro-batches (``--repeat`` runs, median; the machine's speed drifts over minutes, so each step is compared
with baselines of the same moment, and the per-step ratios' median printed): mm_rl's own actor rank without Ray or
the other roles (what the passes cost alone), and transformers' Qwen2.5-VL (forward for a log-prob pass; forward,
backward and an Adam step for the update). Then the same steps with ``rl_config.one_step_off_policy`` (each step's
batch generated while the previous step trained): the median step time of both, and their ratio.

    python bench/step.py [--job output/tiny_grpo/job.yaml] [--steps 5] [--repeat 3] [--json] [a.b.c=value ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PHASES = ("sync", "rollout", "reward", "onload", "images", "old_logp", "ref_logp", "advantages", "update")
ACTOR_PHASES = ("old_logp", "ref_logp", "update")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", type=Path, default=Path("output/tiny_grpo/job.yaml"))
    parser.add_argument("--steps", type=int, default=5, help="GRPO steps, the first one not counted")
    parser.add_argument("--repeat", type=int, default=3, help="raw engine generate calls of the baseline")
    parser.add_argument("--json", action="store_true", help="also print the results as one json line")
    args, overrides = parser.parse_known_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is a warm-up)")
    return args, overrides


def load(job_path: Path, out_dir: Path, overrides: list[str]) -> Any:
    """The job with its outputs in ``out_dir`` and its model and data where the job yaml points."""
    from mm_rl.config.loader import ConfigError, load_job
    from mm_rl.job.validate import validate

    if not job_path.is_file():
        sys.exit(
            f"{job_path} not found: run `make demo` (or `ascendfactory-cli config --af_model_name tiny "
            f"--output_file_path {job_path}`) first"
        )
    b = load_job(job_path, overrides).backend_config
    data = b.data.dataset_param.basic_parameters
    sources = {
        "backend_config.megatron_training.tokenizer_name_or_path": b.megatron_training.tokenizer_name_or_path,
        "backend_config.data.dataset_param.basic_parameters.dataset_dir": data.dataset_dir,
    }
    job = load_job(
        job_path,
        [*overrides, f"af_output_dir={out_dir}", *(f"{key}={Path(value).resolve()}" for key, value in sources.items())],
    )
    problems = validate(job)
    if problems:
        raise ConfigError(problems)
    return job


def raw_generate(job: Any, requests: list[Any], seed: int, threads: int, repeat: int) -> tuple[float, float]:
    """Generated tokens per second and mean response length of vLLM alone on ``requests`` (a step's prompts): an
    engine built as the job builds its replicas (same engine arguments, the job's engine threads, in this process),
    the prompts handed to ``LLM.generate`` ready-made, the sampler reseeded and the prefix and image caches emptied
    before each call (as after every sync of the job), ``repeat`` calls, median. Its weights are the checkpoint's."""
    from mm_rl.convert.hf_writer import job_model_dir
    from mm_rl.rollout.base import sampling_for
    from mm_rl.rollout.engine_worker import set_thread_budget
    from mm_rl.rollout.vllm_engine import VllmEngine

    b = job.backend_config
    pre = b.data.dataset_param.preprocess_parameters
    set_thread_budget(threads)
    source = Path(pre.model_name_or_path)
    model = job_model_dir(source, b.model, Path(job.af_output_dir) / "engine_model")
    engine = VllmEngine(model, b.generate_config, min_pixels=pre.min_pixels, max_pixels=pre.max_pixels)
    try:
        params = engine.sampling_params(sampling_for(b.generate_config))
        prompts = [engine.prompt(request) for request in requests]
        rates, lengths = [], []
        for _ in range(repeat + 1):  # the first call warms up
            engine.reseed(seed)
            engine.llm.llm_engine.reset_encoder_cache()
            engine.llm.reset_prefix_cache()
            start = time.perf_counter()
            outputs = engine.llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            counts = [len(c.token_ids) for out in outputs for c in out.outputs]
            rates.append(sum(counts) / seconds)
            lengths.append(sum(counts) / len(counts))
        return statistics.median(rates[1:]), statistics.median(lengths[1:])
    finally:
        engine.close()


class MeteredRoles:
    """The trainer's roles, counting the tensor bytes the driver hands them (``take`` returns and resets the count):
    measured, and what the same passes would have weighed with each row carrying its prompt's pixel values."""

    def __init__(self, roles: Any) -> None:
        self.roles, self.images = roles, {}
        self.shipped = self.per_sample = 0
        self.passes: list[tuple[str, list[Any], float]] = []  # the step's passes: kind, micro-batches, denominator
        self.loss: Any = None  # the last update's LossSpec

    def __getattr__(self, name: str) -> Any:
        return getattr(self.roles, name)

    def send_images(self, images: Any) -> None:
        from mm_rl.trainer.batch import payload_bytes

        self.images = images
        self.shipped += payload_bytes(images)
        self.roles.send_images(images)

    def log_probs(self, role: str, shards: Any, temperature: float) -> Any:
        self._count(shards)
        self.passes.append(("log_probs", [batch for shard in shards for batch in shard], 0.0))
        return self.roles.log_probs(role, shards, temperature)

    def train_mini_batch(self, shards: Any, loss: Any, denominator: float) -> Any:
        self._count(shards)
        self.passes.append(("update", [batch for shard in shards for batch in shard], denominator))
        self.loss = loss
        return self.roles.train_mini_batch(shards, loss, denominator)

    def _count(self, shards: Any) -> None:
        from mm_rl.trainer.batch import payload_bytes

        for batch in (batch for shard in shards for batch in shard):
            size = payload_bytes(batch)
            self.shipped += size
            self.per_sample += (
                size
                - batch["image_index"].nbytes
                + sum(self.images[index][0].nbytes for index in batch["image_index"].tolist())
            )

    def take(self) -> tuple[int, int]:
        """(bytes shipped, bytes the per-sample way) since the last call; the step's passes start anew."""
        counts, self.shipped, self.per_sample = (self.shipped, self.per_sample), 0, 0
        self.passes = []
        return counts


class TransformersPasses:
    """The actor's passes through transformers' Qwen2.5-VL in this process with the actor's thread count: forward,
    log-probs and entropy for a log-prob pass; the same plus a policy loss, backward and an Adam step (the LLM and
    the merger train, the ViT is frozen, as in the actor) for the update."""

    def __init__(self, hf_dir: str, threads: int) -> None:
        import torch
        from transformers import Qwen2_5_VLForConditionalGeneration

        torch.set_num_threads(threads)
        self.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32)
        for name, param in self.model.named_parameters():
            param.requires_grad_(".visual." not in name or ".merger." in name)
        self.optimizer = torch.optim.Adam([p for p in self.model.parameters() if p.requires_grad], lr=1e-6)

    def __call__(self, passes: list[tuple[str, list[Any], float]], images: Any, loss: Any) -> float:
        """Seconds of one run of ``passes``."""
        import torch

        def log_probs(batch: dict[str, Any]) -> tuple[Any, Any]:
            rows = [index for index in batch["image_index"].tolist() if images[index][0].numel()]
            pixels = (
                {
                    "pixel_values": torch.cat([images[index][0] for index in rows]),
                    "image_grid_thw": batch["image_grid_thw"],
                }
                if rows
                else {}
            )
            logits = self.model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **pixels
            ).logits.float()
            all_log_probs = torch.log_softmax(logits, dim=-1)
            entropy = -(all_log_probs.exp() * all_log_probs).sum(-1)
            return all_log_probs.gather(-1, batch["labels"][..., None]).squeeze(-1), entropy

        start = time.perf_counter()
        for kind, batches, denominator in passes:
            if kind == "log_probs":
                with torch.no_grad():
                    for batch in batches:
                        log_probs(batch)
                continue
            self.optimizer.zero_grad()
            for batch in batches:
                values, _ = log_probs(batch)
                ratio = torch.exp(values - values.detach())
                (-(ratio * batch["advantages"] * batch["response_mask"]).sum() / denominator).backward()
            self.optimizer.step()
        return time.perf_counter() - start


class RankPasses:
    """The actor's passes through mm_rl's own actor rank (``TrainingWorker``, the job's spec and optimizer) in this
    process, without Ray or the other roles: the passes' own cost, so the comparison with transformers separates
    the model from the job around it. Each pass starts with a fresh image cache, as on ranks of their own."""

    def __init__(self, spec: Any, optimizer: Any, mm_dir: str) -> None:
        from actor import _free_port

        from mm_rl.workers.training import TrainingWorker

        self.worker = TrainingWorker(spec, 0)
        self.worker.init_distributed("127.0.0.1", _free_port())
        self.worker.build(mm_dir)
        self.worker.setup_training(optimizer)

    def __call__(self, passes: list[tuple[str, list[Any], float]], images: Any, loss: Any) -> float:
        """Seconds of one run of ``passes``."""
        start = time.perf_counter()
        for kind, batches, denominator in passes:
            self.worker.set_images(images)
            if kind == "log_probs":
                self.worker.compute_log_probs(batches)
            else:
                self.worker.train_mini_batch(batches, loss, denominator)
        return time.perf_counter() - start

    def close(self) -> None:
        self.worker.shutdown()


def report(rows: list[dict[str, float]], raw_tok_per_s: float) -> dict[str, float]:
    """Print the table; returns the numbers printed."""

    def median(key: str) -> float:
        return statistics.median(row.get(key, 0.0) for row in rows)

    step = median("timing/step")
    phases = {phase: median(f"timing/{phase}") for phase in PHASES if any(f"timing/{phase}" in r for r in rows)}
    phases["(in no phase)"] = max(0.0, step - sum(phases.values()))
    print(f"\n{len(rows)} steps counted (first step skipped); medians")
    print(f"{'phase':<16}{'seconds':>10}{'% of step':>12}")
    for phase, seconds in phases.items():
        print(f"{phase:<16}{seconds:>10.3f}{100 * seconds / step:>11.1f}%")
    print(f"{'step':<16}{step:>10.3f}{100.0:>11.1f}%")
    top = max(PHASES, key=lambda p: phases.get(p, 0.0))
    print(f"dominant phase: {top} ({100 * phases[top] / step:.0f}% of the step)\n")
    throughput = {key: median(key) for key in sorted({k for r in rows for k in r if k.startswith("throughput/")})}
    for key, value in throughput.items():
        print(f"{key:<32}{value:>12.2f}")
    rollout = throughput.get("throughput/rollout_tok_per_s", 0.0)
    print(
        f"\nbaseline: rollout phase {rollout:.1f} generated tok/s vs raw engine generate of the same prompts "
        f"{raw_tok_per_s:.1f} tok/s -> {rollout / raw_tok_per_s:.2f}x"
    )
    print(
        f"rollout split over {median('rollout/replicas'):.0f} engine replica(s): slowest / fastest replica "
        f"{median('rollout/replica_wall_spread'):.2f}x"
    )
    before, after = median("driver/bytes_per_sample_images"), median("driver/bytes")
    print(f"driver bytes per step: {before / 1e6:.2f} MB -> {after / 1e6:.2f} MB ({before / after:.1f}x fewer)")
    return (
        {f"timing/{k}": v for k, v in phases.items()}
        | {"timing/step": step}
        | throughput
        | {
            "baseline/raw_generate_tok_per_s": raw_tok_per_s,
            "baseline/rollout_vs_raw": rollout / raw_tok_per_s,
            "driver/bytes_per_sample_images": before,
            "driver/bytes": after,
        }
    )


def run_steps(job: Any, steps: int, repeat: int) -> tuple[list[dict[str, float]], float | None]:
    """``steps`` GRPO steps of ``job`` (the trainer's step counter advanced as ``fit`` does), and with ``repeat``
    the raw engine baseline and, right after each step (this machine's speed drifts over minutes, so each step is
    compared with baselines measured beside it), its actor passes through both in-process baselines."""
    import ray

    from mm_rl.job.run import convert_in
    from mm_rl.trainer.grpo import build_trainer
    from mm_rl.trainer.metrics import step_line
    from mm_rl.workers.megatron_worker import MegatronWorker

    mm_dir = convert_in(job, print)
    trainer = build_trainer(job, mm_dir)
    trainer.roles = meter = MeteredRoles(trainer.roles)
    baselines: dict[str, Any] = {}
    try:
        if repeat:
            threads = meter.roles.actor.run(MegatronWorker.threads)[0]
            spec = dataclasses.replace(meter.roles.worker_spec(trained=True), num_threads=threads)
            baselines = {
                "rank": RankPasses(spec, meter.roles.optimizer_spec(spec.bf16), str(mm_dir)),
                "transformers": TransformersPasses(
                    job.backend_config.megatron_training.tokenizer_name_or_path, threads
                ),
            }
        rows = []
        for step in range(1, steps + 1):
            metrics = trainer.train_step(step)
            passes, images = meter.passes, meter.images
            shipped, per_sample = meter.take()
            metrics |= {"driver/bytes": float(shipped), "driver/bytes_per_sample_images": float(per_sample)}
            trainer.step = step
            for name, baseline in baselines.items():  # the first call of each is its warm-up, as step 1 is the job's
                metrics[f"baseline/{name}"] = statistics.median(
                    baseline(passes, images, meter.loss) for _ in range(repeat)
                )
            print(step_line(step, steps, metrics) + f" | {metrics['timing/step']:.2f} s")
            rows.append(metrics)
        if trainer.pending is not None:
            trainer.pending.result()
        raw = raw_generate(trainer, steps, repeat) if repeat else None
    finally:
        if "rank" in baselines:
            baselines["rank"].close()
        trainer.close()
        ray.shutdown()
    if repeat:
        ours = [sum(row.get(f"timing/{phase}", 0.0) for phase in ACTOR_PHASES) for row in rows[1:]]
        alone, theirs = ([row[f"baseline/{name}"] for row in rows[1:]] for name in ("rank", "transformers"))
        ratio = statistics.median(a / b for a, b in zip(ours, theirs, strict=True))
        ratio_alone = statistics.median(a / b for a, b in zip(alone, theirs, strict=True))
        print(
            f"actor passes ({' + '.join(ACTOR_PHASES)}), medians over the counted steps: "
            f"{statistics.median(ours):.3f} s in the job; the same micro-batches right after each step through "
            f"mm_rl's actor rank in one process {statistics.median(alone):.3f} s and through transformers in one "
            f"process {statistics.median(theirs):.3f} s ({threads} threads) -> job {ratio:.2f}x, rank alone "
            f"{ratio_alone:.2f}x (medians of the per-step ratios)"
        )
    return rows, raw


def main(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_step_") as folder:
        rows, raw = run_steps(load(args.job, Path(folder) / "sync", overrides), args.steps, args.repeat)
        results = report(rows[1:], raw or 0.0)
        print("\nthe same steps with rl_config.one_step_off_policy (the next batch generates while the actor trains):")
        ahead = load(
            args.job, Path(folder) / "ahead", [*overrides, "backend_config.rl_config.one_step_off_policy=true"]
        )
        pipelined, _ = run_steps(ahead, args.steps, 0)
    synchronous = results["timing/step"]
    overlapped = statistics.median(row["timing/step"] for row in pipelined[1:])
    print(
        f"one-step-off-policy: step {overlapped:.3f} s vs {synchronous:.3f} s synchronous -> "
        f"{synchronous / overlapped:.2f}x"
    )
    results |= {"one_step_off/timing/step": overlapped, "one_step_off/speedup": synchronous / overlapped}
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
