"""ddspec's C kernels (native/kernels/): GGUF blocks rebuild exactly the fp32 weights,
matmul rows do not depend on the other rows of a call, the fused decoder layer is the torch
layer's maths, and every method stays lossless with them."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest
import torch

from ddspec import native
from ddspec.native import build as native_build
from ddspec.native import lib as native_lib
from ddspec.native import tuning as native_tuning

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels unavailable: {native.unavailable_reason()}")


def gguf_blocks(kind: str, w: np.ndarray):
    """w [rows, cols] fp32 quantised by gguf-py: (NativeWeight of its blocks, gguf-py's fp32 dequantisation)."""
    import gguf

    from ddspec.models.gguf_blocks import block_weight, dequantize, native_blocks

    qtype = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0}[kind]
    rows, cols = w.shape
    raw = gguf.quantize(w, qtype)  # [rows, bytes]
    reference = gguf.dequantize(raw, qtype).reshape(rows, cols)
    _, qs, d, m = native_blocks(int(qtype), raw, rows)
    assert np.array_equal(dequantize(kind, qs, d, m), reference)  # our formula is gguf-py's
    return block_weight(kind, cols, qs, d, m), torch.from_numpy(reference)


def quantised(kind: str, rows: int, cols: int, seed: int = 0):
    """A random weight quantised by gguf-py: (NativeWeight, its exact fp32 dequantisation [rows, cols])."""
    return gguf_blocks(kind, np.random.default_rng(seed).normal(0, 0.2, (rows, cols)).astype(np.float32))


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_blocks_rebuild_the_dequantised_weights_exactly(kind):
    weight, dense = quantised(kind, 40, 96)
    assert torch.equal(weight(torch.eye(96)), dense.t())  # one-hot rows read each weight back, bit for bit
    x = torch.randn(7, 96)
    assert (weight(x) - x @ dense.t()).abs().max() <= 1e-5


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_block_scales_are_kept_in_fp16_and_one_fp16_cannot_hold_is_refused(kind):
    """The kernels' blocks hold each block's scales (and Q4_1's minimums) in fp16, as the GGUF does:
    64 bytes of Q4_1 scales and minimums per 16 outputs and 32 inputs (320 bytes a block in all),
    32 bytes of Q8_0 scales (544). A scale fp16 would round is refused rather than changed."""
    weight, _ = quantised(kind, 40, 96)
    assert weight.packed[1].shape[-1] == (320 if kind == "q4_1" else 544)
    _, qs, d, m = weight.rows
    off = d.clone()
    off[3, 1] = float(d[3, 1]) * (1 + 2 ** -20)  # between two fp16 values
    bad = native.NativeWeight(kind, weight.out_features, weight.in_features, qs=qs, d=off, m=m)
    with pytest.raises(ValueError, match="fp16 cannot hold exactly"):
        bad.packed


def test_q4_1_copies_of_a_weight_are_gguf_q4_1_blocks():
    """NativeWeight.q4_1 (a draft head's default drafting weights): its blocks, written out as
    GGUF Q4_1 bytes, dequantise in gguf-py to what the kernel reads back, and they approximate
    the weight as closely as gguf-py's own Q4_1 quantiser (within a level step everywhere)."""
    import gguf

    w = np.random.default_rng(3).normal(0, 0.2, (48, 96)).astype(np.float32)
    weight = native.NativeWeight.q4_1(torch.from_numpy(w))
    _, qs, d, m = weight.rows
    rows, nb = d.shape
    raw = np.concatenate([d.half().numpy().view(np.uint8).reshape(rows, nb, 2),
                          m.half().numpy().view(np.uint8).reshape(rows, nb, 2), qs.numpy()], axis=-1)
    qtype = gguf.GGMLQuantizationType.Q4_1
    reference = gguf.dequantize(raw.reshape(rows, -1), qtype).reshape(rows, -1)
    assert torch.allclose(weight(torch.eye(96)).t(), torch.from_numpy(reference), rtol=0, atol=1e-6)
    err = np.abs(reference - w)
    assert (err <= np.repeat(d.numpy(), 32, axis=1) + 1e-3).all()
    theirs = np.abs(gguf.dequantize(gguf.quantize(w, qtype), qtype).reshape(rows, -1) - w)
    assert np.sqrt((err ** 2).mean()) <= 1.02 * np.sqrt((theirs ** 2).mean())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_weights_are_kept_in_half_and_read_back_exactly(dtype):
    """A dense weight whose values fp16 (or bf16) holds exactly is stored in that format (half the
    bytes) and multiplies with the same values; any other fp32 weight stays fp32."""
    w = (torch.randn(48, 72) * 0.1).to(dtype).float()
    if dtype == torch.bfloat16:
        w[0, 0] = torch.tensor(1e30).to(dtype).item()  # outside fp16's range: only bf16 holds it
    weight = native.NativeWeight.dense(w)
    assert weight.kind == {torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]
    assert weight.nbytes == w.numel() * 2
    assert torch.equal(weight(torch.eye(72)), w.t())  # one-hot rows read each weight back, bit for bit
    x = torch.randn(9, 72)
    assert torch.equal(weight(x), native.NativeWeight("f32", 48, 72, w=w)(x))  # the fp32 kernel's sums exactly
    assert native.NativeWeight.dense(torch.randn(40, 72)).kind == "f32"


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "f32", "f16"])
def test_a_row_does_not_depend_on_the_other_rows(kind):
    if kind in ("f32", "f16"):
        weight = native.NativeWeight.dense(torch.randn(50, 64).to(torch.float16 if kind == "f16" else torch.float32).float())
        assert weight.kind == kind
    else:
        weight = quantised(kind, 50, 64, seed=1)[0]
    x = torch.randn(13, 64)
    together = weight(x)
    for r in range(13):
        assert torch.equal(together[r], weight(x[r:r + 1])[0])
    torch.set_num_threads(1)
    try:
        assert torch.equal(weight(x), together)  # nor on the thread count
    finally:
        torch.set_num_threads(2)


