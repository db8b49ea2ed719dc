"""The native C paged attention (kernels/csrc/cpu_paged_attention.c via kernels/cpu_native.py).

Oracle: the reference `attention_ref.paged_attention` (itself tested against an fp64 softmax in
test_kernels_reference.py) on the same bf16 caches. Tolerance 2e-2 as for the other CPU paths:
outputs are O(1) and rounded to bf16 once; the kernel's q.k sums bf16 products in fp32 and its
softmax is online (rescaled per block), the reference's is fp32 SDPA.
"""
from __future__ import annotations

import pytest
import torch

from test_cpu_kernels import CASES, _random_step
from vbatch.kernels import attention_ref, cpu_native, cpu_native_ops, cpu_rotary

native = cpu_native.load()
pytestmark = pytest.mark.skipif(native is None, reason="no C compiler: the native kernels were not built")

CASES = {**CASES,
         "long_prefill_on_prefix": ([37], [40], 16),      # several 16-row items over many blocks
         "prefills_block_16": ([0, 0, 21, 9], [37, 5, 19, 1], 16),  # the tiled many-row path, ragged tiles
         "prefill_block_32_on_prefix": ([40, 3], [20, 33], 32),
         "block_size_not_multiple_of_16": ([29, 3], [1, 20], 24),
         "many_decodes": ([int(x) for x in torch.randint(0, 90, (40,), generator=torch.Generator().manual_seed(1))],
                          [1] * 40, 16)}
# (head_dim, query heads per kv head): the specialised copies (64/128 x 1-8), the generic one
# (96, 12 > 8) and, for head_dim / 16 odd, the fp32 q.k path instead of vdpbf16ps.
SHAPES = [(64, 3), (64, 7), (128, 2), (32, 1), (96, 12), (48, 3), (16, 2)]


def _max_error(case, head_dim, group, threads=2, kv_heads=2):
    context_lens, query_lens, block_size = CASES[case]
    query, key_cache, value_cache, attn, _ = _random_step(context_lens, query_lens, block_size,
                                                          num_kv_heads=kv_heads, group=group, head_dim=head_dim)
    scale = head_dim ** -0.5
    want = attention_ref.paged_attention(query, key_cache, value_cache, attn, scale)
    got = native.paged_attention_bf16(query, key_cache, value_cache, attn, scale, threads)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    return (got.float() - want.float()).abs().max().item()


@pytest.mark.parametrize("case", list(CASES))
def test_native_attention_matches_reference(case):
    assert _max_error(case, 64, 3) < 2e-2


@pytest.mark.parametrize("head_dim,group", SHAPES)
def test_native_attention_every_specialisation(head_dim, group):
    for case in ("decode_ragged", "mixed_prefill_and_decode", "long_prefill_on_prefix", "prefill_block_32_on_prefix"):
        assert _max_error(case, head_dim, group) < 2e-2, case


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_attention_same_rows_whatever_the_thread_count(threads):
    # The work split changes with the thread count (per kv head when there are few requests);
    # every row is computed by one thread in a fixed order, so the results are bit-identical.
    query, key_cache, value_cache, attn, scale = _random_step([5, 40, 0], [1, 1, 9], 16, num_kv_heads=3,
                                                              group=3, head_dim=64)
    one = native.paged_attention_bf16(query, key_cache, value_cache, attn, scale, 1)
    many = native.paged_attention_bf16(query, key_cache, value_cache, attn, scale, threads)
    assert torch.equal(one, many)


