"""edge0's engine: Mixture-of-Experts models whose routed experts stream from SSD.

Rooms, each importing only from the rooms below it:

    measure/  train/              benchmarks, soak, eval; the training phases, synthetic models
    runtime/                      the Engine: loading, prefill and decode, metrics, numeric guard
    routing/  experts/  adapters/ routing and prerouter heads; reads, pool, store; LoRA, K profiles
    checkpoint/                   safetensors index and fingerprint, the family table
    config.py  errors.py          passed down to every room

This module is the surface the app and the tests use; the app also calls the entry points of
`measure/` and `train/`. Names that need MLX are imported on first use, so that `engine.Edge0Error`
or `engine.parse_size` stay cheap for the command's argument parsing (MLX, mlx-lm and
transformers take seconds to import).
"""

from __future__ import annotations

import importlib

from .config import (
    EXACT_MODES,
    HEAD_MODES,
    MAX_SEED,
    MODES,
    EngineConfig,
    GenerationConfig,
    format_bytes,
    mode_label,
    parse_duration,
    parse_size,
)
from .errors import Edge0Error
from .trace import NO_TRACE, Tracer

# name -> the module that defines it, imported when the name is first used.
_ON_FIRST_USE = {
    "Batch": "engine.runtime.batch",
    "Engine": "engine.runtime.generation",
    "GenerationResult": "engine.runtime.generation",
    "GeneratedToken": "engine.runtime.decode",
    "Reply": "engine.runtime.decode",
    "KProfile": "engine.adapters.profiles",
    "release_thread_streams": "engine.runtime.generation",
    "ExpertEvent": "engine.experts.heat",
    "HeatPicture": "engine.experts.heat",
    "MemoryPlan": "engine.runtime.memory_plan",
    "StepMetrics": "engine.runtime.metrics",
    "MemorySnapshot": "engine.runtime.metrics",
    "peak_memory_line": "engine.runtime.metrics",
    "process_lifetime_peaks": "engine.runtime.metrics",
    "routed_by_layer": "engine.runtime.metrics",
    "check_checkpoint": "engine.runtime.loader",
    "plan_hub_model": "engine.runtime.header_plan",
    "summarize_checkpoint": "engine.runtime.catalog",
    "CgroupMemory": "engine.runtime.linux_memory",
    "cgroup_memory": "engine.runtime.linux_memory",
    "read_meminfo": "engine.runtime.linux_memory",
    "MACOS_SYSCTLS": "engine.runtime.macos_memory",
    "SYSCTL": "engine.runtime.macos_memory",
    "VM_STAT": "engine.runtime.macos_memory",
    "command_output": "engine.runtime.macos_memory",
    "mac_counters": "engine.runtime.macos_memory",
    "parse_sysctl": "engine.runtime.macos_memory",
    "parse_vm_stat": "engine.runtime.macos_memory",
    "blas_in_use": "engine.runtime.blas",
    "compute_waits": "engine.runtime.compute_activity",
    "largest_waits": "engine.runtime.compute_activity",
    "preload_fast_blas": "engine.runtime.blas",
    "run_ranks_here": "engine.runtime.ranks",
    "RANK_VARIABLE": "engine.runtime.ranks",
    "LOCAL_HOST": "engine.runtime.ranks",
    "MAX_RANKS": "engine.runtime.ranks",
    "check_adapter_out": "engine.adapters.metadata",
    "check_regular_file": "engine.checkpoint.index",
    "check_shard_count": "engine.checkpoint.index",
    "read_json_file": "engine.checkpoint.json_files",
    "write_json_file": "engine.checkpoint.json_files",
    "check_output_file": "engine.checkpoint.outputs",
    "check_output_folder": "engine.checkpoint.outputs",
    "fit_mlx_lm_to_the_open_file_limit": "engine.runtime.open_file_limit",
    "GrammarError": "engine.runtime.constraint",
    "closed_schema": "engine.runtime.constraint",
    "compile_grammar": "engine.runtime.constraint",
    "gbnf_source": "engine.runtime.constraint",
    "json_schema_source": "engine.runtime.constraint",
    "lark_source": "engine.runtime.constraint",
}

__all__ = [
    "EXACT_MODES",
    "HEAD_MODES",
    "MAX_SEED",
    "MODES",
    "Edge0Error",
    "NO_TRACE",
    "Tracer",
    "EngineConfig",
    "GenerationConfig",
    "format_bytes",
    "mode_label",
    "parse_duration",
    "parse_size",
    *_ON_FIRST_USE,
]


def __getattr__(name: str):
    module = _ON_FIRST_USE.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value
