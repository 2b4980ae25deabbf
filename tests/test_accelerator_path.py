"""The accelerator path's rules, shown on CPU wherever CPU can show them.

Each test names the device failure it guards against. What only a device can show (memory really freed, bf16
gaps, NCCL / HCCL) is in tests/device/.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch
from mp_utils import init_megatron, load_rank_results, save_rank_result, shutdown, spawn


# ------------------------------------------------------------------------------------- rank placement
def test_ranks_take_bundles_in_node_order_so_tp_groups_share_a_node():
    """A PACK placement group numbers its bundles without regard to nodes (here interleaved); ranks take them
    grouped by node, so the TP pairs (0, 1) and (2, 3) each sit on one node."""
    from mm_rl.workers.group import rank_bundles

    nodes = ["a", "b", "a", "b"]
    order = rank_bundles(nodes, inner=2)
    assert order == [0, 2, 1, 3]
    assert [nodes[b] for b in order] == ["a", "a", "b", "b"]
    assert rank_bundles(nodes, inner=1) == [0, 2, 1, 3]  # DP-only: any order works, the same rule applies


def test_a_tp_group_split_over_nodes_is_refused_with_the_counts():
    from mm_rl.workers.group import rank_bundles

    with pytest.raises(RuntimeError, match=r"ranks 0..3 form one TP x CP group .* \{'a': 3, 'b': 5\}"):
        rank_bundles(["a", "a", "a", "b", "b", "b", "b", "b"], inner=4)


# ---------------------------------------------------------------------------------------- engine executor
@pytest.mark.stack
def test_engine_with_tp_uses_vllms_multiprocessing_executor_inside_a_placement_group(tmp_path):
    """Inside a Ray placement group vLLM would pick its Ray executor for TP > 1 (which wants a bundle per rank and
    refuses the engine's one multi-device bundle); the engine's settings name the multiprocessing executor, and
    vLLM's own ParallelConfig, resolved in an actor of a placement group, keeps it."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from mm_rl.rollout.vllm_engine import executor_backend

    assert (executor_backend(1), executor_backend(2)) == ("uni", "mp")

    @ray.remote(num_cpus=1)
    def resolved(backend: str | None) -> str:
        from vllm.config import ParallelConfig

        return str(
            ParallelConfig(tensor_parallel_size=2, distributed_executor_backend=backend).distributed_executor_backend
        )

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        group = placement_group([{"CPU": 1}])
        ray.get(group.ready())
        strategy = PlacementGroupSchedulingStrategy(group, 0)
        assert ray.get(resolved.options(scheduling_strategy=strategy).remote(None)) == "ray"  # what we avoid
        assert ray.get(resolved.options(scheduling_strategy=strategy).remote(executor_backend(2))) == "mp"
        remove_placement_group(group)
    finally:
        ray.shutdown()


# ------------------------------------------------------------------------------- weight-sync TP gather
def _gather_worker(rank: int, world: int, port: int, out: str) -> None:
    """A TP2 stage's gather with ``torch.distributed.gather`` made to fail as HCCL's does."""
    init_megatron(rank, world, port, tp=2)

    def no_gather(*_args, **_kwargs):
        raise RuntimeError("ProcessGroupHCCL does not support gather")

    torch.distributed.gather = no_gather
    from megatron.core import parallel_state

    from mm_rl.sync.sender import gather_shards

    group = parallel_state.get_tensor_model_parallel_group()
    shard = torch.arange(6.0).view(2, 3) + 10 * rank
    save_rank_result(
        out, rank, {"split": gather_shards(shard, True, group), "replicated": gather_shards(shard, False, group)}
    )
    shutdown()


def test_tp_gather_of_the_weight_sync_needs_no_gather_collective(tmp_path):
    spawn(_gather_worker, 2, str(tmp_path))
    first, second = load_rank_results(tmp_path, 2)
    expected = [torch.arange(6.0).view(2, 3), torch.arange(6.0).view(2, 3) + 10]
    assert [t.tolist() for t in first["split"]] == [t.tolist() for t in expected]
    assert first["replicated"][0].tolist() == expected[0].tolist()
    assert second["split"] is None and second["replicated"] is None


# ----------------------------------------------------------------------------------------- checkpoints
def test_checkpoints_carry_the_device_generator(monkeypatch):
    """On a device the default generator (dropout outside megatron's tracker, sampling) is checkpointed and
    restored; a CPU machine has none beside the CPU one. The device's generator is stood in for by a recorder."""
    from mm_rl.platform import device

    saved = torch.tensor([1, 2, 3], dtype=torch.uint8)
    restored: list[torch.Tensor] = []

    class FakeCuda:
        @staticmethod
        def get_rng_state() -> torch.Tensor:
            return saved

        @staticmethod
        def set_rng_state(state: torch.Tensor) -> None:
            restored.append(state)

    assert device.device_rng_state() is None  # CPU: nothing beyond the CPU generator
    monkeypatch.setattr(device, "device_kind", lambda: "cuda")
    monkeypatch.setattr(torch, "cuda", FakeCuda)
    state = device.device_rng_state()
    assert state.tolist() == [1, 2, 3]
    device.set_device_rng_state(state)
    assert restored and restored[0].tolist() == [1, 2, 3]


def _rng_worker(rank: int, world: int, port: int, out: str) -> None:
    init_megatron(rank, world, port)
    from mm_rl.workers.training import rng_state, set_rng_state

    state = rng_state()
    first = torch.rand(3)
    torch.rand(5)
    set_rng_state(state)
    save_rank_result(
        out, rank, {"keys": sorted(state), "device": state["device"], "again": torch.rand(3), "first": first}
    )
    shutdown()


def test_rank_rng_state_round_trips_with_its_device_entry(tmp_path):
    spawn(_rng_worker, 1, str(tmp_path))
    (result,) = load_rank_results(tmp_path, 1)
    assert result["keys"] == ["device", "numpy", "random", "torch", "tracker"]
    assert result["device"] is None  # a CPU rank
    assert torch.equal(result["again"], result["first"])


# ------------------------------------------------------------------------------------------- planner
def _plan_job(**overrides):
    from mm_rl.job.create import ClusterSpec, create_job

    _, job, _ = create_job(
        "qwen2_5_vl_7b",
        "geo3k",
        ClusterSpec(nnodes=1, nproc_per_node=8, device="npu"),
        overrides=[f"{k}={v}" for k, v in overrides.items()],
    )
    return job


def test_memory_estimate_counts_no_llm_attention_scores_whatever_use_flash_attn_says():
    """The LLM's core attention is fused on every device: the flag changes only the (frozen) ViT's term, and the
    LLM's activations grow linearly with the sequence, not with its square (the logits, of the responses only, do
    not grow with it)."""
    from mm_rl.config.plan import estimate_memory, logit_tokens

    key, seq = "backend_config.training.use-flash-attn", "backend_config.training.seq-length"
    flash, math_attention = estimate_memory(_plan_job(**{key: True})), estimate_memory(_plan_job(**{key: False}))
    assert [m.activations for m in flash] == [m.activations for m in math_attention]
    jobs = [_plan_job(**{seq: length}) for length in (4096, 16384)]
    assert logit_tokens(jobs[0]) == logit_tokens(jobs[1])
    b = jobs[0].backend_config
    logits = 2 * 4 * logit_tokens(jobs[0]) * b.model.text_decoder.vocab_size / b.training.tensor_model_parallel_size
    short, long = (estimate_memory(job) for job in jobs)
    for a, z in zip(short, long, strict=True):
        fixed = logits / 2**30 if a is short[-1] else 0.0
        assert z.activations - fixed == pytest.approx(4 * (a.activations - fixed), rel=0.05)


def test_memory_estimate_follows_the_micro_batch_token_budget():
    """A budget of MBS x seq-length tokens is the fixed-count micro-batch's size: the same layers' activations, and
    logits for every token of the budget (it may hold many short samples) where MBS samples have at most MBS x
    max_tokens response tokens (only those reach the output layer); twice the budget holds more activations and
    logits on every stage, and nothing else changes."""
    from mm_rl.config.plan import estimate_memory

    actor, sampling = "backend_config.actor_config", "backend_config.generate_config.sampling_config"
    counted = _plan_job()
    b = counted.backend_config
    rows = b.actor_config.micro_batch_size * b.training.seq_length
    responses = b.actor_config.micro_batch_size * b.generate_config.sampling_config.max_tokens
    assert responses < rows  # the preset's responses are shorter than its sequences
    same = estimate_memory(_plan_job(**{f"{actor}.max_tokens_per_micro_batch": rows}))
    double = estimate_memory(_plan_job(**{f"{actor}.max_tokens_per_micro_batch": 2 * rows}))
    logits = 2 * 4 * (rows - responses) * b.model.text_decoder.vocab_size / b.training.tensor_model_parallel_size
    for budget, count in zip(same, estimate_memory(counted), strict=True):
        extra = logits / 2**30 if budget is same[-1] else 0.0  # the last stage holds the output layer
        assert budget.activations == pytest.approx(count.activations + extra, rel=1e-9)
        assert budget.weights == count.weights
    assert all(d.activations > s.activations and d.weights == s.weights for d, s in zip(double, same, strict=True))
    half = b.generate_config.sampling_config.max_tokens // 2
    shorter = estimate_memory(_plan_job(**{f"{sampling}.max_tokens": half}))
    assert shorter[-1].activations < estimate_memory(counted)[-1].activations


def test_log_prob_micro_batches_grow_only_as_far_as_a_training_micro_batch_holds():
    """A no-grad log-prob pass keeps one layer's activations at a time and the logits (their fp32 copy and
    exponentials too), a training micro-batch every layer's and the logits with their gradient: 7B at TP 2 (28
    layers on one stage) takes several update micro-batches per log-prob one; at PP 4 with responses filling the
    sequences' rest (7 layers beside 152k-column logits on the last stage) only one; never more than a DP replica's
    share of the step, and under PP no fewer micro-batches than stages. A set log-prob budget wins; a training
    budget scales like micro_batch_size."""
    from mm_rl.config.plan import log_prob_scale, micro_batch_limits

    actor, rl, model = "backend_config.actor_config", "backend_config.rl_config", "backend_config.model"
    job = _plan_job()
    scale, mbs = log_prob_scale(job), job.backend_config.actor_config.micro_batch_size
    assert scale >= 2
    assert micro_batch_limits(job, grad=False) == (None, scale * mbs) and micro_batch_limits(job, True) == (None, mbs)
    b = job.backend_config
    responses = b.training.seq_length - b.data.dataset_param.preprocess_parameters.max_prompt_length
    filled = {
        "backend_config.generate_config.sampling_config.max_tokens": responses,
        f"{actor}.pipeline_model_parallel_size": 4,
        f"{model}.text_decoder.pipeline_num_layers": "[7,7,7,7]",
        f"{model}.image_encoder.vision_encoder.pipeline_num_layers": "[32,0,0,0]",
    }
    assert log_prob_scale(_plan_job(**filled)) == 1
    gbs = "backend_config.megatron_training.global_batch_size"
    share = _plan_job(**{f"{rl}.rollout_batch_size": 1, f"{rl}.n_samples_per_prompt": 8, gbs: 8})
    assert mbs == 1 and _dp(share) == 4 and log_prob_scale(share) == 2 < scale  # 8 samples, 2 per replica
    stages = {
        f"{actor}.pipeline_model_parallel_size": 2,
        f"{model}.text_decoder.pipeline_num_layers": "[14,14]",
        f"{model}.image_encoder.vision_encoder.pipeline_num_layers": "[32,0]",
        "backend_config.generate_config.sampling_config.max_tokens": 128,  # few logits: memory allows 7
    }
    assert log_prob_scale(_plan_job(**stages)) == 7
    small = _plan_job(**stages, **{f"{rl}.rollout_batch_size": 1, f"{rl}.n_samples_per_prompt": 8, gbs: 8})
    assert _dp(small) == 2 and log_prob_scale(small) == 2  # 4 samples per replica, a micro-batch per stage
    budget = _plan_job(**{f"{actor}.max_tokens_per_micro_batch": 4096})
    assert micro_batch_limits(budget, False) == (4096 * log_prob_scale(budget), mbs * log_prob_scale(budget))
    own = _plan_job(
        **{f"{actor}.max_tokens_per_micro_batch": 4096, f"{actor}.log_prob_max_tokens_per_micro_batch": 8192}
    )
    assert micro_batch_limits(own, False) == (8192, mbs) and micro_batch_limits(own, True) == (4096, mbs)


def _dp(job):
    from mm_rl.config.topology import topology

    return topology(job).dp


@pytest.mark.parametrize("packed", [True, False])
def test_llm_core_attention_keeps_no_scores_for_backward(packed):
    """What the planner assumes: the LLM layer's core attention (packed rows per sequence, padded rows with a left
    padding mask) saves nothing of S x S size for its backward, and computes causal attention within each
    sequence's real tokens."""
    import torch

    from mm_rl.models.qwen_vl.layers import llm_layer_spec
    from mm_rl.models.qwen_vl.llm_attention import CausalSegments, LLMCoreAttention
    from mm_rl.models.qwen_vl.model import padding_attention_mask

    spec = llm_layer_spec("RMSNorm", ulysses=False)
    assert spec.submodules.self_attention.submodules.core_attention is LLMCoreAttention
    config, seq, heads, groups, dim = _attention_config(), 96, 4, 2, 16
    generator = torch.Generator().manual_seed(0)
    rows = 1 if packed else 2
    q, k, v = (torch.randn(seq, rows, n, dim, generator=generator).requires_grad_() for n in (heads, groups, groups))
    valid = torch.ones(rows, seq, dtype=torch.long)
    if not packed:
        valid[1, :30] = 0  # left padding: some queries see no real key
    mask = None if packed else padding_attention_mask(valid)
    segments = CausalSegments.build(torch.tensor([0, 40, 96], dtype=torch.int32)) if packed else None
    saved: list[torch.Size] = []
    core = LLMCoreAttention(config, 1, None, "self")
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: t.is_floating_point() and saved.append(t.shape) or t, lambda t: t
    ):
        out = core(q, k, v, mask, packed_seq_params=segments)
    # q, k, v, out, log-sum-exp: O(S d) per head; padded rows also the mask as floats, one S x S per row (not per
    # head, as a math kernel's probabilities would be)
    assert saved and max(math.prod(shape) for shape in saved) <= rows * seq * seq
    out.square().sum().backward()
    assert torch.isfinite(q.grad).all()
    pairs = [(slice(0, 40), 0), (slice(40, 96), 0)] if packed else [(slice(None), 0), (slice(30, None), 1)]
    for span, row in pairs:  # each sequence alone (its real tokens), by the textbook formula
        one = [t.detach()[span, row] for t in (q, k, v)]
        expected = _causal_attention(*one, scale=1 / math.sqrt(dim))
        assert torch.allclose(out.detach()[span, row], expected, atol=1e-5), (span, row)


