"""Weight sync from Megatron worker actors (TP x PP) into a running vLLM engine actor, on the tiny Qwen2.5-VL.

Per layout (TP1 with an untied output layer; TP2 x PP2, ViT + LLM layer 0 on stage 0, with tied embeddings so the
last stage holds the output-layer copy that must not be sent; DP2, whose second replica sends nothing): the HF
checkpoint goes through hf2mg at the actor's layout, the worker actors load it, and a vLLM engine (fp32, in its
own actor) starts from the same HF directory. Checked on prompts with an image:

- the sync sends exactly the checkpoint's tensors (no ``lm_head`` when tied), in buckets bounded by the bucket
  size, and the engine applies all of them; syncing unchanged weights leaves greedy generation bit-identical;
- after the sync, the engine's log-probs of its own responses equal the actor's for the same tokens (<= 1e-2),
  with the original weights and after the actor's weights were perturbed (then greedy generation changes);
- syncing the original weights back restores the engine's greedy generation exactly;
- a later sync sends only what trains (the frozen ViT stays in the engine as the first sync left it);
- colocated mode calls wake_up(weights) -> sync -> offload -> wake_up(kv_cache) -> rollout -> sleep -> onload in
  that order (call logs), and the actor's offload really empties its parameter storages after a sync.

Plus single-process checks of the transport's byte buffers and the vocab-padding cut.
"""

from mm_rl.platform import cpu_wheels

cpu_wheels.install()  # vLLM's Qwen2.5-VL and the processors import torchvision

import pickle  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from probes import ProbeRollout, ProbeWorker, record_schedule  # noqa: E402

from mm_rl.config.schema import ActorConfig, GenerateConfig, SamplingConfig, ValSamplingConfig  # noqa: E402
from mm_rl.platform.transfer import pack_bucket, unpack_bucket  # noqa: E402
from mm_rl.rollout.base import RolloutRequest  # noqa: E402
from mm_rl.sync.buckets import weight_group  # noqa: E402
from mm_rl.sync.sender import strip_vocab_padding  # noqa: E402
from mm_rl.sync.transport import SharedBucket  # noqa: E402

pytestmark = pytest.mark.stack  # Ray, vLLM engines or Megatron ranks: in `make test`, not `make test-quick`

MIN_PIXELS, MAX_PIXELS = 56 * 56, 224 * 224
BUCKET_BYTES = 1 << 20  # the tiny model is ~4.4 MB: several buckets per stage
LOGPROB_TOL = 1e-2
NOISE = 1.0
FINAL_NORM_SCALE = 20.0
LAYOUTS = {  # name: (tp, pp, dp, tied, model.json pipeline overrides)
    "tp1": (1, 1, 1, False, {}),
    "tp2_pp2": (
        2,
        2,
        1,
        True,
        {
            "text_decoder": {"pipeline_num_layers": [1, 3]},
            "image_encoder": {"vision_encoder": {"pipeline_num_layers": [2, 0]}},
        },
    ),
    "dp2": (1, 1, 2, False, {}),  # the second replica holds the same weights: it sends nothing
}
GAPS: dict[str, dict[str, float]] = {}


# --------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
    for name, gaps in GAPS.items():
        print(f"\n{name}: " + ", ".join(f"{key} {value:.2e}" for key, value in gaps.items()))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from mm_rl.demo import tiny

    root = tmp_path_factory.mktemp("tiny")
    return {
        tied: peaky(tiny.build_tiny_checkpoint(root / ("tied" if tied else "untied"), seed=0, tie_word_embeddings=tied))
        for tied in (False, True)
    }


def peaky(hf_dir: Path) -> Path:
    """The tiny model's final norm scaled up: its random weights give near-uniform next-token distributions
    (every log-prob ~ -log(vocab)), under which any weights would "match"; scaled, log-probs span a wide range."""
    from safetensors.torch import load_file, save_file

    path = hf_dir / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * FINAL_NORM_SCALE
    save_file(tensors, str(path), metadata={"format": "pt"})
    return hf_dir


