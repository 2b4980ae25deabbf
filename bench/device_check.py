"""The device check for a bare accelerator image (Python 3.12, torch, transformers; no vLLM, Ray or megatron-core, no
network): what only a device shows about the actor side of mm_rl, in one run of a few minutes.

    bench/device_check.sh prepare DIR   # on the CPU machine: tiny dense and MoE checkpoints converted by hf2mg,
                                        # their model.json, and the wheels the image lacks (megatron-core and the
                                        # pure-Python omegaconf + antlr4 runtime, for Python 3.12)
    bench/device_check.sh run DIR       # on the device machine (DIR carried with the working tree)
    bench/device_check.sh run DIR --dry-run   # the same checks on this CPU (gloo, small sizes; in `make test`)

Checks, each one line (ok / skip with the reason / FAIL with the error), exit status 1 if any failed:

1. transfers: a micro-batch to the device from pinned memory and results back as CPU tensors; the device
   generator's state saved and restored gives the same draws;
2. ipc_bucket: a weight-sync bucket packed on the device (``pack_bucket``) is read in place by another process on
   the device through the exported handle (``receive_bucket``), as a colocated engine worker reads it;
3. sync_group: the weight-sync group on the device's collective (nccl / hccl) between two processes on two devices
   broadcasts a packed bucket (needs two devices);
4. attention: the LLM's packed core attention in bf16 (flash varlen on CUDA) against fp32 SDPA, outputs and
   gradients, for separate sequences and for two that share the first one's prompt (keys gathered, the causal
   window aligned to the end of the keys);
5. rank_dense / rank_moe / rank_hybrid: one megatron rank on its device's backend in bf16 (fp32 in the dry run)
   from the hf2mg rank file: log-probs, one update that changes them, offload and onload of parameters, gradients
   and Adam state giving identical log-probs (the MoE rank routes its tokens over 4 experts; the hybrid, the tiny
   Qwen3.5, runs its Gated DeltaNet layers on packed sequences and names the kernel: fla's on CUDA when installed,
   megatron-core's torch reference otherwise);
6. timed_update: actor updates at real widths (4 LLM layers of Qwen2.5-VL-7B, ~4k packed tokens of 4 sequences):
   seconds per update, achieved TFLOP/s and MFU against the device's bf16 dense peak;
7. log_prob_memory: the memory plan's log-prob micro-batches (``log_prob_scale`` update micro-batches at once, no
   grad) peak no higher on the device's allocator than one update micro-batch (forward, backward, optimizer step),
   both above what the weights, gradients and Adam state hold, at the plan's longest samples.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import socket
import subprocess
import sys
import time
import traceback
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# what the bare image lacks, for Python 3.12 on x86-64 (megatron-core's only compiled part, a data-set helper, is
# not imported); antlr4's runtime is published as source only and is built into a wheel here
WHEELS = ("megatron-core==0.16.1", "omegaconf==2.3.0")
SOURCE_WHEELS = ("antlr4-python3-runtime==4.9.3",)
MODELS = {"dense": ("qwen2_5vl", {}), "moe": ("qwen3_vl", {"num_experts": 4}), "hybrid": ("qwen3_5", {})}
# bf16 dense tensor-core peaks, TFLOP/s, by the name torch reports (vendor data sheets; SXM parts unless named)
BF16_PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H200", 989.4),
    ("H100", 989.4),
    ("H800", 989.4),
    ("H20", 148.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.1),
)
# Qwen2.5-VL-7B's LLM, 4 of its 28 layers
REAL_WIDTHS = {
    "num_layers": 4,
    "pipeline_num_layers": [4],
    "hidden_size": 3584,
    "ffn_hidden_size": 18944,
    "num_attention_heads": 28,
    "num_query_groups": 4,
    "kv_channels": 128,
    "vocab_size": 152064,
}


# ------------------------------------------------------------------------------------------------- prepare
def prepare(out: Path, wheels: bool = True) -> None:
    """The tiny checkpoints as rank files and model.json (the HF directories are dropped: the device needs neither
    transformers' files nor the processor), and the wheels."""
    from mm_rl.config.schema import Hf2MgCfg, HfConfig, ParallelConfig
    from mm_rl.convert import hf2mg, model_config_from_hf
    from mm_rl.demo.tiny import build_tiny_checkpoint
    from mm_rl.files import replace_dir

    out.mkdir(parents=True, exist_ok=True)
    for name, (family, variant) in MODELS.items():
        hf_dir = build_tiny_checkpoint(out / f".hf_{name}", seed=0, family=family, **variant)
        model = model_config_from_hf(hf_dir)
        parallel = ParallelConfig(
            tp_size=1,
            ep_size=1,
            llm_pp_layers=list(model.text_decoder.pipeline_num_layers),
            vit_pp_layers=list(model.image_encoder.vision_encoder.pipeline_num_layers),
        )
        staging = out / f".{name}"
        hf2mg(Hf2MgCfg(mm_dir=str(staging / "mm"), hf_config=HfConfig(hf_dir=str(hf_dir)), parallel_config=parallel),
              model)  # fmt: skip
        (staging / "model.json").write_text(json.dumps(dataclasses.asdict(model), indent=1) + "\n")
        replace_dir(staging, out / name)
        _remove(hf_dir)
    if wheels:
        _download_wheels(out / "wheels")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"prepared {out}: {size / 2**20:.1f} MiB")