def test_shared_prompt_keys_as_the_varlen_kernels_take_them():
    """The layout the CUDA / NPU varlen kernels get for shared prompts (``kv_index`` gathers each sequence's context
    then itself, ``cu_seqlens_kv`` / ``kv_ends`` their ends), read by the textbook attention those kernels compute
    (the causal window aligned to the end of the keys), equals the CPU path's: sequences [0, 40) [40, 50) [50, 96),
    the last two attending to the first one's 30 leading tokens, and a padding segment."""
    import torch

    from mm_rl.models.qwen_vl.llm_attention import CausalSegments, LLMCoreAttention

    segments = CausalSegments.build(
        torch.tensor([0, 40, 50, 96, 100], dtype=torch.int32), [(0, 0), (0, 30), (0, 30), (0, 0)]
    )
    assert segments.kv_ends == [40, 80, 156, 160] and segments.cu_seqlens_kv.tolist() == [0, 40, 80, 156, 160]
    assert segments.max_seqlen_kv == 76 and segments.kv_index.numel() == 160
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(100, 1, n, 16, generator=generator) for n in (4, 2, 2))
    out = LLMCoreAttention(_attention_config(), 1, None, "self")(q, k, v, None, packed_seq_params=segments)[:, 0]
    keys, values = (t[:, 0].index_select(0, segments.kv_index) for t in (k, v))
    starts = [0, *segments.kv_ends]
    for (a, b), k0, k1 in zip(segments.spans, starts[:-1], starts[1:], strict=True):
        kk, vv = (t.repeat_interleave(2, dim=1) for t in (keys[k0:k1], values[k0:k1]))
        scores = torch.einsum("qhd,khd->hqk", q[a:b, 0], kk) / 4.0
        hidden = torch.ones(b - a, k1 - k0, dtype=torch.bool).triu(k1 - k0 - (b - a) + 1)  # end-aligned causal
        expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), vv)
        assert torch.allclose(out[a:b], expected.reshape(b - a, -1), atol=1e-5), (a, b)


