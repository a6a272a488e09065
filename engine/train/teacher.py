"""The teacher of phases 2 and 3: the unquantized float model the served 4-bit base came from, or,
when there is none, the checkpoint itself.

Without a float model (the usual case: people download the 4-bit checkpoint, not the bf16 one),
the student learns to match the 4-bit model as released: every layer routed by its own router at
the native K, no LoRA. What the LoRA then recovers is exactly what prediction routing (and a
narrower K) costs, which is its job; it cannot learn back the quantization error, which the
served model keeps anyway. That teacher is the student's own frozen base run the exact way
(`Student.base_logits`): the student path already holds the dequantized model, so it costs no
memory, and its values are the ones the 4-bit kernels compute with.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model as mlx_lm_load_model

from ..errors import Edge0Error
from ..runtime.loader import read_config
from .student import Student


class CheckpointTeacher:
    """The checkpoint itself as teacher, called like an mlx-lm model (`teacher(tokens, cache)`), so
    the phases sample from it and score with it as they do with a float model."""

    def __init__(self, student: Student) -> None:
        self.student = student
        self.layers = student.model.layers  # for mlx-lm's make_prompt_cache

    def __call__(self, tokens: mx.array, cache: list | None = None) -> mx.array:
        return self.student.base_logits(tokens, cache)

    def make_cache(self) -> list:
        return make_prompt_cache(self.student.model)


def load_teacher(teacher_dir: str | Path | None, student: Student) -> nn.Module | CheckpointTeacher:
    """The unquantized float model (mlx-lm format) the base was quantized from, frozen, computing in
    the student's float dtype; None: the checkpoint itself. Refuses a quantized teacher and one with
    another vocabulary."""
    if teacher_dir is None:
        return CheckpointTeacher(student)
    teacher_dir = Path(teacher_dir)
    config = read_config(teacher_dir)
    if "quantization" in config or "quantization_config" in config:
        raise Edge0Error(
            f"{teacher_dir}: the teacher is quantized; it must be the unquantized (bf16/fp32) model"
        )
    student_config = student.loaded.config
    for key in ("model_type", "vocab_size"):
        theirs, ours = _text_config_value(config, key), _text_config_value(student_config, key)
        if theirs != ours:
            raise Edge0Error(
                f"{teacher_dir}: teacher {key}={theirs!r} but the base model has {ours!r} "
                "(the teacher must be the same architecture and vocabulary)"
            )
    try:
        model, _ = mlx_lm_load_model(teacher_dir, lazy=True, strict=True)
    except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
        raise Edge0Error(f"{teacher_dir}: cannot load the teacher ({e})") from None
    if student.loaded.float_dtype is not None:
        model.set_dtype(student.loaded.float_dtype)
    model.freeze()
    mx.eval(model.parameters())
    return model


def _text_config_value(config: dict, key: str):
    return config.get("text_config", {}).get(key, config.get(key))