def test_gguf_blocks_are_matched_to_their_weights_and_a_mismatch_is_refused(tmp_path, capsys):
    """A small GGUF written with gguf-py: the reader finds the blocks, recovers a row permutation
    (HF's loader permutes q and k) and refuses a weight that is not their exact dequantisation."""
    import gguf

    from ddspec.models.gguf_blocks import native_weights, quantised_tensors

    rng = np.random.default_rng(2)
    w_q = rng.normal(0, 0.2, (64, 64)).astype(np.float32)
    w_up = rng.normal(0, 0.2, (96, 64)).astype(np.float32)
    embed = rng.normal(0, 0.2, (50, 64)).astype(np.float32)
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    writer.add_string("tokenizer.ggml.tokens.dummy", "x" * 100)
    raws = {}
    for name, w, qtype in [("blk.0.attn_q.weight", w_q, gguf.GGMLQuantizationType.Q4_1),
                           ("blk.0.ffn_up.weight", w_up, gguf.GGMLQuantizationType.Q4_1),
                           ("token_embd.weight", embed, gguf.GGMLQuantizationType.Q8_0)]:
        raws[name] = gguf.quantize(w, qtype)
        writer.add_tensor(name, raws[name], raw_shape=raws[name].shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    found = quantised_tensors(tmp_path / "m.gguf")
    assert {k: v[0] for k, v in found.items()} == {"blk.0.attn_q.weight": 3, "blk.0.ffn_up.weight": 3,
                                                   "token_embd.weight": 8}
    assert np.array_equal(found["blk.0.ffn_up.weight"][1], raws["blk.0.ffn_up.weight"])

    deq = {k: torch.from_numpy(gguf.dequantize(r, t).reshape(-1, 64).copy()) for k, r, t in [
        ("q", raws["blk.0.attn_q.weight"], gguf.GGMLQuantizationType.Q4_1),
        ("up", raws["blk.0.ffn_up.weight"], gguf.GGMLQuantizationType.Q4_1),
        ("embed", raws["token_embd.weight"], gguf.GGMLQuantizationType.Q8_0)]}
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    tampered = deq["up"].clone()
    tampered[5, 7] += 1e-3
    dense = {"layers.0.self_attn.q_proj.weight": deq["q"][perm], "layers.0.mlp.up_proj.weight": tampered,
             "embed_tokens.weight": deq["embed"]}
    blocks = native_weights(tmp_path / "m.gguf", dense)
    assert set(blocks) == {"layers.0.self_attn.q_proj.weight", "embed_tokens.weight"}
    assert "do not match their fp32 weights exactly" in capsys.readouterr().err
    assert torch.equal(blocks["layers.0.self_attn.q_proj.weight"](torch.eye(64)), deq["q"][perm].t())
    assert torch.equal(blocks["embed_tokens.weight"](torch.eye(64)), deq["embed"].t())


def test_remembered_row_orders_are_checked_and_a_wrong_one_is_matched_again(tmp_path, monkeypatch):
    """The row permutations found once are remembered in a file; a later load checks a sample of
    rows against them instead of matching every row, and a wrong or unreadable file only costs
    the full matching again (the weights stay exact)."""
    import gguf

    from ddspec.models import gguf_blocks

    rng = np.random.default_rng(3)
    w = rng.normal(0, 0.2, (80, 64)).astype(np.float32)
    raw = gguf.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    writer.add_tensor("blk.0.attn_k.weight", raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    deq = torch.from_numpy(gguf.dequantize(raw, gguf.GGMLQuantizationType.Q4_1).reshape(80, 64).copy())
    perm = torch.randperm(80, generator=torch.Generator().manual_seed(1))
    dense = {"layers.0.self_attn.k_proj.weight": deq[perm]}
    orders = tmp_path / "orders.npz"
    name = "layers.0.self_attn.k_proj.weight"

    first = gguf_blocks.native_weights(tmp_path / "m.gguf", dense, orders)
    assert orders.is_file() and torch.equal(first[name](torch.eye(64)), deq[perm].t())
    matched = []
    real_row_order = gguf_blocks._row_order
    monkeypatch.setattr(gguf_blocks, "_row_order", lambda *a: matched.append(1) or real_row_order(*a))
    again = gguf_blocks.native_weights(tmp_path / "m.gguf", dense, orders)
    assert matched == [] and torch.equal(again[name](torch.eye(64)), deq[perm].t())  # the remembered order

    wrong = perm.numpy().copy()
    wrong[[0, 79]] = wrong[[79, 0]]  # two rows swapped (the first and last are always sampled)
    np.savez(orders, **{name: wrong})
    assert not gguf_blocks._rows_match(*gguf_blocks.native_blocks(3, raw, 80), wrong, dense[name].numpy())
    fixed = gguf_blocks.native_weights(tmp_path / "m.gguf", dense, orders)
    assert matched == [1] and torch.equal(fixed[name](torch.eye(64)), deq[perm].t())
    orders.write_bytes(b"not a npz file")
    assert torch.equal(gguf_blocks.native_weights(tmp_path / "m.gguf", dense, orders)[name](torch.eye(64)),
                       deq[perm].t())
    assert len(matched) == 2


def _fresh_native(monkeypatch, tmp_path, compiler: str | None):
    monkeypatch.setattr(native_lib, "_lib", None)
    monkeypatch.setattr(native_lib, "_why_not", None)
    monkeypatch.setattr(native_lib, "_pending", None)
    monkeypatch.setenv("DDSPEC_CACHE", str(tmp_path / "cache"))
    if compiler is not None:
        monkeypatch.setenv("CC", compiler)


def test_the_kernels_build_in_the_background_and_land_in_place(tmp_path, monkeypatch, capsys):
    """start_build() starts the compiler without waiting; library() waits for it, moves the
    library into the cache and loads it. (The compiler here copies the library this test process
    already built, for each part and the link: the mechanics, not 15 s of gcc.)"""
    built = native_build.built_path()  # in the cache, or where make setup put it
    fake = tmp_path / "fake-cc"
    fake.write_text(f'#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\nsleep 1\ncp "{built}" "$2"\n')
    fake.chmod(0o755)
    _fresh_native(monkeypatch, tmp_path, str(fake))
    folder = tmp_path / "cache" / "native"
    folder.mkdir(parents=True)
    stale, recent = folder / "killed-build.so.tmp", folder / "running-build.so.tmp"
    stale.write_bytes(b"")
    recent.write_bytes(b"")
    os.utime(stale, (0, 0))  # left by a build killed long ago; `recent` may be another process's
    native.start_build()
    assert native_lib._pending is not None and all(p.poll() is None for p in native_lib._pending.procs)  # still compiling: not waited for
    lib = native.library()
    assert lib is not None and native_lib._pending is None
    err = capsys.readouterr().err
    assert "compiling ddspec's CPU kernels in the background" in err and "waiting for the kernel build" in err
    assert sorted(p.name for p in folder.iterdir()) == sorted([native_build.kernel_paths()[0].name, recent.name])
    native.start_build()  # built: nothing to start
    assert native_lib._pending is None


def test_kernels_built_into_the_environment_serve_every_cache(tmp_path, monkeypatch, capsys):
    """prebuild() (``make setup`` runs it beside pip) compiles the kernels into <sys.prefix>/share/
    ddspec/native; a process with an empty cache then loads them without starting a build, and a
    second prebuild() has nothing to do. (The fake compiler copies this test process's library.)"""
    built = native_build.built_path()
    fake = tmp_path / "fake-cc"
    fake.write_text(f'#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\ncp "{built}" "$2"\n')
    fake.chmod(0o755)
    _fresh_native(monkeypatch, tmp_path, str(fake))
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "env"))
    where = native.prebuild()
    assert where == tmp_path / "env" / "share" / "ddspec" / "native" / native_build.kernel_paths()[0].name
    assert where.is_file() and "compiled in" in capsys.readouterr().err
    fake.write_text("#!/bin/sh\nexit 1\n")  # any compiler run from here on fails
    assert native.prebuild() == where
    native.start_build()
    assert native_lib._pending is None  # nothing to build
    assert native.library() is not None and not list((tmp_path / "cache").glob("native/*.so"))


