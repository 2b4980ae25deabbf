"""Multi-process megatron-core test helpers: spawn gloo ranks, set up megatron, move results back to pytest.

Each spawned rank calls :func:`init_megatron` first (one torch thread, the CPU bridges, the process group,
megatron's parallel state, a seeded RNG tracker). A worker writes its results with :func:`save_rank_result`;
the test reads them all with :func:`load_rank_results` after :func:`spawn` returns. Ranks fork from one server
process per pytest process (:data:`PRELOAD`), so each starts in well under a second.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that was free a moment ago (for the gloo rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# What every rank imports, imported once by the fork server rather than by each fresh process (~5 s a rank on
# 2 cores, dozens of ranks a suite). The server starts single-threaded (importing torch starts no thread pool).
PRELOAD = [
    "torch",
    "transformers",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.transformer",
    "megatron.core.models.gpt",
    "mm_rl.models.registry",
    "mm_rl.models.qwen_vl.model",
    "mm_rl.models.qwen_vl.vision",
    "mp_utils",
]


def spawn(worker: Callable[..., None], nprocs: int, *args: Any) -> None:
    """Run ``worker(rank, nprocs, port, *args)`` in ``nprocs`` new processes and wait for all of them."""
    start(worker, nprocs, nprocs, free_port(), *args)


def start(worker: Callable[..., None], nprocs: int, *args: Any) -> None:
    """Run ``worker(rank, *args)`` in ``nprocs`` new processes, forked from a server that holds :data:`PRELOAD`,
    and wait for all of them."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    mp.start_processes(worker, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def init_megatron(
    rank: int,
    world: int,
    port: int,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    seed: int = 1234,
    embedding_ranks: Callable[..., list[int]] | None = None,
) -> None:
    """Everything a spawned rank needs before building megatron modules (call it first).

    ``embedding_ranks``: megatron's ``get_embedding_ranks`` (which pipeline ranks share the word embeddings)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    # Spawned ranks do not get pytest.ini's filters; keep a failure's output readable.
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine|apex).* not installed")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from mm_rl.platform.device import dist_backend, setup_process

    setup_process(num_threads=1)
    torch.distributed.init_process_group(
        dist_backend(),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        get_embedding_ranks=embedding_ranks,
    )
    model_parallel_cuda_manual_seed(seed)


def shutdown() -> None:
    """Leave the process group cleanly (a rank exiting early would stall the others' last collective)."""
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def gather_list(tensor: torch.Tensor, group: torch.distributed.ProcessGroup | None) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on all ranks), in group-rank order."""
    parts = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def gather_cat(tensor: torch.Tensor, group: torch.distributed.ProcessGroup | None, dim: int) -> torch.Tensor:
    """The group's tensors concatenated along ``dim`` (e.g. vocab-parallel logits along the vocab)."""
    return torch.cat(gather_list(tensor, group), dim=dim)


def save_rank_result(out_dir: str | Path, rank: int, result: dict[str, Any]) -> None:
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def load_rank_results(out_dir: str | Path, world: int) -> list[dict[str, Any]]:
    """Each rank's saved dict, in rank order (a missing file means that rank failed before saving)."""
    return [torch.load(Path(out_dir) / f"rank{rank}.pt", weights_only=False) for rank in range(world)]
