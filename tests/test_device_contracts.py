"""The accelerator boundaries of a Megatron rank, checked on a CPU machine with tensors labelled as device tensors.

A rank gets its micro-batches on the CPU (Ray unpickles them there), puts their images together from the step's and
moves them to its device in ``to_device``, and hands results back through ``to_host``. On a GPU, a tensor left on
the wrong side fails the first op that mixes it with the other side, or reaches the driver as a device tensor. Here
the real forward / backward runs on CPU values while every tensor the rank's device would hold says ``cuda:0``
(``npu:0`` where autograd runs: see tests/labelled_device.py), and an op mixing them with CPU tensors raises
:class:`DeviceMismatch`, as CUDA would. The rank runs in a spawned process (its process group, megatron state and
the label's process-wide registrations die with it); each child runs the plain CPU rank and the labelled one on the
same batches.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
from labelled_device import DeviceMismatch, Labelled, assert_on_host, label, labelled_device
from mp_utils import load_rank_results, save_rank_result, spawn

from mm_rl.platform.transfer import to_device, to_host

# the tiny model's image pad, video pad, vision start / end, <|endoftext|>
IMAGE, VIDEO, VSTART, VEND, PAD = 1006, 1007, 1003, 1004, 1000
PATCH_DIM = 3 * 2 * 14 * 14  # channels x temporal patch x patch^2
FIELDS = ("old_log_probs", "ref_log_probs", "advantages")


# ------------------------------------------------------------------------------------------------ inputs
def _image_tokens(grid: tuple[int, int, int], pad: int = IMAGE) -> list[int]:
    t, h, w = grid
    return [VSTART] + [pad] * (t * h * w // 4) + [VEND]


def micro_batches() -> tuple[list[dict[str, torch.Tensor]], dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """The trainer's micro-batches (``mm_rl.trainer.batch.micro_batches``), as a rank receives them, of eight
    samples, two per micro-batch: one image + text beside text, two answers to one text-only prompt, two answers to
    a prompt with two images of different sizes (a group's prompt: computed once, ``shared_prompt``), then two
    answers to a prompt with a video (two frame pairs, an mRoPE time step of 1.5); with the per-token fields of a
    training step. And the step's images they name (``step_images``)."""
    from mm_rl.trainer.batch import Sample, by_count, step_images
    from mm_rl.trainer.batch import micro_batches as build

    g = torch.Generator().manual_seed(0)

    def text(n: int) -> list[int]:
        return torch.randint(0, 1000, (n,), generator=g).tolist()

    def item(grids: list[tuple[int, int, int]], steps: list[float] | None = None) -> SimpleNamespace:
        grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
        return SimpleNamespace(
            pixel_values=torch.randn(int(grid.prod(-1).sum()), PATCH_DIM, generator=g),
            image_grid_thw=grid,
            mrope_time_steps=None if steps is None else torch.tensor(steps, dtype=torch.float64),
        )

    items = {0: item([(1, 4, 4)]), 1: item([]), 2: item([(1, 4, 8), (1, 4, 4)]), 3: item([(2, 4, 4)], [1.5])}
    prompts = {
        0: text(3) + _image_tokens((1, 4, 4)) + text(2),
        1: text(5),
        2: text(2) + _image_tokens((1, 4, 8)) + text(1) + _image_tokens((1, 4, 4)) + text(2),
        3: text(2) + _image_tokens((2, 4, 4), VIDEO) + text(3),
    }
    samples = [
        Sample(index, group, prompts[index], text(length), "stop")
        for group, (index, length) in enumerate([(0, 4), (1, 3), (1, 2), (1, 5), (2, 5), (2, 4), (3, 3), (3, 2)])
    ]
    for sample in samples:
        sample.old_log_probs = -torch.rand(sample.response_len, generator=g)
        sample.ref_log_probs = sample.old_log_probs - 0.05
        sample.advantages = torch.randn(sample.response_len, generator=g)
    return _received((build(by_count(samples, 2), items, PAD, FIELDS), step_images(samples, items)))


def _received(value: Any) -> Any:
    """``value`` as a rank's process receives it: packed by the driver (``Packed``), its one buffer mapped read-only
    from Ray's object store, unpacked into views of the rank's own host buffer."""
    from ray_utils import through_object_store

    from mm_rl.platform.transfer import Packed

    return through_object_store(Packed(value))[0]


@pytest.fixture(scope="module")
def mm_dir(tmp_path_factory) -> Path:
    """The tiny checkpoint converted to MindSpeed-MM's layout (TP1 / PP1)."""
    from mm_rl.config.schema import Hf2MgCfg, HfConfig, ParallelConfig
    from mm_rl.convert import hf2mg, model_config_from_hf
    from mm_rl.demo.tiny import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    hf_dir = build_tiny_checkpoint(root / "hf", seed=0)
    for tp, name in ((1, "mm"), (2, "mm_tp2")):
        parallel = ParallelConfig(tp_size=tp, llm_pp_layers=[4], vit_pp_layers=[2])
        hf2mg(
            Hf2MgCfg(mm_dir=str(root / name), hf_config=HfConfig(hf_dir=str(hf_dir)), parallel_config=parallel),
            model_config_from_hf(hf_dir),
        )
    return root


# ------------------------------------------------------------------------------------ the boundary functions
@dataclasses.dataclass(frozen=True)
class _Stats:
    loss: torch.Tensor
    steps: int


def test_to_device_moves_every_tensor_of_a_training_micro_batch_and_keeps_the_rest():
    """The target is named, never assumed: on ``meta`` nothing of the trainer's micro-batch stays behind, the images
    it names included (put together from the step's there); the step's images themselves stay on the host."""
    from mm_rl.platform.transfer import image_inputs

    batches, images = micro_batches()
    batch = {**batches[2], "uid": "sample-0", "temperature": 0.7}
    assert {"image_index", "image_grid_thw", "response_mask", *FIELDS} <= batch.keys()
    assert "pixel_values" not in batch  # the driver sends no pixels with a micro-batch
    moved = to_device(batch, torch.device("meta"), images)
    expected = {key: value for key, value in batch.items() if key != "image_index"} | image_inputs(batch, images)
    assert moved.keys() == expected.keys() >= {"pixel_values", "encoded_grid_thw", "image_slots"}
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert moved[key].device.type == "meta" and moved[key].shape == value.shape, key
            assert moved[key].dtype == value.dtype, key
        else:
            assert moved[key] == value, key
    assert_on_host(images)
    assert_on_host(batch)
    with pytest.raises(ValueError, match="holds no step images"):
        to_device(batch, torch.device("meta"))


def test_to_host_brings_nested_device_results_back_as_plain_cpu_tensors():
    labelled = [label(torch.randn(2, 3)) for _ in range(3)]
    result = {"log_probs": labelled[:2], "stats": _Stats(labelled[2], 4), "pair": (labelled[0], "x")}
    with pytest.raises(AssertionError, match=r"result\['log_probs'\]\[0\] is on cuda:0"):
        assert_on_host(result)
    host = to_host(result)
    assert_on_host(host)
    assert isinstance(host["stats"], _Stats) and host["stats"].steps == 4 and host["pair"][1] == "x"
    assert torch.equal(host["log_probs"][1], labelled[1].value)
    assert torch.equal(host["stats"].loss, labelled[2].value)


def test_the_harness_applies_cudas_device_rule():
    """What makes the rank tests able to fail: a labelled tensor may meet CPU scalars and CPU indices, never a
    CPU tensor of dim > 0."""
    values = torch.arange(6.0).reshape(2, 3)
    with labelled_device("cuda:0") as device:
        x = values.to(device)
        assert isinstance(x, Labelled) and x.device == device and torch.zeros(2, device="cuda").device == device
        assert torch.equal((x * torch.tensor(2.0)).cpu(), values * 2)
        assert torch.equal(x[torch.tensor([1, 0])].cpu(), values[[1, 0]])
        with pytest.raises(DeviceMismatch, match=r"aten\.add\.Tensor: a tensor on cuda:0 meets a CPU tensor \(2, 3\)"):
            x + torch.ones(2, 3)
        with pytest.raises(DeviceMismatch, match="numpy"):
            x.numpy()
        assert type(x.cpu()) is torch.Tensor and x.tolist() == values.tolist()


# ------------------------------------------------------------------------------------------- a rank's forward
def _quiet() -> None:
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine|apex).* not installed")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")


