"""The actor rank's update on its own (one TrainingWorker in a Ray actor, tiny model, text-only batches):
a step changes the weights and a NaN step leaves them (and the optimizer) untouched; weight decay spares
biases and norms; the LR schedule warms up and decays; a dead rank fails the call with a message naming it."""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from probes import ProbeWorker, record_schedule

from mm_rl.config.schema import Hf2MgCfg, HfConfig, ParallelConfig, RLConfig, TrainingFlags
from mm_rl.workers.training import LossSpec, OptimizerSpec

pytestmark = pytest.mark.stack  # Ray, vLLM engines or Megatron ranks: in `make test`, not `make test-quick`

SPEC = OptimizerSpec(
    lr=1e-3,
    min_lr=1e-4,
    weight_decay=0.0,
    adam_beta1=0.9,
    adam_beta2=0.999,
    clip_grad=1.0,
    lr_decay_style="cosine",
    warmup_steps=2,
    total_steps=6,
)
LOSS = LossSpec(RLConfig(kl_loss_coef=0.0, use_kl_loss=False), max_response_len=4)


@pytest.fixture(scope="module")
def mm_dir(tmp_path_factory):
    from mm_rl.convert import hf2mg, model_config_from_hf
    from mm_rl.demo.tiny import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    hf_dir = build_tiny_checkpoint(root / "hf", seed=0)
    model = model_config_from_hf(hf_dir)
    parallel = ParallelConfig(tp_size=1, llm_pp_layers=[4], vit_pp_layers=[2])
    hf2mg(Hf2MgCfg(mm_dir=str(root / "mm"), hf_config=HfConfig(hf_dir=str(hf_dir)), parallel_config=parallel), model)
    return root / "mm", model


@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _group(ray_session, mm_dir, spec: OptimizerSpec, bf16: bool = False, cp: int = 1, cpus: float = 1.0, dp: int = 1):
    from mm_rl.workers.group import WorkerGroup
    from mm_rl.workers.megatron_worker import WorkerSpec

    path, model = mm_dir
    flags = TrainingFlags(context_parallel_size=cp, context_parallel_algo="ulysses_cp_algo" if cp > 1 else None)
    group = WorkerGroup(
        WorkerSpec(model, bf16=bf16, cp=cp, dp=dp, flags=flags), cpus_per_worker=cpus, worker_cls=ProbeWorker
    )
    group.build(str(path))
    group.run(ProbeWorker.setup_training, spec)
    return group


