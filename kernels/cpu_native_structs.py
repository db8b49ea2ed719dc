"""The ctypes mirrors of the native kernels' argument structs (kernels/csrc/vb_kernels.h): one decoder
layer's weights (VbLayer), what the layers of one step share (VbStep), and what several decode steps
add to them (VbDecode). Filled by kernels/cpu_native_ops.py, passed by kernels/cpu_native.py."""
from __future__ import annotations

import ctypes


class VbLayer(ctypes.Structure):
    """cpu_decoder_layer.c's VbLayer: one decoder layer's weights (pointers) and sizes."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "input_norm", "post_norm", "qkv_weight", "qkv_bias", "o_weight", "o_bias", "gate_up_weight",
        "gate_up_bias", "down_weight", "down_bias")] + [
        (name, ctypes.c_int) for name in ("hidden", "num_q_heads", "num_kv_heads", "head_dim", "intermediate",
                                          "weight_format")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class VbStep(ctypes.Structure):
    """cpu_decoder_layer.c's VbStep: what every layer of one step shares (pointers) and scratch rows."""

    _fields_ = [("rows", ctypes.c_int), ("cos", ctypes.c_void_p), ("signed_sin", ctypes.c_void_p),
                ("slots", ctypes.c_void_p), ("block_tables", ctypes.c_void_p), ("table_stride", ctypes.c_int64),
                ("query_start", ctypes.c_void_p), ("seq_lens", ctypes.c_void_p), ("num_reqs", ctypes.c_int),
                ("block_size", ctypes.c_int)] + [
        (name, ctypes.c_void_p) for name in ("normed", "qkv", "attn", "proj", "gate_up", "act")] + [
        ("final_norm", ctypes.c_void_p), ("final_eps", ctypes.c_float)]


class VbDecode(ctypes.Structure):
    """cpu_decode_steps.c's VbDecode: the embedding, head, rotary rows, stop tokens and scratch of the decode steps."""

    _fields_ = [("embedding", ctypes.c_void_p), ("head_weight", ctypes.c_void_p), ("head_format", ctypes.c_int),
                ("vocab", ctypes.c_int), ("cos_table", ctypes.c_void_p), ("signed_sin_table", ctypes.c_void_p),
                ("position_base", ctypes.c_int64), ("num_table_rows", ctypes.c_int64), ("stop_ids", ctypes.c_void_p),
                ("max_stops", ctypes.c_int), ("temperature", ctypes.c_void_p), ("uniforms", ctypes.c_void_p)] + [
        (name, ctypes.c_void_p) for name in ("logits", "cos", "signed_sin", "slots", "seq_lens")]
