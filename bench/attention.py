"""One LLM layer, forward + backward, with megatron's local core attention against the one the model builds.

A megatron-core ``TransformerLayer`` (the local spec, RMSNorm, SwiGLU, grouped-query attention; widths below) on
one sequence of ``S`` tokens, causal:

- old: megatron's ``DotProductAttention`` (baddbmm scores, a causal mask, an fp32 softmax kept for backward: S x S
  per head);
- new: :class:`mm_rl.models.qwen_vl.llm_attention.LLMCoreAttention` on the packed row (the sequence as one
  segment), which runs torch's ``scaled_dot_product_attention`` (or ``npu_fusion_attention`` on Ascend).

Each (variant, S) runs in its own process, so the peak memory is its own: what the passes add to the process's
peak RSS beyond the layer and its inputs (on an accelerator: to the device's allocation). Printed per S: median
wall time of ``--repeat`` forward + backward passes, peak memory, and the outputs' and gradients' largest
difference (the two compute the same function). The last line:
``attention: S=1024 T.TTx, S=2048 T.TTx faster; peak memory M.MMx, M.MMx lower``.

    python bench/attention.py [--seqs 1024 2048] [--hidden 1024] [--heads 16] [--groups 2] [--ffn 2816]
                              [--repeat 3] [--threads N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", action="store_true", help="also print the results as one json line")
    parser.add_argument("--variant", choices=["old", "new"], help=argparse.SUPPRESS)  # one run, in a child
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _layer(args: argparse.Namespace, variant: str) -> Any:
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from mm_rl.models.qwen_vl.llm_attention import LLMCoreAttention
    from mm_rl.platform.device import cpu_safe_transformer_kwargs

    config = TransformerConfig(
        num_layers=1,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_query_groups=args.groups,
        ffn_hidden_size=args.ffn,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        add_qkv_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        **cpu_safe_transformer_kwargs(),
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = (
        DotProductAttention if variant == "old" else LLMCoreAttention
    )
    return TransformerLayer(config, spec.submodules, layer_number=1)


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """Child: build the layer, time forward + backward at ``args.seq``, save its output and input gradient."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from mm_rl.models.qwen_vl.llm_attention import CausalSegments
    from mm_rl.platform.device import current_device, device_kind, dist_backend, setup_process, synchronize

    setup_process(num_threads=args.threads)
    dist.init_process_group(dist_backend(), init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    device = current_device()
    layer = _layer(args, args.variant).to(device)
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(args.seq, 1, args.hidden, generator=generator).to(device).requires_grad_()
    grad_out = torch.randn(args.seq, 1, args.hidden, generator=generator).to(device)
    mask = torch.ones(1, 1, args.seq, args.seq, dtype=torch.bool, device=device).triu(1)  # True: hidden
    segments = CausalSegments.build(torch.tensor([0, args.seq], dtype=torch.int32, device=device))
    extra = (
        {"attention_mask": mask} if args.variant == "old" else {"attention_mask": None, "packed_seq_params": segments}
    )

    def step() -> Any:
        hidden.grad = None
        out, _ = layer(hidden, **extra)
        out.backward(grad_out)
        synchronize(device)
        return out

    accelerator = getattr(torch, device.type) if device_kind() != "cpu" else None
    base = (
        accelerator.memory_allocated() if accelerator else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )  # the layer and its inputs
    out = step()  # first call: allocations, kernels chosen
    walls = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        out = step()
        walls.append(time.perf_counter() - start)
    peak = (
        accelerator.max_memory_allocated() if accelerator else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ) - base
    torch.save({"out": out.detach().cpu(), "grad": hidden.grad.cpu()}, args.out)
    dist.destroy_process_group()
    return {"wall_s": statistics.median(walls), "peak_bytes": peak, "device": str(device)}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child(args: argparse.Namespace, variant: str, seq: int, root: Path) -> dict[str, Any]:
    argv = [
        sys.executable,
        __file__,
        "--variant",
        variant,
        "--seq",
        str(seq),
        "--out",
        str(root / f"{variant}{seq}"),
        "--hidden",
        str(args.hidden),
        "--heads",
        str(args.heads),
        "--groups",
        str(args.groups),
        "--ffn",
        str(args.ffn),
        "--repeat",
        str(args.repeat),
        "--threads",
        str(args.threads),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} at S={seq} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.variant:
        print(json.dumps(run_one(args)))
        return 0
    import torch

    results: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-attention-") as scratch:
        root = Path(scratch)
        for seq in args.seqs:
            old, new = child(args, "old", seq, root), child(args, "new", seq, root)
            a, b = torch.load(root / f"old{seq}"), torch.load(root / f"new{seq}")
            diff = max((a[k] - b[k]).abs().max().item() for k in ("out", "grad"))
            results[seq] = {"old": old, "new": new, "max_diff": diff}
            print(
                f"S={seq}: old {old['wall_s']:.3f} s, peak {old['peak_bytes'] / 2**20:.0f} MiB | new "
                f"{new['wall_s']:.3f} s, peak {new['peak_bytes'] / 2**20:.0f} MiB | max |old - new| {diff:.1e} "
                f"({new['device']}, hidden {args.hidden}, {args.heads} heads, {args.groups} groups)"
            )
    speed = ", ".join(f"S={s} {r['old']['wall_s'] / r['new']['wall_s']:.2f}x" for s, r in results.items())
    memory = ", ".join(f"{r['old']['peak_bytes'] / r['new']['peak_bytes']:.2f}x" for r in results.values())
    print(f"attention: {speed} faster; peak memory {memory} lower")
    if args.json:
        print(json.dumps({str(s): r for s, r in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
