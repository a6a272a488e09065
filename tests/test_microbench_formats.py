"""`python -m engine.measure.microbench formats` (figures in docs/benchmarks.md): every case is
measured for both formats, and each format's outputs match fp32 products with its own quantized
weights, whose exact dequantization is checked here against an independent numpy decode."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.measure import microbench_formats

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)


def _nibbles(packed: mx.array, columns: int) -> np.ndarray:
    """uint32 words of eight 4-bit codes each, lowest bits first."""
    raw = np.array(packed).view(np.uint8)
    return np.stack([raw & 15, raw >> 4], axis=-1).reshape(raw.shape[0], columns)


def _numpy_dequantize(part: tuple, fmt: str, columns: int) -> np.ndarray:
    w, s, b = part
    codes = _nibbles(w, columns)
    group = microbench_formats.EXPERT_FORMATS[fmt]["group_size"]
    if fmt == "mxfp4":
        values = E2M1[codes & 7] * np.where(codes & 8, -1.0, 1.0).astype(np.float32)
        scale = np.exp2(np.array(s).astype(np.float32) - 127)
        return values * np.repeat(scale, group, axis=1)
    scales = np.array(s.astype(mx.float32))
    biases = np.array(b.astype(mx.float32))
    return codes * np.repeat(scales, group, axis=1) + np.repeat(biases, group, axis=1)


def test_formats_core_measures_and_checks_both_formats():
    result = microbench_formats.format_times(64, 64, [4], repeats=1, copies=1)
    assert result["weights"] == 3 * 64 * 64 and result["copies"] == 1
    assert set(result["formats"]) == {"mxfp4", "affine"}
    cases = {"decode qmm", "4 rows gather_qmm", "4 rows dequant+fp32"}
    cases |= {"dequantize", "dequantize exact"}
    for fmt, f in result["formats"].items():
        assert set(f["ms"]) == cases
        assert all(len(v) == 1 and v[0] >= 0 for v in f["ms"].values())
        assert set(f["errors"]) == cases - {"dequantize", "dequantize exact"}
        for case, err in f["errors"].items():
            assert err["rel"] <= err["rtol"], (fmt, case, err)
        for path in ("decode qmm", "4 rows gather_qmm"):  # the 4-bit kernels: fp32 all through
            assert f["errors"][path]["rtol"] == microbench_formats.EXACT_RTOL
        assert 0 < f["quant_rel_rms"] < 0.3
    m, a = result["formats"]["mxfp4"], result["formats"]["affine"]
    # 4 bits per weight, plus a uint8 scale per 32 (mxfp4) or two bf16 per 64 (affine).
    assert m["parts"] == {"weight": 3 * 64 * 64 // 2, "scales": 3 * 64 * 64 // 32, "biases": 0}
    assert a["parts"] == {"weight": 3 * 64 * 64 // 2, "scales": 3 * 64 * 64 // 32, "biases": 384}
    assert m["bytes"] < a["bytes"]
    # fp4 values times powers of two are exact in bf16; affine's rounded copy is flagged as such.
    assert m["dense_copy"] == {"dtype": "bfloat16", "exact": True}
    assert a["dense_copy"] == {"dtype": "bfloat16", "exact": False}


@pytest.mark.parametrize("fmt", ["mxfp4", "affine"])
def test_reference_weights_are_the_exact_dequantization(fmt):
    mx.random.seed(1)
    w = (mx.random.normal((32, 128)) * 0.02).astype(mx.bfloat16)
    expert = microbench_formats.quantize_expert({"gate": w}, fmt)
    ref = np.array(microbench_formats.reference_weights(expert, fmt)["gate"])
    assert ref.dtype == np.float32
    np.testing.assert_array_equal(ref, _numpy_dequantize(expert["gate"], fmt, 128))


def test_a_mismatch_fails_loudly(monkeypatch):
    """A path whose output is not the product of its quantized weights raises, not prints."""
    format_cases = microbench_formats._format_cases

    def one_percent_off(expert, fmt, inputs):
        cases = format_cases(expert, fmt, inputs)
        decode = cases["decode qmm"]
        cases["decode qmm"] = lambda: decode() * 1.01
        return cases

    monkeypatch.setattr(microbench_formats, "_format_cases", one_percent_off)
    with pytest.raises(RuntimeError, match="decode qmm: .* differs from the fp32 product"):
        microbench_formats.format_times(64, 64, [4], repeats=1, copies=1)