def _start(worker_cls: Any, mm_root: str, port: int) -> Any:
    """A rank 0 of a world of one (the production init: gloo process group, megatron parallel state)."""
    from mm_rl.convert import model_config_from_hf
    from mm_rl.workers.megatron_worker import WorkerSpec

    _quiet()
    worker = worker_cls(WorkerSpec(model_config_from_hf(Path(mm_root) / "hf")), 0)
    worker.init_distributed("127.0.0.1", port)
    return worker


def _process_groups() -> dict[str, Any]:
    """Megatron's groups on this rank (name -> size), which of them are one process group object, and the gloo
    event-loop threads of the process (one per gloo process group; each wakes every 10 ms while idle)."""
    from megatron.core import parallel_state

    names = ("tensor_model_parallel", "pipeline_model_parallel", "data_parallel", "context_parallel")
    groups = {name: getattr(parallel_state, f"get_{name}_group")() for name in names}
    groups |= {"expert_model_parallel": parallel_state.get_expert_model_parallel_group()}
    sharing: dict[int, list[str]] = {}
    for name, group in groups.items():
        sharing.setdefault(id(group), []).append(name)
    threads = [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]
    return {
        "sizes": {name: group.size() for name, group in groups.items()},
        "same": sorted(sharing.values()),
        "gloo_loops": threads.count("gloo_tcp_loop"),
    }