def _causal_attention(q, k, v, scale: float):
    """softmax(q k^T scale + causal mask) v for one sequence [s, heads, d] (groups repeated), as [s, heads * d]."""
    import torch

    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


def _attention_config():
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    from mm_rl.platform.device import cpu_safe_transformer_kwargs

    return TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        kv_channels=16,
        activation_func=F.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **cpu_safe_transformer_kwargs(),
    )


def test_colocated_rollout_phase_counts_the_engine_share_beside_what_the_actor_keeps():
    """While a colocated engine generates, a device holds its gpu_memory_utilization share plus whatever the actor
    does not offload; offloading everything leaves the engine's share alone."""
    from mm_rl.config.plan import device_memory_gb, estimate_memory

    util, actor = "backend_config.generate_config.gpu_memory_utilization", "backend_config.actor_config"
    kept = _plan_job(
        **{
            util: 0.5,
            f"{actor}.offload_train_param": False,
            f"{actor}.offload_train_grad": False,
            f"{actor}.offload_train_optimizer": False,
        }
    )
    offloaded = _plan_job(
        **{
            util: 0.5,
            f"{actor}.offload_train_param": True,
            f"{actor}.offload_train_grad": True,
            f"{actor}.offload_train_optimizer": True,
        }
    )
    share = 0.5 * device_memory_gb(kept)
    for full, empty in zip(estimate_memory(kept), estimate_memory(offloaded), strict=True):
        assert full.rollout == pytest.approx(share + full.weights + full.reference + full.grads + full.optimizer)
        assert empty.rollout == pytest.approx(share)
        assert full.total == max(full.training, full.rollout)
    separate = _plan_job(
        **{
            "backend_config.generate_config.colocate": False,
            "backend_config.generate_config.infer_tensor_parallel_size": 4,
        }
    )
    assert all(m.rollout == 0.0 for m in estimate_memory(separate))


