"""megatron-core on CPU over gloo: TP=2 and PP=2 reproduce a TP=1 reference (logits, loss, gradients).

A single process builds a tiny GPTModel (local layer spec) at TP=1 and records its weights, logits, loss and
gradients. Two processes then load the same weights, sharded the way Megatron lays them out, and must
match the reference within TOL. The model is fp32 with SwiGLU and RMSNorm, like the Qwen2.5 LLM.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from mp_utils import free_port, gather_cat, gather_list, init_megatron, start

SEED = 1234
NUM_LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB = 4, 64, 4, 2, 128, 128
BATCH, SEQ, MICROBATCHES = 4, 16, 2
TOL = 1e-5

_COLUMN_PARALLEL = ("linear_qkv.weight", "linear_fc1.weight", "word_embeddings.weight", "output_layer.weight")
_ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


# ---------------------------------------------------------------- weight layout (TP shards, PP stages)
def tp_dim(name: str) -> int | None:
    """The dimension a tensor-parallel weight is split on; None for replicated ones (norms)."""
    if name.endswith(_COLUMN_PARALLEL):
        return 0
    if name.endswith(_ROW_PARALLEL):
        return 1
    return None


def tp_shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This TP rank's part of a full weight. linear_fc1 is cat(gate, up): gate and up are split separately."""
    dim = tp_dim(name)
    if dim is None:
        return full.clone()
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    return full.chunk(size, dim=dim)[rank].clone()


def tp_unshard(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of tp_shard: the full tensor from every rank's part (in rank order)."""
    dim = tp_dim(name)
    if dim is None:
        return parts[0]
    if name.endswith("linear_fc1.weight"):
        gates, ups = zip(*(part.chunk(2, dim=0) for part in parts), strict=True)
        return torch.cat([*gates, *ups], dim=0)
    return torch.cat(parts, dim=dim)


def global_name(local: str, layer_offset: int, tied_output: bool) -> str:
    """The TP=1 reference name of a stage-local parameter (layer indices restart at 0 on each PP stage)."""
    if tied_output and local == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    match = _LAYER.match(local)
    if match is None:
        return local
    return f"decoder.layers.{int(match.group(1)) + layer_offset}.{local[match.end() :]}"


# ---------------------------------------------------------------- process set-up and model
def _build(tied: bool) -> torch.nn.Module:
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from mm_rl.platform.device import cpu_safe_transformer_kwargs

    config = TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        ffn_hidden_size=FFN,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        **cpu_safe_transformer_kwargs(),
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        position_embedding_type="rope",
        share_embeddings_and_output_weights=tied,
    )


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    return tokens, labels, positions


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # vocab_parallel_cross_entropy shifts its input in place: give it a copy.
    return vocab_parallel_cross_entropy(logits.clone(), labels).mean()


def _load_from_reference(model: torch.nn.Module, ref_state: dict[str, torch.Tensor], tied: bool) -> None:
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    offset = (
        parallel_state.get_pipeline_model_parallel_rank()
        * NUM_LAYERS
        // (parallel_state.get_pipeline_model_parallel_world_size())
    )
    state = model.state_dict()
    for local, value in state.items():
        if isinstance(value, torch.Tensor):
            ref = global_name(local, offset, tied_output=tied)
            state[local] = tp_shard(ref, ref_state[ref], tp_rank, tp_size)
    model.load_state_dict(state, strict=True)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


# ---------------------------------------------------------------- workers (run in spawned processes)
def _reference_worker(rank: int, port: int, out: str) -> None:
    init_megatron(rank, 1, port, tp=1, pp=1, seed=SEED)
    tokens, labels, positions = _batch()
    result = {}
    for tied in (False, True):
        model = _build(tied)
        state = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        logits = model(tokens, positions, None)
        loss = _loss(logits, labels)
        loss.backward()
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
        result[tied] = {"state": state, "logits": logits.detach(), "loss": loss.detach(), "grads": grads}
    torch.save(result, out)
    torch.distributed.destroy_process_group()


