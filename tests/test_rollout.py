"""Rollout engines (vLLM in-process and transformers) on the tiny Qwen2.5-VL and synthetic geo3k prompts.

One engine of each kind serves the whole module (vLLM starts in ~5 s); tests that perturb weights restore them.
"""

from mm_rl.platform import cpu_wheels

cpu_wheels.install()  # vLLM's Qwen2.5-VL and the processors import torchvision

import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from mm_rl.config.schema import GenerateConfig, SamplingConfig, ValSamplingConfig  # noqa: E402
from mm_rl.data.dataset import PromptDataset, PromptProcessor  # noqa: E402
from mm_rl.demo import tiny  # noqa: E402
from mm_rl.demo.synthetic import write_synthetic_geo3k  # noqa: E402
from mm_rl.rollout.base import RolloutRequest, SamplingSpec, sampling_for  # noqa: E402
from mm_rl.rollout.bounds import (  # noqa: E402
    BoundsPolicy,
    apply_bounds,
    collapse_image_pads,
    image_runs,
    token_ids_of,
)
from mm_rl.sync.buckets import GroupAssembler, bucket_by_group, weight_group  # noqa: E402

pytestmark = pytest.mark.stack  # Ray, vLLM engines or Megatron ranks: in `make test`, not `make test-quick`

MIN_PIXELS, MAX_PIXELS = 56 * 56, 224 * 224
MAX_TOKENS = 12
STOP_IDS = (tiny.EOS_TOKEN_ID, tiny.PAD_TOKEN_ID)  # the checkpoint's generation_config eos ids


# --------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def processor(model_dir):
    return PromptProcessor(model_dir, MIN_PIXELS, MAX_PIXELS)


@pytest.fixture(scope="module")
def items(tmp_path_factory, processor):
    data = write_synthetic_geo3k(tmp_path_factory.mktemp("data") / "geo3k", seed=0, train_size=8, test_size=8)
    dataset = PromptDataset(data, "test", processor, max_prompt_length=400)
    return [dataset[i] for i in range(4)]


@pytest.fixture(scope="module")
def requests_(items):
    return [RolloutRequest.from_item(item, pixels=True) for item in items]


@pytest.fixture(scope="module")
def lean_requests(items):
    """Without the actor's pixels (what crosses a process boundary): engines use the images alone."""
    return [RolloutRequest.from_item(item) for item in items]


@pytest.fixture(scope="module")
def config():
    return GenerateConfig(
        max_model_len=512,
        max_num_seqs=16,
        sampling_config=SamplingConfig(max_tokens=MAX_TOKENS, temperature=1.0, n=2, seed=0),
        val_sampling_config=ValSamplingConfig(max_tokens=MAX_TOKENS),
    )