def _batch(group, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Two rows of random tokens; the last 4 positions are the response, half the rows with advantage +1."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (2, 12), generator=generator)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.roll(ids, -1, dims=1)}
    old = group.compute_log_probs([batch])[0]
    mask = torch.zeros(2, 12)
    mask[:, 7:11] = 1.0
    return [batch | {"response_mask": mask, "old_log_probs": old, "advantages": torch.tensor([[1.0], [-1.0]]) * mask}]


def _save_iteration_1(group, root) -> Path:
    """Checkpoint iteration 1 of ``group`` under ``root``; returns its first rank directory."""
    from mm_rl.checkpoint import CheckpointManager

    manager = CheckpointManager(root, keep_last=0)
    staging = manager.stage(1)
    group.run(ProbeWorker.save_checkpoint, str(staging))
    manager.commit(staging, 1)
    return root / "iter_0000001" / "mp_rank_00"


def _assert_resumes_to(ray_session, mm_dir, spec, root, batch, expected, cp: int = 1) -> None:
    """Fresh ranks load iteration 1 from ``root`` and take ``batch``: the weights must equal ``expected``."""
    resumed = _group(ray_session, mm_dir, spec, cp=cp)
    try:
        resumed.run(ProbeWorker.load_checkpoint, str(root), 1, True, True)
        resumed.run(ProbeWorker.train_mini_batch, batch, LOSS, 8.0)
        assert resumed.run(ProbeWorker.parameter_sums)[0] == expected
    finally:
        resumed.shutdown()


def test_update_and_non_finite_skip(ray_session, mm_dir):
    group = _group(ray_session, mm_dir, OptimizerSpec(**{**SPEC.__dict__, "warmup_steps": 0}))  # (warm-up: lr 0 first)
    try:
        batch = _batch(group)
        before = group.run(ProbeWorker.parameter_sums)[0]
        metrics = group.run(ProbeWorker.train_mini_batch, batch, LOSS, 8.0)[0].metrics
        assert metrics["skipped"] == 0.0 and math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
        after = group.run(ProbeWorker.parameter_sums)[0]
        changed = {k for k in before if before[k] != after[k]}
        assert changed and not any(k.startswith("image_encoder.encoder.") for k in changed)  # ViT frozen

        group.run(ProbeWorker.poison_next_step)
        skipped = group.run(ProbeWorker.train_mini_batch, _batch(group, 1), LOSS, 8.0)[0].metrics
        assert skipped["skipped"] == 1.0 and not math.isfinite(skipped["grad_norm"])
        assert group.run(ProbeWorker.parameter_sums)[0] == after  # weights untouched by the NaN step
        healthy = group.run(ProbeWorker.train_mini_batch, _batch(group, 2), LOSS, 8.0)[0].metrics
        assert healthy["skipped"] == 0.0 and math.isfinite(healthy["grad_norm"])  # no NaN left behind
        assert group.run(ProbeWorker.parameter_sums)[0] != after
    finally:
        group.shutdown()


def test_weight_decay_spares_biases_and_norms_and_lr_follows_the_schedule(ray_session, mm_dir):
    spec = OptimizerSpec(**{**SPEC.__dict__, "weight_decay": 0.5})
    group = _group(ray_session, mm_dir, spec)
    try:
        batch = _batch(group)
        batch[0]["advantages"] = torch.zeros_like(batch[0]["advantages"])  # zero loss: only the decay moves weights
        lrs = []
        for _ in range(6):
            before = group.run(ProbeWorker.parameter_sums)[0]
            lrs.append(group.run(ProbeWorker.train_mini_batch, batch, LOSS, 8.0)[0].metrics["lr"])
        after = group.run(ProbeWorker.parameter_sums)[0]
        moved = {k for k in after if after[k] != before[k]}
        assert any(k.endswith("linear_qkv.weight") for k in moved)  # matrices decay
        assert not any(k.endswith((".bias", "layernorm.weight", "final_layernorm.weight")) for k in moved)
        assert lrs[0] < lrs[1] < lrs[2] and lrs[2] == pytest.approx(1e-3)  # warm-up over 2 steps
        assert lrs[2] > lrs[3] > lrs[4] > lrs[5] >= 1e-4  # cosine decay towards min_lr
        # the driver puts the schedule where the plan says (a GRPO step that dropped groups ran fewer steps)
        for updates, lr in ((spec.total_steps, spec.min_lr), (2, spec.lr), (4, lrs[4])):
            group.run(ProbeWorker.schedule_lr_at, updates)
            assert group.run(ProbeWorker.train_mini_batch, batch, LOSS, 8.0)[0].metrics["lr"] == pytest.approx(lr)
    finally:
        group.shutdown()


def test_a_failed_call_names_role_rank_and_method_waited_for_or_not(ray_session, mm_dir):
    """A call started without a wait (``WorkerGroup.start``: the LR schedule, the step's images) fails the group's
    next call, named as its own, and the group goes on; a dead rank fails the call made to it."""
    from mm_rl.workers.group import WorkerError

    group = _group(ray_session, mm_dir, SPEC)
    try:
        group.start(ProbeWorker.schedule_lr_at, "not a step count")
        with pytest.raises(WorkerError, match=r"actor rank 0 \(tp 0, pp 0, dp 0\) failed in schedule_lr_at"):
            group.run(ProbeWorker.ready)
        assert group.run(ProbeWorker.ready) == [True]
        ray_session.kill(group.workers[0])
        for _ in range(100):  # the kill is asynchronous: a call sent at once may still be served
            try:
                ray_session.get(group.workers[0].ready.remote(), timeout=10)
            except ray_session.exceptions.RayActorError:
                break
        with pytest.raises(WorkerError, match=r"actor rank 0 \(tp 0, pp 0, dp 0\) failed in ready"):
            group.run(ProbeWorker.ready)
    finally:
        group.shutdown(graceful=False)


@pytest.mark.parametrize("distributed", [False, True], ids=["adam", "distributed_adam"])
def test_a_saved_rank_resumes_to_the_same_next_step(ray_session, mm_dir, tmp_path, distributed):
    """Save after one step, load into a fresh rank: the next step gives bit-identical weights to the rank that
    went on without stopping (model, Adam moments, LR schedule and RNG all restored; with the distributed
    optimizer each DP rank's shard of the Adam state in its own file)."""
    spec = OptimizerSpec(**{**SPEC.__dict__, "warmup_steps": 0, "use_distributed_optimizer": distributed})
    first = _group(ray_session, mm_dir, spec)
    try:
        first.run(ProbeWorker.train_mini_batch, _batch(first, 0), LOSS, 8.0)
        rank_dir = _save_iteration_1(first, tmp_path / "ckpt")
        assert (rank_dir / "distrib_optim_dp000.pt").is_file() == distributed
        batch = _batch(first, 3)
        first.run(ProbeWorker.train_mini_batch, batch, LOSS, 8.0)
        expected = first.run(ProbeWorker.parameter_sums)[0]
    finally:
        first.shutdown()
    _assert_resumes_to(ray_session, mm_dir, spec, tmp_path / "ckpt", batch, expected)


@pytest.mark.parametrize("distributed, bf16", [(False, False), (True, True)], ids=["adam-fp32", "distributed-bf16"])
def test_offload_empties_the_device_and_onload_gives_the_same_next_step(ray_session, mm_dir, distributed, bf16):
    """The colocated switches on a trained rank: offload leaves no bytes in the parameter, gradient (DDP buffer)
    or optimizer (Adam moments, fp32 main weights) storages; after onload the next step is bit-identical to
    that of a rank that never offloaded."""
    from mm_rl.workers.offload import KINDS

    spec = OptimizerSpec(**{**SPEC.__dict__, "warmup_steps": 0, "use_distributed_optimizer": distributed, "bf16": bf16})
    plain, moved = _group(ray_session, mm_dir, spec, bf16), _group(ray_session, mm_dir, spec, bf16)
    try:
        for group in (plain, moved):
            group.run(ProbeWorker.train_mini_batch, _batch(group, 0), LOSS, 8.0)
        resident = moved.run(ProbeWorker.resident_bytes)[0]
        assert all(resident[kind] > 0 for kind in KINDS), resident
        assert moved.run(ProbeWorker.offload, True, True, True)[0] == resident
        assert moved.run(ProbeWorker.resident_bytes)[0] == dict.fromkeys(KINDS, 0)
        assert moved.run(ProbeWorker.offload, True, True, True)[0] == dict.fromkeys(KINDS, 0)  # already away
        assert moved.run(ProbeWorker.onload, True, True, True)[0] == resident
        assert moved.run(ProbeWorker.resident_bytes)[0] == resident
        assert moved.run(ProbeWorker.parameter_sums)[0] == plain.run(ProbeWorker.parameter_sums)[0]
        batch = _batch(plain, 3)
        for group in (plain, moved):
            group.run(ProbeWorker.train_mini_batch, batch, LOSS, 8.0)
        assert moved.run(ProbeWorker.parameter_sums)[0] == plain.run(ProbeWorker.parameter_sums)[0]
    finally:
        plain.shutdown()
        moved.shutdown()


def test_colocated_schedule_frees_actor_and_reference_during_the_rollout(ray_session, mm_dir, monkeypatch):
    """The colocated schedule around a rollout (transformers engine in its Ray actor): after the sync the actor's
    parameters, gradients and Adam state and the colocated reference's weights hold no bytes while the engine
    generates; before training they are back, and the engine generated from the actor's weights."""
    from mm_rl.config.schema import ActorConfig, GenerateConfig, SamplingConfig, ValSamplingConfig
    from mm_rl.rollout.base import RolloutRequest
    from mm_rl.rollout.engine_worker import rollout_worker_actor
    from mm_rl.trainer.schedule import RolloutSchedule
    from mm_rl.workers.group import WorkerGroup
    from mm_rl.workers.megatron_worker import WorkerSpec
    from mm_rl.workers.offload import KINDS

    path, model = mm_dir
    actor = _group(ray_session, mm_dir, SPEC)
    reference = WorkerGroup(WorkerSpec(model), cpus_per_worker=0.5, worker_cls=ProbeWorker)
    reference.build(str(path))
    generate = GenerateConfig(
        backend="hf",
        max_model_len=64,
        max_num_seqs=2,
        colocate=True,
        sync_bucket_mb=1,
        sampling_config=SamplingConfig(max_tokens=4, n=1),
        val_sampling_config=ValSamplingConfig(),
    )
    engine = rollout_worker_actor(num_cpus=0.5).remote(
        str(path.parent / "hf"), generate, min_pixels=56 * 56, max_pixels=224 * 224
    )
    try:
        actor.run(ProbeWorker.train_mini_batch, _batch(actor, 0), LOSS, 8.0)  # Adam state and gradients exist
        before = actor.run(ProbeWorker.resident_bytes)[0], reference.run(ProbeWorker.resident_bytes)[0]
        weights = actor.run(ProbeWorker.parameter_sums)[0]
        switches = ActorConfig(offload_train_param=True, offload_train_grad=True, offload_train_optimizer=True)
        schedule = RolloutSchedule(actor, [engine], generate, switches, reference=reference)
        done = record_schedule(schedule, monkeypatch)
        report = schedule.before_rollout()
        assert report.applied == report.tensors > 0
        assert actor.run(ProbeWorker.resident_bytes)[0] == dict.fromkeys(KINDS, 0)
        assert reference.run(ProbeWorker.resident_bytes)[0]["params"] == 0
        assert schedule.offloaded_bytes == sum(before[0].values()) + before[1]["params"]
        request = RolloutRequest(uid="0", prompt_ids=list(range(5, 15)))
        (out,) = ray_session.get(engine.generate.remote([request], SamplingConfig(max_tokens=4, temperature=0.0, n=1)))
        schedule.before_training()
        assert (actor.run(ProbeWorker.resident_bytes)[0], reference.run(ProbeWorker.resident_bytes)[0]) == before
        assert actor.run(ProbeWorker.parameter_sums)[0] == weights
        assert done == [
            "actor.offload(grads, optimizer)",
            "reference.offload(params)",
            "engine.wake_up(weights)",
            "sync",
            "actor.offload(params)",
            "engine.wake_up(kv_cache)",
            "engine.sleep",
            "actor.onload(params, grads, optimizer)",
            "reference.onload(params)",
        ]
        sample = out.samples[0]
        ids = torch.tensor([request.prompt_ids + sample.response_ids])
        actor_lp = actor.compute_log_probs([{"input_ids": ids[:, :-1], "labels": ids[:, 1:]}])[0]
        gap = (actor_lp[0, -len(sample.response_ids) :] - sample.logprobs).abs().max()
        assert sample.response_ids and gap < 1e-3  # the engine generated from the trained, synced weights
    finally:
        actor.shutdown()
        reference.shutdown()
        ray_session.kill(engine)


def test_context_parallel_ranks_train_like_one_and_resume_their_optimizer_shards(ray_session, mm_dir, tmp_path):
    """CP2 (Ulysses: each rank keeps half of every sequence) against CP1 on the same batches: equal log-probs,
    gradient norm and loss, and after an update the same weights (fp32 sums in another order: 5e-5 relative).
    With the distributed optimizer the Adam state is sharded over the two CP ranks: saved, loaded into fresh
    ranks, the next step is bit-identical to the ranks that went on."""
    spec = OptimizerSpec(**{**SPEC.__dict__, "warmup_steps": 0, "use_distributed_optimizer": True})
    single, split = _group(ray_session, mm_dir, spec, cpus=0.5), _group(ray_session, mm_dir, spec, cp=2, cpus=0.5)
    try:
        batch = _batch(single, 0)
        assert torch.allclose(_batch(split, 0)[0]["old_log_probs"], batch[0]["old_log_probs"], atol=1e-5)
        metrics = [
            next(r.metrics for r in group.run(ProbeWorker.train_mini_batch, batch, LOSS, 8.0) if r and r.metrics)
            for group in (single, split)
        ]
        assert metrics[1]["grad_norm"] == pytest.approx(metrics[0]["grad_norm"], rel=1e-5)  # gradients, unscaled
        assert metrics[1]["pg_loss"] == pytest.approx(metrics[0]["pg_loss"], rel=1e-5, abs=1e-7)
        # Adam divides by sqrt(v) + 1e-8, so elements whose gradient is near 1e-8 pass the gradients' 1e-6 noise
        # on amplified: measured up to 1.2e-5 relative on one machine (linear_proj of layer 2), 1e-5 elsewhere
        one, two = single.run(ProbeWorker.parameter_sums)[0], split.run(ProbeWorker.parameter_sums)[0]
        assert one.keys() == two.keys() and all(abs(one[k] - two[k]) <= 5e-5 * (1 + abs(one[k])) for k in one)
        rank_dir = _save_iteration_1(split, tmp_path / "ckpt")
        assert sorted(p.name for p in rank_dir.glob("distrib_*")) == [f"distrib_optim_dp00{i}.pt" for i in (0, 1)]
        batch = _batch(split, 3)
        split.run(ProbeWorker.train_mini_batch, batch, LOSS, 8.0)
        expected = split.run(ProbeWorker.parameter_sums)[0]
    finally:
        single.shutdown()
        split.shutdown()
    _assert_resumes_to(ray_session, mm_dir, spec, tmp_path / "ckpt", batch, expected, cp=2)


KL_LOSS = LossSpec(RLConfig(kl_loss_coef=0.1, use_kl_loss=True), max_response_len=4)


def _dp1_and_dp2(ray_session, mm_dir):
    """Two actors from the same weights, without warm-up: one replica, and two."""
    spec = OptimizerSpec(**{**SPEC.__dict__, "warmup_steps": 0})
    return _group(ray_session, mm_dir, spec, cpus=0.5), _group(ray_session, mm_dir, spec, cpus=0.5, dp=2)


def _kl_batch(group) -> dict[str, torch.Tensor]:
    """``_batch``'s micro-batch with reference log-probs 0.1 below the old ones (a KL term that is not zero)."""
    (batch,) = _batch(group, 0)
    batch["ref_log_probs"] = batch["old_log_probs"] - 0.1 * batch["response_mask"]
    return batch


def _per_row(batch: dict[str, torch.Tensor]) -> list[list[dict[str, torch.Tensor]]]:
    """One shard per DP replica, each the micro-batch of one of the two rows."""
    return [[{key: value[i : i + 1] for key, value in batch.items()}] for i in range(2)]


def test_metrics_of_two_data_parallel_replicas_are_those_of_the_whole_mini_batch(ray_session, mm_dir):
    """DP2 (each replica one row) against DP1 (both rows) on the same mini-batch: loss, pg loss, KL loss, entropy
    and clip fractions are the mini-batch's on the returned rank, not one replica's share; grad norms agree."""
    single, split = _dp1_and_dp2(ray_session, mm_dir)
    try:
        batch = _kl_batch(single)
        rows = _per_row(batch)
        whole, _ = single.train_mini_batch([[batch]], KL_LOSS, 8.0)
        shared, _ = split.train_mini_batch(rows, KL_LOSS, 8.0)
        assert whole.keys() == shared.keys() and whole["kl_loss"] > 0
        for key in whole:
            assert shared[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key
    finally:
        single.shutdown()
        split.shutdown()


def test_an_on_policy_update_takes_its_own_forward_as_the_old_log_probs(ray_session, mm_dir):
    """A mini-batch sent without old log-probs (exactly on-policy) trains like one with the log-prob pass's: the
    update's own forward, detached, comes back per DP replica equal to the pass's to 1e-6; ratio 1, no clipping;
    the same loss, grad norm and weights after the step."""
    passed, own = _dp1_and_dp2(ray_session, mm_dir)
    try:
        batch = _kl_batch(passed)
        rows = _per_row({key: value for key, value in batch.items() if key != "old_log_probs"})
        expected, none = passed.train_mini_batch([[batch]], KL_LOSS, 8.0)
        metrics, returned = own.train_mini_batch(rows, KL_LOSS, 8.0)
        assert none == [None]  # old log-probs were sent: nothing to hand back
        mask = batch["response_mask"] == 1
        update_forward = torch.cat([replica[0] for replica in returned])
        assert (update_forward[mask] - batch["old_log_probs"][mask]).abs().max() <= 1e-6
        assert metrics["pg_clipfrac"] == 0.0 and metrics["ppo_kl"] == 0.0
        for key in ("loss", "pg_loss", "kl_loss", "grad_norm"):
            assert metrics[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
        one, two = passed.run(ProbeWorker.parameter_sums)[0], own.run(ProbeWorker.parameter_sums)[0]
        assert all(abs(one[k] - two[k]) <= 1e-5 * (1 + abs(one[k])) for k in one)
    finally:
        passed.shutdown()
        own.shutdown()


def test_two_token_budgets_give_the_same_update(ray_session, mm_dir):
    """One mini-batch of uneven samples cut by two token budgets (3 and 6 micro-batches) trains to the same loss
    terms and grad norm (1e-6 relative) and weights: every micro-batch's loss carries the whole mini-batch's
    denominator, so how it is cut does not matter."""
    from mm_rl.trainer.batch import Sample, by_tokens, micro_batches, step_images

    g = torch.Generator().manual_seed(3)
    samples = [
        Sample(
            i,
            i // 2,
            torch.randint(0, 1000, (int(n),), generator=g).tolist(),
            torch.randint(0, 1000, (int(r),), generator=g).tolist(),
            "stop",
        )
        for i, (n, r) in enumerate(zip([6, 6, 14, 14, 9, 9], [2, 11, 5, 1, 8, 3], strict=True))
    ]
    for k, sample in enumerate(samples):
        sample.advantages = torch.full((sample.response_len,), 1.0 if k % 2 else -0.5)
        sample.ref_log_probs = torch.full((sample.response_len,), -7.0)
    text_only = SimpleNamespace(
        pixel_values=torch.zeros(0, 1), image_grid_thw=torch.zeros(0, 3, dtype=torch.long), mrope_time_steps=None
    )
    items = {s.index: text_only for s in samples}
    loss = LossSpec(RLConfig(kl_loss_coef=0.1, use_kl_loss=True), max_response_len=11)
    spec = OptimizerSpec(**{**SPEC.__dict__, "warmup_steps": 0})
    cuts = [by_tokens(samples, budget) for budget in (40, 20)]
    assert [len(runs) for runs in cuts] == [3, 6]
    results = []
    for runs in cuts:
        group = _group(ray_session, mm_dir, spec, cpus=0.5)
        try:
            group.run(ProbeWorker.set_images, step_images(samples, items))
            batches = micro_batches(runs, items, 0, ("advantages", "ref_log_probs"))
            metrics, _ = group.train_mini_batch([batches], loss, float(sum(s.response_len for s in samples)))
            results.append((metrics, group.run(ProbeWorker.parameter_sums)[0]))
        finally:
            group.shutdown()
    (two, weights_two), (five, weights_five) = results
    for key in ("loss", "pg_loss", "kl_loss", "grad_norm"):
        assert five[key] == pytest.approx(two[key], rel=1e-6), key
    # weights after Adam (g / sqrt(v) magnifies fp32 reordering on near-zero gradients): 1e-5, as for CP and DP
    assert all(abs(weights_two[k] - weights_five[k]) <= 1e-5 * (1 + abs(weights_two[k])) for k in weights_two)