def _download_wheels(target: Path) -> None:
    pip = [sys.executable, "-m", "pip"]
    target.mkdir(parents=True, exist_ok=True)
    platform = ["--python-version", "3.12", "--platform", "manylinux_2_28_x86_64", "--only-binary=:all:"]
    subprocess.run([*pip, "download", "-q", "--no-deps", *platform, "-d", str(target), *WHEELS], check=True)
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "-w", str(target), *SOURCE_WHEELS], check=True)


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _use_wheels(out: Path) -> None:
    """Put the prepared wheels on the path (unpacked once into DIR/site) where the environment lacks them."""
    try:
        import megatron.core  # noqa: F401
        import omegaconf  # noqa: F401

        return
    except ImportError:
        pass
    site = out / "site"
    if not site.is_dir():
        for wheel in sorted((out / "wheels").glob("*.whl")):
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(site)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])


# ----------------------------------------------------------------------------------------------------- checks
@dataclasses.dataclass(frozen=True)
class Context:
    out: Path
    dry_run: bool


class Skip(Exception):
    """A check that cannot run here (the reason is its message)."""


def check_transfers(ctx: Context) -> str:
    import torch

    from mm_rl.platform.device import current_device, device_rng_state, set_device_rng_state, setup_process
    from mm_rl.platform.transfer import to_device, to_host

    setup_process()
    device = current_device()
    batch = {"input_ids": torch.ones(2, 5, dtype=torch.long), "pixel_values": torch.randn(8, 12), "note": "x"}
    moved = to_device(batch, device)
    assert all(t.device == device for k, t in moved.items() if k != "note") and moved["note"] == "x"
    back = to_host({"log_probs": [moved["pixel_values"]]})
    assert back["log_probs"][0].device.type == "cpu" and torch.equal(back["log_probs"][0], batch["pixel_values"])
    state = device_rng_state()
    first = torch.rand(4, device=device)
    if state is not None:
        set_device_rng_state(state)
        assert torch.equal(torch.rand(4, device=device), first)
    return f"{device}: batch moved, results on the host, generator state restored"


def _read_bucket(fields: tuple[Any, ...]) -> list[tuple[str, float]]:
    """In a fresh process on the device: the bucket mapped through its handle, each tensor's sum."""
    from mm_rl.sync.transport import DeviceBucket, receive_bucket

    return [(name, float(tensor.double().sum())) for name, tensor in receive_bucket(DeviceBucket(*fields))]


def _bucket(device: Any) -> list[tuple[str, Any]]:
    import torch

    generator = torch.Generator().manual_seed(0)
    shapes = {"a.weight": (64, 48), "a.bias": (64,), "b.weight": (3, 5, 7)}
    dtypes = {"a.weight": torch.bfloat16, "a.bias": torch.float32, "b.weight": torch.float16}
    return [(n, torch.randn(s, generator=generator).to(device, dtypes[n])) for n, s in shapes.items()]