def _tp2_worker(rank: int, port: int, ref_path: str, out_dir: str) -> None:
    from megatron.core import parallel_state

    init_megatron(rank, 2, port, tp=2, pp=1, seed=SEED)
    ref = torch.load(ref_path, weights_only=True)[False]
    model = _build(tied=False)
    _load_from_reference(model, ref["state"], tied=False)
    tokens, labels, positions = _batch()
    logits = model(tokens, positions, None)
    loss = _loss(logits, labels)
    loss.backward()

    group = parallel_state.get_tensor_model_parallel_group()
    diffs = {"logits": _max_diff(gather_cat(logits.detach(), group, -1), ref["logits"])}
    diffs["loss"] = abs(loss.item() - ref["loss"].item())
    for name, param in model.named_parameters():
        parts = gather_list(param.grad.detach(), group)
        diffs[f"grad:{name}"] = _max_diff(tp_unshard(name, parts), ref["grads"][name])
    torch.save(diffs, Path(out_dir) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def _pp2_worker(rank: int, port: int, ref_path: str, out_dir: str) -> None:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    init_megatron(rank, 2, port, tp=1, pp=2, seed=SEED)
    ref = torch.load(ref_path, weights_only=True)[True]
    model = _build(tied=True)
    _load_from_reference(model, ref["state"], tied=True)
    tokens, labels, positions = _batch()
    micro = BATCH // MICROBATCHES
    batches = iter(
        [(tokens[i : i + micro], labels[i : i + micro], positions[i : i + micro]) for i in range(0, BATCH, micro)]
    )
    captured_logits: list[torch.Tensor] = []

    def forward_step(data_iterator, model):
        mb_tokens, mb_labels, mb_positions = next(data_iterator)

        def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            captured_logits.append(logits.detach().clone())
            loss = _loss(logits, mb_labels)
            return loss, {"loss": loss.detach().clone()}  # the schedule divides `loss` in place

        return model(mb_tokens, mb_positions, None), loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=batches,
        model=[model],
        num_microbatches=MICROBATCHES,
        seq_length=SEQ,
        micro_batch_size=micro,
        forward_only=False,
    )

    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    # Tied embeddings: the first stage's embedding and the last stage's output copy each hold part of the
    # gradient; their sum is the TP=1 gradient (what megatron's finalize_model_grads all-reduces).
    first = parallel_state.is_pipeline_first_stage()
    tied_name = "embedding.word_embeddings.weight" if first else "output_layer.weight"
    torch.distributed.all_reduce(grads[tied_name], group=parallel_state.get_embedding_group())

    offset = parallel_state.get_pipeline_model_parallel_rank() * NUM_LAYERS // 2
    diffs = {}
    for name, grad in grads.items():
        diffs[f"grad:{name}"] = _max_diff(grad, ref["grads"][global_name(name, offset, tied_output=True)])
    if parallel_state.is_pipeline_last_stage():
        diffs["logits"] = _max_diff(torch.cat(captured_logits), ref["logits"])
        diffs["loss"] = abs(torch.stack([x["loss"] for x in losses]).mean().item() - ref["loss"].item())
    torch.save(diffs, Path(out_dir) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


# ---------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tp1") / "reference.pt"
    start(_reference_worker, 1, free_port(), str(path))
    return str(path)


def _run_two_ranks(worker, reference: str, out_dir: Path) -> dict[str, float]:
    start(worker, 2, free_port(), reference, str(out_dir))
    diffs: dict[str, float] = {}
    for rank in range(2):
        for key, value in torch.load(out_dir / f"rank{rank}.pt", weights_only=True).items():
            diffs[f"rank{rank}/{key}"] = value
    return diffs


def _assert_close(diffs: dict[str, float], expected_keys: int) -> None:
    assert len(diffs) == expected_keys, sorted(diffs)
    for kind in ("logits", "loss", "grad:"):
        worst = max((key for key in diffs if kind in key), key=diffs.get)
        print(f"max {kind.rstrip(':')} diff {diffs[worst]:.3e} ({worst})")
    too_far = {k: v for k, v in diffs.items() if not v <= TOL}
    assert not too_far, too_far


def test_device_kind_and_setup_are_cpu_and_idempotent() -> None:
    from mm_rl.platform import device

    assert device.device_kind() == "cpu"
    assert device.dist_backend() == "gloo"
    assert device.current_device() == torch.device("cpu")
    threads = torch.get_num_threads()
    device.setup_process(num_threads=threads)
    from megatron.core import parallel_state

    bridged_torch = parallel_state.torch
    assert bridged_torch is not torch and bridged_torch.cuda.current_device() == torch.device("cpu")
    device.setup_process(num_threads=threads + 1)  # second call: no-op
    assert parallel_state.torch is bridged_torch
    assert torch.get_num_threads() == threads
    assert torch.cuda.current_device is not bridged_torch.cuda.current_device  # the real torch is untouched


def test_tp2_matches_tp1(reference: str, tmp_path: Path) -> None:
    diffs = _run_two_ranks(_tp2_worker, reference, tmp_path)
    params = 1 + NUM_LAYERS * 6 + 2  # embedding, 6 per layer, final norm, output layer
    _assert_close(diffs, expected_keys=2 * (2 + params))


def test_pp2_matches_tp1(reference: str, tmp_path: Path) -> None:
    diffs = _run_two_ranks(_pp2_worker, reference, tmp_path)
    stage0 = 1 + NUM_LAYERS // 2 * 6  # embedding + layers
    stage1 = NUM_LAYERS // 2 * 6 + 2 + 2  # layers, final norm, output copy of the embedding; logits, loss
    _assert_close(diffs, expected_keys=stage0 + stage1)