# ------------------------------------------------------------------------------------------------- NPU
def test_colocated_npu_engine_keeps_weights_out_of_the_nz_layout(monkeypatch):
    """vllm-ascend refuses wake_up on FRACTAL_NZ weights (its default): a colocated engine on NPU runs with
    VLLM_ASCEND_ENABLE_NZ=0; a separate one, and every engine elsewhere, keeps the default."""
    from mm_rl.config.schema import GenerateConfig
    from mm_rl.rollout import vllm_engine

    colocated, separate = GenerateConfig(colocate=True), GenerateConfig(colocate=False)
    assert vllm_engine.device_environment(colocated) == {}  # CPU
    monkeypatch.setattr(vllm_engine, "device_kind", lambda: "npu")
    assert vllm_engine.device_environment(colocated) == {"VLLM_ASCEND_ENABLE_NZ": "0"}
    assert vllm_engine.device_environment(separate) == {}
    monkeypatch.setattr(vllm_engine, "device_kind", lambda: "cuda")
    assert vllm_engine.device_environment(colocated) == {}


def test_megatron_type_checks_see_cuda_names_inside_the_bridged_functions():
    """torch_npu names an NPU parameter 'torch.npu.BFloat16Tensor'; megatron's optimizer compares with
    'torch.cuda.*' strings. Inside a bridged function every name reads as CUDA's."""
    from mm_rl.platform.megatron_cpu import _with_cuda_tensor_methods, as_cuda_type

    assert as_cuda_type("torch.npu.BFloat16Tensor") == "torch.cuda.BFloat16Tensor"
    assert as_cuda_type("torch.FloatTensor") == "torch.cuda.FloatTensor"
    assert as_cuda_type("torch.cuda.HalfTensor") == "torch.cuda.HalfTensor"
    bridged = _with_cuda_tensor_methods(lambda t: t.type(), cpu=False)
    assert bridged(torch.zeros(1, dtype=torch.bfloat16)) == "torch.cuda.BFloat16Tensor"
    assert torch.zeros(1).type() == "torch.FloatTensor"  # outside, nothing changes


