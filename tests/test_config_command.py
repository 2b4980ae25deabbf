"""`ascendfactory-cli config` / `check`: what config writes passes check, plans fit, errors are clear."""

import pytest
from job_inputs import write_data_dir, write_hf_dir

from mm_rl.config.loader import ConfigError, load_job, load_section
from mm_rl.config.plan import batch_sizes, split_layers
from mm_rl.config.presets import load_preset
from mm_rl.config.schema import ModelConfig
from mm_rl.job.create import ClusterSpec, create_job
from mm_rl_cli.main import main

REAL = [
    "qwen2_5_vl_3b",
    "qwen2_5_vl_7b",
    "qwen2_5_vl_32b",
    "qwen2_5_vl_72b",
    "qwen2_vl_2b",
    "qwen2_vl_72b",
    "qwen3_vl_2b",
    "qwen3_vl_32b",
    "qwen3_vl_30b_a3b",
    "qwen3_vl_235b_a22b",
]


def preset_model(name):
    return load_section(ModelConfig, load_preset(name).model)


@pytest.fixture()
def paths(tmp_path):
    write_hf_dir(tmp_path / "hf")
    write_data_dir(tmp_path / "data")
    return ["--model_path", str(tmp_path / "hf"), "--dataset_dir", str(tmp_path / "data")]


