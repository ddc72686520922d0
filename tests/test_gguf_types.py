"""GGUF block types beyond the shipped Q4_1 / Q8_0: Q4_0, Q5_0 and Q5_1 read exactly into the
kernels' blocks (the K types: test_k_quants.py), every other type dequantised by gguf-py's formulas
and named in a notice."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from ddspec import native  # noqa: E402
from ddspec.models.gguf_blocks import NATIVE_SOURCES, dequantize, native_blocks, native_weights  # noqa: E402
from ddspec.models.gguf_convert import dequantize_tensor  # noqa: E402

T = gguf.GGMLQuantizationType


def _weights(rows: int, cols: int, seed: int) -> np.ndarray:
    w = np.random.default_rng(seed).normal(0, 0.3, (rows, cols)).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block (scale 0)
    w[1, :32] = np.linspace(-2, 7, 32)  # a lopsided one
    return w


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0])
def test_blocks_the_kernels_read_dequantise_to_gguf_pys_values_bit_for_bit(qtype):
    raw = gguf.quantize(_weights(24, 96, int(qtype)), qtype)
    kind, qs, d, m = native_blocks(int(qtype), raw, 24)
    assert kind == NATIVE_SOURCES[int(qtype)]
    reference = gguf.dequantize(raw, qtype).reshape(24, 96)
    ours = dequantize(kind, qs, d, m)
    zero = np.float32(0)  # bit for bit but for the sign of zeros (Q4_0's -0.0 reads as +0.0 in Q4_1's form)
    assert np.array_equal((ours + zero).view(np.uint32), (reference + zero).view(np.uint32))
    if qtype != T.Q4_0:
        assert np.array_equal(ours.view(np.uint32), reference.view(np.uint32))


@pytest.mark.parametrize("qtype", [T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K])
def test_other_block_types_dequantise_by_gguf_pys_formulas(qtype):
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, (8, 512 // per * size), dtype=np.uint8)
    # fp16 scales at random bytes may be inf / nan: overwrite every block's fp16 fields with small values
    blocks = raw.reshape(8, -1, size)
    halves = {T.Q5_1: (0, 2), T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}[qtype]
    for at in halves:
        blocks[..., at:at + 2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    w = dequantize_tensor(int(qtype), [512, 8], raw.reshape(-1))
    assert w.shape == (8, 512) and w.dtype == np.float32 and np.isfinite(w).all()
    assert np.array_equal(w, gguf.dequantize(raw, qtype).reshape(8, 512))


def _write(path, tensors):
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, raw, qtype in tensors:
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.skipif(not native.available(), reason="no native kernels here")
def test_q4_0_q5_0_and_q5_1_weights_run_on_the_kernels_and_other_types_are_named(tmp_path, capsys):
    from test_k_quants import k_raw

    tensors = [("blk.0.attn_q.weight", gguf.quantize(_weights(64, 64, 1), T.Q4_0), T.Q4_0),
               ("blk.0.ffn_down.weight", gguf.quantize(_weights(64, 96, 2), T.Q5_0), T.Q5_0),
               ("blk.0.ffn_gate.weight", gguf.quantize(_weights(96, 64, 4), T.Q5_1), T.Q5_1),
               ("blk.0.ffn_up.weight", k_raw(T.Q2_K, 96, 256, 3), T.Q2_K)]
    _write(tmp_path / "m.gguf", tensors)
    names = {"blk.0.attn_q.weight": "layers.0.self_attn.q_proj.weight", "blk.0.ffn_down.weight": "layers.0.mlp.down_proj.weight",
             "blk.0.ffn_gate.weight": "layers.0.mlp.gate_proj.weight", "blk.0.ffn_up.weight": "layers.0.mlp.up_proj.weight"}
    dense = {names[n]: torch.from_numpy(gguf.dequantize(raw, t).reshape(raw.shape[0], -1).copy()) for n, raw, t in tensors}
    blocks = native_weights(tmp_path / "m.gguf", dense)
    assert {n: b.kind for n, b in blocks.items()} == {names["blk.0.attn_q.weight"]: "q4_1", names["blk.0.ffn_down.weight"]: "q8_0",
                                                       names["blk.0.ffn_gate.weight"]: "q5_1"}
    notice = capsys.readouterr().err
    assert "1 weight tensor (1 Q2_K) have no native kernel yet" in notice
    for name, weight in blocks.items():  # the kernels compute with exactly the file's fp32 weights
        x = torch.randn(3, dense[name].shape[1], generator=torch.Generator().manual_seed(0))
        exact = torch.stack([torch.stack([(x[r].double() * dense[name][o].double()).sum() for o in range(dense[name].shape[0])])
                             for r in range(3)]).float()
        assert torch.allclose(weight(x), exact, atol=1e-5, rtol=1e-5)


def _cli_on(path, tmp_path):
    import os
    import subprocess
    import sys

    cache = tmp_path / "cache"
    out = subprocess.run([sys.executable, "-m", "ddspec.cli", "generate", "hi", "--model", str(path)],
                         capture_output=True, text=True, env={**os.environ, "DDSPEC_CACHE": str(cache)})
    models = cache / "models"
    return out, not models.exists() or not any(models.iterdir())


def test_a_truncated_file_or_an_unknown_block_type_is_one_line_naming_the_tensor(tmp_path):
    import struct

    from test_gguf_convert import write_tiny_llama

    whole = tmp_path / "tiny.gguf"
    write_tiny_llama(whole, {"embd": int(T.Q8_0), "attn": int(T.Q4_0), "ffn": int(T.Q5_0), "norm": int(T.F32)})
    data = whole.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) - 4096])
    out, clean = _cli_on(cut, tmp_path / "a")
    assert out.returncode == 2 and "Traceback" not in out.stderr and clean
    assert "is truncated or its header is corrupt" in out.stderr and "tensor '" in out.stderr

    name = b"blk.0.ffn_up.weight"  # its tensor info: name, n_dims (u32), dims (u64 each), type (u32), offset
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    unknown = bytearray(data)
    struct.pack_into("<I", unknown, at + 4 + 8 * n_dims, 99)
    odd = tmp_path / "odd.gguf"
    odd.write_bytes(bytes(unknown))
    out, clean = _cli_on(odd, tmp_path / "b")
    assert out.returncode == 2 and "Traceback" not in out.stderr and clean
    assert "tensor 'blk.0.ffn_up.weight' has GGML type 99" in out.stderr