def test_every_megatron_type_comparison_lies_in_a_bridged_function():
    """A tripwire for megatron upgrades: each `.type()` compared with a 'torch.cuda.' name in the optimizer modules
    sits in a function the NPU bridge wraps (or one only the wrapped DistributedOptimizer.__init__ calls)."""
    import ast
    import importlib
    import inspect

    from mm_rl.platform.megatron_cpu import TYPE_CHECK_SITES

    wrapped = {qualname.split(".")[-1] for _, qualname in TYPE_CHECK_SITES} | {"_build_model_and_main_param_groups"}
    found = set()
    for module_name in {module for module, _ in TYPE_CHECK_SITES}:
        tree = ast.parse(inspect.getsource(importlib.import_module(module_name)))
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef):
                continue
            for node in ast.walk(function):
                text = ast.unparse(node) if isinstance(node, ast.Compare) else ""
                if ".type()" in text and "torch.cuda." in text:
                    found.add(function.name)
    assert found and found <= wrapped, found - wrapped
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    assert "_build_model_and_main_param_groups" in inspect.getsource(DistributedOptimizer.__init__)


def test_planner_offloads_what_a_colocated_rollout_needs_and_writes_it_into_the_job():
    """A 7B on one 8-device node: with 141 GB devices the engine's share fits once the gradients are dropped; with
    64 GB only with the Adam state away too. The planner picks the least offload that fits, and the job carries
    it."""
    from mm_rl.config.plan import OFFLOAD_KINDS
    from mm_rl.job.create import ClusterSpec, create_job

    chosen = []
    for memory in (141, 64):
        _, job, plan = create_job("qwen2_5_vl_7b", "x", ClusterSpec(1, 8, "npu", device_memory_gb=memory))
        actor = job.backend_config.actor_config
        chosen.append({kind for kind in OFFLOAD_KINDS if getattr(actor, f"offload_train_{kind}")})
        assert plan.fits and set(plan.offload) == chosen[-1]
    assert chosen == [{"grad"}, {"grad", "optimizer"}]


