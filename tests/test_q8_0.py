"""Q8_0 weights (kernels/q8_0.py): the format against hand-computed blocks and the rule written out
element by element; its error bound; the typed errors for what it cannot hold; the engine options
that ask for it and refuse it where it does not run."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vbatch.kernels import q8_0


def _rule(block: list[float]) -> tuple[list[int], float]:
    """The Q8_0 rule for one block, written out in plain Python with numpy's fp16: d = fp16(max |x| /
    127), q = x / d rounded to nearest (ties to even) and clamped to [-127, 127]; q = 0 where d = 0."""
    d = float(np.float16(max(abs(v) for v in block) / 127))
    if d == 0:
        return [0] * len(block), 0.0
    return [max(-127, min(127, round(v / d))) for v in block], d   # Python's round: ties to even


def test_hand_computed_block():
    # max |x| = 127 gives d = 1 exactly: q is x rounded (ties to even: 2.5 -> 2, -63.5 -> -64).
    block = [127.0, -63.5, 2.5, 0.4, -0.6] + [0.0] * 27
    packed = q8_0.quantize(torch.tensor([block]))
    q, d = q8_0.split(packed, 32)
    assert d.tolist() == [[1.0]]
    assert q[0, :5].tolist() == [127, -64, 2, 0, -1] and q[0, 5:].abs().sum() == 0
    assert q8_0.dequantize(packed, 32)[0, :5].tolist() == [127.0, -64.0, 2.0, 0.0, -1.0]


def test_quantize_follows_the_rule_element_by_element():
    torch.manual_seed(0)
    weight = torch.randn(5, 96) * torch.tensor([1e-3, 0.02, 1.0, 30.0, 0.0]).unsqueeze(1)  # tiny..large, a zero row
    packed = q8_0.quantize(weight)
    assert packed.dtype == torch.int8 and packed.shape == (5, 96 + 6) == (5, q8_0.row_bytes(96))
    q, d = q8_0.split(packed, 96)
    rows = weight.tolist()
    for r in range(5):
        for b in range(3):
            want_q, want_d = _rule(rows[r][32 * b:32 * b + 32])
            assert q[r, 32 * b:32 * b + 32].tolist() == want_q, (r, b)
            assert d[r, b].item() == want_d, (r, b)
    # the row layout: the values, then the scales' bytes (what cpu_linear_small.c reads)
    assert packed[:, 96:].contiguous().view(torch.float16).equal(d)


def test_error_is_at_most_half_a_step_per_weight():
    torch.manual_seed(1)
    weight = torch.randn(64, 576) * 0.05
    deq = q8_0.dequantize(q8_0.quantize(weight), 576)
    step = weight.reshape(64, 18, 32).abs().amax(-1, keepdim=True) / 127       # d before fp16 rounding
    err = (deq - weight).reshape(64, 18, 32).abs()
    assert (err <= step * (0.5 + 2 ** -11 * 127) + 1e-12).all()   # half a step, plus fp16's rounding of d
    assert err.max() > 0                                           # it is a lossy format
    assert q8_0.in_features_of(q8_0.quantize(weight)) == 576


def test_what_q8_0_cannot_hold_is_a_typed_error():
    with pytest.raises(q8_0.QuantizationError, match="whole 32-weight blocks; this weight has 40"):
        q8_0.quantize(torch.randn(4, 40))
    with pytest.raises(q8_0.QuantizationError, match="fp16 Q8_0 scale"):
        q8_0.quantize(torch.full((1, 32), 1e7))                    # 1e7 / 127 is beyond fp16's 65504
    with pytest.raises(q8_0.QuantizationError, match="fp16 Q8_0 scale"):
        q8_0.quantize(torch.tensor([[math.nan] + [0.0] * 31]))
    with pytest.raises(q8_0.QuantizationError, match="not a Q8_0 weight"):
        q8_0.split(torch.zeros(2, 34, dtype=torch.int8), 64)


def test_engine_options_refuse_q8_0_where_it_does_not_run():
    from vbatch.engine.config import ModelConfig
    from vbatch.engine.device import resolve_dtype
    from vbatch.engine.errors import ConfigError
    with pytest.raises(ConfigError, match="quantization: must be one of q8_0"):
        ModelConfig(quantization="int4").validate()
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu, quantization="q8_0") == torch.float32   # auto: fp32 arithmetic
    assert resolve_dtype("float32", cpu, quantization="q8_0") == torch.float32
    with pytest.raises(ConfigError, match="computed in fp32, not bfloat16"):
        resolve_dtype("bfloat16", cpu, quantization="q8_0")
    with pytest.raises(ConfigError, match="CPU only"):
        resolve_dtype("auto", torch.device("cuda"), quantization="q8_0")


def test_get_ops_refuses_q8_0_without_native_kernels(monkeypatch):
    from vbatch.kernels import cpu_native
    from vbatch.kernels.ops import get_ops
    monkeypatch.setattr(cpu_native, "_loaded", {})
    monkeypatch.setenv("VBATCH_CPU_NATIVE", "0")                  # as on a machine without a C compiler
    with pytest.raises(q8_0.QuantizationError, match="native kernels not built"):
        get_ops("cpu", torch.float32, quantization="q8_0")
    with pytest.raises(q8_0.QuantizationError, match="CPU only"):
        get_ops("cuda", torch.float32, quantization="q8_0")
