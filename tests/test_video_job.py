"""Video prompts on the real stack: vLLM takes the clips with the actor's processor settings (its prompt ids equal
the actor's, Qwen3-VL's timestamps included), and the video demo (``tiny_video``: clips and prompts of one to three
images) runs as a whole job that learns and converts back."""

from mm_rl.platform import cpu_wheels

cpu_wheels.install()  # vLLM's Qwen2.5-VL and the processors import torchvision

import dataclasses  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402
from trainer_utils import ASSET_KEYS, run_job_in_process  # noqa: E402

from mm_rl.trainer.metrics import read_metrics  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.stack]


@pytest.mark.parametrize("family", ["qwen2vl", "qwen3_vl"])
def test_vllm_takes_clips_with_the_actors_ids(family, tmp_path):
    """vLLM expands each clip from its frames and metadata to exactly the actor's ids (it raises otherwise; Qwen3-VL
    with a timestamp before every frame pair), prompts with one to three images too; with other video pixel bounds
    than the actor's the ids differ and the engine says so."""
    from mm_rl.config.schema import GenerateConfig
    from mm_rl.data.dataset import PromptDataset, PromptProcessor
    from mm_rl.data.video import VideoSampling, VideoSettings
    from mm_rl.demo.synthetic_video import write_synthetic_video
    from mm_rl.demo.tiny import build_tiny_checkpoint
    from mm_rl.rollout.base import RolloutRequest, SamplingSpec
    from mm_rl.rollout.vllm_engine import VllmEngine

    model = build_tiny_checkpoint(tmp_path / "tiny", seed=0, family=family)
    video = VideoSettings(VideoSampling(2.0, 4, 8), 56 * 56, 84 * 84)
    processor = PromptProcessor(model, 56 * 56, 224 * 224, video)
    data = write_synthetic_video(tmp_path / "set", seed=2, train_size=6, test_size=0)
    dataset = PromptDataset(data, "train", processor, max_prompt_length=1024)
    requests = [RolloutRequest.from_item(dataset[i]) for i in range(len(dataset))]
    assert sum(bool(r.videos) for r in requests) == 4 and max(len(r.images) for r in requests) >= 1
    config = GenerateConfig(max_images_per_prompt=3, max_videos_per_prompt=1, max_model_len=512, max_num_seqs=8)
    engine = VllmEngine(model, config, min_pixels=56 * 56, max_pixels=224 * 224, seed=0, video=video)
    try:
        outputs = engine.generate(requests, SamplingSpec(max_tokens=8, temperature=1.0, n=2))
    finally:
        engine.close()
    assert all(len(output.samples) == 2 for output in outputs) and not any(o.skipped for o in outputs)
    if family != "qwen3_vl":
        return
    smaller = dataclasses.replace(video, max_pixels=60 * 60)
    other = VllmEngine(model, config, min_pixels=56 * 56, max_pixels=224 * 224, seed=0, video=smaller)
    try:
        with pytest.raises(RuntimeError, match="tokenised request"):
            other.generate([r for r in requests if r.videos][:1], SamplingSpec(max_tokens=4, temperature=1.0, n=1))
    finally:
        other.close()


STEPS = 20


def test_the_video_demo_learns_and_converts_back(video_base, tmp_path):
    """tiny_video: hf2mg -> GRPO on clips (files and frame lists) and one to three images per prompt -> mg2hf. The
    engine's log-probs equal the actor's within 1e-3 at every step (on policy: the clips' positions and pixels are
    the same on both sides), the reward rises, the generations log names each clip's frames."""
    from mm_rl.config.loader import load_job

    assets = (tmp_path / "out", video_base / "tiny_hf", video_base / "video_synthetic")
    job = load_job(
        video_base / "job.yaml",
        [f"{k}={v}" for k, v in zip(ASSET_KEYS, assets, strict=True)]
        + [
            f"backend_config.megatron_training.train_iters={STEPS}",
            "backend_config.rl_config.val_freq=0",
            "backend_config.rl_config.val_before_train=false",
        ],
    )
    result, _ = run_job_in_process(job)
    records = [r for r in read_metrics(tmp_path / "out" / "metrics.jsonl") if r["step"] > 0]
    rewards = [r["reward/score"] for r in records]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    gaps = [r["rollout/logprob_gap_max"] for r in records]
    print(f"\nvideo demo: reward of the first 4 steps {first:.3f}, of the last 4 {last:.3f}; gap max {max(gaps):.1e}")
    assert last > first + 0.1
    assert max(gaps) < 1e-3
    generations = [json.loads(line) for line in (tmp_path / "out" / "generations.jsonl").read_text().splitlines()]
    clips = [g for g in generations if "<|video_pad|>" in g["prompt"]]
    assert clips and all(g["video_frames"] == [6] for g in clips)
    assert any(g["prompt"].count("<|image_pad|>") > 1 for g in generations)  # several images in one prompt
    assert list(result.hf_dir.glob("*.safetensors"))