def test_moe_on_a_gpu_without_transformer_engine_finds_the_routers_gemm_name():
    """megatron-core 0.16.1's MoE router tests a name (``te_general_gemm``) that its module defines only when
    Transformer Engine imports: the process set-up defines it on every device kind, not only on CPU (a fresh
    process told it has a CUDA device: the CPU bridges stay off, the name is there)."""
    probe = textwrap.dedent("""
        import mm_rl.platform.device as device
        device.device_kind = lambda: "cuda"
        device.setup_process()
        import megatron.core.transformer.moe.moe_utils as moe_utils
        from mm_rl.platform import megatron_cpu
        print(moe_utils.te_general_gemm is None, megatron_cpu._installed)
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "False"]


def test_engines_run_graphs_and_their_own_process_on_accelerators_and_eager_in_process_on_cpu(monkeypatch):
    """``enforce_eager`` unset: eager on CPU, CUDA / ACL graphs and torch.compile on accelerators; set, as set. The
    engine core runs in the caller's process only on CPU at TP 1 (on a device its scheduling and detokenising
    overlap the device's work)."""
    from mm_rl.config.schema import GenerateConfig
    from mm_rl.rollout import vllm_engine

    assert vllm_engine.eager(GenerateConfig()) is True
    assert vllm_engine.engine_in_process(1) and not vllm_engine.engine_in_process(2)
    for kind in ("cuda", "npu"):
        monkeypatch.setattr(vllm_engine, "device_kind", lambda kind=kind: kind)
        assert vllm_engine.eager(GenerateConfig()) is False
        assert vllm_engine.eager(GenerateConfig(enforce_eager=True)) is True
        assert not vllm_engine.engine_in_process(1)


def test_reseed_restarts_what_either_vllm_model_runner_draws_from():
    """V1 (CPU, vllm-ascend) samples unseeded requests from torch's default generator; V2 (CUDA's default) gives
    each a seed from numpy's global generator: both repeat after the same reseed, and differ with another seed."""
    import numpy as np

    from mm_rl.rollout.vllm_engine import WeightReceiver

    def draws(seed: int) -> tuple[int, float]:
        WeightReceiver.mm_rl_reseed(None, seed)  # type: ignore[arg-type]  # uses no worker state
        return int(np.random.randint(-(2**62), 2**62)), float(torch.rand(()))

    assert draws(2**40 + 7) == draws(2**40 + 7)
    first, other = draws(7), draws(8)
    assert first[0] != other[0] and first[1] != other[1]


@pytest.mark.parametrize(("kind", "tags", "emptied"), [("npu", ["kv_cache"], True), ("npu", ["weights"], False),
                                                      ("cuda", None, True), ("cpu", ["kv_cache"], False)])  # fmt: skip
def test_the_kv_cache_wakes_up_after_every_worker_emptied_its_allocator_cache(monkeypatch, kind, tags, emptied):
    """vllm-ascend 0.23's wake_up leaves the allocator's cached blocks (received buckets, per-layer temporaries)
    held: the engine has every worker give them back first, then wakes the KV cache (the engine object with its
    vLLM handle replaced by a recorder: no accelerator here)."""
    from mm_rl.rollout import vllm_engine

    calls: list[str] = []

    class Llm:
        def collective_rpc(self, method, args=(), kwargs=None):
            calls.append(method)
            return [None]

        def wake_up(self, tags=None):
            calls.append(f"wake_up {tags}")

    monkeypatch.setattr(vllm_engine, "device_kind", lambda: kind)
    engine = object.__new__(vllm_engine.VllmEngine)
    engine.llm = Llm()
    engine._wake_up(tags)
    expected = ["mm_rl_empty_cache"] if emptied else []
    assert calls == [*expected, f"wake_up {tags}"]


def test_megatrons_torch_adam_is_switched_to_the_fused_kernel_in_place():
    """Without Transformer Engine or apex megatron builds torch's AdamW (foreach): ``fuse_adam`` switches each group
    to torch's fused kernel (used on CUDA), whose steps equal an AdamW built fused (CPU has the kernel too)."""
    from types import SimpleNamespace

    from mm_rl.workers.training import fuse_adam

    def steps(optimizer, params):
        for k in range(3):
            for p in params:
                p.grad = torch.full_like(p, 0.1 * (k + 1)) + p
            optimizer.step()
        return [p.detach().clone() for p in params]

    start = [torch.randn(5, 3, generator=torch.Generator().manual_seed(0)), torch.randn(7)]
    ours = [p.clone().requires_grad_() for p in start]
    theirs = [p.clone().requires_grad_() for p in start]
    built = torch.optim.AdamW(ours, lr=1e-2, weight_decay=0.1)
    assert fuse_adam(SimpleNamespace(optimizer=built)) == 1 and built.param_groups[0]["fused"]
    fused = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1, fused=True)
    assert all(torch.equal(a, b) for a, b in zip(steps(built, ours), steps(fused, theirs), strict=True))


