"""Last-layer pruning (engine/models/output_rows.py): a step with prompt chunks runs its last decoder
layer's attention, o_proj and MLP only for the rows that get logits.

Oracle: the same model on the same step without pruning, its hidden rows gathered afterwards
(fp32 reference ops: equal to 1e-5; bf16 CPU ops: within bf16 rounding), and the KV caches both
leave behind (every token's K/V is still written). prepare_inputs builds the pruned rows' metadata
only when every logits row is the last row of its request and they are fewer than the tokens.
"""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from vbatch.engine.inputs import prepare_inputs
from vbatch.engine.models.registry import get_model_class
from vbatch.engine.request import Request
from vbatch.engine.sampling_params import SamplingParams
from vbatch.engine.scheduler_output import ScheduledRequest, SchedulerOutput

BS = 4
CPU = torch.device("cpu")
CONFIG = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, rms_norm_eps=1e-5)


def _request(rid: str, prompt_len: int, computed: int, outputs: int = 0, prompt_logprobs: int | None = None):
    params = SamplingParams(max_tokens=8, prompt_logprobs=prompt_logprobs).resolve(eos_token_ids=[0], vocab_size=128)
    r = Request(rid, [(7 * i + len(rid)) % 120 + 3 for i in range(prompt_len)], params, max_tokens=8)
    for t in range(outputs):
        r.append_output_token(11 + t)
    r.num_computed_tokens = computed
    return r


def _step(prompt_logprobs: int | None = None) -> SchedulerOutput:
    """A whole 9-token prompt (samples), a 6-token chunk of a 20-token prompt (does not), one decode."""
    a = _request("a", 9, 0, prompt_logprobs=prompt_logprobs)
    b = _request("bb", 20, 4)
    c = _request("ccc", 5, 6, outputs=2)         # 5 prompt + 2 outputs; the last output is new
    return SchedulerOutput(scheduled=(ScheduledRequest(a, 9, (3, 1, 8)),
                                      ScheduledRequest(b, 6, (2, 5, 9)),
                                      ScheduledRequest(c, 1, (4, 6))), num_scheduled_tokens=16)


def test_prepare_inputs_keeps_the_last_row_of_each_sampling_request():
    inputs = prepare_inputs(_step(), BS, CPU)
    rows = inputs.output_rows
    assert rows is not None
    assert rows.indices.tolist() == inputs.logits_indices.tolist() == [8, 15]  # a's last row, c's row
    m = rows.attn
    assert m.query_lens_list == (1, 1) and m.query_start_loc.tolist() == [0, 1, 2]
    assert m.seq_lens_list == (9, 7) and m.seq_lens.tolist() == [9, 7] and m.context_lens.tolist() == [8, 6]
    assert m.block_tables.tolist() == [[3, 1, 8], [4, 6, 0]] and m.max_seq_len == 9 and m.max_query_len == 1
    assert m.slot_mapping.tolist() == inputs.attn.slot_mapping[[8, 15]].tolist()


def test_no_pruning_for_prompt_logprobs_or_pure_decode():
    assert prepare_inputs(_step(prompt_logprobs=2), BS, CPU).output_rows is None   # every prompt row scored
    c = _request("ccc", 5, 6, outputs=2)
    d = _request("d", 3, 4, outputs=2)
    decode = SchedulerOutput(scheduled=(ScheduledRequest(c, 1, (4, 6)), ScheduledRequest(d, 1, (7, 10))),
                             num_scheduled_tokens=2)
    assert prepare_inputs(decode, BS, CPU).output_rows is None                     # every row is a logits row
    b = _request("bb", 20, 4)
    chunk_only = SchedulerOutput(scheduled=(ScheduledRequest(b, 6, (2, 5, 9)),), num_scheduled_tokens=6)
    assert prepare_inputs(chunk_only, BS, CPU).output_rows is None                 # nothing samples
    pooled = _request("p", 6, 0)
    pooled.pooling_params = object()
    with_pooling = SchedulerOutput(scheduled=(*_step().scheduled, ScheduledRequest(pooled, 6, (11, 12))),
                                   num_scheduled_tokens=22)
    assert prepare_inputs(with_pooling, BS, CPU).output_rows is None               # its rows are read later


