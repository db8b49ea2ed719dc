"""Encoder ops (LayerNorm, add + LayerNorm, GELU, bidirectional attention within packed sequences):
the fast paths (kernels/torch_encoder.py) against the written-out references, and the references
against hand-computed cases and against torch's own formulas."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from vbatch.kernels import torch_encoder as fast
from vbatch.kernels.activation_ref import gelu
from vbatch.kernels.encoder_attention_ref import encoder_attention
from vbatch.kernels.layer_norm_ref import add_layer_norm, layer_norm
from vbatch.kernels.ops import get_ops

G = torch.Generator().manual_seed(0)


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=G).to(dtype)


def test_layer_norm_reference_is_the_formula():
    x = torch.tensor([[1.0, 2.0, 3.0, 6.0]])
    mean, var = 3.0, ((2 ** 2 + 1 + 0 + 9) / 4)
    want = torch.tensor([[(v - mean) / math.sqrt(var + 1e-5) for v in (1.0, 2.0, 3.0, 6.0)]]) * 2 + 0.5
    got = layer_norm(x, torch.full((4,), 2.0), torch.full((4,), 0.5), 1e-5)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_layer_norms_match_the_reference(dtype):
    x, res = rand(37, 384, dtype=dtype), rand(37, 384, dtype=dtype)
    w, b = rand(384, dtype=dtype), rand(384, dtype=dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(fast.layer_norm(x, w, b, 1e-12), layer_norm(x, w, b, 1e-12), **tol)
    want = add_layer_norm(x, res, w, b, 1e-12)
    torch.testing.assert_close(fast.add_layer_norm(x.clone(), res, w, b, 1e-12), want, **tol)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_reference_and_fast_path(approximate):
    x = torch.linspace(-6, 6, 1001)
    assert gelu(torch.tensor([0.0]))[0] == 0.0
    assert abs(float(gelu(torch.tensor([1.0]))[0]) - 0.8413447460685429) < 1e-6   # 1 * Phi(1)
    torch.testing.assert_close(fast.gelu(x, approximate), gelu(x, approximate), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError):
        gelu(x, "sigmoid")


def test_encoder_attention_reference_hand_computed():
    # Two sequences [1 token, 2 tokens], one head, head_dim 1: the first attends only to itself.
    q = torch.tensor([[[1.0]], [[1.0]], [[2.0]]])
    k = torch.tensor([[[5.0]], [[0.0]], [[1.0]]])
    v = torch.tensor([[[7.0]], [[1.0]], [[3.0]]])
    out = encoder_attention(q, k, v, [1, 2], scale=1.0)
    assert out[0, 0, 0] == 7.0
    p = torch.softmax(torch.tensor([0.0, 1.0]), 0)        # token 1: scores q*k = 0, 1
    assert abs(float(out[1, 0, 0]) - float(p @ torch.tensor([1.0, 3.0]))) < 1e-6
    p = torch.softmax(torch.tensor([0.0, 2.0]), 0)        # token 2: scores 0, 2
    assert abs(float(out[2, 0, 0]) - float(p @ torch.tensor([1.0, 3.0]))) < 1e-6


@pytest.mark.parametrize("seq_lens", [[5], [8, 8, 8], [1, 17, 3, 3, 64, 2, 9], [300, 1]])
@pytest.mark.parametrize("heads", [(12, 12), (8, 2)])
def test_fast_encoder_attention_matches_the_reference(seq_lens, heads):
    hq, hk = heads
    t = sum(seq_lens)
    q, k, v = rand(t, hq, 32), rand(t, hk, 32), rand(t, hk, 32)
    want = encoder_attention(q, k, v, seq_lens, 32 ** -0.5)
    got = fast.encoder_attention(q, k, v, seq_lens, 32 ** -0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_encoder_attention_keeps_sequences_apart():
    # Changing one sequence's keys never changes another sequence's outputs.
    lens = [4, 6, 3]
    q, k, v = rand(13, 2, 8), rand(13, 2, 8), rand(13, 2, 8)
    base = fast.encoder_attention(q, k, v, lens, 0.3)
    k2 = k.clone()
    # New keys for sequence 1 only. NOTE: not a constant shift: adding c to every key adds c * sum(q)
    # to all of a query's scores alike, which softmax cancels (exactly, on a 16-lane build).
    k2[4:10] = 3.0 * rand(6, 2, 8)
    moved = fast.encoder_attention(q, k2, v, lens, 0.3)
    torch.testing.assert_close(moved[:4], base[:4])
    torch.testing.assert_close(moved[10:], base[10:])
    assert not torch.allclose(moved[4:10], base[4:10])


def test_length_groups_cover_every_sequence_once_with_little_padding():
    lens = [int(x) for x in torch.randint(1, 200, (500,), generator=G)]
    groups = fast.length_groups(lens)
    assert sorted(i for g in groups for i in g) == list(range(500))
    for g in groups:
        real, padded = sum(lens[i] for i in g), max(lens[i] for i in g) * len(g)
        assert len(g) == 1 or padded <= 1.25 * real


def test_reference_attention_equals_a_padded_masked_softmax():
    # An independent formulation: a padded batch with a key-padding mask (what transformers does).
    lens = [3, 5]
    q, k, v = rand(8, 2, 4), rand(8, 2, 4), rand(8, 2, 4)
    pad = lambda t: torch.stack([F.pad(t[:3], (0, 0, 0, 0, 0, 2)), t[3:]])        # [2, 5, H, D]
    qp, kp, vp = (pad(t).transpose(1, 2) for t in (q, k, v))                       # [2, H, 5, D]
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)[:, None, None, :]
    scores = (qp @ kp.transpose(-1, -2)) * 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    ref = (torch.softmax(scores, -1) @ vp).transpose(1, 2)                         # [2, 5, H, D]
    got = encoder_attention(q, k, v, lens, 0.5)
    torch.testing.assert_close(got[:3], ref[0, :3])
    torch.testing.assert_close(got[3:], ref[1])


def test_cpu_ops_carry_the_fast_encoder_ops():
    ops = get_ops("cpu", torch.float32)
    assert ops.layer_norm is fast.layer_norm and ops.gelu is fast.gelu
    if ops.native is not None:                    # the native kernel for short sequences, SDPA beyond
        assert ops.encoder_attention.__func__.__name__ == "encoder_attention" and ops.encoder_attention.__self__
    else:
        assert ops.encoder_attention is fast.encoder_attention
    ref = get_ops("cpu", None)
    assert ref.encoder_attention is encoder_attention and ref.gelu is gelu


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("rows", [3, 300])
def test_gelu_fused_into_the_packed_gemm_equals_gemm_then_gelu(approximate, rows):
    from vbatch.kernels import cpu_linear, gemm_libraries
    if not gemm_libraries.can_pack(torch.float32):
        pytest.skip("no prepacked fp32 GEMM in this torch build")
    lin = torch.nn.Linear(64, 256)
    packed = cpu_linear.pack_linear(lin)
    x = rand(rows, 64)
    want = gelu(F.linear(x, lin.weight, lin.bias), approximate)
    torch.testing.assert_close(packed.linear_gelu(x, approximate), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_lens,heads,dim", [([1, 17, 3, 64, 2, 9], (12, 12), 32), ([5] * 7, (8, 2), 64),
                                                ([200, 1], (4, 4), 16)])
def test_native_encoder_attention_matches_the_reference(native, dtype, seq_lens, heads, dim):
    hq, hk = heads
    t = sum(seq_lens)
    qkv = rand(t, hq + 2 * hk, dim, dtype=dtype)                  # a fused projection's rows, as BERT has them
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
    got = native.encoder_attention(q, k, v, seq_lens, dim ** -0.5, 2)
    assert got is not None and got.shape == (t, hq, dim) and got.dtype == dtype
    want = encoder_attention(q, k, v, seq_lens, dim ** -0.5)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)


def test_native_encoder_attention_refuses_layouts_it_does_not_take(native):
    q = rand(10, 4, 24)                                           # head_dim not a multiple of 16
    assert native.encoder_attention(q, q, q, [10], 0.2, 1) is None