def test_memory_plan_of_lora_keeps_the_base_and_trains_only_adapters():
    """LoRA on the 7B (8 NPUs): the same bf16 weights (plus adapters), grads and Adam state of the adapters only
    (< 2% of full training's), no reference copy unless a separate one is asked for."""
    from mm_rl.config.plan import estimate_memory

    lora = "backend_config.actor_config.lora"
    full, adapted = estimate_memory(_plan_job()), estimate_memory(_plan_job(**{f"{lora}.rank": 16}))
    separate = estimate_memory(_plan_job(**{f"{lora}.rank": 16, f"{lora}.separate_reference": True}))
    for f, a, s in zip(full, adapted, separate, strict=True):
        assert f.weights < a.weights < 1.01 * f.weights
        assert 0 < a.grads < 0.02 * f.grads and 0 < a.optimizer < 0.02 * f.optimizer
        assert f.reference > 0 and a.reference == 0 and s.reference == f.reference


def test_memory_estimate_counts_a_videos_frames_where_the_vit_trains():
    """With the ViT trained, each sample's video frames (max_frames at video_max_pixels) add ViT activations on its
    stage, more frames more; a frozen ViT keeps none, and a job without videos counts none."""
    from mm_rl.config.plan import estimate_memory

    actor, gen, pre = (
        "backend_config.actor_config",
        "backend_config.generate_config",
        "backend_config.data.dataset_param.preprocess_parameters",
    )
    trained = {f"{actor}.unfreeze_vision_encoder": True}

    def vit_stage(**overrides):
        return estimate_memory(_plan_job(**overrides))[0].activations

    images = vit_stage(**trained)
    few, many = (vit_stage(**trained, **{f"{gen}.max_videos_per_prompt": 1, f"{pre}.max_frames": n}) for n in (8, 32))
    assert images < few < many
    assert many - images == pytest.approx(4 * (few - images), rel=0.05)  # the frames' tokens: 4x, their activations
    frozen = {f"{gen}.max_videos_per_prompt": 1, f"{pre}.max_frames": 32}
    assert vit_stage(**frozen) == vit_stage()