@pytest.mark.parametrize("model", REAL)
@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_config_output_passes_check(model, nodes, tmp_path, paths, capsys):
    write_hf_dir(tmp_path / "hf", model=model)
    out = tmp_path / "job.yaml"
    argv = [
        "config",
        "--backend",
        "mm_rl",
        "--af_model_name",
        model,
        "--exp_name",
        "e",
        "--output_file_path",
        str(out),
        "--nnodes",
        str(nodes),
        "--nproc_per_node",
        "8",
        "--device",
        "npu",
        *paths,
        f"--af_output_dir={tmp_path / 'out'}",
        "--allow-oversubscribe",
    ]  # 72B on few nodes exceeds 64 GiB
    assert main(argv) == 0
    assert main(["check", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "ok\nparallel layout: world" in printed
    cfg = load_job(out)
    b = cfg.backend_config
    world = nodes * 8
    t = b.training
    assert world % (t.tensor_model_parallel_size * t.pipeline_model_parallel_size) == 0
    dp = world // (t.tensor_model_parallel_size * t.pipeline_model_parallel_size)
    assert b.megatron_training.global_batch_size % (b.actor_config.micro_batch_size * dp) == 0
    assert "${backend_config.actor_config.tensor_model_parallel_size}" in out.read_text()


def test_config_overrides_and_single_source(tmp_path, paths):
    out = tmp_path / "job.yaml"
    assert (
        main(
            [
                "config",
                "--af_model_name",
                "qwen2_5_vl_7b",
                "--output_file_path",
                str(out),
                "--nproc_per_node",
                "8",
                *paths,
                "--backend_config.actor_config.tensor_model_parallel_size=4",
                "--backend_config.actor_config.lr=2.5e-5",
            ]
        )
        == 0
    )
    cfg = load_job(out)
    assert cfg.backend_config.training.tensor_model_parallel_size == 4
    assert cfg.backend_config.convert_ckpt_mg2hf.cfg.parallel_config.tp_size == 4
    assert cfg.backend_config.training.lr == 2.5e-5


def test_unknown_model_and_backend_list_the_known(capsys):
    assert main(["config", "--af_model_name", "qwen3_vl"]) == 1
    err = capsys.readouterr().err
    assert "unknown model" in err and "qwen2_5_vl_7b" in err and "tiny" in err
    assert main(["config", "--af_model_name", "tiny", "--backend", "verl"]) == 1
    assert "unknown backend" in capsys.readouterr().err


def test_config_rejects_a_bad_override_without_writing(tmp_path, capsys):
    out = tmp_path / "job.yaml"
    assert (
        main(
            [
                "config",
                "--af_model_name",
                "qwen2_5_vl_7b",
                "--output_file_path",
                str(out),
                "--backend_config.actor_config.tensor_model_parallel_size=3",
            ]
        )
        == 1
    )
    assert "TP must divide" in capsys.readouterr().err
    assert not out.exists()


def test_check_reports_problems(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text("backend_config:\n  actor_config:\n    min_lr: 1.0\n")
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert "backend_config.actor_config.min_lr = 1.0: must not exceed lr" in err
    assert "Traceback" not in err


def test_vit_first_and_cost_balanced_split():
    model = preset_model("qwen2_5_vl_7b")
    vit, llm = split_layers(model, 4, seq_length=2048, image_tokens=334)
    assert vit == [32, 0, 0, 0]
    assert sum(llm) == 28 and min(llm) >= 1
    # 32 ViT blocks cost about 2-3 LLM layers, so stage 0 gets fewer LLM layers, but not a single one.
    assert 1 < llm[0] < max(llm[1:])
    vit, llm = split_layers(preset_model("qwen2_5_vl_72b"), 8, seq_length=2048, image_tokens=334)
    assert vit[0] == 32 and sum(llm) == 80 and min(llm) >= 1


def test_planner_picks_a_layout_that_fits_or_warns():
    # 8 nodes: the LLM's attention scores (math attention) and a colocated engine's share are part of the estimate
    _, job, plan = create_job("qwen2_5_vl_72b", "x", ClusterSpec(8, 8, "npu"))
    assert plan.fits and plan.tp * plan.pp > 1
    _, _, plan = create_job("qwen2_5_vl_72b", "x", ClusterSpec(1, 8, "npu", device_memory_gb=16))
    assert not plan.fits and "WARNING" in plan.describe()
    _, _, plan = create_job("qwen2_5_vl_3b", "x", ClusterSpec(1, 8, "npu"))
    assert (plan.tp, plan.pp) == (1, 1)


def test_the_7b_gpu_plan_leaves_the_device_a_real_margin():
    """One 8-GPU node, 7B: the plan may fill 80 - 6 reserved GiB (three processes' CUDA contexts, NCCL buffers,
    fragmentation), so TP 1 (77.8 GiB in training) no longer fits and TP 2 does, with room to spare; the plan table
    shows the reserve and the margin. A reserve of 0 brings back the layout that fills the device."""
    from mm_rl.config.plan import current_plan

    _, job, plan = create_job("qwen2_5_vl_7b", "x", ClusterSpec(1, 8, "cuda"))
    assert (plan.tp, plan.reserve_gb) == (2, 6.0) and plan.peak <= 74.0 and plan.margin_gb > 5
    assert "6.0 reserved" in plan.describe() and f"margin at the peak: {plan.margin_gb:.1f} GiB" in plan.describe()
    job.env.DEVICE_MEMORY_RESERVE_GB = 0.0
    assert current_plan(job).usable_gb == 80.0
    _, _, bare = create_job("qwen2_5_vl_7b", "x", ClusterSpec(1, 8, "cpu"))
    assert bare.reserve_gb == 0.0  # a CPU host has no device contexts


def test_config_gives_a_colocated_engine_the_tp_its_weights_need():
    """32B in bf16 (~62 GiB) beside the actor on 64 GiB devices: engine TP 1 would leave its KV cache nothing of its
    share, so config picks the smallest TP within the node that does; 3B keeps TP 1; where no TP fits, the plan
    warns."""
    _, job, plan = create_job("qwen2_5_vl_32b", "x", ClusterSpec(1, 8, "npu"))
    tp = job.backend_config.generate_config.infer_tensor_parallel_size
    assert tp > 1 and plan.engine_tp == tp and plan.engine_fits
    assert plan.engine_weights * tp > 0.9 * plan.engine_share  # the whole model on one device would not fit
    assert f"colocated engine: TP {tp}" in plan.describe()
    _, job, plan = create_job("qwen2_5_vl_3b", "x", ClusterSpec(1, 8, "npu"))
    assert job.backend_config.generate_config.infer_tensor_parallel_size == 1 and plan.engine_fits
    _, _, plan = create_job("qwen2_5_vl_72b", "x", ClusterSpec(1, 8, "npu", device_memory_gb=16))
    assert not plan.engine_fits and "the engine's weights leave its KV cache" in plan.describe()


def test_bigger_device_memory_needs_less_model_parallelism():
    small = create_job("qwen2_5_vl_32b", "x", ClusterSpec(2, 8, "npu", device_memory_gb=32))[2]
    large = create_job("qwen2_5_vl_32b", "x", ClusterSpec(2, 8, "npu", device_memory_gb=96))[2]
    assert small.tp * small.pp > large.tp * large.pp


def test_batch_sizes():
    assert batch_sizes(dp=4, micro_batch_size=2, n_samples=8, target_gbs=60, target_prompts=30) == (64, 32)
    gbs, prompts = batch_sizes(dp=3, micro_batch_size=1, n_samples=5, target_gbs=16, target_prompts=8)
    assert gbs % 3 == 0 and (prompts * 5) % gbs == 0


def test_bad_cli_value_is_an_error_not_a_traceback(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["config", "--af_model_name", "tiny", "--nnodes", "two"])
    assert "invalid int value" in capsys.readouterr().err
    with pytest.raises(ConfigError):
        create_job("tiny", "x", ClusterSpec(), overrides=["--env.NNODES"])


def test_tiny_config_builds_its_model_and_data_and_passes_check(tiny_base, capsys):
    """The session's ``config --af_model_name tiny`` (conftest) built everything the job names."""
    out = tiny_base / "job.yaml"
    assert (tiny_base / "tiny_hf" / "model.safetensors").is_file()
    assert (tiny_base / "geo3k_synthetic" / "train.parquet").is_file()
    assert (tiny_base / "tiny_hf" / "tiny_warmup.json").is_file()
    assert main(["check", str(out)]) == 0  # includes the tiny model.json vs the checkpoint's config.json
    assert "world 1 = TP 1 x PP 1 x DP 1" in capsys.readouterr().out
    cfg = load_job(out)
    assert cfg.env.DEVICE == "cpu" and cfg.backend_config.model.text_decoder.vocab_size == 1024


@pytest.mark.parametrize(
    ("model", "billions"),
    [
        ("qwen2_5_vl_3b", 3.75),
        ("qwen2_5_vl_7b", 8.29),
        ("qwen2_5_vl_72b", 73.4),
        ("qwen2_vl_2b", 2.21),
        ("qwen2_vl_7b", 8.29),
        ("qwen2_vl_72b", 73.4),
        ("qwen3_vl_2b", 2.13),
        ("qwen3_vl_4b", 4.44),
        ("qwen3_vl_8b", 8.77),
        ("qwen3_vl_32b", 33.4),
        ("qwen3_vl_30b_a3b", 31.1),
        ("qwen3_vl_235b_a22b", 236),
        # Qwen3.5: transformers' Qwen3_5ForConditionalGeneration built from each preset's config.json on the meta
        # device (the cards round to 0.8B, 2B, 4B, 9B, 27B; the 9B's LLM alone, as GGUF counts it: 8.95B)
        ("qwen3_5_0_8b", 0.853),
        ("qwen3_5_2b", 2.213),
        ("qwen3_5_4b", 4.539),
        ("qwen3_5_9b", 9.410),
        ("qwen3_5_27b", 27.36),
        ("qwen3_5_35b_a3b", 35.11),
        ("qwen3_5_122b_a10b", 122.56),
        ("qwen3_5_397b_a17b", 396.8),
    ],
)
def test_presets_have_the_published_parameter_counts(model, billions):
    """The planner's parameter count of each preset matches the model card's (safetensors total), so the presets'
    shapes and the memory estimates built on them are those of the published checkpoints."""
    from mm_rl.config.plan import model_parameters

    assert model_parameters(preset_model(model)) / 1e9 == pytest.approx(billions, rel=0.01)


@pytest.mark.parametrize("model", ["qwen3_vl_30b_a3b", "qwen3_vl_235b_a22b"])
def test_moe_plans_spread_the_experts(model, tmp_path, paths):
    """An MoE preset's plan has no TP (megatron trains MoE with TP only under sequence parallelism), spreads the
    experts with EP inside DP, and passes check."""
    write_hf_dir(tmp_path / "hf", model=model)
    out = tmp_path / "job.yaml"
    argv = [
        "config",
        "--backend",
        "mm_rl",
        "--af_model_name",
        model,
        "--exp_name",
        "e",
        "--output_file_path",
        str(out),
        "--nnodes",
        "4",
        "--nproc_per_node",
        "8",
        "--device",
        "npu",
        *paths,
        f"--af_output_dir={tmp_path / 'out'}",
        "--allow-oversubscribe",
    ]
    assert main(argv) == 0 and main(["check", str(out)]) == 0
    b = load_job(out).backend_config
    ep, tp = b.actor_config.expert_model_parallel_size, b.actor_config.tensor_model_parallel_size
    assert tp == 1 and ep > 1 and 128 % ep == 0
    assert b.convert_ckpt_hf2mg.cfg.parallel_config.ep_size == ep


@pytest.mark.parametrize("model", ["qwen3_5_9b", "qwen3_5_27b", "qwen3_5_35b_a3b"])
def test_qwen3_5_plans_pass_check_and_count_the_engines_recurrent_states(model, tmp_path, paths):
    """A Qwen3.5 preset's plan on 8-device nodes passes check; a colocated engine's share holds its weights and the
    Gated DeltaNet states of max_num_seqs sequences (tens of MiB each at 27B)."""
    from mm_rl.config.plan import engine_state_gb, recurrent_state_bytes

    write_hf_dir(tmp_path / "hf", model=model)
    out = tmp_path / "job.yaml"
    argv = ["config", "--backend", "mm_rl", "--af_model_name", model, "--exp_name", "e", "--output_file_path",
            str(out), "--nnodes", "2", "--nproc_per_node", "8", "--device", "npu", *paths,
            f"--af_output_dir={tmp_path / 'out'}", "--allow-oversubscribe"]  # fmt: skip
    assert main(argv) == 0 and main(["check", str(out)]) == 0
    cfg = load_job(out)
    text = cfg.backend_config.model.text_decoder
    layers = text.layer_types.count("linear_attention")
    assert layers == text.num_layers * 3 // 4
    per_layer = text.linear_num_value_heads * 128 * 128 + (2 * 16 * 128 + text.linear_num_value_heads * 128) * 3
    assert recurrent_state_bytes(text) == layers * per_layer * 2
    assert engine_state_gb(cfg) > 0


def test_the_planner_keeps_deepstack_layers_with_the_vit():
    """Qwen3-VL's first 3 LLM layers take DeepStack features: whatever the PP size, they share the ViT's stage."""
    from mm_rl.config.plan import split_layers

    model = preset_model("qwen3_vl_8b")
    for pp in (2, 4, 8):
        vit, llm = split_layers(model, pp, seq_length=2048, image_tokens=4096)
        assert vit[0] == 27 and not any(vit[1:]) and llm[0] >= 3, (pp, vit, llm)
