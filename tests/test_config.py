"""The job yaml: schema, loading, overrides, interpolation, and one test per validation rule."""

import dataclasses
import json

import pytest
from job_inputs import write_data_dir, write_hf_dir

from mm_rl.config.loader import ConfigError, all_key_paths, compose, load_job, parse_overrides, to_job
from mm_rl.config.schema import defaults
from mm_rl.config.writer import job_yaml
from mm_rl.job.validate import validate

TEXT = "backend_config.model.text_decoder"
VIT = "backend_config.model.image_encoder.vision_encoder"
PROJ = "backend_config.model.image_encoder.vision_projector"
ACTOR = "backend_config.actor_config"
TRAIN = "backend_config.training"
RL = "backend_config.rl_config"
GEN = "backend_config.generate_config"
NPU = "env.DEVICE=npu"


def job(*overrides):
    return load_job(None, [f"--{o}" for o in overrides])


def broken_keys(*overrides):
    return {v.key for v in validate(job(*overrides), check_paths=False)}


def test_defaults_are_valid_and_round_trip(tmp_path):
    assert validate(job(), check_paths=False) == []
    from omegaconf import OmegaConf

    path = tmp_path / "job.yaml"
    path.write_text(job_yaml(OmegaConf.create(defaults()), "header"))
    assert load_job(path) == job()
    assert "${backend_config.actor_config.tensor_model_parallel_size}" in path.read_text()


SEED_002_PATHS = [
    "af_output_dir",
    "backend_config.megatron_training.tokenizer_name_or_path",
    "backend_config.data.dataset_param.basic_parameters.dataset_dir",
    "backend_config.data.dataset_param.preprocess_parameters.model_name_or_path",
    "backend_config.convert_ckpt_hf2mg.cfg.mm_dir",
    "backend_config.convert_ckpt_hf2mg.cfg.hf_config.hf_dir",
    "backend_config.convert_ckpt_hf2mg.cfg.parallel_config.tp_size",
    "backend_config.convert_ckpt_hf2mg.cfg.parallel_config.llm_pp_layers",
    "backend_config.convert_ckpt_hf2mg.cfg.parallel_config.vit_pp_layers",
    "backend_config.convert_ckpt_mg2hf.cfg.save_hf_dir",
    "backend_config.convert_ckpt_mg2hf.cfg.parallel_config.tp_size",
    "backend_config.convert_ckpt_mg2hf.cfg.parallel_config.llm_pp_layers",
    "backend_config.convert_ckpt_mg2hf.cfg.parallel_config.vit_pp_layers",
    "backend_config.actor_config.micro_batch_size",
    "backend_config.megatron_training.global_batch_size",
    "backend_config.actor_config.tensor_model_parallel_size",
    "backend_config.actor_config.pipeline_model_parallel_size",
    "backend_config.actor_config.lr",
    "backend_config.actor_config.min_lr",
    "backend_config.megatron_training.train_iters",
    "backend_config.megatron_training.save_interval",
    "backend_config.training.tensor-model-parallel-size",
    "backend_config.training.pipeline-model-parallel-size",
    "env.NNODES",
    "env.NODE_RANK",
    "env.NPROC_PER_NODE",
]


@pytest.mark.parametrize("path", SEED_002_PATHS)
def test_seed_key_paths_exist(path):
    assert path in set(all_key_paths())