def _first_compile() -> dict[str, Any]:
    """Graphs a first call of a function megatron-core's ``jit_fuser`` wraps (torch.compile) builds in this rank, and
    what the processes the rank starts are told (``TORCH_COMPILE_DISABLE``)."""
    from megatron.core.jit import jit_fuser
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    jit_fuser(lambda x: x * 2 + 1)(torch.ones(3))
    return {"graphs": counters["stats"]["unique_graphs"] - before, "children": os.environ.get("TORCH_COMPILE_DISABLE")}


def _error(run: Any) -> str | None:
    """None when ``run()`` mixes no devices, else the DeviceMismatch's message (op and caller)."""
    try:
        run()
    except DeviceMismatch as error:
        return str(error)
    return None


def _on_host(value: Any) -> str | None:
    """None when every tensor in ``value`` is a plain CPU tensor, else the assertion's message."""
    try:
        assert_on_host(value)
    except AssertionError as error:
        return str(error)
    return None


def _host_copy(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Plain copies whatever came back (a labelled tensor cannot be unpickled in the test process)."""
    return [getattr(v, "value", v).clone() for v in values]


def _log_prob_rank(rank: int, world: int, port: int, mm_root: str, out_dir: str) -> None:
    from labelled_device import labelled_device, plain_tensors

    import mm_rl.workers.megatron_worker as megatron_worker
    from mm_rl.workers.megatron_worker import MegatronWorker

    worker = _start(MegatronWorker, mm_root, port)
    (batches, images), mm = micro_batches(), str(Path(mm_root) / "mm")
    worker.set_images(images)
    worker.build(mm)
    result: dict[str, Any] = {"plain": worker.compute_log_probs(batches), "groups": _process_groups()}
    result["compile"] = _first_compile()
    with labelled_device("cuda:0"):
        worker.build(mm)  # as on a GPU: megatron allocates its layers on the device, build() moves the rest
        result["left_on_host"] = plain_tensors(worker.model)
        result["unmoved_model"] = _error(lambda: worker.compute_log_probs(batches[1:2]))
        worker.set_images(images)  # the step starts: the frozen ViT's per-step cache, on this rank's device
        labelled = worker.compute_log_probs(batches)
        cache = worker.model.image_encoder.cache
        result["cache"] = (len(cache), sorted({str(t.device) for t in cache.values()}))
        result["labelled"] = _host_copy(labelled)
        result["labelled_on_host"] = _on_host(labelled)
        result["images_on_host"] = _on_host(worker.images)
        outputs = worker.vision_outputs()  # what the other role's rank at this place would receive
        result["handed_on_host"] = _on_host(outputs)
        worker.set_images(images)
        worker.add_vision_outputs(outputs)
        result["taken"] = sorted({str(t.device) for t in worker.model.image_encoder.cache.values()})
        result["taken_log_probs"] = _host_copy(worker.compute_log_probs(batches))
        with mock.patch.object(
            megatron_worker,
            "to_device",  # the images put together, nothing moved
            lambda batch, device, images=None: to_device(batch, torch.device("cpu"), images),
        ):
            result["without_to_device"] = _error(lambda: worker.compute_log_probs(batches))
        with mock.patch.object(megatron_worker, "to_host", lambda value: value):
            kept = worker.compute_log_probs(batches)
            result["without_to_host"] = _on_host(kept)
    save_rank_result(out_dir, rank, result)
    torch.distributed.destroy_process_group()


def _spawned(rank_fn: Any, mm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``rank_fn``'s results from a one-rank child process (labels and megatron state stay out of pytest's)."""
    out = tmp_path_factory.mktemp(rank_fn.__name__.strip("_"))
    spawn(rank_fn, 1, str(mm_dir), str(out))
    return load_rank_results(out, 1)[0]


@pytest.fixture(scope="module")
def log_prob_run(mm_dir, tmp_path_factory) -> dict[str, Any]:
    return _spawned(_log_prob_rank, mm_dir, tmp_path_factory)


def test_log_probs_of_a_labelled_rank_come_back_on_the_host_equal_to_the_cpu_rank(log_prob_run):
    """``compute_log_probs`` on the trainer's CPU micro-batches (images, a video and text) with every weight, buffer
    and activation of the rank on cuda:0: no op mixes devices, and the results are plain CPU tensors equal to
    the CPU rank's (CUDA's kernel choices computed on CPU: 1e-6). The step's images the rank keeps stay on the host
    (each micro-batch takes what it needs to the device); the frozen ViT's per-step cache fills on the device."""
    batches = micro_batches()[0]
    assert [b["shared_prompt"].tolist() for b in batches][1:] == [[0, 4], [0, 20], [0, 14]]  # groups' prompts
    assert batches[3]["mrope_time_steps"].tolist() == [1.5, 1.5]  # the video's time step, on the host
    assert log_prob_run["labelled_on_host"] is None
    assert log_prob_run["images_on_host"] is None
    assert log_prob_run["cache"][0] > 0 and log_prob_run["cache"][1] == ["cuda:0"]  # the ViT outputs stay there
    plain, labelled = log_prob_run["plain"], log_prob_run["labelled"]
    assert len(plain) == len(labelled) == 4
    for ours, reference in zip(labelled, plain, strict=True):
        assert type(reference) is torch.Tensor and reference.device.type == "cpu"
        torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)