@pytest.mark.parametrize("block_size", [8, 16])  # 16: prefill rows take the tiled path
def test_native_attention_never_reads_unowned_slots(block_size):
    # Slots past each request's length and blocks no request owns may hold anything (the cache is
    # allocated with torch.empty): NaN there must not reach the output.
    query, key_cache, value_cache, attn, scale = _random_step([2, 13, 30], [1, 1, 7], block_size, head_dim=64)
    want = attention_ref.paged_attention(query, key_cache, value_cache, attn, scale)
    block_size = key_cache.shape[1]
    for r, n in enumerate(attn.seq_lens_list):
        table = attn.block_tables[r]
        last = int(table[(n - 1) // block_size])
        key_cache[last, (n - 1) % block_size + 1:] = float("nan")     # tail of the last block
        value_cache[last, (n - 1) % block_size + 1:] = float("inf")
    owned = {int(b) for r, n in enumerate(attn.seq_lens_list) for b in attn.block_tables[r, :-(-n // block_size)]}
    for b in set(range(key_cache.shape[0])) - owned:
        key_cache[b], value_cache[b] = float("nan"), float("nan")
    got = native.paged_attention_bf16(query, key_cache, value_cache, attn, scale, 2)
    assert torch.isfinite(got.float()).all()
    assert (got.float() - want.float()).abs().max().item() < 2e-2


def test_native_attention_long_context_softmax_is_stable():
    # Large logits (scores ~ +-60) over 2,000 positions: the online softmax must rescale exactly.
    torch.manual_seed(0)
    query, key_cache, value_cache, attn, _ = _random_step([1999], [1], 16, head_dim=64)
    query = (query.float() * 8).to(torch.bfloat16)
    want = attention_ref.paged_attention(query, key_cache, value_cache, attn, 1.0)
    got = native.paged_attention_bf16(query, key_cache, value_cache, attn, 1.0, 2)
    assert (got.float() - want.float()).abs().max().item() < 2e-2


def test_unsupported_shape_is_a_typed_error_and_the_op_falls_back():
    query, key_cache, value_cache, attn, scale = _random_step([3, 9], [1, 1], 8, head_dim=72)  # 72 % 16 != 0
    with pytest.raises(cpu_native.NativeKernelError, match="head_dim"):
        native.paged_attention_bf16(query, key_cache, value_cache, attn, scale, 1)
    want = attention_ref.paged_attention(query, key_cache, value_cache, attn, scale)
    got = cpu_native_ops.paged_attention(query, key_cache, value_cache, attn, scale)  # the bound op
    assert (got.float() - want.float()).abs().max().item() < 2e-2


def test_native_attention_tiled_path_rescales_when_the_max_moves():
    # The many-row path keeps its running max until a score exceeds it by more than LAZY_MAX (8):
    # keys growing along the sequence make the max jump by tens at later chunks, and rows
    # that see only the early chunks never rescale. Large logits (+-100) on a prefix and a prefill.
    torch.manual_seed(3)
    query, key_cache, value_cache, attn, _ = _random_step([30, 0], [50, 70], 16, head_dim=64)
    query = (query.float() * 4).to(torch.bfloat16)
    ramp = torch.linspace(0.2, 3.0, key_cache.shape[0] * key_cache.shape[1]).view(key_cache.shape[0], -1, 1, 1)
    key_cache = (key_cache.float() * ramp).to(torch.bfloat16)
    want = attention_ref.paged_attention(query, key_cache, value_cache, attn, 1.0)
    got = native.paged_attention_bf16(query, key_cache, value_cache, attn, 1.0, 2)
    assert (got.float() - want.float()).abs().max().item() < 2e-2


def test_build_is_cached_and_a_missing_compiler_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("VBATCH_CACHE", str(tmp_path))
    first, compiled_now = cpu_native.build()
    assert compiled_now and first.is_file() and first.is_relative_to(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert cpu_native.build() == (first, False) and first.stat().st_mtime_ns == mtime  # reused, not rebuilt
    with pytest.raises(FileNotFoundError):
        cpu_native.build(compiler=str(tmp_path / "no-such-cc"))


@pytest.mark.parametrize("in_features", [576, 80, 1000, 32])     # whole 32-chunks, masked tails, one chunk
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_small_linear_matches_exact_product(rows, in_features):
    # Oracle: the fp64 product of the same bf16 tensors; the kernel sums bf16 products in fp32 and
    # rounds once, so it is within one bf16 rounding (2^-8 of the row's largest output) of it.
    torch.manual_seed(rows * 7 + in_features)
    out_features = 200 if in_features != 576 else 960      # 200: a partial last tile of 16 outputs
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    weight = torch.randn(out_features, in_features).to(torch.bfloat16)
    bias = torch.randn(out_features).to(torch.bfloat16)
    for b in (None, bias):
        got = native.linear_small_bf16(x, weight, b, 2)
        if got is None:
            pytest.skip("this CPU has no avx512_bf16: the small-rows kernel is not built")
        exact = x.double() @ weight.double().t() + (0 if b is None else b.double())
        tol = exact.abs().amax(-1, keepdim=True) * 2 ** -8
        assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
        assert ((got.double() - exact).abs() <= tol).all()


def test_small_linear_refuses_more_than_eight_rows():
    x, weight = torch.zeros(9, 64, dtype=torch.bfloat16), torch.zeros(16, 64, dtype=torch.bfloat16)
    assert native.linear_small_bf16(x, weight, None, 1) is None


# --- the fused per-token ops (kernels/csrc/cpu_elementwise.c) against their references -----------

def _ulp_close(got: torch.Tensor, want: torch.Tensor, max_mismatch: float = 0.01) -> None:
    # Same roundings at the same places as the reference; only sums taken in another order may
    # move a result by one bf16 step, on a small share of elements.
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    one_step = want.float().abs().clamp_min(1e-30) * 2 ** -7
    assert (diff <= one_step).all()
    assert (diff > 0).float().mean().item() <= max_mismatch


@pytest.mark.parametrize("hidden", [576, 100])  # 100: a tail of 4 after whole vectors
@pytest.mark.parametrize("rows", [1, 300])      # 300 x 576: above the threading threshold
def test_native_rms_norms_match_reference(rows, hidden):
    from vbatch.kernels import norm_ref
    torch.manual_seed(rows + hidden)
    x = (torch.randn(rows, hidden) * 3).to(torch.bfloat16)
    residual = torch.randn(rows, hidden).to(torch.bfloat16)
    weight = (torch.rand(hidden) + 0.5).to(torch.bfloat16)
    _ulp_close(cpu_native_ops.rms_norm(x, weight, 1e-5), norm_ref.rms_norm(x, weight, 1e-5))
    got, got_res = cpu_native_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    want, want_res = norm_ref.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(got_res, want_res)  # one rounded add: exact
    _ulp_close(got, want)


@pytest.mark.parametrize("d", [1536, 40])
def test_native_silu_and_mul_matches_reference(d):
    from vbatch.kernels import activation_ref
    torch.manual_seed(d)
    x = (torch.randn(64, 2 * d) * 4).to(torch.bfloat16)
    _ulp_close(cpu_native_ops.silu_and_mul(x), activation_ref.silu_and_mul(x))


def test_native_rotary_matches_reference_on_qkv_views():
    from vbatch.kernels import rotary_ref
    torch.manual_seed(0)
    cache = rotary_ref.build_rope_cache(64, 2048, 10000.0, None)
    positions = torch.randint(0, 2048, (37,))
    qkv = torch.randn(37, (9 + 3 + 3) * 64).to(torch.bfloat16)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k = q.view(37, 9, 64), k.view(37, 3, 64)
    want_q, want_k = rotary_ref.apply_rotary(positions, q.clone(), k.clone(), cache)
    tables = cpu_rotary.prepare_rotary(positions, cache, torch.bfloat16)
    got_q, got_k = cpu_native_ops.apply_rotary(positions, q, k, tables)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)  # same products, same roundings
    assert got_q.data_ptr() == q.data_ptr()  # in place, in the qkv buffer


def test_native_kv_write_matches_reference():
    from vbatch.kernels import cache_ref
    torch.manual_seed(0)
    kv = torch.randn(5, 2 * 3 * 64).to(torch.bfloat16)
    k, v = (t.view(5, 3, 64) for t in kv.split([192, 192], dim=-1))
    slots = torch.tensor([17, 3, 40, 41, 0])
    want_k, want_v = torch.zeros(4, 16, 3, 64, dtype=torch.bfloat16), torch.zeros(4, 16, 3, 64, dtype=torch.bfloat16)
    got_k, got_v = want_k.clone(), want_v.clone()
    cache_ref.write_kv_cache(k, v, want_k, want_v, slots)
    cpu_native_ops.write_kv_cache(k, v, got_k, got_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_native_ops_fall_back_for_inputs_they_do_not_take():
    from vbatch.kernels import activation_ref, norm_ref
    x = torch.randn(3, 64)  # fp32: the references run
    w = torch.ones(64)
    assert torch.equal(cpu_native_ops.rms_norm(x, w, 1e-6), norm_ref.rms_norm(x, w, 1e-6))
    assert torch.equal(cpu_native_ops.silu_and_mul(x), activation_ref.silu_and_mul(x))


def test_native_attention_reads_query_rows_in_place_from_a_qkv_view():
    query, key_cache, value_cache, attn, scale = _random_step([5, 0, 30], [1, 7, 1], 16, head_dim=64)
    qkv = torch.cat([query.flatten(1), torch.randn(query.shape[0], 2 * 2 * 64).to(torch.bfloat16)], dim=1)
    view = qkv[:, :query.shape[1] * 64].view(query.shape)      # rows (15 * 64) elements apart
    assert not view.is_contiguous()
    want = native.paged_attention_bf16(query, key_cache, value_cache, attn, scale, 2)
    assert torch.equal(native.paged_attention_bf16(view, key_cache, value_cache, attn, scale, 2), want)


def test_without_the_native_build_bf16_ops_keep_the_torch_paths(monkeypatch):
    # No C compiler (or VBATCH_CPU_NATIVE=0): load() gives None and get_ops binds the torch fast
    # paths (oneDNN linears, inductor decode attention) instead, same contract.
    from vbatch.kernels import cpu_attention, cpu_linear
    from vbatch.kernels.ops import get_ops
    if not cpu_linear.can_pack(torch.bfloat16):
        pytest.skip("no oneDNN bf16 on this CPU")
    monkeypatch.setattr(cpu_native, "_loaded", None)
    ops = get_ops("cpu", torch.bfloat16)
    assert ops.name == "cpu-bf16" and ops.paged_attention is cpu_attention.paged_attention
    linear = torch.nn.Linear(64, 32).to(torch.bfloat16)
    packed = ops.pack_linear(linear)
    assert packed.native is None and packed.weight is None  # no second copy of the weights
    monkeypatch.undo()
    assert get_ops("cpu", torch.bfloat16).name == "cpu-bf16-native"


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("VBATCH_CPU_NATIVE", "0")
    monkeypatch.setattr(cpu_native, "_loaded", False)  # forget the cached load
    assert cpu_native.load() is None


# --- the whole decoder layer in one call (kernels/csrc/cpu_decoder_layer.c) ----------------------

@pytest.mark.parametrize("name", ["llama_untied_biases", "qwen2"])  # every bias pointer; GQA
def test_fused_decoder_layer_equals_the_layer_op_by_op(name, monkeypatch):
    # Oracle: the same bf16 model running its layers' forward (the native ops one by one, each
    # tested against its reference above). The fused layer composes the same kernels, so the
    # logits must be identical, not just close, at 1-4 rows; 5 rows must take the layer forward.
    from test_llama_model import CONFIGS, PagedBatch, prompts
    from transformers import AutoModelForCausalLM
    from vbatch.engine.models.registry import get_model_class
    config = CONFIGS[name]()
    config.hidden_size, config.intermediate_size, config.head_dim = 256, 160, 64  # as the kernels take it
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in pname else 0.15 * torch.randn_like(p))
    model = get_model_class(config)(config, dtype=torch.bfloat16, device="cpu")
    model.load_weights(hf.state_dict().items())
    model.finalize_weights()                                   # as the model runner does: packed linears
    if not native.has_small_linear:
        pytest.skip("this CPU has no avx512_bf16: the fused layer (built on the small-rows linear) is off")
    assert model.ops.decoder_layer is cpu_native_ops.decoder_layer
    assert cpu_native_ops._layer_struct(model.layers[0]) is not None
    calls = []
    real = cpu_native.NativeKernels.decoder_layer_bf16
    monkeypatch.setattr(cpu_native.NativeKernels, "decoder_layer_bf16",
                        lambda self, *a: calls.append(a[4].shape[0]) or real(self, *a))
    for rows in (1, 2, 4, 5):                   # decode steps of 1, 2 and 4 rows are fused; 5 are not
        seqs = prompts(config.vocab_size, [6, 3, 9, 4, 5][:rows], seed=rows)
        runs = {}
        for fused in (True, False):
            monkeypatch.setattr(cpu_native_ops, "FUSED_LAYER_MAX_ROWS", 4 if fused else 0)
            batch = PagedBatch(model, [len(s) + 3 for s in seqs])
            batch.kv_caches = [(k.bfloat16(), v.bfloat16()) for k, v in batch.kv_caches]
            logits = [batch.step(model, seqs, [0] * rows)]                 # prefill
            for step in range(3):                                          # decode
                tokens = [[int(l.argmax())] for l in logits[-1][-rows:]] if step else [[5]] * rows
                logits.append(batch.step(model, tokens, [len(s) + step for s in seqs]))
            runs[fused] = logits
        for got, want in zip(runs[True], runs[False], strict=True):
            assert torch.equal(got, want), rows
    # fused: the 3 decode steps of every layer at 1, 2 and 4 rows (the prefills have more than 4 tokens)
    assert sorted(set(calls)) == [1, 2, 4] and len(calls) == 3 * 3 * config.num_hidden_layers