def test_a_failing_compiler_is_reported_and_torch_kernels_are_used(tmp_path, monkeypatch, capsys):
    _fresh_native(monkeypatch, tmp_path, "/bin/false")
    native.start_build()
    assert native.library() is None
    assert "could not build" in native.unavailable_reason() and "failed" in native.unavailable_reason()
    assert "using torch's kernels" in capsys.readouterr().err
    assert list((tmp_path / "cache" / "native").iterdir()) == []  # nothing half-written


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_layer_equals_the_torch_layer(tiny_dirs, family, monkeypatch):
    """Prefill, one token, and a tree (mask with holes) after a prefix: logits and the cache agree (1e-5)."""
    from ddspec.models.loading import load_target

    monkeypatch.setenv("DDSPEC_KERNEL", "mm")
    reference = load_target(str(tiny_dirs[family]), impl="native")
    monkeypatch.setenv("DDSPEC_KERNEL", "native")
    fused = load_target(str(tiny_dirs[family]), impl="native")
    assert fused.layers[0].fused is not None
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 128, (11,), generator=gen)
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]], dtype=torch.bool)
    steps = [(prefix, torch.arange(11), None), (torch.tensor([9]), torch.tensor([11]), None),
             (torch.randint(0, 128, (5,), generator=gen), torch.tensor([12, 13, 13, 14, 14]), tree)]
    for t in (reference, fused):
        t.reset(40)
    for tokens, positions, mask in steps:
        outs = [t.forward(tokens, positions, mask, hidden_layers=(0, 1)) for t in (reference, fused)]
        assert (outs[0].logits - outs[1].logits).abs().max() <= 1e-5
        for i in (0, 1):
            assert (outs[0].hidden_states[i] - outs[1].hidden_states[i]).abs().max() <= 1e-5
    n = reference.cache.length
    assert (reference.cache.keys[:, :, :, :n] - fused.cache.keys[:, :, :, :n]).abs().max() <= 1e-5
    assert (reference.cache.values[:, :, :, :n] - fused.cache.values[:, :, :, :n]).abs().max() <= 1e-5


@pytest.mark.parametrize("weights", ["exact", "q8_0", "q8_0a8", "q4_1a8"])
@pytest.mark.parametrize("method", ["chain", "eagle2", "ddd", "ddspec"])
def test_every_method_is_lossless_on_the_native_kernels(tiny_dirs, method, weights, monkeypatch):
    """Target and draft head both on the C path (the head's weights exact, or quantised as drafting
    uses them by default): greedy output equals plain decoding."""
    from ddspec.config import StopConfig
    from ddspec.engine import Engine
    from ddspec.models.loading import load_target
    from test_spec_engine import PROMPTS, eagle

    monkeypatch.setenv("DDSPEC_KERNEL", "native")
    monkeypatch.setenv("DDSPEC_DRAFT_WEIGHTS", weights)
    target = load_target(str(tiny_dirs["llama"]), impl="native")
    stop = StopConfig(max_new_tokens=30, stop_on_eos=False)
    for prompt in PROMPTS[:2]:
        ref = Engine(target).generate(prompt, stop).token_ids
        drafter = eagle(target, method)
        assert drafter.packed.plan.needed == {"native"} and drafter.packed.layers[0].fused is not None
        assert drafter.packed.layers[0].qkv.native.kind == {"exact": "f32"}.get(weights, weights)
        assert Engine(target, drafter).generate(prompt, stop).token_ids == ref


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setattr(native_lib, "_lib", None)
    monkeypatch.setattr(native_lib, "_why_not", None)
    monkeypatch.setenv("DDSPEC_NATIVE", "0")
    assert native.library() is None and "DDSPEC_NATIVE" in native.unavailable_reason()
    from ddspec.models.kernels import candidates

    assert "native" not in candidates(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("kv", ["fp32", "fp16"])
@pytest.mark.parametrize("shape", [dict(hidden=256, heads=4, kv_heads=2), dict(hidden=36, heads=3, kv_heads=1)],
                         ids=["head_dim64", "head_dim12"])
def test_both_attention_passes_equal_the_torch_layer_and_each_other(tmp_path, shape, kv, monkeypatch):
    """The one-pass attention (a unit per token and head) and the shared one (each kv head's
    keys read once for all its queries) over a 75-token prefix, one token, a tree with holes and a
    9-token chain (more queries than one pass of the values takes on 16 lanes):
    both within 2e-5 of torch's layer relative to the logits' scale (the old per-head attention
    measured 6.4e-6 of it on the wider model), and equal to each other bit for bit (the same sums
    in the same order). The same with fp16 caches on both sides (torch's layer attends over the
    rounded values too), where a key computed an ulp apart can round to the next fp16 (an fp16 ulp
    is 2^-11 of the value): within 1e-3 (2e-4 measured)."""
    from ddspec.models.loading import load_target
    from ddspec.models.tiny import make_tiny_model_dir

    path = make_tiny_model_dir(tmp_path / "m", "llama", seed=3, **shape)
    monkeypatch.setenv("DDSPEC_KV_CACHE", kv)
    monkeypatch.setenv("DDSPEC_KERNEL", "mm")
    reference = load_target(str(path), impl="native")
    monkeypatch.setenv("DDSPEC_KERNEL", "native")
    fused = load_target(str(path), impl="native")
    gen = torch.Generator().manual_seed(7)
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]], dtype=torch.bool)
    steps = [(torch.randint(0, 128, (75,), generator=gen), torch.arange(75), None),
             (torch.tensor([9]), torch.tensor([75]), None),
             (torch.randint(0, 128, (5,), generator=gen), torch.tensor([76, 77, 77, 78, 78]), tree),
             (torch.randint(0, 128, (9,), generator=gen), torch.arange(79, 88), torch.tril(torch.ones(9, 9, dtype=torch.bool)))]
    wide = native.attention_wide()  # as the model load chose it; restored below
    try:
        logits = {}
        for mode, lanes16 in (("rows", True), ("shared", True), ("shared", False)):
            native.set_attention(mode)
            native.set_attention_wide(lanes16)
            for t in (reference, fused):
                t.reset(96)
            for s, (tokens, positions, mask) in enumerate(steps):
                ref, out = (t.forward(tokens, positions, mask) for t in (reference, fused))
                tolerance = 2e-5 if kv == "fp32" else 1e-3
                assert (ref.logits - out.logits).abs().max() <= tolerance * ref.logits.abs().max(), (mode, s)
                logits[mode, lanes16, s] = out.logits
        assert fused.cache.keys.dtype == reference.cache.keys.dtype == getattr(torch, {"fp32": "float32", "fp16": "float16"}[kv])
        for s in range(len(steps)):
            assert torch.equal(logits["rows", True, s], logits["shared", True, s])
            assert torch.equal(logits["shared", False, s], logits["shared", True, s])  # 8 or 16 lanes: same bits
    finally:
        native.set_attention("auto")
        native.set_attention_wide(wide)
    with pytest.raises(KeyError):
        native.set_attention("fast")