@pytest.fixture(scope="module")
def prompts(tmp_path_factory, checkpoints):
    from mm_rl.data.dataset import PromptDataset, PromptProcessor
    from mm_rl.demo.synthetic import write_synthetic_geo3k

    data = write_synthetic_geo3k(tmp_path_factory.mktemp("data") / "geo3k", seed=0, train_size=4, test_size=4)
    dataset = PromptDataset(
        data, "test", PromptProcessor(checkpoints[False], MIN_PIXELS, MAX_PIXELS), max_prompt_length=400
    )
    return [dataset[i] for i in range(2)]  # PromptItems: the actor's ids and processed pixels


def requests_of(items: list[Any]) -> list[RolloutRequest]:
    return [RolloutRequest.from_item(item) for item in items]  # ids and images (vLLM makes its own pixels)


def generate_config(colocate: bool = False) -> GenerateConfig:
    return GenerateConfig(
        max_model_len=512,
        max_num_seqs=4,
        colocate=colocate,
        sync_bucket_mb=1,
        sampling_config=SamplingConfig(max_tokens=12, temperature=1.0, n=2),
        val_sampling_config=ValSamplingConfig(max_tokens=12),
    )


@dataclass
class Layout:
    name: str
    hf_dir: Path
    group: Any
    engine: Any
    model: Any
    route: Any = None  # the device route, joined by the first collective sync


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout(request, ray_session, checkpoints, tmp_path_factory):
    """Engine actor and worker group of one layout (the engine starts while the workers come up)."""
    import ray

    from mm_rl.config.schema import Hf2MgCfg, HfConfig, ParallelConfig
    from mm_rl.convert.hf2mg import hf2mg
    from mm_rl.convert.model_config import model_config_from_hf
    from mm_rl.workers.group import WorkerGroup
    from mm_rl.workers.megatron_worker import WorkerSpec

    started = time.perf_counter()
    tp, pp, dp, tied, overrides = LAYOUTS[request.param]
    hf_dir = checkpoints[tied]
    engine = ray.remote(num_cpus=1)(ProbeRollout).remote(
        str(hf_dir), generate_config(), min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, backend="vllm", dtype="float32"
    )
    model = model_config_from_hf(hf_dir, overrides)
    parallel = ParallelConfig(
        tp_size=tp,
        llm_pp_layers=list(model.text_decoder.pipeline_num_layers),
        vit_pp_layers=list(model.image_encoder.vision_encoder.pipeline_num_layers),
    )
    mm_dir = tmp_path_factory.mktemp(f"mm_{request.param}")
    hf2mg(Hf2MgCfg(mm_dir=str(mm_dir), hf_config=HfConfig(hf_dir=str(hf_dir)), parallel_config=parallel), model)
    group = WorkerGroup(WorkerSpec(model, tp=tp, pp=pp, dp=dp), cpus_per_worker=0.5, worker_cls=ProbeWorker)
    group.build(str(mm_dir))
    ray_session.get(engine.ready.remote())
    print(f"\n{request.param}: set-up {time.perf_counter() - started:.1f}s")
    yield Layout(request.param, hf_dir, group, engine, model)
    group.shutdown()
    ray_session.get(engine.close.remote())
    ray_session.kill(engine)


# ----------------------------------------------------------------------------------------------------- helpers
def greedy(layout: Layout, prompts: list[Any]) -> list[tuple[list[int], torch.Tensor]]:
    import ray

    greedy_spec = SamplingConfig(max_tokens=12, temperature=0.0, n=1)
    out = ray.get(layout.engine.generate.remote(requests_of(prompts), greedy_spec))
    return [(o.samples[0].response_ids, o.samples[0].logprobs) for o in out]


def sampled(layout: Layout, prompts: list[Any]) -> list[tuple[list[int], torch.Tensor]]:
    import ray

    spec = SamplingConfig(max_tokens=12, temperature=1.0, n=2)
    out = ray.get(layout.engine.generate.remote(requests_of(prompts), spec))
    return [(s.response_ids, s.logprobs) for o in out for s in o.samples]