def check_ipc_bucket(ctx: Context) -> str:
    from mm_rl.platform.device import current_device, export_ipc, ipc_supported, setup_process
    from mm_rl.platform.transfer import pack_bucket
    from mm_rl.sync.transport import DeviceBucket

    setup_process()
    device = current_device()
    if not ipc_supported(device):
        raise Skip(f"{device} cannot share storages between processes (colocated syncs take the object store)")
    bucket = _bucket(device)
    layout, flat = pack_bucket(bucket, device)
    message = DeviceBucket("check", 0, layout, flat.numel(), export_ipc(flat))
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        read = pool.apply(_read_bucket, (dataclasses.astuple(message),))
    want = [(name, float(tensor.double().sum())) for name, tensor in bucket]
    assert read == want, (read, want)
    return f"{len(bucket)} tensors ({flat.numel()} bytes) read in place by another process"


def _receiver(port: int, fields: tuple[Any, ...], queue: Any) -> None:
    import torch

    from mm_rl.platform.device import device_kind, setup_process
    from mm_rl.sync.transport import DeviceBucket, join_group, receive_bucket

    if device_kind() == "cuda":
        torch.cuda.set_device(1)
    setup_process()
    join_group("check", 0, "127.0.0.1", port, rank=1, world=2, timeout_s=120)
    queue.put([(name, float(tensor.double().sum())) for name, tensor in receive_bucket(DeviceBucket(*fields))])


def check_sync_group(ctx: Context) -> str:
    from mm_rl.platform.device import current_device, device_count, device_kind, setup_process
    from mm_rl.platform.transfer import bucket_layout, pack_bucket
    from mm_rl.sync.transport import _sync_group, join_group

    setup_process()
    if device_kind() != "cpu" and device_count() < 2:
        raise Skip("one device: a sync group on nccl / hccl needs a second device for the receiving process")
    device = current_device()
    bucket = _bucket(device)
    layout, nbytes = bucket_layout(bucket)
    port = _free_port()
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_receiver, args=(port, (("check", 0, layout, nbytes, None)), queue))
    child.start()
    join_group("check", 0, "127.0.0.1", port, rank=0, world=2, timeout_s=120)
    _, flat = pack_bucket(bucket, device)
    _sync_group("check", 0).group.broadcast(flat, 0).wait()
    read = queue.get(timeout=120)
    child.join(60)
    assert read == [(name, float(tensor.double().sum())) for name, tensor in bucket]
    return f"{len(bucket)} tensors broadcast to a second process ({nbytes} bytes, {device_kind()} group)"


def check_attention(ctx: Context) -> str:
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    from mm_rl.models.qwen_vl.llm_attention import CausalSegments, LLMCoreAttention
    from mm_rl.platform.device import current_device, setup_process

    setup_process()
    device = current_device()
    config = TransformerConfig(num_layers=1, hidden_size=512, num_attention_heads=8, num_query_groups=2,
                               kv_channels=64, ffn_hidden_size=1024, activation_func=F.silu, hidden_dropout=0.0,
                               attention_dropout=0.0)  # fmt: skip
    core = LLMCoreAttention(config, 1, None, "self")
    bounds = torch.tensor([0, 300, 310, 1100], dtype=torch.int32, device=device)
    layouts = {  # three sequences; then the last two sharing the first's 299 leading tokens (a GRPO group's prompt)
        "separate": CausalSegments.build(bounds),
        "shared prompt": CausalSegments.build(bounds, [(0, 0), (0, 299), (0, 299)]),
    }
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1100, 1, heads, 64, generator=generator) for heads in (8, 2, 2)]
    lines = []
    for name, segments in layouts.items():
        results = []
        for dtype in (torch.bfloat16, torch.float32):
            q, k, v = (t.to(device, dtype, copy=True).requires_grad_() for t in inputs)
            out = core(q, k, v, None, packed_seq_params=segments)
            out.float().square().sum().backward()
            results.append((out.float(), q.grad.float(), k.grad.float()))
        gaps = [(low - high).abs().max().item() / high.abs().max().item() for low, high in zip(*results, strict=True)]
        assert max(gaps) <= 2e-2 and math.isfinite(results[0][1].sum().item()), (name, gaps)
        lines.append(f"{name}: output {gaps[0]:.1e}, gradients q {gaps[1]:.1e} k {gaps[2]:.1e}")
    return f"bf16 vs fp32 on {device} (relative to the largest): " + "; ".join(lines)