def test_frozen_vit_outputs_leave_a_labelled_rank_on_the_host_and_enter_the_other_on_its_device(log_prob_run):
    """The hand-over between the reference's and the actor's ranks: what a rank gives is plain host tensors (it
    crosses processes through Ray), what a rank takes goes to its device, and its log-probs stay those computed."""
    assert log_prob_run["handed_on_host"] is None
    assert log_prob_run["taken"] == ["cuda:0"]
    for ours, reference in zip(log_prob_run["taken_log_probs"], log_prob_run["plain"], strict=True):
        torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)


def test_without_to_device_the_cpu_batch_meets_the_device_weights(log_prob_run):
    """The negative control: with the driver -> rank boundary bypassed the same run fails at the first op
    that mixes the CPU micro-batch with device weights."""
    assert log_prob_run["without_to_device"] is not None
    assert "a tensor on cuda:0 meets a CPU tensor" in log_prob_run["without_to_device"]


def test_without_to_host_the_results_would_reach_the_driver_on_the_device(log_prob_run):
    assert log_prob_run["without_to_host"] is not None
    assert "result[0] is on cuda:0" in log_prob_run["without_to_host"]


def test_a_one_rank_world_runs_megatrons_groups_on_one_process_group(log_prob_run):
    """Megatron makes some twenty groups; in a world of one each is a one-rank group and over gloo each would keep
    an event loop waking every 10 ms beside the rank's compute threads: they share one process group (and
    megatron's gloo copies of its data-parallel groups, which the checkpoint never uses, are not made)."""
    groups = log_prob_run["groups"]
    assert set(groups["sizes"].values()) == {1}
    assert len(groups["same"]) == 1, groups["same"]
    assert groups["gloo_loops"] <= 2, groups  # the world's group and the one-rank groups' (21 before)