def same(a: list[tuple[list[int], torch.Tensor]], b: list[tuple[list[int], torch.Tensor]]) -> bool:
    return all(ia == ib and torch.equal(la, lb) for (ia, la), (ib, lb) in zip(a, b, strict=True))


def actor_gap(layout: Layout, prompts: list[Any], responses: list[tuple[list[int], torch.Tensor]]) -> float:
    """max |engine log-prob - actor log-prob| over the response tokens (one micro-batch per response).

    ``responses`` pair with ``prompts`` in order, ``len(responses) // len(prompts)`` per prompt."""
    per_prompt = len(responses) // len(prompts)
    batches, spans = [], []
    for index, (ids, _) in enumerate(responses):
        prompt = prompts[index // per_prompt]
        length = len(prompt.input_ids)
        full = torch.cat([prompt.input_ids, torch.tensor(ids, dtype=torch.long)])[None]
        batches.append(
            {
                "input_ids": full,
                "attention_mask": torch.ones_like(full),
                "labels": torch.roll(full, -1, dims=1),
                "pixel_values": prompt.pixel_values,
                "image_grid_thw": prompt.image_grid_thw,
            }
        )
        spans.append(slice(length - 1, length - 1 + len(ids)))
    actor = layout.group.compute_log_probs(batches)
    return max(
        (lp[0, span] - engine_lp).abs().max().item()
        for lp, span, (_, engine_lp) in zip(actor, spans, responses, strict=True)
    )


def sync(layout: Layout, transport: str = "object_store") -> Any:
    from mm_rl.sync.driver import join_device_sync, sync_weights

    if transport == "collective" and layout.route is None:
        layout.route = join_device_sync(layout.group, [layout.engine])
    return sync_weights(
        layout.group, [layout.engine], BUCKET_BYTES, route=layout.route if transport == "collective" else None
    )


# ------------------------------------------------------------------------------------------------------- tests
def test_sync_sends_the_checkpoint_in_bounded_buckets(layout):
    from safetensors import safe_open

    with safe_open(str(layout.hf_dir / "model.safetensors"), "pt") as handle:
        sizes = {name: handle.get_slice(name).get_shape() for name in handle.keys()}  # noqa: SIM118
    # each rank: its 0.5 CPU -> 1 thread
    assert layout.group.run(ProbeWorker.threads) == [1] * len(layout.group.workers)
    report = sync(layout)
    assert sorted(report.names) == sorted(sizes)  # every checkpoint tensor once; tied: no lm_head
    assert ("lm_head.weight" in report.names) == (not LAYOUTS[layout.name][3])
    assert report.applied == report.tensors == len(sizes)
    group_bytes: dict[str, int] = {}
    for name, shape in sizes.items():
        group_bytes[weight_group(name)] = group_bytes.get(weight_group(name), 0) + 4 * int(torch.tensor(shape).prod())
    assert len(report.stages) == LAYOUTS[layout.name][1]  # one sender per stage (of DP replica 0)
    for stage in report.stages:
        assert stage.buckets >= 2 and stage.max_bucket_bytes <= BUCKET_BYTES + max(group_bytes.values())
    assert report.bytes == sum(group_bytes.values())


@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_engine_log_probs_equal_the_actors_and_restoring_restores_generation(layout, prompts, transport):
    baseline = greedy(layout, prompts)  # the engine's own start-up weights
    report = sync(layout, transport)
    assert report.applied == report.tensors > 0
    synced = greedy(layout, prompts)
    assert same(synced, baseline)  # unchanged weights arrive bit-exact
    gaps = {"original greedy": actor_gap(layout, prompts, synced)}

    layout.group.run(ProbeWorker.perturb_weights, NOISE, 1)
    try:
        sync(layout, transport)
        perturbed = greedy(layout, prompts)
        assert [ids for ids, _ in perturbed] != [ids for ids, _ in baseline]
        gaps["perturbed greedy"] = actor_gap(layout, prompts, perturbed)
        responses = sampled(layout, prompts)
        gaps["perturbed sampled"] = actor_gap(layout, prompts, responses)
    finally:
        layout.group.run(ProbeWorker.restore_weights)
    # the comparison discriminates: the original actor is far from the perturbed engine on the same tokens
    gaps["original actor vs perturbed engine"] = actor_gap(layout, prompts, responses)
    sync(layout, transport)
    assert same(greedy(layout, prompts), baseline)
    GAPS[f"{layout.name} {transport}"] = dict(gaps)
    assert gaps.pop("original actor vs perturbed engine") > 20 * LOGPROB_TOL
    assert max(gaps.values()) <= LOGPROB_TOL, gaps


def test_a_later_sync_sends_only_what_trains_and_the_engine_keeps_the_rest(layout, prompts):
    """Once an engine holds a sync's weights, a ``trained_only`` sync sends the modules with a trained parameter
    (the LLM and the merger) and leaves the frozen ViT in the engine as it is (vLLM's layerwise reload puts back
    the layers that receive nothing). With the trained tensors perturbed, the engine's log-probs of its own
    responses to prompts with an image (the ViT's output reaches every token) equal the actor's; with the actor's
    ViT perturbed too, the engine keeps its own ViT, and the same comparison sees that."""
    from mm_rl.sync.driver import sync_weights

    full = sync(layout)
    frozen = {name for name in full.names if "visual." in name and "merger" not in name}
    assert frozen and any("merger" in name for name in full.names)
    layout.group.run(ProbeWorker.perturb_weights, NOISE, 2, True)
    try:
        report = sync_weights(layout.group, [layout.engine], BUCKET_BYTES, trained_only=True)
        assert sorted(report.names) == sorted(set(full.names) - frozen)
        assert report.applied == report.tensors
        gaps = {"trained perturbed": actor_gap(layout, prompts, sampled(layout, prompts))}
        layout.group.run(ProbeWorker.perturb_weights, NOISE, 3)  # the ViT too, in the actor only
        sync_weights(layout.group, [layout.engine], BUCKET_BYTES, trained_only=True)
        gaps["actor's ViT perturbed, engine's not"] = actor_gap(layout, prompts, sampled(layout, prompts))
    finally:
        layout.group.run(ProbeWorker.restore_weights)
        sync(layout)
    GAPS[f"{layout.name} trained only"] = gaps
    assert gaps["trained perturbed"] <= LOGPROB_TOL < 20 * LOGPROB_TOL < gaps["actor's ViT perturbed, engine's not"]


def test_colocated_schedule_calls_switches_in_order(layout, prompts, monkeypatch):
    import ray

    from mm_rl.trainer.schedule import RolloutSchedule

    actor = ActorConfig(offload_train_param=True, offload_train_grad=True, offload_train_optimizer=False)
    engine_log = len(ray.get(layout.engine.calls.remote()))
    worker_logs = [len(events) for events in layout.group.run(ProbeWorker.events)]
    schedule = RolloutSchedule(layout.group, [layout.engine], generate_config(colocate=True), actor)
    done = record_schedule(schedule, monkeypatch)
    resident = layout.group.run(ProbeWorker.resident_bytes)
    schedule.before_rollout()
    assert [r["params"] for r in layout.group.run(ProbeWorker.resident_bytes)] == [0] * len(layout.group.coords)
    assert schedule.offloaded_bytes == sum(r["params"] + r["grads"] for r in resident) > 1e6
    ray.get(layout.engine.generate.remote(requests_of(prompts[:1]), SamplingConfig(max_tokens=2, n=1)))
    schedule.before_training()
    assert all(r["params"] > 0 for r in layout.group.run(ProbeWorker.resident_bytes))
    text = prompts[0].input_ids[:9]  # the leading text tokens (no image)
    layout.group.compute_log_probs([{"input_ids": text[None, :8], "labels": text[None, 1:]}])
    try:
        calls = ray.get(layout.engine.calls.remote())[engine_log:]
        updates = calls.count("update_weights")
        assert updates >= 2 and calls == ["wake_up", "begin_weight_update"] + ["update_weights"] * updates + [
            "end_weight_update",
            "wake_up",
            "generate",
            "sleep",
        ]
        switches = {"params": True, "grads": True, "optimizer": False}
        before_sync = {"params": False, "grads": True, "optimizer": False}
        after_sync = {"params": True, "grads": False, "optimizer": False}
        logs = layout.group.run(ProbeWorker.events)
        for events, start, coords in zip(logs, worker_logs, layout.group.coords, strict=True):
            pushed = events[start + 1][1]
            assert events[start:] == [
                ("offload", before_sync),
                ("push_weights", pushed),
                ("offload", after_sync),
                ("onload", switches),
            ]
            assert (pushed > 0) == coords.is_sender()
        assert done == [
            "actor.offload(grads)",
            "engine.wake_up(weights)",
            "sync",
            "actor.offload(params)",
            "engine.wake_up(kv_cache)",
            "engine.sleep",
            "actor.onload(params, grads)",
        ]
    finally:
        ray.get(layout.engine.wake_up.remote())

    plain = RolloutSchedule(layout.group, [layout.engine], generate_config(colocate=False), actor)
    done = record_schedule(plain, monkeypatch)
    plain.before_rollout()
    plain.before_training()
    assert done == ["sync"]
    # a separate engine keeps the weights: validation's sync serves the next rollout unless an update came between
    assert plain.before_rollout().tensors == 0 and done == ["sync"]
    plain.weights_changed()
    plain.before_rollout()
    assert done == ["sync", "sync"]
    # colocated, the level-2 sleep drops the engine's weights: every rollout syncs
    schedule.before_rollout()
    schedule.before_training()
    assert schedule.before_rollout().tensors > 0
    schedule.before_training()
    ray.get(layout.engine.wake_up.remote())


@pytest.mark.parametrize("transport", ["object_store", "collective", "mixed"])
def test_every_engine_replica_receives_the_weights(layout, prompts, transport):
    """Two engine replicas: one sync (one object-store copy per bucket, or one broadcast to both, or "mixed": the
    route of a colocated replica on the sender's device beside one on another device, which on CPU, where no
    device memory can be shared, falls back to the object store for the first while the second takes the
    broadcast) leaves each with the actor's perturbed weights (log-probs of its own sampled responses <= 1e-3 from
    the actor's), and the sync back restores both."""
    import dataclasses

    import ray

    from mm_rl.rollout.engine_worker import rollout_worker_actor
    from mm_rl.sync.driver import join_device_sync, join_route, plan_route, sync_weights

    if layout.name != "tp1":
        pytest.skip("replicas differ only on the engine side: one actor layout shows it")
    other = rollout_worker_actor(num_cpus=1).remote(
        str(layout.hf_dir),
        generate_config(),
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        backend="vllm",
        dtype="float32",
    )
    replicas = [layout, dataclasses.replace(layout, engine=other)]
    engines = [r.engine for r in replicas]
    try:
        ray.get(other.ready.remote())
        key = {
            "object_store": None,
            "collective": lambda: join_device_sync(layout.group, engines),
            "mixed": lambda: join_route(
                layout.group, engines, plan_route("mixed", {0: "device-0"}, [["device-0"], ["device-1"]])
            ),
        }[transport]
        key = key() if key else None
        if transport == "mixed":
            assert key.stages[0].ranks == ((None,), (1,)) and key.stages[0].world == 2
        baseline = greedy(layout, prompts)
        layout.group.run(ProbeWorker.perturb_weights, NOISE, 2)
        try:
            report = sync_weights(layout.group, engines, BUCKET_BYTES, route=key)
            assert report.applied == report.tensors > 0  # every replica applied every tensor
            outputs = [greedy(r, prompts) for r in replicas]
            assert same(outputs[0], outputs[1]) and not same(outputs[0], baseline)
            gaps = [actor_gap(r, prompts, sampled(r, prompts)) for r in replicas]
        finally:
            layout.group.run(ProbeWorker.restore_weights)
        sync_weights(layout.group, engines, BUCKET_BYTES, route=key)
        assert all(same(greedy(r, prompts), baseline) for r in replicas)
        GAPS[f"{layout.name} {transport} replicas"] = {f"replica {i}": gap for i, gap in enumerate(gaps)}
        assert max(gaps) <= 1e-3, gaps
    finally:
        ray.get(other.close.remote())
        ray.kill(other)


@pytest.mark.slow
def test_a_tp2_engine_receives_on_every_worker_over_the_collective(layout, prompts):
    """A TP2 engine (two vLLM worker processes) joins each stage's sync group with both workers (world 1 + 2): the
    broadcast lands in each worker itself, not in the engine's host process and then a file. After a sync of
    perturbed weights its log-probs equal the actor's (<= 1e-3); the sync back restores its greedy generation."""
    import dataclasses

    import ray

    from mm_rl.rollout.engine_worker import rollout_worker_actor
    from mm_rl.sync.driver import join_device_sync, sync_weights

    if layout.name != "tp2_pp2":
        pytest.skip("one actor layout with two stages (two sync groups) shows it")
    config = dataclasses.replace(generate_config(), infer_tensor_parallel_size=2)
    engine = rollout_worker_actor(num_cpus=1).remote(
        str(layout.hf_dir), config, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, backend="vllm", dtype="float32"
    )
    tp2 = dataclasses.replace(layout, engine=engine)
    try:
        assert ray.get(engine.device_identities.remote()) == [None, None]  # two loading processes (CPU)
        key = join_device_sync(layout.group, [engine])
        assert [stage.ranks for stage in key.stages.values()] == [((1, 2),)] * 2
        baseline = greedy(tp2, prompts)
        layout.group.run(ProbeWorker.perturb_weights, NOISE, 3)
        try:
            report = sync_weights(layout.group, [engine], BUCKET_BYTES, route=key)
            assert report.applied == report.tensors > 0 and len(report.stages) == 2
            perturbed = greedy(tp2, prompts)
            assert not same(perturbed, baseline)
            gap = actor_gap(tp2, prompts, sampled(tp2, prompts))
        finally:
            layout.group.run(ProbeWorker.restore_weights)
        sync_weights(layout.group, [engine], BUCKET_BYTES, route=key)
        assert same(greedy(tp2, prompts), baseline)
        GAPS[f"{layout.name} collective tp2 engine"] = {"perturbed sampled": gap}
        assert gap <= 1e-3, gap
    finally:
        ray.get(engine.close.remote())
        ray.kill(engine)


def test_colocated_schedule_offloads_only_the_ranks_beside_an_engine(layout):
    """An engine replica beside rank 0 only: rank 0 frees its parameters for the rollout, rank 1 keeps them."""
    import ray

    from mm_rl.trainer.schedule import RolloutSchedule

    if layout.name != "dp2":
        pytest.skip("needs two ranks on two bundles")
    actor = ActorConfig(offload_train_param=True)
    schedule = RolloutSchedule(
        layout.group, [layout.engine], generate_config(colocate=True), actor, shared_bundles={layout.group.bundles[0]}
    )
    try:
        schedule.before_rollout()
        params = [r["params"] for r in layout.group.run(ProbeWorker.resident_bytes)]
        assert params[0] == 0 and params[1] > 1e6
        schedule.before_training()
        assert all(r["params"] > 0 for r in layout.group.run(ProbeWorker.resident_bytes))
    finally:
        ray.get(layout.engine.wake_up.remote())


# ----------------------------------------------------------------------------------------- single process
def test_shared_bucket_travels_as_raw_buffers_and_unpickles_as_tensors():
    tensors = [
        ("a", torch.randn(3, 4)),
        ("b", torch.randn(4, 6).to(torch.bfloat16)[:, ::2]),
        ("c", torch.tensor(3.0)),
        ("d", torch.arange(6, dtype=torch.int64).view(2, 3)),
    ]
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(SharedBucket(tensors), protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == len(tensors) and len(payload) < 1000  # the bytes went out of band
    out = pickle.loads(payload, buffers=buffers)
    assert [name for name, _ in out] == [name for name, _ in tensors]
    for (_, got), (_, want) in zip(out, tensors, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert out[0][1].data_ptr() == tensors[0][1].data_ptr()  # neither side copied a contiguous tensor
    assert all(t.untyped_storage().resizable() for _, t in tensors)  # an offload can still free the sources


def test_a_packed_bucket_unpacks_to_the_same_tensors_at_aligned_offsets():
    tensors = [
        ("a", torch.randn(3, 5)),
        ("b", torch.randn(4, 6).to(torch.bfloat16)[:, ::2]),
        ("c", torch.tensor(3.0)),
        ("d", torch.arange(7, dtype=torch.int64)),
        ("e", torch.randn(0, 4)),
    ]
    layout, flat = pack_bucket(tensors, torch.device("cpu"))
    assert all(start % 64 == 0 for *_, start in layout) and flat.numel() >= sum(t.nbytes for _, t in tensors)
    out = unpack_bucket(layout, flat)
    assert [name for name, _ in out] == [name for name, _ in tensors]
    for (_, got), (_, want) in zip(out, tensors, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_vocab_padding_is_cut_before_the_merge():
    from mm_rl.convert.mapping import Bound, entry_for
    from mm_rl.convert.model_config import model_config_from_hf

    model = model_config_from_hf(
        {
            "model_type": "qwen2_5_vl",
            "vision_config": {"depth": 1, "hidden_size": 8, "intermediate_size": 8, "num_heads": 2},
            "hidden_size": 4,
            "num_hidden_layers": 1,
            "intermediate_size": 8,
            "num_attention_heads": 2,
            "vocab_size": 10,
        }
    )
    name = "text_decoder.embedding.word_embeddings.weight"
    bound = Bound(entry_for(model, name), name, ("model.embed_tokens.weight",))
    full = torch.arange(10 * 4, dtype=torch.float32).view(10, 4)
    padded = torch.cat([full, torch.full((2, 4), -1.0)])  # vocab 10 padded to 12 for TP2: 6 rows per rank
    shards = strip_vocab_padding(bound, list(padded.chunk(2)), model)
    assert [s.shape[0] for s in shards] == [5, 5] and torch.equal(torch.cat(shards), full)
    unpadded = list(full.chunk(2))
    assert strip_vocab_padding(bound, unpadded, model) is unpadded  # nothing to cut: the shards as they are


def test_a_process_on_the_senders_device_maps_its_buffer_and_the_others_join_its_group():
    """The device route. Colocated, one replica per device, PP2: each stage's sender's own replica maps its buffer,
    the rest take the broadcast with a rank each. Colocated TP2 replicas: the worker on the sender's device maps,
    its TP peer on the next device joins the group. Separate TP2 engines: two ranks each. CPU (no identity):
    everything over the group. Two processes on one device in one group are refused (nccl / hccl would hang)."""
    from mm_rl.sync.driver import plan_route

    colocated = plan_route("k", {0: "gpu-a", 1: "gpu-c"}, [["gpu-a"], ["gpu-b"], ["gpu-c"], ["gpu-d"]])
    assert colocated.stages[0].ranks == ((None,), (1,), (2,), (3,))
    assert colocated.stages[1].ranks == ((1,), (2,), (None,), (3,)) and colocated.stages[1].world == 4
    assert colocated.stages[1].maps(2) and not colocated.stages[1].joins(2) and colocated.stages[1].joins(0)

    tp2 = plan_route("k", {0: "gpu-a", 1: "gpu-b"}, [["gpu-a", "gpu-b"], ["gpu-c", "gpu-d"]])
    assert tp2.stages[0].ranks == ((None, 1), (2, 3)) and tp2.stages[1].ranks == ((1, None), (2, 3))
    assert tp2.stages[0].maps(0) and tp2.stages[0].joins(0) and tp2.stages[0].world == 4

    separate = plan_route("k", {0: "gpu-a"}, [["gpu-e", "gpu-f"], ["gpu-g", "gpu-h"]]).stages[0]
    assert separate.ranks == ((1, 2), (3, 4)) and separate.world == 5 and not separate.maps(0)

    cpu = plan_route("k", {0: None}, [[None], [None, None]]).stages[0]
    assert cpu.ranks == ((1,), (2, 3)) and cpu.world == 4

    with pytest.raises(ValueError, match="two engine processes on device gpu-b"):
        plan_route("k", {0: "gpu-a"}, [["gpu-b"], ["gpu-b"]])


def test_ipc_is_offered_only_where_a_device_shares_memory():
    """CUDA tensors are mapped in place by a same-device reader; CPU and other devices take the object store."""
    from mm_rl.platform.device import ipc_supported

    assert ipc_supported(torch.device("cuda", 0))
    assert not ipc_supported(torch.device("cpu")) and not ipc_supported(torch.device("meta"))


def test_pipeline_stages_reach_every_replica_in_one_order(ray_session, checkpoints, tmp_path):
    """Two engine replicas and PP2 over gloo (the device route, as NCCL / HCCL take it): a replica's actor takes one
    call at a time, so were the stages' senders to post their buckets' receives together, replica 0 could take
    stage 0's while replica 1 took stage 1's, each waiting in a broadcast that needs the other. Every replica
    receives stage 0's buckets, then stage 1's, and the sync ends (within a timeout, not hung)."""
    import concurrent.futures

    import ray

    from mm_rl.config.schema import Hf2MgCfg, HfConfig, ParallelConfig
    from mm_rl.convert.hf2mg import hf2mg
    from mm_rl.convert.model_config import model_config_from_hf
    from mm_rl.sync.driver import join_device_sync, sync_weights
    from mm_rl.workers.group import WorkerGroup
    from mm_rl.workers.megatron_worker import WorkerSpec

    hf_dir = checkpoints[True]
    overrides = LAYOUTS["tp2_pp2"][4]
    model = model_config_from_hf(hf_dir, overrides)
    parallel = ParallelConfig(tp_size=1, llm_pp_layers=[1, 3], vit_pp_layers=[2, 0])
    hf2mg(Hf2MgCfg(mm_dir=str(tmp_path / "mm"), hf_config=HfConfig(hf_dir=str(hf_dir)), parallel_config=parallel),
          model)  # fmt: skip
    # tiny CPU shares: the module's last layout (its engine and ranks) still holds most of the session's CPUs
    replica = ray.remote(num_cpus=0.01)(ProbeRollout)
    engines = [replica.remote(str(hf_dir), generate_config(), min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                              backend="hf", dtype="float32") for _ in range(2)]  # fmt: skip
    group = WorkerGroup(WorkerSpec(model, pp=2), cpus_per_worker=0.01, worker_cls=ProbeWorker)
    try:
        group.build(str(tmp_path / "mm"))
        ray.get([engine.ready.remote() for engine in engines])
        route = join_device_sync(group, engines)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a hung sync fails the test instead of the suite
            done = pool.submit(sync_weights, group, engines, 16 << 10, route=route).result(timeout=300)
        assert done.applied == done.tensors > 0
        for engine in engines:
            stages = [call for call in ray.get(engine.calls.remote()) if call.startswith("receive_weights")]
            first_stage_1 = stages.index("receive_weights(stage 1)")
            assert set(stages[:first_stage_1]) == {"receive_weights(stage 0)"} and first_stage_1 > 1
            assert set(stages[first_stage_1:]) == {"receive_weights(stage 1)"}
    finally:
        group.shutdown()
        for engine in engines:
            ray.kill(engine)