def int8_reference(kind: str, weight, x: torch.Tensor) -> torch.Tensor:
    """x @ W^T as the 8-bit activation kernels define it, written plainly in float64: per row and
    block of 32 inputs, dx = max|x| / 127 and qx = round-half-even(x * (127 / max|x|)) in fp32,
    then d * dx * sum(q * qx) (+ m * sum(x) for Q4_1)."""
    _, qs, d, m = weight.rows
    out, inp = weight.out_features, weight.in_features
    nb = inp // 32
    q = (torch.cat([qs & 0x0F, qs >> 4], dim=-1) if kind == "q4_1" else qs.view(torch.int8)).reshape(out, nb, 32)
    xb = x.float().reshape(x.shape[0], nb, 32)
    mx = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(mx > 0, torch.tensor(127.0) / mx, torch.zeros_like(mx))  # fp32, as the kernel
    qx = torch.round(xb * inv)
    dx = (mx / 127.0).double()
    isum = torch.einsum("rbk,obk->rob", qx.double(), q.double())
    y = (isum * d.double().reshape(1, out, nb) * dx.reshape(-1, 1, nb)).sum(-1)
    if kind == "q4_1":
        y = y + (m.double().reshape(1, out, nb) * xb.double().sum(-1).reshape(-1, 1, nb)).sum(-1)
    return y


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_int8_activation_kernels_compute_their_integer_arithmetic(kind):
    """--activations int8: the kernels equal the plain definition (float64) to fp32 rounding, stay
    close to the fp32 product (the rounding of x costs about 1%), and a row never depends on the
    others, on the thread count or on whether the threads share the rounding of the rows."""
    weight, dense = quantised(kind, 40, 96, seed=3)
    fast = weight.with_int8_activations()
    assert fast.kind == kind + "a8" and fast.nbytes == weight.nbytes
    x = torch.randn(13, 96)
    x[2, 32:64] = 0.0  # an all-zero block: scale 0
    x[5, 7] = 40.0  # one large value: the rest of its block rounds coarsely
    y = fast(x)
    ref = int8_reference(kind, weight, x)
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() <= 2e-6
    exact = x @ dense.t()
    assert ((y - exact).norm() / exact.norm()).item() <= 3e-2
    for r in range(13):
        assert torch.equal(y[r], fast(x[r:r + 1])[0])
    for n in (5, 6, 7, 12):  # every tile size of the 8-lane passes (13 rows run as 5 + 4 + 4)
        assert torch.equal(fast(x[:n]), y[:n]), f"{n} rows"
    try:
        for rows in (0, 1, 14):  # the rows rounded by every thread, or once and shared (13 rows: from 3 on, the default)
            native.set_share_rows(rows)
            assert torch.equal(fast(x), y), f"sharing the rounding from {rows} rows"
        torch.set_num_threads(1)
        assert torch.equal(fast(x), y)
    finally:
        torch.set_num_threads(2)
        native.set_share_rows(3)
    with pytest.raises(ValueError, match="share the rounding"):
        native.set_share_rows(-1)


def _quantise_dense(monkeypatch) -> None:
    """Make the native target read Q4_1 blocks (Q8_0 for the embeddings) quantised from the tiny
    model's own weights, as if they came from a GGUF."""
    from ddspec.models import llama, loading

    def blocks(path, weights):
        return {name: gguf_blocks("q8_0" if "embed" in name else "q4_1", t.float().contiguous().numpy())[0]
                for name, t in weights.items() if t.dim() == 2 and t.shape[1] % 32 == 0}

    monkeypatch.setattr(llama, "read_gguf_blocks", blocks)
    monkeypatch.setattr(loading, "_gguf_source", lambda spec: "blocks.gguf")


@pytest.mark.parametrize("method", ["chain", "eagle2", "ddd", "ddspec"])
def test_int8_activations_keep_every_method_lossless(tiny_dirs, method, monkeypatch):
    """A target on Q4_1 blocks with 8-bit activations: every matmul of the blocks runs on the int8
    kernels (prefill, decoding and trees alike), its logits stay near the fp32-activation model's,
    and every method's greedy output equals plain decoding with it."""
    from ddspec.config import StopConfig
    from ddspec.engine import Engine
    from ddspec.models.loading import load_target
    from test_spec_engine import PROMPTS, eagle

    _quantise_dense(monkeypatch)
    target = load_target(str(tiny_dirs["llama"]), impl="native", activations="int8")
    assert target.layer_plan.needed == {"native"} and target.head_plan.needed == {"native"}
    assert {target.layers[0].qkv.native.kind, target.layers[0].down.native.kind} == {"q4_1a8"}
    assert target.lm_head_w.native.kind == "q8_0a8"
    assert target.lm_head_blocks(None).kind == "q8_0"  # draft heads' lm_heads keep the blocks as read
    if method == "chain":
        fp32 = load_target(str(tiny_dirs["llama"]), impl="native")
        tokens = torch.tensor(PROMPTS[0])
        for t in (target, fp32):
            t.reset(20)
        a, b = (t.forward(tokens, torch.arange(len(tokens))).logits for t in (target, fp32))
        assert ((a - b).norm() / b.norm()).item() <= 0.1  # a wrong layout or scale gives ~1
    stop = StopConfig(max_new_tokens=30, stop_on_eos=False)
    for prompt in PROMPTS[:2]:
        ref = Engine(target).generate(prompt, stop).token_ids
        assert Engine(target, eagle(target, method)).generate(prompt, stop).token_ids == ref


def test_int8_activations_are_refused_where_they_cannot_run(tiny_dirs, monkeypatch):
    from ddspec.errors import ConfigError
    from ddspec.models.loading import ModelLoadError, load_target

    with pytest.raises(ConfigError, match="block weights.*--activations fp32"):
        load_target(str(tiny_dirs["llama"]), impl="native", activations="int8")  # dense weights: nothing to round for
    with pytest.raises(ModelLoadError, match="native implementation"):
        load_target(str(tiny_dirs["llama"]), impl="hf", activations="int8")
    _quantise_dense(monkeypatch)
    monkeypatch.setenv("DDSPEC_KERNEL", "onednn")
    with pytest.raises(ConfigError, match="DDSPEC_KERNEL=onednn"):
        load_target(str(tiny_dirs["llama"]), impl="native", activations="int8")


@pytest.mark.parametrize("activations", ["fp32", "int8"])
@pytest.mark.parametrize("prefix_len", [13, 45])  # 45: rows of 46-49 keys, past the softmax's 16-lane steps
def test_a_tree_node_gets_bit_for_bit_what_its_path_gets_decoded_alone(tiny_dirs, activations, prefix_len,
                                                                       monkeypatch):
    """The fused layers' attention sums a row's visible keys in the same lanes whatever the other
    rows, the tree's shape or the masked keys: each node's features equal, bit for bit, those of
    decoding its path one token at a time (what keeps 8-bit activations, which would turn an ulp
    into a different rounding of x, exactly lossless)."""
    from ddspec.models.loading import load_target

    _quantise_dense(monkeypatch)
    target = load_target(str(tiny_dirs["llama"]), impl="native", activations=activations)
    gen = torch.Generator().manual_seed(11)
    prefix = torch.randint(0, 128, (prefix_len,), generator=gen)
    # root 0; children 1, 2; 3 under 1; 4 under 2; 5 under 3
    parents = [-1, 0, 0, 1, 2, 3]
    tokens = torch.randint(0, 128, (len(parents),), generator=gen)
    depth = [0] * len(parents)
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
            depth[i] = depth[p] + 1
    target.reset(prefix_len + 27)
    target.forward(prefix, torch.arange(prefix_len))
    tree = target.forward(tokens, prefix_len + torch.tensor(depth), mask).features
    for node in range(len(parents)):
        path = [i for i in range(len(parents)) if mask[node, i]]
        target.truncate(prefix_len)
        for step, i in enumerate(path):
            out = target.forward(tokens[i:i + 1], torch.tensor([prefix_len + step]))
        assert torch.equal(out.features[0], tree[node]), f"node {node} (path {path})"


