"""Where a GRPO step's time goes, and how it compares with the engine alone, the rank alone, the machine's matmul
rate and a single-process trainer.

Two workloads (``--workload``):

- ``tiny``: the job ``--job`` (default ``output/tiny_grpo/job.yaml``, written by ``make demo``) at 8 prompts x 4
  samples x 32 tokens, GBS 32, MBS 8, KL 0.04, fp32 (``TINY``): overhead-bound, where time around the work shows;
- ``realistic``: a random checkpoint of the tiny builder at LLM hidden 512 x 8 layers and a 4-layer ViT
  (bench/actor.py's sizes, 28M parameters) whose end-of-turn token is sampled about once in 40 tokens (a constant
  channel in the embeddings and a matching output row, calibrated through transformers), the synthetic geo3k set
  with images of 112, 168 and 224 px (16, 36 and 64 LLM tokens), 4 prompts x n 8, responses up to 256 tokens,
  KL 0.04: built once under ``--root``.

The job runs with its outputs in a temporary ``af_output_dir`` (hf2mg there too; no checkpoint is written):
``--steps`` calls of ``GRPOTrainer.train_step``, the first one a warm-up that is not counted. Printed:

- per phase (the trainer's ``timing/*``) the median seconds and share of the step, and the medians of
  ``throughput/*``;
- rollout: the rollout phase's generated tokens per second (:func:`generated_rate`: what the engine generated,
  before the trainer cuts a response at a vision token) against vLLM alone (:func:`raw_generate`; 1.00x = the
  trainer adds nothing around the engine) on each step's batch (:func:`raw_ahead`: its prompts, seed and
  weights, right after the previous step's update as a real job's rollout comes, while the
  bench's step itself comes after the driver's baselines: both on a cold engine; median of the per-step ratios),
  and on the last step's prompts at the end of the run (a warm engine, back to back);
- the tensor bytes the driver hands the roles per step beside a copy of the prompt's pixel values in every row;
- actor passes: the job's old-log-prob, reference and update phases against the same micro-batches through mm_rl's
  actor rank alone in this process (``RankPasses``, measured right after each step: the machine's speed drifts),
  and their matmul FLOP/s (bench/flops.py) against ``torch.mm`` at the same shapes measured right after each step
  (the machine's rate drifts: measured once, at the end, it moved 149-184 GFLOP/s between runs);
- a single-process trainer on the same step: transformers' ``generate`` of the step's prompts (n samples, the same
  sampling) and the same passes through transformers' Qwen2.5-VL (``TransformersPasses``), in this process with the
  actor's threads: its time over mm_rl's step;
- the same steps with ``rl_config.one_step_off_policy`` (each step's batch generated while the previous trained).

    python bench/step.py [--workload tiny|realistic] [--job output/tiny_grpo/job.yaml] [--root output/bench_realistic]
                         [--steps 5] [--repeat 3] [--json] [a.b.c=value ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PHASES = ("sync", "rollout", "reward", "onload", "images", "old_logp", "ref_logp", "advantages", "update")
ACTOR_PHASES = ("old_logp", "ref_logp", "update")
TINY = [  # the issue-sized tiny job on top of the demo's yaml
    "backend_config.rl_config.n_samples_per_prompt=4",
    "backend_config.generate_config.sampling_config.max_tokens=32",
    "backend_config.rl_config.kl_loss_coef=0.04",
]
REALISTIC = [
    "backend_config.rl_config.rollout_batch_size=4",
    "backend_config.rl_config.n_samples_per_prompt=8",
    "backend_config.megatron_training.global_batch_size=32",
    "backend_config.generate_config.sampling_config.max_tokens=256",
    "backend_config.rl_config.kl_loss_coef=0.04",
    "backend_config.training.seq-length=512",
]
IMAGE_SIZES = (112, 168, 224)
EOS_EVERY = 40  # the realistic checkpoint's mean response length, in tokens


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("tiny", "realistic"), default="tiny")
    parser.add_argument("--job", type=Path, default=Path("output/tiny_grpo/job.yaml"), help="the demo's job yaml")
    parser.add_argument("--root", type=Path, default=Path("output/bench_realistic"), help="the realistic workload")
    parser.add_argument("--steps", type=int, default=5, help="GRPO steps, the first one not counted")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each baseline (median)")
    parser.add_argument("--json", action="store_true", help="also print the results as one json line")
    args, overrides = parser.parse_known_args(argv)
    if args.steps < 2 or args.repeat < 1:
        parser.error("--steps must be at least 2 (the first step is a warm-up) and --repeat at least 1")
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


# ----------------------------------------------------------------------------------------- realistic workload
def realistic_job(root: Path, demo_job: Path) -> Path:
    """The realistic workload's job yaml under ``root`` (built once; see the module docstring): the demo's job with
    the bench checkpoint, its model section and the three-size data set."""
    from omegaconf import OmegaConf

    from mm_rl.convert import model_config_from_hf

    job_path = root / "job.yaml"
    if job_path.is_file():
        return job_path
    hf_dir = eos_every(root / "hf", EOS_EVERY)
    data = three_sizes(root / "data")
    if not demo_job.is_file():
        sys.exit(f"{demo_job} not found: run `make demo` first (its job yaml is the realistic job's template)")
    job = OmegaConf.load(demo_job)
    job.backend_config.model = OmegaConf.structured(model_config_from_hf(hf_dir))
    job.backend_config.megatron_training.tokenizer_name_or_path = str(hf_dir.resolve())
    job.backend_config.data.dataset_param.preprocess_parameters.model_name_or_path = str(hf_dir.resolve())
    job.backend_config.data.dataset_param.basic_parameters.dataset_dir = str(data.resolve())
    OmegaConf.save(job, job_path)
    return job_path


def eos_every(out_dir: Path, mean_length: int) -> Path:
    """bench/actor.py's checkpoint with the end-of-turn token sampled about once per ``mean_length`` tokens: hidden
    channel 0 is a clean constant (1 in every token's embedding; no layer or the merger writes it), the output
    layer reads it only for the end token, with the weight found by bisection so that the end token's mean
    probability over random text positions is 1 / ``mean_length`` (transformers, the final model)."""
    import torch
    from actor import TEXT, VISION
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2_5_VLForConditionalGeneration

    from mm_rl.demo.tiny import EOS_TOKEN_ID, build_tiny_checkpoint

    if (out_dir / "eos_calibrated.json").is_file():
        return out_dir
    base = build_tiny_checkpoint(out_dir.parent / "hf_base", seed=0, vision_config=VISION, **TEXT)
    shutil.rmtree(out_dir, ignore_errors=True)
    shutil.copytree(base, out_dir)
    (weights_file,) = out_dir.glob("*.safetensors")
    weights = load_file(weights_file)
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight", "merger.mlp.2.weight", "merger.mlp.2.bias")):
            tensor[0] = 0.0  # nothing writes channel 0 of the residual stream
    weights["model.embed_tokens.weight"][:, 0] = 1.0
    weights["lm_head.weight"][:, 0] = 0.0
    weights["lm_head.weight"][EOS_TOKEN_ID] = 0.0
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(base, dtype=torch.float32)
    missing = model.load_state_dict(_in_memory_names(model, weights), strict=False)
    assert not missing.missing_keys, missing.missing_keys
    text = torch.randint(0, 1000, (8, 96), generator=torch.Generator().manual_seed(0))
    low, high = 0.0, 64.0
    for _ in range(30):
        scale = (low + high) / 2
        with torch.no_grad():
            model.lm_head.weight[EOS_TOKEN_ID, 0] = scale
            probability = model(input_ids=text).logits.softmax(-1)[..., EOS_TOKEN_ID].mean().item()
        low, high = (scale, high) if probability < 1 / mean_length else (low, scale)
    weights["lm_head.weight"][EOS_TOKEN_ID, 0] = scale
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    (out_dir / "eos_calibrated.json").write_text(json.dumps({"scale": scale, "eos_probability": probability}))
    return out_dir


def _in_memory_names(model: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's tensors under the names the loaded transformers model uses (a suffix match)."""
    names = list(model.state_dict())
    out = {}
    for name, tensor in weights.items():
        short = name.removeprefix("model.")
        match = [n for n in names if n == name or n.endswith("." + short) or n == short]
        if match:
            out[match[0]] = tensor
    return out


def three_sizes(out_dir: Path) -> Path:
    """The synthetic geo3k set with its rows' images at 112, 168 and 224 px in turn (train and test)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mm_rl.demo.synthetic import write_synthetic_geo3k

    if (out_dir / "train.parquet").is_file():
        return out_dir
    parts = [write_synthetic_geo3k(out_dir.parent / f"data_{px}", seed=px, image_size=px) for px in IMAGE_SIZES]
    out_dir.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        tables = [pq.read_table(part / f"{split}.parquet") for part in parts]
        rows = min(len(table) for table in tables)
        order = [table.slice(i, 1) for i in range(rows) for table in tables]
        pq.write_table(pa.concat_tables(order), out_dir / f"{split}.parquet")
    return out_dir


def raw_generate(
    roles: Any, requests: list[Any], sampling: Any, seed: int, repeat: int, warm: bool = True
) -> tuple[float, float]:
    """Generated tokens per second and mean response length of vLLM alone on ``requests`` in the state the job's
    rollout finds its engine: right after a weight sync (the actor's current weights), the prefix, image-encoder
    and processor caches empty. Inside the first engine replica's process (its threads, its neighbours):
    ``LLM.generate`` on prompts built beforehand, the sampler reseeded as the step's was. ``repeat`` sync + generate
    rounds (after a warm-up one with ``warm``), median."""
    import ray
    import ray.cloudpickle

    if __name__ != "__main__":  # imported as a module the engine's process cannot import: send the function itself
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    engine = roles.engines.actors[0]
    rounds = []
    for _ in range(repeat + warm):
        roles.schedule.weights_changed()
        roles.before_rollout()
        rounds.append(ray.get(engine.__ray_call__.remote(_raw_in_engine, requests, sampling, seed)))
    rates, lengths = zip(*rounds[int(warm) :], strict=True)
    return statistics.median(rates), statistics.median(lengths)


def _raw_in_engine(worker: Any, requests: list[Any], sampling: Any, seed: int) -> tuple[float, float]:
    engine = worker.engine
    params = engine.sampling_params(sampling)
    prompts = [engine.prompt(request) for request in requests]
    engine.reseed(seed)
    engine.llm.llm_engine.reset_encoder_cache()
    engine.llm.reset_prefix_cache()
    engine.llm.reset_mm_cache()
    start = time.perf_counter()
    outputs = engine.llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    counts = [len(c.token_ids) for out in outputs for c in out.outputs]
    return sum(counts) / seconds, sum(counts) / len(counts)


def generated_rate(row: dict[str, float]) -> float:
    """The rollout phase's tokens per second over what the engine generated (``rollout/generated_tokens``), as vLLM
    alone counts them: the trainer's ``throughput/rollout_tok_per_s`` counts the responses it trains on, which a
    cut at a vision token shortens (the realistic workload's random model samples them: 27.9 trained against 30.5
    generated tokens per sample in one step, the samples themselves identical to vLLM alone's)."""
    return row["rollout/generated_tokens"] / row["timing/rollout"]


def raw_ahead(trainer: Any, roles: Any, job: Any, step: int) -> dict[str, float]:
    """vLLM alone on the batch ``step`` will generate, as its rollout will find the engine, called right after the
    previous step: the prompts the step will draw (the sampler peeked, not drawn), its seed, the weights it
    will sync, the caches emptied: it draws the step's own samples, token for token (checked on both workloads; the
    mean generated lengths are printed side by side). Afterwards the engine is marked stale, so that the step syncs
    as it would have, and its processor cache is emptied (the step must process its images itself)."""
    import ray

    from mm_rl.rollout.base import RolloutRequest, sampling_for
    from mm_rl.trainer.grpo import sampling_seed

    trainer.prompts.settle()  # the step's prefetch is done with the processor
    indices = trainer.prompts.sampler.peek()
    requests = [RolloutRequest.from_item(trainer.prompts.train_set[index]) for index in indices]
    sampling = sampling_for(job.backend_config.generate_config)
    rate, length = raw_generate(roles, requests, sampling, sampling_seed(trainer.seed, step, 0), 1, warm=False)
    roles.schedule.weights_changed()
    ray.get([engine.__ray_call__.remote(_empty_processor_cache) for engine in roles.engines.actors])
    return {"baseline/raw_tok_per_s": rate, "baseline/raw_response_length": length}


def _empty_processor_cache(worker: Any) -> None:
    worker.engine.llm.reset_mm_cache()


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


class TransformersGenerate:
    """A single-process trainer's rollout: transformers' ``generate`` on a step's prompts (left-padded, their pixel
    values, n sequences each, the job's sampling, stopping at the end token), with the model of a
    ``TransformersPasses``."""

    def __init__(self, passes: TransformersPasses, sampling: Any, pad_id: int, eos_id: int) -> None:
        self.model, self.sampling, self.pad_id, self.eos_id = passes.model, sampling, pad_id, eos_id

    def __call__(self, requests: list[Any]) -> tuple[float, int]:
        """Seconds of one ``generate`` and the tokens it generated."""
        import torch

        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, request in enumerate(requests):
            ids[row, width - len(request.prompt_ids) :] = torch.tensor(request.prompt_ids)
            mask[row, width - len(request.prompt_ids) :] = 1
        pixels = [r.pixel_values for r in requests if r.pixel_values is not None and r.pixel_values.numel()]
        grids = [r.image_grid_thw for r in requests if r.image_grid_thw is not None and r.image_grid_thw.numel()]
        images = {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.cat(grids)} if pixels else {}
        s = self.sampling
        start = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                **images,
                do_sample=s.temperature > 0,
                temperature=s.temperature or None,
                top_p=s.top_p,
                top_k=s.top_k if s.top_k > 0 else 0,
                num_return_sequences=s.n,
                max_new_tokens=s.max_tokens,
                eos_token_id=self.eos_id,
                pad_token_id=self.pad_id,
            )
        seconds = time.perf_counter() - start
        new = out[:, width:]
        ended = (new == self.eos_id).int().cumsum(-1)
        generated = int(((ended == 0) | ((ended == 1) & (new == self.eos_id))).sum())
        return seconds, generated


def run_steps(job: Any, steps: int, repeat: int) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """``steps`` GRPO steps of ``job`` (the trainer's step counter advanced as ``fit`` does) and, with ``repeat``,
    right after each step (the machine's speed drifts over minutes, so each step is compared with baselines of the
    same moment) its passes through the rank alone, the single-process trainer and the matmul rate at the passes'
    shapes; then vLLM alone on the last step's prompts. Returns the rows and the rest."""
    import ray
    from flops import matmul_peak, passes_flops

    from mm_rl.job.run import convert_in
    from mm_rl.rollout.base import RolloutRequest, sampling_for
    from mm_rl.trainer.grpo import build_trainer, sampling_seed
    from mm_rl.trainer.metrics import step_line
    from mm_rl.workers.megatron_worker import MegatronWorker

    mm_dir = convert_in(job, print)
    trainer = build_trainer(job, mm_dir)
    trainer.roles = meter = MeteredRoles(trainer.roles)
    baselines: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    try:
        threads = meter.roles.actor.run(MegatronWorker.threads)[0]
        if repeat:
            spec = dataclasses.replace(meter.roles.worker_spec(trained=True), num_threads=threads)
            hf = TransformersPasses(job.backend_config.megatron_training.tokenizer_name_or_path, threads)
            generate = TransformersGenerate(
                hf, sampling_for(job.backend_config.generate_config), trainer.prompts.pad_id, eos_token(job)
            )
            baselines = {"rank": RankPasses(spec, meter.roles.optimizer_spec(spec.bf16), str(mm_dir)), "hf": hf}
        rows = []
        ahead = raw_ahead(trainer, meter.roles, job, 1) if repeat else {}
        for step in range(1, steps + 1):
            metrics = trainer.train_step(step) | ahead
            passes, images = meter.passes, meter.images
            shipped, per_sample = meter.take()
            metrics |= {"driver/bytes": float(shipped), "driver/bytes_per_sample_images": float(per_sample)}
            work, mean_positions = passes_flops(job.backend_config.model, passes)
            metrics["passes/flops"] = work
            trainer.step = step
            # right after the update, as a real job's next rollout comes: the step's own rollout then comes after
            # the baselines below, cold as well
            ahead = raw_ahead(trainer, meter.roles, job, step + 1) if repeat and step < steps else {}
            for name, baseline in baselines.items():  # the first call of each is its warm-up, as step 1 is the job's
                metrics[f"baseline/{name}"] = statistics.median(
                    baseline(passes, images, meter.loss) for _ in range(repeat)
                )
            if baselines:
                requests = [RolloutRequest.from_item(item, pixels=True) for item in trainer.prompts.cached.values()]
                seconds, generated = generate(requests)
                metrics |= {"baseline/hf_generate": seconds, "baseline/hf_generated_tokens": float(generated)}
                metrics["baseline/matmul_peak"] = matmul_peak(job.backend_config.model, mean_positions, threads)
            print(step_line(step, steps, metrics) + f" | {metrics['timing/step']:.2f} s")
            rows.append(metrics)
        if trainer.pending is not None:
            trainer.pending.result()
        if repeat:  # the last step's prompts, in their order, with its seed
            last = trainer.prompts.requests(list(trainer.prompts.cached))
            sampling = sampling_for(job.backend_config.generate_config)
            seed = sampling_seed(trainer.seed, steps, 0)
            extra["raw"] = raw_generate(meter.roles, last, sampling, seed, repeat)
    finally:
        if "rank" in baselines:
            baselines["rank"].close()
        trainer.close()
        ray.shutdown()
    if repeat:
        extra["threads"] = threads
    return rows, extra


def eos_token(job: Any) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(job.backend_config.megatron_training.tokenizer_name_or_path)
    return int(tokenizer.convert_tokens_to_ids("<|im_end|>"))


def report(rows: list[dict[str, float]], extra: dict[str, Any]) -> dict[str, float]:
    """Print the tables and ratios of the counted steps; returns the numbers printed."""

    def median(key: str) -> float:
        return statistics.median(row.get(key, 0.0) for row in rows)

    step = median("timing/step")
    phases = {phase: median(f"timing/{phase}") for phase in PHASES if any(f"timing/{phase}" in r for r in rows)}
    phases["(in no phase)"] = statistics.median(  # per step, then the median (a sum of medians is no median)
        max(0.0, row["timing/step"] - sum(row.get(f"timing/{phase}", 0.0) for phase in PHASES)) for row in rows
    )
    print(f"\n{len(rows)} steps counted (first step skipped); medians")
    print(f"{'phase':<16}{'seconds':>10}{'% of step':>12}")
    for phase, seconds in phases.items():
        print(f"{phase:<16}{seconds:>10.3f}{100 * seconds / step:>11.1f}%")
    print(f"{'step':<16}{step:>10.3f}{100.0:>11.1f}%")
    throughput = {key: median(key) for key in sorted({k for r in rows for k in r if k.startswith("throughput/")})}
    for key, value in throughput.items():
        print(f"{key:<32}{value:>12.2f}")
    results = {f"timing/{k}": v for k, v in phases.items()} | {"timing/step": step} | throughput
    before, after = median("driver/bytes_per_sample_images"), median("driver/bytes")
    print(f"driver bytes per step: {before / 1e6:.2f} MB -> {after / 1e6:.2f} MB ({before / after:.1f}x fewer)")
    if not extra:
        return results
    rollout = statistics.median(map(generated_rate, rows))
    raw, raw_length = extra["raw"]
    per_step = statistics.median(generated_rate(row) / row["baseline/raw_tok_per_s"] for row in rows)
    generated = statistics.median(row["rollout/generated_tokens"] / row["rollout/samples"] for row in rows)
    print(
        f"\nrollout: the rollout phase {rollout:.1f} generated tok/s (responses {generated:.1f} "
        f"tokens) vs vLLM alone on each step's batch {median('baseline/raw_tok_per_s'):.1f} "
        f"tok/s (responses {median('baseline/raw_response_length'):.1f}) -> {per_step:.2f}x "
        f"(median of per-step ratios); vs vLLM alone on the last step's prompts at the end, warm, "
        f"{raw:.1f} tok/s (responses {raw_length:.1f}) -> {rollout / raw:.2f}x; the phase "
        f"{median('timing/rollout'):.3f} s, of which the engine's generate call in its process "
        f"{median('rollout/wall_s'):.3f} s"
    )
    ours = [sum(row.get(f"timing/{phase}", 0.0) for phase in ACTOR_PHASES) for row in rows]
    alone = [row["baseline/rank"] for row in rows]
    job_vs_rank = statistics.median(a / b for a, b in zip(ours, alone, strict=True))
    rates = [row["passes/flops"] / seconds for row, seconds in zip(rows, ours, strict=True)]
    achieved, peak = statistics.median(rates), median("baseline/matmul_peak")
    share = statistics.median(r / row["baseline/matmul_peak"] for r, row in zip(rates, rows, strict=True))
    print(
        f"actor passes ({' + '.join(ACTOR_PHASES)}): {statistics.median(ours):.3f} s in the job vs "
        f"{statistics.median(alone):.3f} s through the actor rank alone -> {job_vs_rank:.2f}x (median of per-step "
        f"ratios); matmul work {median('passes/flops') / 1e9:.1f} GFLOP -> {achieved / 1e9:.1f} GFLOP/s in the job "
        f"vs torch.mm at the same shapes right after each step {peak / 1e9:.1f} GFLOP/s ({extra['threads']} "
        f"threads) -> {100 * share:.0f}% of the measured peak (median of per-step ratios)"
    )
    single = [row["baseline/hf_generate"] + row["baseline/hf"] for row in rows]
    speedup = statistics.median(a / b for a, b in zip(single, (row["timing/step"] for row in rows), strict=True))
    print(
        f"single-process trainer (transformers generate {median('baseline/hf_generate'):.3f} s + its passes "
        f"{median('baseline/hf'):.3f} s = {statistics.median(single):.3f} s) vs mm_rl's step {step:.3f} s -> "
        f"mm_rl {speedup:.2f}x faster (median of per-step ratios)"
    )
    return results | {
        "rollout_vs_raw": per_step,
        "rollout_vs_raw_warm": rollout / raw,
        "raw_tok_per_s": raw,
        "passes_vs_rank": job_vs_rank,
        "passes_gflop_per_s": achieved / 1e9,
        "matmul_peak_gflop_per_s": peak / 1e9,
        "passes_share_of_peak": share,
        "single_process_step": statistics.median(single),
        "speedup_vs_single_process": speedup,
        "driver/bytes_per_sample_images": before,
        "driver/bytes": after,
    }


def main(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    if args.workload == "realistic":
        job_path, overrides = realistic_job(args.root, args.job), [*REALISTIC, *overrides]
    else:
        job_path, overrides = args.job, [*TINY, *overrides]
    with tempfile.TemporaryDirectory(prefix="bench_step_") as folder:
        rows, extra = run_steps(load(job_path, Path(folder) / "sync", overrides), args.steps, args.repeat)
        results = report(rows[1:], extra)
        print("\nthe same steps with rl_config.one_step_off_policy (the next batch generates while the actor trains):")
        ahead = load(
            job_path, Path(folder) / "ahead", [*overrides, "backend_config.rl_config.one_step_off_policy=true"]
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