def test_repeated_values_have_one_source():
    cfg = job(
        f"{ACTOR}.tensor_model_parallel_size=2",
        "env.NPROC_PER_NODE=2",
        f"{ACTOR}.pipeline_model_parallel_size=2",
        "env.NNODES=2",
        f"{TEXT}.pipeline_num_layers=[10,18]",
        f"{VIT}.pipeline_num_layers=[32,0]",
        "backend_config.megatron_training.tokenizer_name_or_path=/models/qwen",
        "af_output_dir=/out",
    )
    b = cfg.backend_config
    assert b.training.tensor_model_parallel_size == 2 and b.training.pipeline_model_parallel_size == 2
    for stage in (b.convert_ckpt_hf2mg.cfg, b.convert_ckpt_mg2hf.cfg):
        assert stage.parallel_config.tp_size == 2
        assert stage.parallel_config.llm_pp_layers == [10, 18]
        assert stage.parallel_config.vit_pp_layers == [32, 0]
    assert b.convert_ckpt_hf2mg.cfg.mm_dir == "/out/converted_weight_TP2_PP2"
    assert b.convert_ckpt_hf2mg.cfg.hf_config.hf_dir == "/models/qwen"
    assert b.data.dataset_param.preprocess_parameters.model_name_or_path == "/models/qwen"
    assert b.convert_ckpt_mg2hf.cfg.save_hf_dir == "/out/ckpt_converted_mg2hf"
    assert b.generate_config.sampling_config.n == b.rl_config.n_samples_per_prompt
    assert validate(cfg, check_paths=False) == []


def test_override_forms():
    assert parse_overrides(["--a.b=1", "c.d=x", "--e.f", "[1,2]"]) == ["a.b=1", "c.d=x", "e.f=[1,2]"]
    with pytest.raises(ConfigError, match="needs a value"):
        parse_overrides(["--a.b"])
    cfg = load_job(None, ["--backend_config.training.seq-length", "4096", "--env.NNODES=2"])
    assert cfg.backend_config.training.seq_length == 4096 and cfg.env.NNODES == 2


