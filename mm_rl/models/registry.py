"""Every model family mm_rl knows, and the lookups by model.json's ``model_id`` and by an HF config.json.

The families are imported here by name, so a static reader (or a type checker) follows a lookup into the family's
package; a family module is light (no torch, no megatron-core at import).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mm_rl.models.family import ModelFamily, UnknownFamily
from mm_rl.models.qwen2_5_vl.family import FAMILY as QWEN2_5_VL
from mm_rl.models.qwen2_vl.family import FAMILY as QWEN2_VL
from mm_rl.models.qwen3_5.family import FAMILY as QWEN3_5
from mm_rl.models.qwen3_vl.family import FAMILY as QWEN3_VL

if TYPE_CHECKING:
    from mm_rl.config.schema import ModelConfig

FAMILIES: tuple[ModelFamily, ...] = (QWEN2_5_VL, QWEN2_VL, QWEN3_VL, QWEN3_5)


def family(model_id: str) -> ModelFamily:
    """The family whose model.json ``model_id`` is ``model_id``."""
    for candidate in FAMILIES:
        if candidate.model_id == model_id:
            return candidate
    known = ", ".join(f"{f.model_id} ({f.label})" for f in FAMILIES)
    raise UnknownFamily(f"model_id {model_id!r} is not a model family mm_rl knows; known: {known}")


def family_of(model: ModelConfig) -> ModelFamily:
    return family(model.model_id)


def family_for_hf(config: Mapping[str, Any]) -> ModelFamily:
    """The family of an HF checkpoint from its config.json content (``model_type``, else ``architectures``)."""
    model_type = config.get("model_type")
    architectures = list(config.get("architectures") or ())
    for candidate in FAMILIES:
        if model_type in candidate.hf_model_types or candidate.hf_architecture in architectures:
            return candidate
    known = ", ".join(f"{t} ({f.label})" for f in FAMILIES for t in f.hf_model_types)
    raise UnknownFamily(
        f"config.json has model_type {model_type!r} (architectures {architectures}): not a model "
        f"family mm_rl knows; known model_type values: {known}"
    )
