"""``ascendfactory-cli convert hf2mg|mg2hf``: the settings come from a job yaml or from ``--cfg.*`` flags.

With ``--job job.yaml`` the conversion reads ``backend_config.convert_ckpt_hf2mg.cfg`` (or ``..mg2hf.cfg``) and
``backend_config.model``; other ``--a.b=c`` arguments override the yaml. Without a job, ``--cfg.KEY VALUE``
sets the conversion's keys (``mm_dir``, ``hf_config.hf_dir``, ``load_dir``, ``save_hf_dir``,
``parallel_config.*``), model.json is derived from the HF config.json and ``--model.KEY VALUE`` changes it (e.g.
fewer layers); the parallel config defaults to TP 1 and everything on one stage.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mm_rl.config.loader import ConfigError, Violation, load_job, load_section, parse_overrides
from mm_rl.config.schema import Hf2MgCfg, Mg2HfCfg, ModelConfig
from mm_rl.convert.hf2mg import hf2mg
from mm_rl.convert.hf_writer import DEFAULT_MAX_SHARD_BYTES
from mm_rl.convert.layout import Iteration
from mm_rl.convert.mg2hf import mg2hf
from mm_rl.convert.model_config import model_config_from_hf

REQUIRED = {"hf2mg": ("mm_dir", "hf_config.hf_dir"), "mg2hf": ("load_dir", "save_hf_dir")}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def run_convert(
    direction: str,
    job: str | None,
    overrides: Sequence[str],
    hf_dir: str | None = None,
    iteration: str | None = None,
    max_shard_size: str | None = None,
) -> Path:
    """Run one conversion as the CLI describes it; returns the output directory."""
    if job is not None:
        cfg, model, source = _from_job(direction, job, overrides, hf_dir)
    else:
        cfg, model, source = _from_flags(direction, overrides, hf_dir)
    if direction == "hf2mg":
        return hf2mg(cfg, model)
    return mg2hf(cfg, model, source, parse_iteration(iteration), parse_size(max_shard_size))


def _from_job(direction: str, job: str, overrides: Sequence[str], hf_dir: str | None) -> tuple[Any, ModelConfig, str]:
    b = load_job(job, overrides).backend_config
    cfg = b.convert_ckpt_hf2mg.cfg if direction == "hf2mg" else b.convert_ckpt_mg2hf.cfg
    return cfg, b.model, hf_dir or b.convert_ckpt_hf2mg.cfg.hf_config.hf_dir


def _from_flags(direction: str, overrides: Sequence[str], hf_dir: str | None) -> tuple[Any, ModelConfig, str]:
    given = _nested(overrides)
    cfg_data: dict[str, Any] = given.get("cfg", {})
    missing = [key for key in REQUIRED[direction] if _get(cfg_data, key) in (None, "")]
    if direction == "mg2hf" and not hf_dir:
        missing.append("hf_dir")
    if missing:
        raise ConfigError(
            [
                Violation(
                    f"--{'' if k == 'hf_dir' else 'cfg.'}{k}",
                    None,
                    f"is required for convert {direction} without --job",
                    f"pass --{'' if k == 'hf_dir' else 'cfg.'}{k} PATH, or --job job.yaml",
                )
                for k in missing
            ]
        )
    source = str(_get(cfg_data, "hf_config.hf_dir") if direction == "hf2mg" else hf_dir)
    model_data = model_config_from_hf(source, given.get("model", {}))
    parallel = cfg_data.setdefault("parallel_config", {})
    text, vit = model_data.text_decoder, model_data.image_encoder.vision_encoder
    parallel.setdefault("tp_size", 1)
    parallel.setdefault("ep_size", 1)
    stages = len(parallel.get("llm_pp_layers") or parallel.get("vit_pp_layers") or [0])
    parallel.setdefault("llm_pp_layers", [0] * (stages - 1) + [text.num_layers])
    parallel.setdefault("vit_pp_layers", [vit.num_layers] + [0] * (stages - 1))
    if direction == "hf2mg":
        cfg_data["hf_config"] = {"hf_dir": source}
    try:
        cfg = load_section(Hf2MgCfg if direction == "hf2mg" else Mg2HfCfg, cfg_data)
    except ConfigError as err:  # the section's keys are --cfg.* on this command line
        raise ConfigError([dataclasses.replace(v, key=f"cfg.{v.key}") for v in err.violations]) from None
    text.pipeline_num_layers = list(cfg.parallel_config.llm_pp_layers)
    vit.pipeline_num_layers = list(cfg.parallel_config.vit_pp_layers)
    return cfg, model_data, source


def _nested(overrides: Sequence[str]) -> dict[str, Any]:
    items = parse_overrides(overrides)
    wrong = [item for item in items if not item.startswith(("cfg.", "model."))]
    if wrong:
        raise ConfigError(
            [
                Violation(
                    "--" + item.split("=", 1)[0],
                    item.split("=", 1)[1],
                    "is not a convert option without --job",
                    "use --cfg.KEY VALUE (conversion keys), --model.KEY VALUE (model.json keys), or --job job.yaml",
                )
                for item in wrong
            ]
        )
    try:
        data = OmegaConf.to_container(OmegaConf.from_dotlist(list(items)))
    except OmegaConfBaseException as err:
        raise ConfigError(
            [Violation("overrides", list(items), str(err).splitlines()[0], "write --cfg.a.b VALUE")]
        ) from None
    return data if isinstance(data, dict) else {}


def _get(data: dict[str, Any], dotted: str) -> Any:
    for key in dotted.split("."):
        if not isinstance(data, dict):
            return None
        data = data.get(key)  # type: ignore[assignment]
    return data


def parse_iteration(text: str | None) -> Iteration | None:
    if text is None:
        return None
    if text == "release" or text.isdigit():
        return "release" if text == "release" else int(text)
    raise ConfigError(
        [
            Violation(
                "--iteration",
                text,
                "must be 'release' or a step number",
                "e.g. --iteration 100 (or leave it out for the latest)",
            )
        ]
    )


def parse_size(text: str | None) -> int:
    """``2GB`` (10^9), ``2GiB`` (2^30), ``500MB`` or a byte count."""
    if text is None:
        return DEFAULT_MAX_SHARD_BYTES
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?[iI]?[bB]?)\s*", text)
    if not match or match.group(2).lower() not in _UNITS or float(match.group(1)) <= 0:
        raise ConfigError([Violation("--max_shard_size", text, "is not a size", "e.g. 2GB, 500MB or 4GiB")])
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