def test_vnni_kernels_give_the_same_bits_as_the_avx2_ones(tmp_path):
    """Where the CPU has VNNI the 8-bit-activation kernels add their products with vpdpbusd; a build
    without it (DDSPEC_VNNI=0, in a subprocess with its own cache) must give the same bits."""
    import subprocess
    import sys

    if not native.available():
        pytest.skip(native.unavailable_reason())
    if not native.vnni_flags():
        pytest.skip("this CPU (or compiler) has no VNNI: both builds would be the same")
    script = (
        "import sys, numpy as np, torch\n"
        f"sys.path.insert(0, {str(os.path.dirname(__file__))!r})\n"
        "from test_native_kernels import gguf_blocks\n"
        "from ddspec import native\n"
        "assert native.available() and native.vnni_flags() == []\n"
        "torch.manual_seed(0)\n"
        "x = torch.randn(9, 96)\n"
        "for kind in ('q4_1', 'q8_0'):\n"
        "    w, _ = gguf_blocks(kind, np.random.default_rng(3).normal(0, 0.2, (40, 96)).astype(np.float32))\n"
        "    torch.save(w.with_int8_activations()(x), sys.argv[1] + '/' + kind + '.pt')\n"
    )
    env = {**os.environ, "DDSPEC_VNNI": "0", "DDSPEC_CACHE": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    torch.manual_seed(0)
    x = torch.randn(9, 96)
    for kind in ("q4_1", "q8_0"):
        weight, _ = quantised(kind, 40, 96, seed=3)
        assert torch.equal(weight.with_int8_activations()(x), torch.load(tmp_path / f"{kind}.pt"))


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q4_1a8", "q8_0a8"])
def test_avx512_passes_give_the_same_bits_as_the_8_lane_ones(kind):
    """Every groups-per-pass choice of the AVX-512 passes, at every tile size and at row counts
    that split into several tiles, equals the 8-lane passes bit for bit (200 outputs: 13 groups,
    so the last unit of 2, 3 or 4 groups is short; a bias on one of them), with and without
    the L2 prefetch of the passes of several rows. The 8-bit-activation kinds (AVX-512 VNNI)
    get rows whose blocks reach the rounding's +-127 and hold zeros."""
    if not native.wide_available(kind):
        pytest.skip(f"these kernels were built without the AVX-512 passes for {kind}")
    weight, _ = quantised(kind[:4], 200, 96, seed=5)
    if kind.endswith("a8"):
        weight = weight.with_int8_activations()
    biased = weight.with_bias(torch.randn(200))
    torch.manual_seed(1)
    chosen = native.prefetch_blocks()
    try:
        for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17):
            x = torch.randn(n, 96) * torch.logspace(-2, 2, 96)  # blocks of very different scales
            x[0, 32:64] = 0.0  # an all-zero block (scale 0)
            tiles = -(-n // native.WIDE_ROWS)
            tile = -(-n // tiles)
            for w in (weight, biased):
                native.set_wide(kind, [0] * native.WIDE_ROWS)
                reference = w(x)
                for g in native.wide_options(tile, kind)[1:]:
                    native.set_wide(kind, [g if r == tile else 0 for r in range(1, native.WIDE_ROWS + 1)])
                    for ahead in (0, 1, 24):
                        native.set_prefetch(ahead)
                        assert torch.equal(w(x), reference), f"{n} rows, {g} groups per pass, prefetch {ahead}"
    finally:
        native.set_wide(kind, [1] * native.WIDE_ROWS)
        native.set_prefetch(chosen)
    with pytest.raises(ValueError, match="blocks ahead"):
        native.set_prefetch(-1)


def _tree_case(activations: str, seed: int):
    """A lone Q4_1 weight (200 x 96, with 8-bit activations for int8), a generator, a 13-token
    prompt, a 5-node tree's tokens, its positions after the prompt and mask, and 9 rows for the
    weight."""
    weight, _ = quantised("q4_1", 200, 96, seed=5)
    if activations == "int8":
        weight = weight.with_int8_activations()
    gen = torch.Generator().manual_seed(seed)
    prefix, tokens = torch.randint(0, 128, (13,), generator=gen), torch.randint(0, 128, (5,), generator=gen)
    mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                        dtype=torch.bool)
    return weight, gen, prefix, tokens, torch.tensor([13, 14, 14, 15, 15]), mask, torch.randn(9, 96, generator=gen)


@pytest.mark.parametrize("activations", ["fp32", "int8"])
@pytest.mark.parametrize("lanes", [16, 8])
def test_groups_taken_from_a_late_thread_give_the_same_bits(tiny_dirs, activations, lanes, monkeypatch):
    """Work stealing: with thread 0 of every matmul held back, the other thread takes its groups
    from the end of its share (counted: the test sees it happen), on the AVX-512 passes and on the
    8-lane ones. Every matmul, a forward's accumulating ones (x += o(...), x += down(...)) and a
    dense weight's included, gives the same bits as without, and a lone weight's rows the same as
    computed one at a time."""
    from ddspec.models.loading import load_target

    kind = "q4_1a8" if activations == "int8" else "q4_1"
    if lanes == 16 and not native.wide_available(kind):
        pytest.skip(f"these kernels were built without the AVX-512 passes for {kind}")
    if lanes == 8 and native.wide_available(kind):
        before = native.wide_choice()
        for k in before:
            native.set_wide(k, [0] * native.WIDE_ROWS)
        monkeypatch.setattr(native, "tune_wide_on_forward", lambda *a, **k: None)
        monkeypatch.setattr(native, "choose_wide", lambda *a, **k: None)
    _quantise_dense(monkeypatch)
    torch.set_num_threads(2)
    target = load_target(str(tiny_dirs["llama"]), impl="native", activations=activations)
    weight, gen, prefix, tokens, positions, mask, x = _tree_case(activations, 3)
    dense = native.NativeWeight.dense(torch.randn(200, 96, generator=gen))

    def run():
        target.reset(40)
        first = target.forward(prefix, torch.arange(13))
        tree = target.forward(tokens, positions, mask)
        return (first.logits, tree.logits, tree.features, weight(x), weight(x[:1]), weight(x[:2]), dense(x),
                dense(x[:2]))

    native.set_span_delay(0)
    on_time = run()
    try:
        native.set_span_delay(2000)
        late = run()
    finally:
        taken = native.set_span_delay(0)
        if lanes == 8 and native.wide_available(kind):
            for k, g in before.items():
                native.set_wide(k, g)
    assert taken > 0, "no group was taken from the late thread"
    for a, b in zip(on_time, late):
        assert torch.equal(a, b)
    assert torch.equal(on_time[3], torch.cat([weight(x[r:r + 1]) for r in range(9)]))


@pytest.mark.parametrize("activations", ["fp32", "int8"])
def test_more_threads_than_cpus_cross_openmps_barriers_and_give_the_same_bits(tiny_dirs, activations, monkeypatch):
    """The kernels' own barrier (a spinning one) serves regions of at most as many threads as the
    process has CPUs; with more, the threads cross OpenMP's barriers instead (and an 8-bit matmul
    hands its shared rows over through OpenMP from 8 rows): a forward's logits and features, and
    a lone weight's rows (9: shared), are the same bits either way.

    Every matmul runs on the kernels (DDSPEC_KERNEL=native): left to the measured plan, an fp32
    target's lm_head may run on torch's matmul instead (on this tiny model it often wins the
    timing, here and on AVX2-only Zen 3 CPUs), and MKL's sgemm does not promise the same bits at
    every thread count (torch 2.13, MKL 2024.2, AMD EPYC Zen 4: a 5-row tree's logits from the
    same features differ by an ulp at 2 and at 4 threads); the kernels do."""
    from ddspec.models.loading import load_target

    _quantise_dense(monkeypatch)
    monkeypatch.setenv("DDSPEC_KERNEL", "native")
    cpus = len(os.sched_getaffinity(0))
    weight, _, prefix, tokens, positions, mask, x = _tree_case(activations, 4)

    def run(threads: int):
        torch.set_num_threads(threads)
        target = load_target(str(tiny_dirs["llama"]), impl="native", activations=activations)
        assert target.layer_plan.needed == {"native"} and target.head_plan.needed == {"native"}
        target.reset(40)
        first = target.forward(prefix, torch.arange(13))
        tree = target.forward(tokens, positions, mask)
        return first.logits, tree.logits, tree.features, weight(x), weight(x[:3])

    try:
        fitting, more = run(min(2, cpus)), run(cpus + 2)
    finally:
        torch.set_num_threads(2)
    for a, b in zip(fitting, more):
        assert torch.equal(a, b)


@pytest.mark.skipif(not native.available(), reason="no native kernels here")
def test_the_kernel_choices_are_measured_once_and_cached(tmp_path, monkeypatch):
    """The AVX-512 passes' groups (where the build has them) and the prefetch distance (always)."""
    monkeypatch.setenv("DDSPEC_CACHE", str(tmp_path))
    weights = {"q4_1": [quantised("q4_1", 64, 64, seed=2)[0]], "q8_0": [quantised("q8_0", 48, 64, seed=3)[0]]}
    weights.update({f"{k}a8": [w.with_int8_activations() for w in ws] for k, ws in list(weights.items())})
    chosen = native.choose_wide(weights)
    assert set(chosen) == {k for k in weights if native.wide_available(k)}
    for kind, groups in chosen.items():
        assert len(groups) == native.WIDE_ROWS
        assert all(g in native.wide_options(r, kind) for r, g in enumerate(groups, 1))
    cached = list((tmp_path / "kernels").glob("wide-*.json"))
    if not cached:
        pytest.skip("other programs used the CPU while timing: the choice was not cached")
    monkeypatch.setattr(native_tuning, "measure_wide", lambda ws: pytest.fail("measured again"))
    monkeypatch.setattr(native_tuning, "measure_prefetch", lambda ws: pytest.fail("measured again"))
    ahead = native.prefetch_blocks()
    assert ahead in native.PREFETCH_OPTIONS
    native.set_prefetch(0)
    assert native.choose_wide(weights) == chosen and native.prefetch_blocks() == ahead  # read back from the cache


@pytest.mark.skipif(not native.available(), reason="no native kernels here")
def test_the_rows_that_prefetch_are_chosen_once_per_model_and_distance(tmp_path, monkeypatch):
    """From how many rows on the passes prefetch: measured on the model's forward (here a stand-in
    answer), cached per distance and model, read back; with no distance set, 3 and nothing timed."""
    monkeypatch.setenv("DDSPEC_CACHE", str(tmp_path))
    ahead, rows = native.prefetch_blocks(), native.prefetch_rows()
    try:
        native.set_prefetch(0)
        assert native.choose_prefetch_rows({"model": "m"}, lambda: pytest.fail("timed")) == 3
        native.set_prefetch(12)
        answers = []
        assert native.choose_prefetch_rows({"model": "m"}, lambda: answers.append(1) or 2) == 2 == native.prefetch_rows()
        if not list((tmp_path / "kernels").glob("prefetch-rows-*.json")):
            pytest.skip("other programs used the CPU meanwhile: the choice was not cached")
        native.set_prefetch_rows(3)
        assert native.choose_prefetch_rows({"model": "m"}, lambda: pytest.fail("timed again")) == 2  # the cache
        assert native.choose_prefetch_rows({"model": "other"}, lambda: 3) == 3 and answers == [1]
    finally:
        native.set_prefetch(ahead)
        native.set_prefetch_rows(rows)


@pytest.mark.skipif(not native.available(), reason="no native kernels here")
def test_the_prefetch_is_chosen_for_k_type_models_too(tmp_path, monkeypatch):
    """A model of GGUF's K types alone (no kind with AVX-512 passes) still gets its prefetch distance
    and rows measured, and cached, instead of none at all."""
    monkeypatch.setenv("DDSPEC_CACHE", str(tmp_path))
    from test_k_quants import T, k_weight

    weights = {"q4_ka8": [k_weight(T.Q4_K, 64, 256, seed=1)[0].with_int8_activations()],
               "q6_ka8": [k_weight(T.Q6_K, 32, 256, seed=2)[0].with_int8_activations()]}
    measured = []
    real = native_tuning.measure_prefetch
    monkeypatch.setattr(native_tuning, "measure_prefetch", lambda ws: measured.append(len(ws)) or real(ws))
    assert native.choose_wide(weights) == {}
    assert measured == [2] and native.prefetch_blocks() in native.PREFETCH_OPTIONS
    with pytest.raises(ValueError, match="from 0 rows"):
        native.set_prefetch_rows(0)


def test_the_attention_lanes_are_measured_once_and_cached(tmp_path, monkeypatch):
    """Where the build has the 16-lane attention passes, the faster setting is measured once per
    CPU, build, threads and attention shape and read back after; without them, off."""
    monkeypatch.setenv("DDSPEC_CACHE", str(tmp_path))
    before = native.attention_wide()
    calls = []
    try:
        def measure(answer):
            calls.append(answer)
            return answer
        shape = {"heads": 4, "kv_heads": 2, "head_dim": 64}
        got = native.choose_attention_wide(shape, lambda: measure(False))
        if not native.wide_available():
            assert got is False and calls == []
            return
        assert got is False and calls == [False]
        if not list((tmp_path / "kernels").glob("attention-*.json")):
            pytest.skip("other programs used the CPU while timing: the choice was not cached")
        native.set_attention_wide(True)
        assert native.choose_attention_wide(shape, lambda: measure(True)) is False and calls == [False]  # cached
        assert native.choose_attention_wide({**shape, "head_dim": 32}, lambda: measure(True)) is True  # another shape
    finally:
        native.set_attention_wide(before)


def test_bench_reports_name_the_kernels_that_ran():
    from ddspec.bench.report import machine_info

    line = machine_info(1, "cpu")["native kernels"]
    assert line.startswith("AVX2/FMA") and native.build_id() in line
    assert ("AVX-512 passes" in line) == native.wide_available()
    assert ("VNNI" in line) == bool(native.vnni_flags())


def test_compiler_probes_are_cached(tmp_path, monkeypatch):
    """A CPU-flag probe runs the compiler once per compiler and flags; later processes read the answer."""
    import shutil
    import subprocess

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("DDSPEC_CACHE", str(tmp_path))
    assert native_build._compiles(compiler, ["-O2"]) is True
    assert native_build._compiles(compiler, ["-mno-such-flag-here"]) is False
    assert (tmp_path / "native" / "probes.json").is_file()

    def no_compiler(*a, **k):
        raise AssertionError("probed again")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert native_build._compiles(compiler, ["-O2"]) is True
    assert native_build._compiles(compiler, ["-mno-such-flag-here"]) is False


@pytest.mark.skipif(not native.wide_available("q4_1"), reason="these kernels were built without the AVX-512 passes")
def test_the_passes_are_chosen_by_the_run_they_serve(tmp_path, monkeypatch):
    """measure_wide_on keeps, for each tile size, the option under which the given run is fastest
    (here a run that sleeps 3 ms unless the option in use is the one wanted for its row count), and
    tune_wide_on_forward caches that choice and applies it again without running anything; a
    later choose_wide (another model loading) leaves it in place."""
    monkeypatch.setenv("DDSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(native_tuning, "_forward_tuned", {})
    before = native.wide_choice()
    wanted = {rows: native.wide_options(rows)[-1 - rows % 2] for rows in range(1, native.WIDE_ROWS + 1)}
    seen = []

    def run(rows: int) -> None:
        seen.append(rows)
        if native.wide_choice()["q4_1"][rows - 1] != wanted[rows]:
            time.sleep(0.003)

    try:
        chosen = native.tune_wide_on_forward(["q4_1"], {"model": "fake"}, run, reps=3)
        assert chosen == {"q4_1": [wanted[r] for r in range(1, native.WIDE_ROWS + 1)]}
        assert native.wide_choice()["q4_1"] == chosen["q4_1"]
        if not list((tmp_path / "kernels").glob("wide-forward-*.json")):
            pytest.skip("other programs used the CPU while timing: the choice was not cached")
        native.set_wide("q4_1", before["q4_1"])
        seen.clear()
        assert native.tune_wide_on_forward(["q4_1"], {"model": "fake"}, run, reps=3) == chosen
        assert not seen and native.wide_choice()["q4_1"] == chosen["q4_1"]
        native.choose_wide({"q4_1": [quantised("q4_1", 64, 64, seed=2)[0]]})
        assert native.wide_choice()["q4_1"] == chosen["q4_1"]
    finally:
        native.set_wide("q4_1", before["q4_1"])


@pytest.mark.skipif(not native.wide_available("q4_1"), reason="these kernels were built without the AVX-512 passes")
def test_a_burst_in_one_sweep_does_not_pick_the_passes(monkeypatch):
    """With rounds=2 each option keeps its best median over two sweeps: an option slowed in the first
    sweep only (other work on the machine) is still chosen when it is the fastest; one sweep alone
    keeps another."""
    monkeypatch.setattr(native_tuning, "_forward_tuned", {})
    before = native.wide_choice()
    wanted = {rows: native.wide_options(rows)[-1] for rows in range(1, native.WIDE_ROWS + 1)}

    def timed(rounds: int) -> list[int]:
        state = {"sweep": 0, "last": 0}

        def run(rows: int) -> None:
            if rows < state["last"]:
                state["sweep"] += 1  # back at one row: the next sweep
            state["last"] = rows
            fast = native.wide_choice()["q4_1"][rows - 1] == wanted[rows]
            time.sleep(0.006 if fast and state["sweep"] == 0 else 0.0 if fast else 0.003)

        return native.measure_wide_on(run, ["q4_1"], reps=3, rounds=rounds)["q4_1"]

    try:
        assert timed(2) == [wanted[r] for r in range(1, native.WIDE_ROWS + 1)]
        assert all(g != wanted[r] for r, g in enumerate(timed(1), 1))
    finally:
        native.set_wide("q4_1", before["q4_1"])


@pytest.mark.skipif(not native.wide_available("q4_1"), reason="these kernels were built without the AVX-512 passes")
def test_a_screening_sweep_leaves_only_the_close_options_to_time(monkeypatch):
    """With screen > 0 a first, short sweep drops the options slower than its fastest by more than
    the margin (here 50%: sleeps jitter): the later sweeps never run them (here they would have been
    the fastest there), and the choice among the kept ones is the later sweeps' (not the
    screening's)."""
    monkeypatch.setattr(native_tuning, "_forward_tuned", {})
    before = native.wide_choice()
    state = {"sweep": 0, "last": 0}
    later = set()  # (rows, option) run after the screening sweep

    def run(rows: int) -> None:
        if rows < state["last"]:
            state["sweep"] += 1
        state["last"] = rows
        options = native.wide_options(rows)
        g = native.wide_choice()["q4_1"][rows - 1]
        if state["sweep"] == 0:  # screening: the last two options fast, the others far behind
            time.sleep(0.002 if g in options[-2:] else 0.008)
        else:
            later.add((rows, g))
            time.sleep(0.002 if g != options[-1] else 0.005)  # the second last is the fastest now

    try:
        chosen = native.measure_wide_on(run, ["q4_1"], reps=3, rounds=1, screen=3, margin=0.5)["q4_1"]
        assert chosen == [native.wide_options(r)[-2] for r in range(1, native.WIDE_ROWS + 1)]
        assert later == {(r, g) for r in range(1, native.WIDE_ROWS + 1) for g in native.wide_options(r)[-2:]}
    finally:
        native.set_wide("q4_1", before["q4_1"])


@pytest.mark.skipif(not native.wide_available("q4_1"), reason="these kernels were built without the AVX-512 passes")
def test_the_matmuls_alone_screen_out_the_passes_that_slow_them(monkeypatch):
    """With ``alone`` (a kind's matmuls run alone), options that make them slower than the fastest by
    more than alone_margin are gone before the whole run is timed, even where the whole run would
    have chosen one of them (its share of a forward hiding the difference); the choice among the
    kept ones is the whole run's."""
    monkeypatch.setattr(native_tuning, "_forward_tuned", {})
    before = native.wide_choice()
    kept = {rows: set(native.wide_options(rows)[-2:]) for rows in range(1, native.WIDE_ROWS + 1)}
    timed_whole = set()

    def alone(kind: str, rows: int) -> None:
        assert kind == "q4_1"
        time.sleep(0.002 if native.wide_choice()["q4_1"][rows - 1] in kept[rows] else 0.006)

    def run(rows: int) -> None:
        g = native.wide_choice()["q4_1"][rows - 1]
        timed_whole.add((rows, g))
        time.sleep(0.001 if g == native.wide_options(rows)[0] else 0.002 if g == native.wide_options(rows)[-1] else 0.004)

    try:
        chosen = native.measure_wide_on(run, ["q4_1"], reps=3, rounds=1, alone=alone, alone_margin=0.5)["q4_1"]
        assert chosen == [native.wide_options(r)[-1] for r in range(1, native.WIDE_ROWS + 1)]
        assert timed_whole <= {(r, g) for r in kept for g in kept[r]}
    finally:
        native.set_wide("q4_1", before["q4_1"])


def test_the_int8_model_keeps_fp16_keys_and_values_rounded_once(tiny_dirs, monkeypatch):
    """--activations int8: the cache holds fp16 (half the bytes its attention reads); each key and
    value is the fp32 one the forward computes, rounded to the nearest fp16 (the first layer's of a
    DDSPEC_KV_CACHE=fp32 twin, rounded, equal it bit for bit; the logits move less than the 8-bit
    activations move them from the fp32 model's). fp32 activations keep fp32, and a bad
    DDSPEC_KV_CACHE is refused with a message naming the fix."""
    from ddspec.errors import ConfigError
    from ddspec.models.loading import load_target

    _quantise_dense(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 128, (21,), generator=gen)
    out = {}
    for kv, activations in (("", "int8"), ("fp32", "int8"), ("", "fp32")):
        monkeypatch.setenv("DDSPEC_KV_CACHE", kv)
        target = load_target(str(tiny_dirs["llama"]), impl="native", activations=activations)
        target.reset(32)
        target.forward(tokens[:20], torch.arange(20))  # the prompt: its own keys, in one forward
        target.commit(torch.arange(20))
        out[kv + activations] = (target.forward(tokens[20:], torch.tensor([20])).logits, target.cache)
    half, full = out["int8"][1], out["fp32int8"][1]
    assert half.keys.dtype == half.values.dtype == torch.float16 and full.keys.dtype == torch.float32
    # the first layer's keys and values come from the same fp32 arithmetic in both (later layers
    # read attention over the rounded ones): rounded, the same bits
    assert torch.equal(half.keys[0, :, :, :21], full.keys[0, :, :, :21].half())
    assert torch.equal(half.values[0, :, :, :21], full.values[0, :, :, :21].half())
    assert not torch.equal(half.keys[1:, :, :, :21].float(), full.keys[1:, :, :, :21])
    # the fp16 cache moves the logits less than the 8-bit activations themselves do
    assert out["fp32"][1].keys.dtype == torch.float32  # fp32 activations: an fp32 cache
    kv_change = (out["int8"][0] - out["fp32int8"][0]).abs().max()
    assert 0 < kv_change < (out["fp32int8"][0] - out["fp32"][0]).abs().max()
    monkeypatch.setenv("DDSPEC_KV_CACHE", "bf16")
    with pytest.raises(ConfigError, match="DDSPEC_KV_CACHE"):
        load_target(str(tiny_dirs["llama"]), impl="native", activations="int8")


def test_a_half_cache_hands_fp32_callers_fp32():
    """torch's layer (any model on a path other than the native kernel) writes fp32 keys into a
    cache of fp16 and attends over the stored (rounded) values, as fp32."""
    from ddspec.kv_cache import StaticKVCache

    cache = StaticKVCache(2, 1, 8, 16, dtype=torch.float16)
    k, v = torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8)
    keys, values = cache.write(1, k, v)
    assert keys.dtype == values.dtype == torch.float32 and keys.shape == (1, 1, 3, 8)
    assert torch.equal(keys, k.half().float()) and torch.equal(values, v.half().float())


def test_a_long_prompt_runs_in_chunks_with_the_bits_of_one_forward(tiny_dirs, monkeypatch):
    """A causal forward longer than PREFILL_CHUNK runs as forwards of PREFILL_CHUNK tokens: logits,
    features, captured residual streams and the cache are those of one forward, bit for bit, and
    the cache then keeps them all as that forward's entries."""
    from ddspec.models import llama
    from ddspec.models.loading import load_target

    _quantise_dense(monkeypatch)
    target = load_target(str(tiny_dirs["llama"]), impl="native", activations="int8")
    tokens = torch.randint(0, 128, (70,), generator=torch.Generator().manual_seed(2))
    runs = {}
    for chunk in (1000, 32, 7):
        monkeypatch.setattr(llama, "PREFILL_CHUNK", chunk)
        target.reset(80)
        out = target.forward(tokens, torch.arange(70), hidden_layers=(1,))
        target.commit(torch.arange(70))
        last = target.forward(tokens[:3], torch.arange(70, 73), last_logits=True)
        runs[chunk] = (out, last, target.cache.keys[:, :, :, :73].clone(), target.cache_length)
        target.reset(80)  # as the engine asks: the last token's logits only
        assert torch.equal(target.forward(tokens, torch.arange(70), last_logits=True).logits, out.logits[-1:])
    one = runs[1000]
    for chunk in (32, 7):
        out, last, keys, length = runs[chunk]
        assert length == one[3] == 73
        assert torch.equal(out.logits, one[0].logits) and torch.equal(out.features, one[0].features)
        assert torch.equal(out.hidden_states[1], one[0].hidden_states[1])
        assert torch.equal(last.logits, one[1].logits) and torch.equal(keys, one[2])


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q4_1a8", "q8_0a8", "f32"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_matmuls_argmax_is_numpys_argmax_of_its_output(kind, threads):
    """with_argmax: the same outputs as the plain call and numpy's argmax of them, whatever the
    threads (3: more than these CPUs, OpenMP's barrier), ties to the first column (here across the
    threads' halves and inside one), a NaN first of all."""
    if kind == "f32":
        weight = native.NativeWeight.dense(torch.randn(300, 64))
    else:
        weight = quantised(kind[:4], 300, 64, seed=3)[0]
        weight = weight.with_int8_activations() if kind.endswith("a8") else weight
    eye = weight(torch.eye(64))  # [64, 300]: the weight as the kernel sees it, one column per output
    x = torch.randn(5, 64)
    x[1] = eye[:, 17]  # the 17th output's own weights: its dot product is the largest by far
    x[2] = eye[:, 200]
    torch.set_num_threads(threads)
    try:
        y, best = weight.with_argmax(x)
        assert torch.equal(y, weight(x))
        assert best.tolist() == y.numpy().argmax(-1).tolist()
        assert best[1] == 17 and best[2] == 200
        if kind == "f32":  # exact ties: duplicated output rows
            rows = weight.rows[0].clone()
            rows[250], rows[230] = rows[17], rows[200]
            twin = native.NativeWeight.dense(rows)
            y, best = twin.with_argmax(x)
            assert y[1, 17] == y[1, 250] and best[1] == 17  # across the halves
            assert y[2, 200] == y[2, 230] and best[2] == 200  # inside the second half
        y, best = weight.with_argmax(torch.full((2, 64), float("nan")))
        assert best.tolist() == [0, 0]
    finally:
        torch.set_num_threads(2)


def test_a_sweep_of_matmuls_computes_each_as_its_own_call():
    """gemm_sweep (the phase profile's matmuls alone): weights of several kinds and widths in one C
    call, its output the last one's, bit for bit as that weight's own call; other input widths and
    an empty list refused."""
    a = quantised("q4_1", 48, 64, seed=1)[0].with_int8_activations()
    b = quantised("q8_0", 300, 64, seed=2)[0]
    c = native.NativeWeight.dense(torch.randn(20, 64))
    x = torch.randn(3, 64)
    for order in ([a, b, c], [c, b, a], [b, b, b, a, b]):
        y = native.gemm_sweep(order, x)
        assert torch.equal(y, order[-1](x))
    with pytest.raises(ValueError, match="64 inputs"):
        native.gemm_sweep([a, native.NativeWeight.dense(torch.randn(8, 32))], x)
    with pytest.raises(ValueError):
        native.gemm_sweep([], x)