# ------------------------------------------------------------------------------------------- megatron ranks
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _model(path: Path) -> Any:
    from mm_rl.config.loader import load_section
    from mm_rl.config.schema import ModelConfig

    return load_section(ModelConfig, json.loads(path.read_text()))


def _worker(model: Any, bf16: bool) -> Any:
    """A TrainingWorker of a world of one on this device's backend (nccl, hccl; gloo on CPU)."""
    from mm_rl.workers.megatron_worker import WorkerSpec
    from mm_rl.workers.training import TrainingWorker

    worker = TrainingWorker(WorkerSpec(model, bf16=bf16, num_threads=max(1, (os.cpu_count() or 2) // 2)), 0)
    worker.init_distributed("127.0.0.1", _free_port())
    return worker


def _optimizer(steps: int) -> Any:
    from mm_rl.workers.training import OptimizerSpec

    return OptimizerSpec(lr=1e-4, min_lr=1e-5, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.999, clip_grad=1.0,
                         lr_decay_style="constant", warmup_steps=0, total_steps=steps)  # fmt: skip


def _samples(lengths: list[tuple[int, int]], vocab: int, seed: int) -> tuple[list[Any], list[dict[str, Any]]]:
    """Text-only samples (prompt, response lengths) as one micro-batch with the per-token fields of a step; ``vocab``:
    the ids drawn (below the special tokens: an image or video pad among them would need its pixels)."""
    import torch

    from mm_rl.trainer.batch import Sample, micro_batches

    generator = torch.Generator().manual_seed(seed)
    samples = []
    for group, (prompt, response) in enumerate(lengths):
        ids = torch.randint(0, vocab - 1, (prompt + response,), generator=generator).tolist()
        sample = Sample(group, group, ids[:prompt], ids[prompt:], "stop")
        sample.old_log_probs = -torch.rand(response, generator=generator)
        sample.ref_log_probs = sample.old_log_probs - 0.05
        sample.advantages = torch.randn(response, generator=generator)
        samples.append(sample)
    items = {s.index: _no_image() for s in samples}
    return samples, micro_batches([samples], items, 0, ("old_log_probs", "ref_log_probs", "advantages"))


def _no_image() -> Any:
    from types import SimpleNamespace

    import torch

    return SimpleNamespace(
        pixel_values=torch.zeros(0, 1176), image_grid_thw=torch.zeros(0, 3, dtype=torch.long), mrope_time_steps=None
    )


def _loss(max_response: int) -> Any:
    from mm_rl.config.schema import RLConfig
    from mm_rl.workers.training import LossSpec

    return LossSpec(RLConfig(kl_loss_coef=0.01, use_kl_loss=True), max_response_len=max_response)


def _rank(name: str, out: str, dry_run: bool) -> str:
    """One rank from DIR/<name>: log-probs, an update that moves them, offload / onload keeping them exactly."""
    import torch

    from mm_rl.platform.device import device_kind, setup_process
    from mm_rl.trainer.batch import step_images

    setup_process()
    bf16 = device_kind() != "cpu"
    model = _model(Path(out) / name / "model.json")
    worker = _worker(model, bf16)
    samples, batches = _samples([(6, 9), (4, 12), (9, 5)], model.vision_start_token_id, seed=1)
    worker.set_images(step_images(samples, {s.index: _no_image() for s in samples}))
    worker.build(str(Path(out) / name / "mm"))
    worker.setup_training(_optimizer(4))
    before = worker.compute_log_probs(batches)
    metrics = worker.train_mini_batch(batches, _loss(12), float(len(samples))).metrics
    after = worker.compute_log_probs(batches)
    moved = max((a - b).abs().max().item() for a, b in zip(after, before, strict=True))
    freed = worker.offload(params=True, grads=True, optimizer=True)
    worker.onload(params=True, grads=True, optimizer=True)
    again = worker.compute_log_probs(batches)
    assert all(torch.equal(a, b) for a, b in zip(again, after, strict=True)), "log-probs changed by offload / onload"
    assert moved > 0 and math.isfinite(metrics["grad_norm"]), (moved, metrics)
    moe = f", expert load max {metrics['moe/load_max']:.2f}" if "moe/load_max" in metrics else ""
    if "linear_attention" in model.text_decoder.layer_types:
        from mm_rl.models.qwen3_5.linear_attention import kernel_name

        moe += f", Gated DeltaNet kernel: {kernel_name(torch.device(device_kind()))}"
    torch.distributed.destroy_process_group()
    kind = "bf16" if bf16 else "fp32"
    return (f"{kind} on {device_kind()}: update moved log-probs by {moved:.2e}, grad norm {metrics['grad_norm']:.3f}, "
            f"offload freed {sum(freed.values()) / 2**20:.1f} MiB, onload exact{moe}")  # fmt: skip


def _timed(out: str, dry_run: bool) -> str:
    """Actor updates at real widths (small ones in the dry run): seconds, TFLOP/s, MFU."""
    import torch

    from mm_rl.config.loader import load_section
    from mm_rl.config.presets import load_preset
    from mm_rl.config.schema import ModelConfig
    from mm_rl.platform.device import current_device, device_kind, setup_process, synchronize
    from mm_rl.trainer.batch import step_images

    setup_process()
    data = load_preset("tiny" if dry_run else "qwen2_5_vl_7b").model
    if not dry_run:  # 4 LLM layers, one ViT block (text-only sequences: the ViT does not run)
        data["text_decoder"].update(REAL_WIDTHS)
        data["image_encoder"]["vision_encoder"].update(num_layers=1, pipeline_num_layers=[1])
    model = load_section(ModelConfig, data)
    bf16 = device_kind() != "cpu"
    worker = _worker(model, bf16)
    lengths = [(16, 48)] * 2 if dry_run else [(64, 960)] * 4
    samples, batches = _samples(lengths, model.vision_start_token_id, seed=2)
    worker.set_images(step_images(samples, {s.index: _no_image() for s in samples}))
    worker.build(None)
    worker.setup_training(_optimizer(8))
    loss, device = _loss(max(r for _, r in lengths)), current_device()
    worker.train_mini_batch(batches, loss, float(len(lengths)))  # warm-up: allocations, kernels chosen
    synchronize(device)
    updates = 1 if dry_run else 3
    start = time.perf_counter()
    for _ in range(updates):
        worker.train_mini_batch(batches, loss, float(len(lengths)))
    synchronize(device)
    seconds = (time.perf_counter() - start) / updates
    # 6 FLOPs per weight and token (forward 2, backward 4) for the LLM's matmuls (the embedding lookup is none),
    # and the causal attention's two products: 6 x heads x head dim x length^2 per layer and sequence
    text = model.text_decoder
    head_dim = text.kv_channels or text.hidden_size // text.num_attention_heads
    weights = worker.model.named_parameters()
    matmul = sum(p.numel() for n, p in weights if n.startswith("text_decoder") and "word_embeddings" not in n)
    tokens = sum(p + r for p, r in lengths)
    attention = 6 * text.num_layers * text.num_attention_heads * head_dim * sum((p + r) ** 2 for p, r in lengths)
    tflops = (6 * matmul * tokens + attention) / seconds / 1e12
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    peak = next((value for key, value in BF16_PEAK_TFLOPS if key in name), None)
    mfu = f"MFU {tflops / peak:.1%} of {peak:.0f}" if peak else "MFU n/a (no bf16 peak known for this device)"
    torch.distributed.destroy_process_group()
    kind = "bf16" if bf16 else "fp32"
    return (f"{text.num_layers} layers x hidden {text.hidden_size}, {tokens} tokens in {len(lengths)} sequences, "
            f"{kind}: {seconds:.3f} s per update, {tflops:.1f} TFLOP/s on {name}, {mfu}")  # fmt: skip


def _memory_job(dry_run: bool) -> Any:
    """The Qwen2.5-VL-7B job on one device with an 8-layer LLM of hidden 1024 and a 32k vocabulary (4 layers of
    hidden 128 and 1k in the dry run) and a one-block ViT: wide enough that activations and logits dwarf the
    allocator's own, and a plan whose log-prob micro-batches hold several update micro-batches."""
    from mm_rl.job.create import ClusterSpec, create_job
    from mm_rl.platform.device import device_kind

    layers, hidden, vocab = (4, 128, 1000) if dry_run else (8, 1024, 32000)
    head, text, vision = hidden // 8, "backend_config.model.text_decoder", "backend_config.model.image_encoder"
    overrides = {
        f"{text}.num_layers": layers,
        f"{text}.pipeline_num_layers": f"[{layers}]",
        f"{text}.hidden_size": hidden,
        f"{text}.ffn_hidden_size": hidden * 11 // 4,
        f"{text}.num_attention_heads": 8,
        f"{text}.num_query_groups": 2,
        f"{text}.kv_channels": head,
        f"{text}.mrope_section": f"[{head // 8},{3 * head // 16},{3 * head // 16}]",
        f"{text}.vocab_size": vocab,
        f"{vision}.vision_encoder.num_layers": 1,
        f"{vision}.vision_encoder.pipeline_num_layers": "[1]",
        f"{vision}.vision_encoder.fullatt_block_indexes": "[0]",
        f"{vision}.vision_projector.hidden_size": hidden,
        "backend_config.actor_config.tensor_model_parallel_size": 1,
        "backend_config.actor_config.micro_batch_size": 2,
        "backend_config.generate_config.sampling_config.max_tokens": 32 if dry_run else 256,
        "backend_config.data.dataset_param.preprocess_parameters.max_prompt_length": 64 if dry_run else 1024,
    }
    cluster = ClusterSpec(nnodes=1, nproc_per_node=1, device=device_kind())
    return create_job("qwen2_5_vl_7b", "geo3k", cluster, overrides=[f"{k}={v}" for k, v in overrides.items()])[1]


def _log_prob_memory(dry_run: bool) -> str:
    """Peak bytes above the trained state of one update micro-batch and of one log-prob micro-batch of the plan."""
    import torch

    from mm_rl.config.plan import log_prob_scale
    from mm_rl.platform.device import device_kind, setup_process
    from mm_rl.trainer.batch import step_images

    setup_process()
    job = _memory_job(dry_run)
    b, kind = job.backend_config, device_kind()
    scale, mbs = log_prob_scale(job), b.actor_config.micro_batch_size
    assert scale >= 2, f"the plan takes {scale} micro-batch per log-prob pass here: nothing to check"
    prompt, response = b.data.dataset_param.preprocess_parameters.max_prompt_length, b.response_tokens
    model = b.model
    worker = _worker(model, bf16=kind != "cpu")
    samples, passing = _samples([(prompt, response)] * (scale * mbs), model.text_decoder.vocab_size, seed=3)
    _, training = _samples([(prompt, response)] * mbs, model.text_decoder.vocab_size, seed=3)
    worker.set_images(step_images(samples, {s.index: _no_image() for s in samples}))
    worker.build(None)
    worker.setup_training(_optimizer(4))
    loss = _loss(response)
    worker.train_mini_batch(training, loss, float(mbs))  # Adam's state allocated: part of what the run holds
    if kind == "cpu":
        worker.compute_log_probs(passing)
        torch.distributed.destroy_process_group()
        return f"scale {scale}: an update of {mbs} samples and a log-prob pass of {scale * mbs} ran; no allocator here"
    accelerator = getattr(torch, kind)

    def peak(run: Callable[[], Any]) -> int:
        accelerator.synchronize()
        accelerator.reset_peak_memory_stats()
        held = accelerator.memory_allocated()
        run()
        accelerator.synchronize()
        return int(accelerator.max_memory_allocated() - held)

    update = peak(lambda: worker.train_mini_batch(training, loss, float(mbs)))
    log_probs = peak(lambda: worker.compute_log_probs(passing))
    torch.distributed.destroy_process_group()
    sizes = f"samples of {prompt} + {response} tokens, vocab {model.text_decoder.vocab_size}"
    assert log_probs <= update, (
        f"a log-prob pass of {scale} x {mbs} samples peaked {log_probs / 2**20:.0f} MiB above the trained state, "
        f"an update micro-batch of {mbs} {update / 2**20:.0f} MiB ({sizes})"
    )
    return (f"scale {scale}: log-prob pass of {scale * mbs} samples {log_probs / 2**20:.0f} MiB <= update "
            f"micro-batch of {mbs} {update / 2**20:.0f} MiB above the trained state ({sizes})")  # fmt: skip


def _in_child(fn: Callable[..., str], *args: Any) -> str:
    """``fn`` in a fresh process (its process group and megatron state die with it)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def check_rank_dense(ctx: Context) -> str:
    return _in_child(_rank, "dense", str(ctx.out), ctx.dry_run)


def check_rank_moe(ctx: Context) -> str:
    return _in_child(_rank, "moe", str(ctx.out), ctx.dry_run)


def check_rank_hybrid(ctx: Context) -> str:
    return _in_child(_rank, "hybrid", str(ctx.out), ctx.dry_run)


def check_timed_update(ctx: Context) -> str:
    return _in_child(_timed, str(ctx.out), ctx.dry_run)


def check_log_prob_memory(ctx: Context) -> str:
    return _in_child(_log_prob_memory, ctx.dry_run)


CHECKS: dict[str, Callable[[Context], str]] = {
    "transfers": check_transfers,
    "ipc_bucket": check_ipc_bucket,
    "sync_group": check_sync_group,
    "attention": check_attention,
    "rank_dense": check_rank_dense,
    "rank_moe": check_rank_moe,
    "rank_hybrid": check_rank_hybrid,
    "timed_update": check_timed_update,
    "log_prob_memory": check_log_prob_memory,
}


def run(out: Path, dry_run: bool, only: list[str] | None = None) -> int:
    """Every check (or ``only``), a line each; the number that failed."""
    _use_wheels(out)
    from mm_rl.platform.device import device_kind

    if device_kind() == "cpu" and not dry_run:
        print("no CUDA or NPU device here: run with --dry-run for the CPU rehearsal", flush=True)
        return 1
    ctx, failed, started = Context(out, dry_run), 0, time.perf_counter()
    for name in only or list(CHECKS):
        begun = time.perf_counter()
        try:
            line = f"ok    {name}: {CHECKS[name](ctx)}"
        except Skip as reason:
            line = f"skip  {name}: {reason}"
        except Exception as error:  # noqa: BLE001 - every check is reported, the run goes on
            failed += 1
            line = f"FAIL  {name}: {type(error).__name__}: {error}\n{traceback.format_exc(limit=6)}"
        print(f"{line} [{time.perf_counter() - begun:.1f}s]", flush=True)
    print(f"device check: {len(only or CHECKS) - failed} passed or skipped, {failed} failed, "
          f"{time.perf_counter() - started:.0f}s", flush=True)  # fmt: skip
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="build DIR on the CPU machine")
    prep.add_argument("dir", type=Path)
    prep.add_argument("--no-wheels", action="store_true", help="skip the wheels (this environment has them)")
    go = sub.add_parser("run", help="run the checks with DIR")
    go.add_argument("dir", type=Path)
    go.add_argument("--dry-run", action="store_true", help="on this CPU, small sizes (the suite's rehearsal)")
    go.add_argument("--only", nargs="*", choices=list(CHECKS), help="these checks only")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare(args.dir, wheels=not args.no_wheels)
        return 0
    return 1 if run(args.dir, args.dry_run, args.only) else 0


if __name__ == "__main__":
    sys.exit(main())
