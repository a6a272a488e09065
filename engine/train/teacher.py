"""The teacher of phases 2 and 3: the unquantized float model the served 4-bit base came from."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import load_model as mlx_lm_load_model

from ..errors import Edge0Error
from ..runtime.loader import read_config
from .student import Student


def load_teacher(teacher_dir: str | Path, student: Student) -> nn.Module:
    """The unquantized float model (mlx-lm format) the base was quantized from, frozen, computing in
    the student's float dtype. Refuses a quantized teacher and one with another vocabulary."""
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