def test_a_cpu_rank_runs_compiled_helpers_eagerly(log_prob_run):
    """megatron-core's ``jit_fuser`` helpers (MoE routing and dispatch, the Gated DeltaNet, the attention output
    gate) run as the code they wrap on a CPU rank, and the processes it starts are told to: a first call compiles
    nothing (inductor's first compiles took a tiny Qwen3.5 job's first step from 2.9 to 6.9 s)."""
    assert log_prob_run["compile"] == {"graphs": 0, "children": "1"}


def test_a_rank_builds_its_whole_model_on_its_device(log_prob_run):
    """On a GPU, megatron allocates its layers' weights on the current device, but torch.nn modules (the RMSNorm
    weights, the ViT's patch-embedding Conv3d) are created on the host, and megatron-core leaves moving the model
    to the caller (Megatron-LM's get_model calls ``.cuda()``). A rank must own no host parameter (without the move
    the first RMSNorm of a GPU rank's forward fails; ``unmoved_model`` names the op and the caller)."""
    assert log_prob_run["left_on_host"] == [], log_prob_run["unmoved_model"]


def _tp2_log_prob_rank(rank: int, world: int, port: int, mm_root: str, out_dir: str) -> None:
    """One of two TP ranks (sequence parallelism: each holds half of every packed row, the packed row padded to a
    multiple of TP, which is where the attention builds a segment boundary with ``new_tensor``)."""
    from labelled_device import labelled_device

    from mm_rl.convert import model_config_from_hf
    from mm_rl.workers.megatron_worker import MegatronWorker, WorkerSpec

    _quiet()
    worker = MegatronWorker(WorkerSpec(model_config_from_hf(Path(mm_root) / "hf"), tp=2), rank)
    worker.init_distributed("127.0.0.1", port)
    (batches, images), mm = micro_batches(), str(Path(mm_root) / "mm_tp2")
    worker.set_images(images)
    worker.build(mm)
    result: dict[str, Any] = {"plain": worker.compute_log_probs(batches), "groups": _process_groups()}
    with labelled_device("cuda:0"):
        worker.build(mm)
        worker.set_images(images)
        labelled = worker.compute_log_probs(batches)
        result["labelled"] = None if labelled is None else _host_copy(labelled)  # TP rank 0 returns them
        result["labelled_on_host"] = _on_host(labelled)
    save_rank_result(out_dir, rank, result)
    torch.distributed.destroy_process_group()