@pytest.fixture(scope="module")
def vllm_engine(model_dir, config):
    from mm_rl.rollout.vllm_engine import VllmEngine

    engine = VllmEngine(model_dir, config, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    yield engine
    engine.close()
    assert not torch.distributed.is_initialized()  # the pytest process is left clean for other tests


@pytest.fixture(scope="module")
def hf_engine(model_dir, config):
    from mm_rl.rollout.hf_engine import HfEngine

    return HfEngine(model_dir, config, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


@pytest.fixture(scope="module")
def reference(model_dir):
    """An untouched transformers model for recomputing log-probs."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def weights(model_dir):
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


@pytest.fixture(params=["vllm", "hf"])
def engine(request):
    return request.getfixturevalue(f"{request.param}_engine")


# ----------------------------------------------------------------------------------------------------- helpers
def recompute(reference, request, response_ids, temperature):
    """Log-probs of ``response_ids`` after the prompt, from one full forward pass (logits / temperature)."""
    from mm_rl.models.family import hf_token_types

    ids = torch.tensor([request.prompt_ids + list(response_ids)])
    with torch.no_grad():
        logits = reference(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=hf_token_types(ids, tiny.IMAGE_TOKEN_ID),
            pixel_values=request.pixel_values,
            image_grid_thw=request.image_grid_thw,
        ).logits[0]
    start = len(request.prompt_ids) - 1
    scores = logits[start : start + len(response_ids)].float() / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(scores, -1).gather(1, torch.tensor(response_ids)[:, None]).squeeze(1)


def greedy(engine, requests, max_tokens=6):
    out = engine.generate(requests, SamplingConfig(max_tokens=max_tokens, temperature=0.0, n=1))
    return [(o.samples[0].response_ids, o.samples[0].logprobs) for o in out]


def same_outputs(a, b):
    return all(ids_a == ids_b and torch.equal(lp_a, lp_b) for (ids_a, lp_a), (ids_b, lp_b) in zip(a, b, strict=True))


def stop_head(weights):
    """An output layer whose argmax is always a stop token: eos on +x, pad (also a stop id) on -x of one feature."""
    head = torch.zeros_like(weights["lm_head.weight"])
    head[STOP_IDS[0], 5], head[STOP_IDS[1], 5] = 50.0, -50.0
    return head


def layer_tensors(weights, index):
    prefix = f"model.layers.{index}."
    return [(name, tensor) for name, tensor in weights.items() if name.startswith(prefix)]


# ---------------------------------------------------------------------------------------------- the contract
def test_outputs_are_well_formed_for_n2_with_images(engine, config, requests_, items):
    out = engine.generate(requests_, config.sampling_config)
    assert len(out) == len(requests_)
    for output, item in zip(out, items, strict=True):
        assert output.prompt_ids == item.input_ids.tolist()  # the actor's ids, image pads expanded
        assert output.uid == item.row_id and output.skipped is None and not output.truncated
        assert len(output.samples) == 2
        for sample in output.samples:
            assert 1 <= len(sample.response_ids) <= MAX_TOKENS
            assert sample.logprobs.dtype == torch.float32 and sample.logprobs.shape == (len(sample.response_ids),)
            assert torch.isfinite(sample.logprobs).all() and (sample.logprobs <= 0).all()
            stopped = sample.response_ids[-1] in STOP_IDS
            assert sample.finish_reason == ("stop" if stopped else "length")
            assert stopped or len(sample.response_ids) == MAX_TOKENS
            assert not any(t in STOP_IDS for t in sample.response_ids[:-1])
    assert out[0].samples[0].response_ids != out[0].samples[1].response_ids  # two samples, not one copied
    tokens = sum(len(s.response_ids) for o in out for s in o.samples)
    assert out.metrics.samples == 8 and out.metrics.generated_tokens == tokens
    assert out.timing.wall_s > 0 and out.timing.tok_per_s > 0
    assert out[0].timing is out[-1].timing and out[0].timing.generated_tokens == tokens
    assert out.metrics.as_dict()["rollout/tok_per_s"] > 0


def test_requests_without_pixels_give_the_same_outputs(engine, requests_, lean_requests):
    assert lean_requests[0].pixel_values is None and requests_[0].pixel_values is not None
    assert same_outputs(greedy(engine, lean_requests[:2]), greedy(engine, requests_[:2]))


def test_vllm_prompt_ids_equal_the_actors_and_a_mismatch_raises(vllm_engine, items, requests_):
    from vllm import SamplingParams

    request = requests_[0]
    collapsed = collapse_image_pads(request.prompt_ids, vllm_engine.bounds.image_token_id)
    assert len(image_runs(collapsed, vllm_engine.bounds.image_token_id)) == 1
    assert collapsed.count(vllm_engine.bounds.image_token_id) == 1
    raw = vllm_engine.llm.generate([vllm_engine.prompt(r) for r in requests_], SamplingParams(max_tokens=1))
    assert [list(o.prompt_token_ids) for o in raw] == [item.input_ids.tolist() for item in items]
    run = image_runs(request.prompt_ids, vllm_engine.bounds.image_token_id)[0]
    one_pad_more = request.prompt_ids[: run[1]] + [vllm_engine.bounds.image_token_id] + request.prompt_ids[run[1] :]
    with pytest.raises(RuntimeError, match="min_pixels"):
        vllm_engine.generate([dataclasses.replace(request, prompt_ids=one_pad_more)], SamplingConfig(max_tokens=2, n=1))


def test_vllm_on_cpu_compiles_nothing(vllm_engine, config, requests_):
    """On CPU the engine runs eagerly, vLLM's ``torch.compile``-decorated helpers too (the sampler's rank of the
    sampled token, the Gated DeltaNet's input split): a generate compiles no graph, even with torch's compile caches
    emptied (the sampler's first compile cost each engine's first generate ~2 s; ``compiled_helpers_run_eagerly``)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    assert vllm_engine.generate(requests_[:2], config.sampling_config)[0].samples[0].logprobs.numel() > 0
    assert counters["stats"]["unique_graphs"] == before


def test_greedy_vllm_equals_hf(vllm_engine, hf_engine, config, requests_):
    spec = sampling_for(config, validation=True)
    assert spec.greedy and spec.n == 1 and spec.max_tokens == MAX_TOKENS
    a, b = vllm_engine.generate(requests_[:2], spec), hf_engine.generate(requests_[:2], spec)
    for out_a, out_b in zip(a, b, strict=True):
        (sa,), (sb,) = out_a.samples, out_b.samples
        pairs = zip(sa.response_ids, sb.response_ids, strict=False)
        diverged = next((i for i, (x, y) in enumerate(pairs) if x != y), None)  # float noise may flip a near-tie
        if diverged is None:
            assert sa.response_ids == sb.response_ids
        assert diverged is None or diverged > 0, "greedy first tokens differ"
        length = len(sa.response_ids) if diverged is None else diverged
        assert torch.allclose(sa.logprobs[:length], sb.logprobs[:length], atol=1e-2)


@pytest.mark.parametrize("name, tolerance", [("vllm", 1e-2), ("hf", 1e-4)])
def test_logprobs_equal_a_recomputation_from_hf_logits(request, name, tolerance, reference, requests_):
    engine = request.getfixturevalue(f"{name}_engine")
    temperature = 0.7
    out = engine.generate(requests_[:2], SamplingConfig(max_tokens=MAX_TOKENS, temperature=temperature, n=2))
    for req, output in zip(requests_[:2], out, strict=True):
        for sample in output.samples:
            expected = recompute(reference, req, sample.response_ids, temperature)
            assert torch.allclose(sample.logprobs, expected, atol=tolerance), (sample.logprobs - expected).abs().max()


def test_greedy_with_n2_gives_two_equal_samples(engine, requests_):
    (output,) = engine.generate(requests_[:1], SamplingConfig(max_tokens=4, temperature=0.0, n=2))
    first, second = output.samples
    assert first is not second and first.response_ids == second.response_ids
    assert torch.allclose(first.logprobs, second.logprobs)


def test_top_logprobs_hold_the_sampled_token(engine, requests_):
    spec = SamplingSpec(max_tokens=4, temperature=1.0, n=1, logprobs=3)
    (output,) = engine.generate(requests_[:1], spec)
    sample = output.samples[0]
    assert len(sample.top_logprobs) == len(sample.response_ids)
    for position, token, logprob in zip(sample.top_logprobs, sample.response_ids, sample.logprobs, strict=True):
        assert 3 <= len(position) <= 4 and position[token] == pytest.approx(float(logprob), abs=1e-5)


# --------------------------------------------------------------------------------------------------- weights
def test_update_weights_changes_generation_and_restoring_restores_it(engine, requests_, weights):
    baseline = greedy(engine, requests_[:2])
    assert engine.update_weights(iter([("lm_head.weight", stop_head(weights))])) == 1  # an iterator is fine
    stopped = engine.generate(requests_[:2], SamplingConfig(max_tokens=6, temperature=0.0, n=1))
    for output in stopped:
        (sample,) = output.samples
        assert sample.response_ids[0] in STOP_IDS and len(sample.response_ids) == 1
        assert sample.finish_reason == "stop" and sample.logprobs[0] > -1e-3
    generator = torch.Generator().manual_seed(0)
    noisy = [(n, t + 0.2 * torch.randn(t.shape, generator=generator)) for n, t in layer_tensors(weights, 1)]
    engine.update_weights(noisy + [("lm_head.weight", weights["lm_head.weight"])])
    assert not same_outputs(greedy(engine, requests_[:2]), baseline)
    engine.update_weights(layer_tensors(weights, 1))
    assert same_outputs(greedy(engine, requests_[:2]), baseline)


def test_vllm_applies_a_layer_only_once_all_its_tensors_arrived(vllm_engine, requests_, weights):
    baseline = greedy(vllm_engine, requests_[:1])
    generator = torch.Generator().manual_seed(1)
    noisy = [(n, t + 0.2 * torch.randn(t.shape, generator=generator)) for n, t in layer_tensors(weights, 2)]
    assert vllm_engine.update_weights(noisy[:3]) == 0  # half a layer: held back
    assert vllm_engine.assembler.pending_names == sorted(n for n, _ in noisy[:3])
    assert same_outputs(greedy(vllm_engine, requests_[:1]), baseline)
    assert vllm_engine.update_weights(noisy[3:]) == len(noisy)
    assert not same_outputs(greedy(vllm_engine, requests_[:1]), baseline)
    buckets = list(bucket_by_group(layer_tensors(weights, 2), bucket_bytes=1))
    assert len(buckets) == 1  # one layer is never split, even when it exceeds the bucket
    assert vllm_engine.update_weights(buckets[0]) == len(noisy) and not vllm_engine.assembler.pending
    assert same_outputs(greedy(vllm_engine, requests_[:1]), baseline)


def test_vllm_multiprocess_engine_takes_weights_through_files(vllm_engine, model_dir, config, requests_, weights):
    """The engine-core-in-a-subprocess path (what TP > 1 uses): RPC arguments are serialised, buckets go by file.
    It starts as the trainer starts its engines, without the checkpoint's weights (``dummy_weights``: vLLM's
    random ones), and once every tensor is pushed it generates exactly what the checkpoint-loaded engine does,
    with images (what the dummy loader randomises beyond the checkpoint's tensors is put back). It runs beside the
    module's in-process engine, which must keep working; a second in-process one is refused."""
    from mm_rl.rollout.vllm_engine import VllmEngine

    with pytest.raises(RuntimeError, match="already runs"):
        VllmEngine(model_dir, config, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    baseline = greedy(vllm_engine, requests_[:2])
    engine = VllmEngine(
        model_dir, config, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, in_process=False, dummy_weights=True
    )
    try:
        assert not same_outputs(greedy(engine, requests_[:2]), baseline)  # random weights
        assert engine.update_weights(weights.items()) == len(weights)
        assert same_outputs(greedy(engine, requests_[:2]), baseline)
        assert engine.update_weights([("lm_head.weight", stop_head(weights))]) == 1
        assert greedy(engine, requests_[:1])[0][0][0] in STOP_IDS
        assert engine.update_weights(weights.items()) == len(weights)
        assert same_outputs(greedy(engine, requests_[:2]), baseline)
        engine.sleep(1)
        assert engine.asleep  # released, until woken
        engine.wake_up()
        assert not engine.asleep and same_outputs(greedy(engine, requests_[:2]), baseline)  # level 1 kept weights
    finally:
        engine.close()
    assert same_outputs(greedy(vllm_engine, requests_[:2]), baseline)


@pytest.mark.slow
def test_vllm_tp2_engine_matches_hf_and_takes_sharded_weight_pushes(model_dir, config, reference, requests_, weights):
    """A TP2 engine (multiprocess; on CPU its two ranks split this machine's cores): its log-probs equal a
    recomputation from HF logits, and full HF tensors pushed to it land sharded over both ranks (fused qkv and
    gate/up included): a stop head stops, a perturbed layer changes generation, the originals restore it exactly."""
    from mm_rl.rollout.vllm_engine import VllmEngine

    engine = VllmEngine(
        model_dir,
        dataclasses.replace(config, infer_tensor_parallel_size=2),
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
    )
    try:
        assert not engine.in_process
        out = engine.generate(requests_[:2], SamplingConfig(max_tokens=MAX_TOKENS, temperature=0.7, n=2))
        for req, output in zip(requests_[:2], out, strict=True):
            for sample in output.samples:
                expected = recompute(reference, req, sample.response_ids, 0.7)
                assert torch.allclose(sample.logprobs, expected, atol=1e-2), (sample.logprobs - expected).abs().max()
        baseline = greedy(engine, requests_[:2])
        assert engine.update_weights([("lm_head.weight", stop_head(weights))]) == 1
        assert all(ids[0] in STOP_IDS for ids, _ in greedy(engine, requests_[:2]))
        generator = torch.Generator().manual_seed(0)
        noisy = [(n, t + 0.2 * torch.randn(t.shape, generator=generator)) for n, t in layer_tensors(weights, 1)]
        engine.update_weights(noisy + [("lm_head.weight", weights["lm_head.weight"])])
        assert not same_outputs(greedy(engine, requests_[:2]), baseline)
        assert engine.update_weights(weights.items()) == len(weights)
        assert same_outputs(greedy(engine, requests_[:2]), baseline)
    finally:
        engine.close()


def test_engine_settings_come_from_the_generate_config(model_dir, config):
    from mm_rl.rollout.vllm_engine import engine_kwargs

    def kwargs(**changes):
        return engine_kwargs(
            model_dir, dataclasses.replace(config, **changes), min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS
        )

    assert kwargs()["dtype"] == "float32"  # auto on CPU
    assert kwargs(dtype="bfloat16")["dtype"] == "bfloat16"
    assert kwargs(max_images_per_prompt=3)["limit_mm_per_prompt"] == {"image": 3, "video": 0}
    assert "enable_sleep_mode" not in kwargs(colocate=True)  # nothing to free on CPU


def test_cpu_thread_binding_splits_the_cores_among_engine_ranks(monkeypatch):
    from mm_rl.rollout import vllm_engine

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(vllm_engine.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 5})
    nodes = len(list(vllm_engine.Path("/sys/devices/system/node").glob("node[0-9]*")))
    assert vllm_engine.cpu_thread_binding(1) is None
    if nodes < 2:
        assert vllm_engine.cpu_thread_binding(2) == "0,1|2,3"
    if nodes < 8:
        assert vllm_engine.cpu_thread_binding(8) == "nobind"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    assert vllm_engine.cpu_thread_binding(2) is None  # the user's own binding stands


def test_weight_groups_and_buckets(weights):
    assert weight_group("model.layers.3.self_attn.q_proj.weight") == "model.layers.3"
    assert weight_group("visual.blocks.1.attn.qkv.bias") == "visual.blocks.1"
    assert weight_group("lm_head.weight") == "lm_head"
    named = list(weights.items())
    buckets = list(bucket_by_group(named, bucket_bytes=200_000))
    assert [t for b in buckets for t in b] == named and len(buckets) > 2
    groups = [{weight_group(n) for n, _ in b} for b in buckets]
    assert all(not (a & b) for i, a in enumerate(groups) for b in groups[i + 1 :])  # no group in two buckets
    assembler = GroupAssembler(weights)
    released = [n for b in reversed(buckets) for n, _ in assembler.feed(b)]
    assert sorted(released) == sorted(weights) and not assembler.pending


# ---------------------------------------------------------------------------------------------------- bounds
def _policy(model_dir, **changes):
    base = BoundsPolicy(max_model_len=300, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, **token_ids_of(model_dir))
    return dataclasses.replace(base, **changes)


def _with_image(processor, request, image):
    ids, pixels, grid = processor.encode(request.prompt_text, [image])
    return RolloutRequest(ids.tolist(), request.prompt_text, [image], pixels, grid)


def test_bounds_policies_are_counted(model_dir, processor, requests_):
    request = requests_[0]
    long_request = dataclasses.replace(request, prompt_ids=[50] * 200 + request.prompt_ids)
    small = _with_image(processor, request, Image.new("RGB", (20, 20), "white"))
    thin = dataclasses.replace(request, images=[Image.new("RGB", (1000, 2), "white")])
    two_images = dataclasses.replace(request, images=[request.images[0]] * 2)
    batch = [request, long_request, small, thin, two_images]

    admitted, metrics = apply_bounds(batch, _policy(model_dir), max_tokens=12)
    assert [a.skipped for a in admitted] == [None, "prompt_overflow", None, "image_aspect_ratio", "image_pads_mismatch"]
    assert metrics.prompts == 5 and metrics.prompts_skipped == 3 and metrics.prompt_overflow_skipped == 1
    assert metrics.images_out_of_bounds == 1 and metrics.images_resized == 1 and metrics.image_unusable_skipped == 2

    admitted, metrics = apply_bounds(batch, _policy(model_dir, prompt_overflow="truncate", image_bounds="skip"), 12)
    assert [a.skipped for a in admitted][:3] == [None, None, "image_out_of_bounds"]
    cut = admitted[1]
    assert cut.truncated and len(cut.request.prompt_ids) == 300 - 12 and cut.request.prompt_text is None
    assert cut.request.prompt_ids[-len(request.prompt_ids) :] == request.prompt_ids  # only leading text dropped
    assert (
        metrics.prompt_overflow_truncated == 1 and metrics.prompt_tokens_truncated == len(long_request.prompt_ids) - 288
    )
    assert metrics.image_bounds_skipped == 1 and metrics.images_resized == 0

    runs = image_runs(request.prompt_ids, processor.image_token_id)
    images_only = _policy(model_dir, max_model_len=runs[0][1] - runs[0][0] + 12 + 1, prompt_overflow="truncate")
    admitted, metrics = apply_bounds([request], images_only, 12)  # the image block alone does not fit
    assert admitted[0].skipped == "prompt_overflow" and metrics.prompt_overflow_skipped == 1

    two = dataclasses.replace(
        request, prompt_ids=request.prompt_ids + request.prompt_ids[runs[0][0] - 1 : runs[0][1] + 1]
    )
    admitted, metrics = apply_bounds([dataclasses.replace(two, images=two_images.images)], _policy(model_dir), 12)
    assert admitted[0].skipped == "too_many_images" and metrics.image_unusable_skipped == 1
    with pytest.raises(ValueError, match="no room"):
        apply_bounds([request], _policy(model_dir), max_tokens=300)


def test_engines_apply_the_bounds_without_crashing(engine, processor, requests_):
    request = requests_[0]
    small = _with_image(processor, request, Image.new("RGB", (20, 20), "white"))  # below min_pixels: resized
    huge = dataclasses.replace(request, prompt_ids=[50] * 600 + request.prompt_ids)
    policy = engine.bounds
    try:
        engine.bounds = dataclasses.replace(policy, prompt_overflow="truncate")
        out = engine.generate([small, huge, request], SamplingConfig(max_tokens=4, temperature=0.0, n=1))
    finally:
        engine.bounds = policy
    assert out[0].prompt_ids == small.prompt_ids and len(out[0].samples) == 1  # same image tokens as the actor
    assert out[1].truncated and len(out[1].prompt_ids) == 512 - 4 and len(out[1].samples) == 1
    assert out[2].samples and out.metrics.images_resized == 1 and out.metrics.prompt_overflow_truncated == 1
    skipped = engine.generate([huge, request], SamplingConfig(max_tokens=4, temperature=0.0, n=1))
    assert skipped[0].skipped == "prompt_overflow" and skipped[0].samples == [] and skipped[1].samples
    assert skipped.metrics.prompt_overflow_skipped == 1 and skipped.metrics.prompts_skipped == 1


# ------------------------------------------------------------------------------------------------ sleep / seed
def test_an_asleep_engine_refuses_to_generate_until_woken(engine, requests_):
    engine.sleep(1)
    assert engine.asleep
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(requests_[:1], SamplingConfig(max_tokens=2, n=1))
    engine.wake_up()
    assert not engine.asleep
    assert engine.generate(requests_[:1], SamplingConfig(max_tokens=2, n=1))[0].samples


def test_only_asleep_memory_is_woken_and_generation_waits_for_all_of_it(engine, requests_, monkeypatch):
    """The colocated order (weights, then KV cache) and an engine woken while awake (a fresh one before its first
    rollout): the backend is asked only for what is asleep, and generation is refused (vLLM's paused scheduler
    would wait forever) until all of it is back."""
    woken: list[list[str]] = []
    wake = engine._wake_up

    def recorded(tags):
        woken.append(tags)
        wake(tags)

    monkeypatch.setattr(engine, "_wake_up", recorded)
    engine.wake_up(["weights"])  # awake: nothing to take back
    engine.sleep(2)
    engine.sleep(2)  # asleep already: nothing more to release
    engine.wake_up(["weights"])
    with pytest.raises(RuntimeError, match="kv_cache memory is asleep"):
        engine.generate(requests_[:1], SamplingConfig(max_tokens=2, n=1))
    engine.wake_up(["kv_cache"])
    engine.wake_up()
    engine.generate(requests_[:1], SamplingConfig(max_tokens=2, n=1))
    assert woken == [["weights"], ["kv_cache"]]


def test_hf_seed_repeats_samples(model_dir, config, requests_):
    from mm_rl.rollout.hf_engine import HfEngine

    twin = HfEngine(model_dir, config, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    state = torch.random.get_rng_state()
    first = [s.response_ids for o in twin.generate(requests_[:2], config.sampling_config) for s in o.samples]
    again = HfEngine(model_dir, config, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    assert [s.response_ids for o in again.generate(requests_[:2], config.sampling_config) for s in o.samples] == first
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG was not consumed


def test_hf_engine_takes_per_expert_weights_into_its_fused_experts(tmp_path, config):
    """The weight sync names routed experts one tensor per expert and part; transformers holds them fused
    (``gate_up_proj`` [E, 2F, H], ``down_proj`` [E, H, F]): the transformers engine writes each into its slice."""
    from safetensors.torch import load_file

    from mm_rl.rollout.hf_engine import HfEngine

    hf = tiny.build_tiny_checkpoint(tmp_path / "moe", seed=0, family="qwen3_5", num_experts=4)
    engine = HfEngine(hf, config, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    sent = {n: t + 1.0 for n, t in load_file(hf / "model.safetensors").items() if ".mlp.experts." in n}
    assert engine.update_weights(sent.items()) == len(sent) == 4 * 4 * 3  # layers x experts x parts
    layer = "model.language_model.layers.1.mlp.experts."
    gate_up, down = engine.tensors[layer + "gate_up_proj"], engine.tensors[layer + "down_proj"]
    assert torch.equal(gate_up[2, :32], sent[layer + "2.gate_proj.weight"])
    assert torch.equal(gate_up[2, 32:], sent[layer + "2.up_proj.weight"])
    assert torch.equal(down[3], sent[layer + "3.down_proj.weight"])


# ------------------------------------------------------------------------------------------------------- Ray
def test_ray_rollout_worker(model_dir, config, lean_requests, items, weights):
    import ray

    from mm_rl.rollout.engine_worker import rollout_worker_actor

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        worker = rollout_worker_actor(num_cpus=1).remote(
            str(model_dir), config, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, backend="vllm"
        )
        assert ray.get(worker.threads.remote()) == 1  # the thread budget follows the CPU reservation
        out = ray.get(worker.generate.remote(lean_requests[:2], config.sampling_config))
        assert [o.prompt_ids for o in out] == [item.input_ids.tolist() for item in items[:2]]
        assert all(len(o.samples) == 2 for o in out) and out.metrics.samples == 4
        assert ray.get(worker.update_weights.remote([("lm_head.weight", stop_head(weights))])) == 1
        ray.get(worker.sleep.remote(1))
        ray.get(worker.wake_up.remote())
        out = ray.get(worker.generate.remote(lean_requests[:1], SamplingConfig(max_tokens=4, temperature=0.0, n=1)))
        assert out[0].samples[0].finish_reason == "stop"  # the update outlived the sleep
    finally:
        ray.shutdown()