def _same_inputs(got, want) -> None:
    """Every field equal, tensors in value, dtype and shape (and contiguous, as the kernels read them)."""
    import dataclasses
    for obj_got, obj_want in ((got, want), (got.attn, want.attn)):
        for f in dataclasses.fields(obj_want):
            a, b = getattr(obj_got, f.name), getattr(obj_want, f.name)
            if f.name == "attn":
                continue
            if isinstance(b, torch.Tensor):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) and a.is_contiguous(), f.name
            else:
                assert a == b, f.name


def test_decode_steps_get_the_general_paths_inputs():
    # Oracle: the general path on the same decode steps. Requests at a block's first and last slot,
    # tables of different widths (padded with 0), one request alone.
    from vbatch.engine import inputs as inp
    reqs = [_request("a", 3, 4, outputs=2),          # position 4: block 1's first slot
            _request("bb", 9, 11, outputs=3),        # position 11: block 2's last slot
            _request("c", 1, 1, outputs=1)]          # position 1 of a one-token prompt
    tables = [(7, 2), (5, 9, 3), (6,)]
    for scheduled in ([ScheduledRequest(r, 1, t) for r, t in zip(reqs, tables)],
                      [ScheduledRequest(reqs[1], 1, tables[1])]):
        sched = SchedulerOutput(scheduled=tuple(scheduled), num_scheduled_tokens=len(scheduled))
        got, want = inp._decode_inputs(sched.scheduled, BS, CPU), inp._general_inputs(sched.scheduled, BS, CPU)
        _same_inputs(got, want)
        assert got.logits_indices.tolist() == list(range(len(scheduled)))   # every row: the runner gathers none
        assert got.attn.slot_mapping.tolist() == [t[r.num_computed_tokens // BS] * BS + r.num_computed_tokens % BS
                                                  for r, t in ((s.request, s.block_ids) for s in scheduled)]
        fast = inp.prepare_inputs(sched, BS, CPU)
        assert fast.input_ids.data_ptr() == fast.positions.data_ptr() - 8 * len(scheduled)  # views of one tensor
    # Not decode: a one-token prompt chunk that scores a prompt token, or does not sample.
    scored = _request("p", 9, 3, prompt_logprobs=1)
    not_last = _request("q", 9, 3)
    for s in (ScheduledRequest(scored, 1, (1, 2, 3)), ScheduledRequest(not_last, 1, (1, 2, 3))):
        step = SchedulerOutput(scheduled=(s,), num_scheduled_tokens=1)
        _same_inputs(inp.prepare_inputs(step, BS, CPU), inp._general_inputs(step.scheduled, BS, CPU))
    assert inp.prepare_inputs(SchedulerOutput(scheduled=(ScheduledRequest(scored, 1, (1, 2, 3)),),
                                              num_scheduled_tokens=1), BS, CPU).prompt_logprobs
    assert not inp.prepare_inputs(SchedulerOutput(scheduled=(ScheduledRequest(not_last, 1, (1, 2, 3)),),
                                                  num_scheduled_tokens=1), BS, CPU).sample_reqs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pruned_last_layer_equals_the_full_step(dtype):
    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG)
    model = get_model_class(config)(config, dtype=dtype, device=CPU)
    model.load_weights((name, 0.15 * torch.randn(shape) if "norm" not in name else 1 + 0.2 * torch.randn(shape))
                       for name, shape in _hf_shapes(config))
    if hasattr(model, "finalize_weights"):
        model.finalize_weights()
    inputs = prepare_inputs(_step(), BS, CPU)
    assert model.prunes_last_layer and inputs.output_rows is not None

    def run(output_rows):
        torch.manual_seed(1)  # the same cache contents, prefix positions included, for both runs
        caches = [tuple(torch.randn(model.kv_cache_shape(11, BS)).to(dtype) for _ in range(2))
                  for _ in range(model.num_layers)]
        with torch.inference_mode():
            hidden = model(inputs.input_ids, inputs.positions, caches, inputs.attn, output_rows)
        return hidden, caches

    full, full_caches = run(None)
    pruned, pruned_caches = run(inputs.output_rows)
    assert pruned.shape == (2, 64)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(pruned.float(), full[inputs.logits_indices].float(), atol=tol, rtol=tol)
    for (k1, v1), (k2, v2) in zip(full_caches, pruned_caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)   # every token's K/V written, the last layer's too


def _hf_shapes(config):
    """(HF parameter name, shape) of a Llama checkpoint with `config`."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    return [(name, p.shape) for name, p in hf.state_dict().items()]