def test_tp2_ranks_under_sequence_parallelism_keep_their_tensors_on_the_device(mm_dir, tmp_path):
    """Two labelled TP ranks (their collectives on the CPU values over gloo): the sequence-parallel paths (each
    rank's share of the tokens, the padding segment of the packed row) mix no devices, and each rank's results come
    back on the host equal to the plain TP2 run's."""
    spawn(_tp2_log_prob_rank, 2, str(mm_dir), str(tmp_path))
    first, second = load_rank_results(tmp_path, 2)
    for groups in (first["groups"], second["groups"]):  # the TP group its own; the one-rank groups one between them
        assert groups["sizes"]["tensor_model_parallel"] == 2, groups
        assert ["tensor_model_parallel"] in groups["same"] and len(groups["same"]) == 2, groups
    assert first["labelled_on_host"] is None and second["labelled"] is second["plain"] is None
    assert len(first["plain"]) == 4
    for ours, reference in zip(first["labelled"], first["plain"], strict=True):
        torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------- a rank's update
def _train_rank(rank: int, world: int, port: int, mm_root: str, out_dir: str) -> None:
    from labelled_device import labelled_device, register_npu_label

    from mm_rl.config.schema import RLConfig
    from mm_rl.workers.megatron_worker import all_reduce
    from mm_rl.workers.training import LossSpec, OptimizerSpec, TrainingWorker

    spec = OptimizerSpec(
        lr=1e-3,
        min_lr=1e-4,
        weight_decay=0.1,
        adam_beta1=0.9,
        adam_beta2=0.999,
        clip_grad=1.0,
        lr_decay_style="cosine",
        warmup_steps=0,
        total_steps=4,
    )
    loss = LossSpec(RLConfig(kl_loss_coef=0.1, use_kl_loss=True), max_response_len=5)
    (batches, images), mm = micro_batches(), str(Path(mm_root) / "mm")
    plain = _start(TrainingWorker, mm_root, port)
    plain.set_images(images)
    plain.build(mm)
    initial = {k: v.clone() for k, v in plain.model.state_dict().items() if isinstance(v, torch.Tensor)}
    plain.setup_training(spec)
    result: dict[str, Any] = {"initial": initial, "plain_metrics": plain.train_mini_batch(batches, loss, 8.0).metrics}
    result["plain"] = {k: v for k, v in plain.model.state_dict().items() if isinstance(v, torch.Tensor)}

    register_npu_label()  # autograd over device-labelled tensors (see labelled_device)
    worker = TrainingWorker(plain.spec, 0)
    worker.coords = plain.coords
    worker.set_images(images)
    with labelled_device("npu:0"):
        worker.build(mm)
        worker.setup_training(spec)
        metrics = worker.train_mini_batch(batches, loss, 8.0).metrics
        state = worker.model.state_dict()
        flag = torch.tensor([1.0])  # what the non-finite check once all-reduced on the rank's nccl group
        result["cpu_collective"] = _error(lambda: torch.distributed.all_reduce(flag))
        reduced = all_reduce(flag)
        result["reduced"] = (type(reduced).__name__, str(reduced.device), reduced.tolist())
    result["labelled_metrics"] = metrics
    result["metric_types"] = sorted({type(v).__name__ for v in metrics.values()})
    result["labelled_device"] = str(next(worker.model.parameters()).device)
    result["grad_buffer_device"] = str(worker.ddp.buffers[0].grad_data.device)
    result["labelled"] = {k: getattr(v, "value", v).clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    save_rank_result(out_dir, rank, result)
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def train_run(mm_dir, tmp_path_factory) -> dict[str, Any]:
    return _spawned(_train_rank, mm_dir, tmp_path_factory)


def test_an_update_on_a_labelled_rank_returns_floats_and_equals_the_cpu_rank(train_run):
    """``train_mini_batch`` (forward, backward into megatron's DDP grad buffers, grad norm and clipping, Adam
    step) with the model, grad buffers and optimizer state on the device: no op mixes devices, the metrics come
    back as plain floats equal to the CPU rank's, and so do the weights.

    Weights: Adam's first step is lr x g / (|g| + eps), so a gradient within ~1e-10 of zero moves its weight by
    a visibly different fraction of lr; the CPU rank differs from CUDA's kernel choices by that much. Every
    weight is within 1% of a step (1e-5 at lr 1e-3) and each tensor's sum within 1e-5 relative."""
    assert train_run["labelled_device"] == "npu:0" and train_run["grad_buffer_device"] == "npu:0"
    assert train_run["metric_types"] == ["float"]
    plain, labelled = train_run["plain_metrics"], train_run["labelled_metrics"]
    assert plain.keys() == labelled.keys() and plain["skipped"] == 0.0
    for key in plain:
        assert labelled[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-7), key
    moved = max((train_run["plain"][k] - v).abs().max().item() for k, v in train_run["initial"].items())
    assert moved > 5e-4  # the step moved the weights (so equal weights mean the same step)
    for name, reference in train_run["plain"].items():
        ours = train_run["labelled"][name]
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5, msg=name)
        assert abs(ours.sum().item() - reference.sum().item()) <= 1e-5 * (1 + abs(reference.sum().item())), name