def test_yaml_then_overrides_win(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("backend_config:\n  actor_config:\n    lr: 3.0e-6\n    min_lr: 1e-7\n")
    cfg = load_job(path, ["--backend_config.actor_config.min_lr=2e-7"])
    assert cfg.backend_config.actor_config.lr == 3e-6
    assert cfg.backend_config.actor_config.min_lr == 2e-7
    assert cfg.backend_config.training.lr == 3e-6


@pytest.mark.parametrize(
    ("key", "suggestion"),
    [
        ("backend_config.actor_config.micro_batch_sise", "backend_config.actor_config.micro_batch_size"),
        ("backend_config.training.micro_batch_size", "backend_config.training.micro-batch-size"),
        ("env.NNODE", "env.NNODES"),
        ("backend_config.actor_config.train_iters", "backend_config.megatron_training.train_iters"),
    ],
)
def test_unknown_keys_suggest_the_nearest(key, suggestion):
    with pytest.raises(ConfigError) as err:
        load_job(None, [f"--{key}=1"])
    (violation,) = err.value.violations
    assert violation.key == key and violation.rule == "unknown key" and f"'{suggestion}'" in violation.fix


@pytest.mark.parametrize(
    ("override", "why"),
    [
        ("backend_config.actor_config.recompute_activations=false", "never had an effect"),
        ("env.MASTER_ADDR=10.0.0.1", "find each other through Ray"),  # MindSpeed's rendezvous keys: nothing read them
        ("env.MASTER_PORT=70000", "env.RAY_ADDRESS"),
    ],
)
def test_a_retired_key_says_why_it_is_gone(override, why):
    with pytest.raises(ConfigError) as err:
        load_job(None, [f"--{override}"])
    (violation,) = err.value.violations
    assert violation.rule == "unknown key" and why in violation.fix and violation.meant is None


def test_type_errors_are_all_reported_once(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(
        "env:\n  NNODES: two\nbackend_config:\n  rl_config:\n    n_samples_per_prompt: four\n"
        "  training:\n    bf16: maybe\n"
    )
    with pytest.raises(ConfigError) as err:
        load_job(path)
    assert [v.key for v in err.value.violations] == [
        "env.NNODES",
        "backend_config.training.bf16",
        "backend_config.rl_config.n_samples_per_prompt",
    ]


def test_broken_interpolation_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not resolve"):
        load_job(None, ["--af_output_dir=${nowhere}"])
    path = tmp_path / "bad.yaml"
    path.write_text("env: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid yaml"):
        load_job(path)
    with pytest.raises(ConfigError, match="file not found"):
        load_job(tmp_path / "missing.yaml")


# One case per rule: overrides that break it, the key it must name, and overrides that satisfy it.
RULE_CASES = {
    "world": (
        ["env.NPROC_PER_NODE=3", f"{ACTOR}.tensor_model_parallel_size=2"],
        "env.NPROC_PER_NODE",
        ["env.NPROC_PER_NODE=4", f"{ACTOR}.tensor_model_parallel_size=2"],
    ),
    "gbs_multiple": (
        ["env.NPROC_PER_NODE=4", "backend_config.megatron_training.global_batch_size=2", f"{ACTOR}.micro_batch_size=1"],
        "backend_config.megatron_training.global_batch_size",
        ["env.NPROC_PER_NODE=4", "backend_config.megatron_training.global_batch_size=8"],
    ),
    "rollout_fills_gbs": (
        ["backend_config.megatron_training.global_batch_size=24"],
        "backend_config.megatron_training.global_batch_size",
        ["backend_config.megatron_training.global_batch_size=32"],
    ),
    "tp_divides": (
        ["env.NPROC_PER_NODE=3", f"{ACTOR}.tensor_model_parallel_size=3"],
        f"{ACTOR}.tensor_model_parallel_size",
        ["env.NPROC_PER_NODE=4", f"{ACTOR}.tensor_model_parallel_size=4"],
    ),
    "query_groups": ([f"{TEXT}.num_query_groups=3"], f"{TEXT}.num_query_groups", [f"{TEXT}.num_query_groups=7"]),
    "vocab": (
        [f"{TRAIN}.make-vocab-size-divisible-by=1000"],
        f"{TRAIN}.make-vocab-size-divisible-by",
        [f"{TRAIN}.make-vocab-size-divisible-by=128"],
    ),
    "pp_entries": (
        ["env.NPROC_PER_NODE=2", f"{ACTOR}.pipeline_model_parallel_size=2", f"{VIT}.pipeline_num_layers=[32,0]"],
        f"{TEXT}.pipeline_num_layers",
        [
            "env.NPROC_PER_NODE=2",
            f"{ACTOR}.pipeline_model_parallel_size=2",
            f"{VIT}.pipeline_num_layers=[32,0]",
            f"{TEXT}.pipeline_num_layers=[10,18]",
        ],
    ),
    "pp_sum": (
        [f"{TEXT}.pipeline_num_layers=[27]"],
        f"{TEXT}.pipeline_num_layers",
        [f"{TEXT}.pipeline_num_layers=[28]"],
    ),
    "vit_first": (
        [
            "env.NPROC_PER_NODE=4",
            f"{ACTOR}.pipeline_model_parallel_size=4",
            f"{VIT}.pipeline_num_layers=[30,2,0,0]",
            f"{TEXT}.pipeline_num_layers=[1,10,10,7]",
        ],
        VIT + ".pipeline_num_layers",
        [
            "env.NPROC_PER_NODE=4",
            f"{ACTOR}.pipeline_model_parallel_size=4",
            f"{VIT}.pipeline_num_layers=[32,0,0,0]",
            f"{TEXT}.pipeline_num_layers=[1,10,10,7]",
        ],
    ),
    "conversion": (
        ["backend_config.convert_ckpt_hf2mg.cfg.parallel_config.tp_size=2"],
        "backend_config.convert_ckpt_hf2mg.cfg.parallel_config.tp_size",
        ["backend_config.convert_ckpt_hf2mg.cfg.parallel_config.tp_size=1"],
    ),
    "conversion_layers": (
        ["backend_config.convert_ckpt_mg2hf.cfg.parallel_config.llm_pp_layers=[20]"],
        "backend_config.convert_ckpt_mg2hf.cfg.parallel_config.llm_pp_layers",
        ["backend_config.convert_ckpt_mg2hf.cfg.parallel_config.llm_pp_layers=[28]"],
    ),
    "mrope": ([f"{TEXT}.mrope_section=[16,24,16]"], f"{TEXT}.mrope_section", [f"{TEXT}.mrope_section=[32,32]"]),
    "projector": ([f"{PROJ}.hidden_size=3072"], f"{PROJ}.hidden_size", [f"{PROJ}.hidden_size=3584"]),
    "llm_hidden": ([f"{TEXT}.llm_hidden_size=3072"], f"{TEXT}.llm_hidden_size", [f"{TEXT}.llm_hidden_size=3584"]),
    "fused_rmsnorm": (
        [f"{TRAIN}.use-fused-rmsnorm=true", f"{TEXT}.normalization=LayerNorm"],
        f"{TRAIN}.use-fused-rmsnorm",
        [f"{TRAIN}.use-fused-rmsnorm=true"],
    ),
    "fused_swiglu": (
        [f"{TRAIN}.use-fused-swiglu=true", f"{TEXT}.swiglu=false"],
        f"{TRAIN}.use-fused-swiglu",
        [f"{TRAIN}.use-fused-swiglu=true"],
    ),
    "cp_algo": (
        [f"{TRAIN}.context-parallel-algo=ulysses_cp_algo"],
        f"{TRAIN}.context-parallel-algo",
        ["env.NPROC_PER_NODE=2", f"{TRAIN}.context-parallel-size=2", f"{TRAIN}.context-parallel-algo=ulysses_cp_algo"],
    ),
    "lr": ([f"{ACTOR}.min_lr=1e-5"], f"{ACTOR}.min_lr", [f"{ACTOR}.min_lr=1e-7"]),
    "warmup": ([f"{TRAIN}.lr-warmup-fraction=1.0"], f"{TRAIN}.lr-warmup-fraction", [f"{TRAIN}.lr-warmup-fraction=0.1"]),
    "save_interval": (
        ["backend_config.megatron_training.save_interval=0"],
        "backend_config.megatron_training.save_interval",
        ["backend_config.megatron_training.save_interval=5"],
    ),
    "freeze_vit": ([f"{VIT}.freeze=false"], f"{VIT}.freeze", [f"{ACTOR}.unfreeze_vision_encoder=true"]),
    "freeze_projector": ([f"{PROJ}.freeze=true"], f"{PROJ}.freeze", [f"{ACTOR}.freeze_vision_projector=true"]),
    "group_size": (
        ["backend_config.rl_config.n_samples_per_prompt=1"],
        "backend_config.rl_config.n_samples_per_prompt",
        ["backend_config.rl_config.n_samples_per_prompt=4"],
    ),
    "dual_clip": (
        ["backend_config.rl_config.clip_ratio_c=0.5"],
        "backend_config.rl_config.clip_ratio_c",
        ["backend_config.rl_config.clip_ratio_c=10.0"],
    ),
    "reward_fn": (
        ["backend_config.rl_config.reward.function=geo3k"],
        "backend_config.rl_config.reward.function",
        ["backend_config.rl_config.reward.function=my.module:score"],
    ),
    "overlong": (
        [f"{RL}.overlong_buffer.enable=true"],
        f"{RL}.overlong_buffer.len",
        [f"{RL}.overlong_buffer.enable=true", f"{RL}.overlong_buffer.len=128"],
    ),
    "seq_budget": ([f"{TRAIN}.seq-length=1000"], f"{TRAIN}.seq-length", [f"{TRAIN}.seq-length=1536"]),
    "positive": ([f"{ACTOR}.micro_batch_size=0"], f"{ACTOR}.micro_batch_size", [f"{ACTOR}.micro_batch_size=2"]),
    "node_rank": (["env.NODE_RANK=1"], "env.NODE_RANK", ["env.NNODES=2", "env.NODE_RANK=1"]),
    "engine_colocated_splits_the_node": (
        [NPU, "env.NPROC_PER_NODE=3", f"{GEN}.infer_tensor_parallel_size=2"],
        f"{GEN}.infer_tensor_parallel_size",
        [NPU, "env.NPROC_PER_NODE=2", f"{GEN}.infer_tensor_parallel_size=2"],
    ),
    "engine_leaves_devices": (
        [NPU, f"{GEN}.colocate=false"],
        f"{GEN}.colocate",
        [NPU, f"{GEN}.colocate=false", "env.NPROC_PER_NODE=2"],
    ),
    "engine_on_one_node": (
        [NPU, "env.NNODES=2", "env.NPROC_PER_NODE=2", f"{GEN}.colocate=false", f"{GEN}.infer_tensor_parallel_size=4"],
        f"{GEN}.infer_tensor_parallel_size",
        [NPU, "env.NNODES=2", "env.NPROC_PER_NODE=4", f"{GEN}.colocate=false", f"{GEN}.infer_tensor_parallel_size=4"],
    ),
    "world_minus_engine": (
        [NPU, "env.NPROC_PER_NODE=4", f"{ACTOR}.tensor_model_parallel_size=2", f"{GEN}.colocate=false"],
        "env.NPROC_PER_NODE",
        [NPU, "env.NPROC_PER_NODE=5", f"{ACTOR}.tensor_model_parallel_size=2", f"{GEN}.colocate=false"],
    ),
    "group_size_baseline": (
        [f"{RL}.adv_estimator=reinforce_plus_plus_baseline", f"{RL}.n_samples_per_prompt=1"],
        f"{RL}.n_samples_per_prompt",
        [
            f"{RL}.adv_estimator=reinforce_plus_plus",
            f"{RL}.n_samples_per_prompt=1",
            "backend_config.megatron_training.global_batch_size=8",
        ],
    ),
    "clip_low_band": (
        [f"{RL}.clip_ratio_low=1.0"],
        f"{RL}.clip_ratio_low",
        [f"{RL}.clip_ratio_low=1.0", f"{RL}.policy_loss=cispo"],
    ),
    "gspo_per_sequence": (
        [f"{RL}.policy_loss=gspo"],
        f"{RL}.loss_agg_mode",
        [f"{RL}.policy_loss=gspo", f"{RL}.loss_agg_mode=seq-mean-token-mean"],
    ),
    "sapo_tau": (
        [f"{RL}.policy_loss=sapo", f"{RL}.tau_neg=0"],
        f"{RL}.tau_neg",
        [f"{RL}.policy_loss=sapo", f"{RL}.tau_neg=1.05"],
    ),
    "is_threshold": (
        [f"{RL}.rollout_correction.rollout_is_threshold=1.0"],
        f"{RL}.rollout_correction.rollout_is_threshold",
        [f"{RL}.rollout_correction.rollout_is=sequence", f"{RL}.rollout_correction.rollout_is_threshold=5"],
    ),
    "bypass_no_op": (
        [f"{RL}.rollout_correction.bypass_mode=true", f"{RL}.rollout_correction.rollout_is=token"],
        f"{RL}.rollout_correction.rollout_is",
        [f"{RL}.rollout_correction.bypass_mode=true", f"{RL}.one_step_off_policy=true"],
    ),
}


@pytest.mark.parametrize("case", list(RULE_CASES))
def test_rule(case):
    bad, key, good = RULE_CASES[case]
    assert key in broken_keys(*bad)
    assert broken_keys(*good) == set()


def test_five_mistakes_give_five_violations(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("""
backend_config:
  actor_config: {min_lr: 1.0e-3}
  training: {context-parallel-algo: ulysses_cp_algo, lr-warmup-fraction: 1.5}
  model:
    text_decoder: {mrope_section: [16, 16, 16]}
    image_encoder:
      vision_encoder: {freeze: false}
""")
    problems = validate(load_job(path), check_paths=False)
    assert len(problems) == 5
    assert all(p.fix and p.rule for p in problems)


def test_error_names_key_value_rule_and_fix():
    (problem,) = validate(job(f"{TEXT}.mrope_section=[16,24,16]"), check_paths=False)
    text = str(problem)
    assert text.startswith(f"{TEXT}.mrope_section = [16, 24, 16]: must sum to the rotary dim / 2 = 64")
    assert "Fix:" in text


def _paths(tmp_path, **extra):
    hf = write_hf_dir(tmp_path / "hf", model="qwen2_5_vl_7b")  # the schema's defaults
    data = write_data_dir(tmp_path / "data")
    return job(
        f"backend_config.megatron_training.tokenizer_name_or_path={hf}",
        f"backend_config.data.dataset_param.basic_parameters.dataset_dir={data}",
        f"af_output_dir={tmp_path / 'out'}",
        *[f"{k}={v}" for k, v in extra.items()],
    )


def test_paths_must_exist_and_outputs_be_writable(tmp_path):
    assert validate(_paths(tmp_path)) == []
    missing = {v.key for v in validate(job())}
    assert {
        "backend_config.data.dataset_param.basic_parameters.dataset_dir",
        "backend_config.megatron_training.tokenizer_name_or_path",
    } <= missing
    (tmp_path / "afile").write_text("x")
    cfg = _paths(
        tmp_path,
        af_output_dir=tmp_path / "afile" / "out",
        **{"backend_config.convert_ckpt_hf2mg.cfg.hf_config.hf_dir": tmp_path / "nope"},
    )
    keys = {v.key for v in validate(cfg)}
    assert {"af_output_dir", "backend_config.convert_ckpt_hf2mg.cfg.hf_config.hf_dir"} <= keys


def _hf_config(**text):
    text_config = {
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "num_hidden_layers": 28,
        "tie_word_embeddings": False,
    } | text
    return {
        "model_type": "qwen2_5_vl",
        "image_token_id": 151655,
        "vision_start_token_id": 151652,
        "text_config": text_config,
        "vision_config": {"hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "depth": 32},
    }


def test_checkpoint_config_must_match(tmp_path):
    cfg = _paths(tmp_path)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(_hf_config()))
    assert validate(cfg) == []
    assert validate(_paths(tmp_path, **{f"{TEXT}.num_layers": 24, f"{TEXT}.pipeline_num_layers": "[24]"})) == []
    (tmp_path / "hf" / "config.json").write_text(
        json.dumps(_hf_config(vocab_size=151936, num_hidden_layers=20, tie_word_embeddings=True))
    )
    keys = {v.key for v in validate(cfg)}
    assert keys == {f"{TEXT}.vocab_size", f"{TEXT}.num_layers", f"{TEXT}.untie_embeddings_and_output_weights"}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(_hf_config() | {"image_token_id": 1}))
    assert {v.key for v in validate(cfg)} == {"backend_config.model.img_context_token_id"}


def test_compose_keeps_interpolations_unresolved():
    node = compose(None, ["--backend_config.actor_config.tensor_model_parallel_size=4"])
    raw = node.backend_config.convert_ckpt_hf2mg.cfg.parallel_config._get_node("tp_size")._value()
    assert raw == "${backend_config.actor_config.tensor_model_parallel_size}"
    assert to_job(node).backend_config.convert_ckpt_hf2mg.cfg.parallel_config.tp_size == 4


def test_topology_is_the_one_place_for_world_dp_engine_devices_and_threads():
    from mm_rl.config.topology import topology

    gen = "--backend_config.generate_config"
    job = load_job(
        None,
        [
            "--env.DEVICE=npu",
            "--env.NNODES=2",
            "--env.NPROC_PER_NODE=8",
            f"{gen}.colocate=false",
            f"{gen}.infer_tensor_parallel_size=2",
            "--backend_config.actor_config.tensor_model_parallel_size=2",
        ],
    )
    topo = topology(job)
    assert (topo.world_size, topo.rollout_devices, topo.dp) == (14, 2, 7)
    assert topo.rank_threads(cores=56) == 2 and topo.engine_threads() is None  # half of 56 // 14 on accelerators
    cpu = topology(load_job(None, ["--env.NPROC_PER_NODE=2", f"{gen}.colocate=false"]))
    assert (cpu.world_size, cpu.rollout_devices, cpu.rank_threads(cores=8), cpu.engine_threads(cores=8)) == (2, 0, 4, 8)
    overlap = dataclasses.replace(cpu, rollout_overlaps=True)  # one-step-off-policy: the engine runs beside the ranks
    assert (overlap.rank_threads(cores=8), overlap.engine_threads(cores=8)) == (2, 4)
    assert (overlap.rank_threads(cores=2), overlap.engine_threads(cores=2)) == (1, 1)
    assert topo.with_layout(1, 2).dp == 7 and topo.with_layout(7, 2).dp == 1


def test_one_step_off_policy_needs_an_engine_that_does_not_sleep_and_no_dynamic_sampling():
    rl = "backend_config.rl_config"
    on = f"{rl}.one_step_off_policy=true"
    assert not broken_keys(on)  # CPU: the engine runs on the host beside the ranks
    accelerator = ("env.DEVICE=npu", "env.NPROC_PER_NODE=2", "backend_config.training.bf16=true")
    assert broken_keys(on, *accelerator) == {f"{rl}.one_step_off_policy"}
    assert not broken_keys(on, *accelerator, "backend_config.generate_config.colocate=false")
    assert broken_keys(on, f"{rl}.dynamic_sampling.enable=true") == {f"{rl}.dynamic_sampling.enable"}


def test_algorithm_choices_load_with_their_defaults():
    rl = job().backend_config.rl_config
    assert (rl.adv_estimator, rl.grpo_std, rl.policy_loss, rl.tau_pos, rl.tau_neg) == (
        "grpo",
        "unbiased",
        "ppo_clip",
        1.0,
        1.05,
    )
    rc = rl.rollout_correction
    assert (rc.rollout_is, rc.rollout_is_mode, rc.rollout_is_threshold, rc.bypass_mode) == (
        "auto",
        "truncate",
        2.0,
        False,
    )
    off = job(
        f"{RL}.rollout_correction.rollout_is=null",
        f"{RL}.rollout_correction.rollout_is_mode=mask",
        f"{RL}.grpo_std=biased",
        f"{RL}.policy_loss=cispo",
    ).backend_config.rl_config
    assert off.rollout_correction.rollout_is is None and off.rollout_correction.rollout_is_mode == "mask"
    assert (off.grpo_std, off.policy_loss) == ("biased", "cispo")
    with pytest.raises(ConfigError, match="rollout_is"):
        job(f"{RL}.rollout_correction.rollout_is=off")  # yaml reads off as false: null is the way to turn it off


def _preset_job(name, *overrides):
    """A job whose model section is preset ``name``'s model.json."""
    from mm_rl.config.presets import load_preset

    model = load_preset(name).model
    flat = [f"backend_config.model.{key}={json.dumps(value)}" for key, value in _flatten(model)]
    return job(*flat, *overrides)


def _flatten(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def test_model_family_rules():
    """An unknown model_id, a field the family's checkpoints fix, and DeepStack's placement rules are each
    reported on their key with a fix."""
    (problem,) = validate(job("backend_config.model.model_id=llava"), check_paths=False)
    assert problem.key == "backend_config.model.model_id" and "qwen3_vl (Qwen3-VL)" in problem.fix
    vit = "backend_config.model.image_encoder.vision_encoder"
    (problem,) = validate(job(f"{vit}.swiglu=false"), check_paths=False)
    assert problem.key == f"{vit}.swiglu" and "Qwen2.5-VL checkpoints have True" in problem.rule
    assert validate(_preset_job("qwen3_vl_8b"), check_paths=False) == []
    problems = validate(_preset_job("qwen3_vl_8b", f"{vit}.deepstack_visual_indexes=[8,16,40]"), check_paths=False)
    assert [p.key for p in problems] == [f"{vit}.deepstack_visual_indexes"]
    split = validate(
        _preset_job(
            "qwen3_vl_8b",
            f"{TEXT}.pipeline_num_layers=[2,34]",
            f"{vit}.pipeline_num_layers=[27,0]",
            "backend_config.actor_config.pipeline_model_parallel_size=2",
        ),
        check_paths=False,
    )
    assert f"{TEXT}.pipeline_num_layers" in {p.key for p in split}


def test_a_checkpoint_of_another_family_is_refused(tmp_path):
    hf = write_hf_dir(tmp_path / "qwen2_vl", model="qwen2_vl_7b")
    cfg = _paths(tmp_path, **{"backend_config.megatron_training.tokenizer_name_or_path": hf})
    problems = [p for p in validate(cfg) if p.key == "backend_config.model.model_id"]
    assert len(problems) == 1 and "Qwen2-VL" in problems[0].rule and "qwen2vl" in problems[0].fix


@pytest.mark.parametrize(
    ("job_model", "overrides", "checkpoint", "key", "said"),
    [
        ("qwen3_vl_30b_a3b", [], "qwen3_vl_8b", "num_moe_experts", "none: a dense model"),  # an MoE job, dense ckpt
        ("qwen3_vl_8b", [], "qwen3_vl_30b_a3b", "num_moe_experts", "(128)"),  # a dense job on an MoE checkpoint
        ("qwen3_vl_30b_a3b", ["num_moe_experts=64"], "qwen3_vl_30b_a3b", "num_moe_experts", "(128)"),
        ("qwen3_vl_30b_a3b", ["moe_intermediate_size=512"], "qwen3_vl_30b_a3b", "moe_intermediate_size", "(768)"),
    ],
)
def test_the_experts_must_be_the_checkpoints(tmp_path, job_model, overrides, checkpoint, key, said):
    """Dense vs MoE, the expert count and the expert width are the checkpoint's: refused by check, as the other
    family mismatches, not by hf2mg two seconds into train."""
    hf = write_hf_dir(tmp_path / "hf", model=checkpoint)
    data = write_data_dir(tmp_path / "data")
    paths = [
        f"backend_config.megatron_training.tokenizer_name_or_path={hf}",
        f"backend_config.data.dataset_param.basic_parameters.dataset_dir={data}",
        f"af_output_dir={tmp_path / 'out'}",
    ]
    cfg = _preset_job(job_model, *paths, *[f"{TEXT}.{o}" for o in overrides])
    problems = [p for p in validate(cfg) if p.key == f"{TEXT}.{key}"]
    assert len(problems) == 1 and said in problems[0].rule and "must match the checkpoint" in problems[0].rule
    assert not [p for p in validate(_preset_job(checkpoint, *paths)) if "must match the checkpoint" in p.rule]


@pytest.mark.parametrize("key", ["mrope_section.0", "mrope_section[0]"])
def test_an_override_of_one_list_element_asks_for_the_whole_list(key):
    with pytest.raises(ConfigError) as err:
        load_job(None, [f"--{TEXT}.{key}=5"])
    (problem,) = err.value.violations
    assert problem.key == f"{TEXT}.{key}" and "not one element of a list" in problem.rule
    assert f"--{TEXT}.mrope_section='[1,2,3]'" in problem.fix
    assert load_job(None, [f"--{TEXT}.mrope_section=[8,12,12]"]).backend_config.model.text_decoder.mrope_section == [
        8, 12, 12]  # fmt: skip