def test_collectives_of_a_device_rank_take_device_tensors(train_run):
    """nccl / hccl reject host tensors: a CPU flag all-reduced as it was before fails under the labels, the rank's
    ``all_reduce`` helper (the update's non-finite flag and metrics) moves it to the device and hands back a CPU
    tensor. The update above ran every collective of its step under the same rule."""
    assert train_run["cpu_collective"] is not None and "device tensors only" in train_run["cpu_collective"]
    assert train_run["reduced"] == ("Tensor", "cpu", [1.0])


def test_moe_routing_counts_stay_on_the_routers_device():
    """The router hook adds to counts on the router's device (no host copy per layer and micro-batch); the
    counts reach the host once, through the reader's all-reduce."""
    from mm_rl.models.qwen_vl.routing import RoutingCounts

    counts = RoutingCounts(layers=2, experts=4)
    with labelled_device("cuda:0"):
        routing_map = label(torch.tensor([[True, False, True, False], [False, True, True, False]]))
        for _ in range(2):
            counts.add(1, torch.nn.Identity(), (), (routing_map.float(), routing_map))
        assert counts.counts.device.type == "cuda"
        assert counts.counts.cpu().tolist() == [[0, 0, 0, 0, 0], [2, 2, 4, 0, 4]]


def test_to_device_moves_a_trajectorys_tool_images_with_its_prompts_and_names_no_key_there():
    """A multi-turn row names its prompt's images and its tools' (``tool_image_index``): both keys stay on the
    host side of the boundary, their pixels go to the device together, the step's images stay on the host."""
    from mm_rl.platform.transfer import image_inputs
    from mm_rl.rollout.base import Turns
    from mm_rl.trainer.batch import Sample, step_images
    from mm_rl.trainer.batch import micro_batches as build

    grid = torch.tensor([[1, 4, 4]])
    items = {0: SimpleNamespace(pixel_values=torch.randn(16, 8), image_grid_thw=grid, mrope_time_steps=None)}
    plain = Sample(0, 0, [1, 2] + [IMAGE] * 4 + [3], [4, 5], "stop")
    tooled = Sample(0, 0, [1, 2] + [IMAGE] * 4 + [3], [4, 6, *[IMAGE] * 4, 7, 8], "stop", image_key=-2)
    tooled.turns = Turns([1, 0, 0, 0, 0, 0, 0, 1])
    tooled.loss_mask = torch.tensor(tooled.turns.loss_mask, dtype=torch.float32)
    tooled.tool_images = (torch.randn(16, 8), grid)
    (batch,) = build([[plain, tooled]], items, PAD)
    images = step_images([plain, tooled], items)
    moved = to_device(batch, torch.device("meta"), images)
    assert not {"image_index", "tool_image_index"} & moved.keys()
    assert moved["pixel_values"].device.type == "meta" and moved["pixel_values"].shape == (32, 8)
    assert image_inputs(batch, images)["image_slots"].tolist() == [0, 0, 1]
    assert_on_host(images)
    assert_on_host(batch)
