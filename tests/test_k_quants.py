"""GGUF's K types (Q3_K, Q4_K, Q5_K, Q6_K) and Q5_1 on the native kernels: their blocks decoded as gguf-py
decodes them, the matmuls equal to dequantise-then-multiply in both activation modes, a row never
depending on the others, and a target on K blocks decoding every method token for token as plain
decoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from ddspec import native  # noqa: E402
from ddspec.models.gguf_blocks import NATIVE_SOURCES, block_weight, dequantize, native_blocks  # noqa: E402

T = gguf.GGMLQuantizationType
K_TYPES = [T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q5_1]
FP16_FIELDS = {T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q2_K: (80, 82), T.Q5_1: (0, 2)}
needs_kernels = pytest.mark.skipif(not native.available(), reason="no native kernels here")


def k_raw(qtype, rows: int, cols: int, seed: int) -> np.ndarray:
    """A tensor of ``qtype`` blocks: random levels, scales and minimums (every bit pattern the format
    allows), with small random fp16 super-block scales (random bytes there could be inf or NaN)."""
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // per * size), dtype=np.uint8)
    blocks = raw.reshape(rows, -1, size)
    for i, at in enumerate(FP16_FIELDS[qtype]):
        scales = rng.uniform(0.001, 0.02, blocks.shape[:2]).astype(np.float16)
        if qtype == T.Q5_1 and i == 1:  # its minimums: either sign
            scales = (scales * rng.choice([-16, 16], scales.shape)).astype(np.float16)
        blocks[..., at:at + 2] = scales[..., None].view(np.uint8)
    return raw


def k_weight(qtype, rows: int, cols: int, seed: int = 0):
    """(NativeWeight of a random ``qtype`` tensor, gguf-py's fp32 dequantisation of it [rows, cols])."""
    raw = k_raw(qtype, rows, cols, seed)
    kind, qs, d, m = native_blocks(int(qtype), raw, rows)
    weight = block_weight(kind, cols, qs, d, m)
    return weight, torch.from_numpy(gguf.dequantize(raw, qtype).reshape(rows, cols).copy())


@pytest.mark.parametrize("qtype", K_TYPES)
def test_k_blocks_decode_to_gguf_pys_values_bit_for_bit(qtype):
    raw = k_raw(qtype, 8, 512, int(qtype))
    kind, qs, d, m = native_blocks(int(qtype), raw, 8)
    assert kind == NATIVE_SOURCES[int(qtype)] == {T.Q4_K: "q4_k", T.Q5_1: "q5_1"}.get(qtype, "q6_k")
    ours, reference = dequantize(kind, qs, d, m), gguf.dequantize(raw, qtype).reshape(8, 512)
    assert np.array_equal(ours.view(np.uint32), reference.view(np.uint32))
    low, high = {T.Q3_K: (-4, 3), T.Q4_K: (0, 15), T.Q5_K: (0, 31), T.Q6_K: (-32, 31), T.Q5_1: (0, 31)}[qtype]
    assert qs.dtype == np.int8 and low <= qs.min() and qs.max() <= high


@needs_kernels
@pytest.mark.parametrize("qtype", K_TYPES)
def test_k_matmuls_equal_dequantise_then_multiply(qtype):
    """fp32 activations: over 1 .. 64 rows the kernel equals the float64 product with gguf-py's
    weights within 1e-4 (relative to the largest output), a one-hot row reads each weight back bit
    for bit, and each row is the same alone as among the others (and on one thread)."""
    weight, dense = k_weight(qtype, 40, 512, seed=int(qtype))
    eye = weight(torch.eye(512))
    zero = torch.tensor(0.0)
    assert torch.equal((eye + zero).view(torch.int32), (dense.t() + zero).view(torch.int32))
    rng = torch.Generator().manual_seed(0)
    for n in [*range(1, 17), 31, 64]:
        x = torch.randn(n, 512, generator=rng)
        y = weight(x)
        ref = x.double() @ dense.double().t()
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() <= 1e-4, n
        if n in (1, 2, 3, 7, 16):
            for r in range(n):
                assert torch.equal(y[r], weight(x[r:r + 1])[0]), (n, r)
    try:
        torch.set_num_threads(1)
        assert torch.equal(weight(x), y)
    finally:
        torch.set_num_threads(2)


def k_int8_reference(weight, x: torch.Tensor) -> torch.Tensor:
    """x @ W^T as the 8-bit-activation K kernels define it, in float64: per row and block of 32
    inputs dx = max|x| / 127 and qx = round-half-even(x * (127 / max|x|)) in fp32; per sub-block of
    16 inputs the integer sum of q * qx times fl(fl(d * sc) * dx), minus fl(dmin * m) * sum(x)
    (Q5_1: the block's d, and plus m * sum(x))."""
    _, qs, d, m = weight.rows
    out, inp = weight.out_features, weight.in_features
    nb = inp // 32
    if weight.kind == "q5_1":  # as a K weight with d = 1, sc = the block's d and dmin * m = -m
        d, m = torch.stack([torch.ones(out, nb // 8), torch.ones(out, nb // 8)], -1), torch.stack([d, d, -m, 0 * d], -1)
    xb = x.float().reshape(x.shape[0], nb, 32)
    mx = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(mx > 0, torch.tensor(127.0) / mx, torch.zeros_like(mx))
    qx = torch.round(xb * inv).double().reshape(x.shape[0], nb, 2, 16)
    dx = mx / 127.0  # fp32 [n, nb, 1]
    sup = d.float().repeat_interleave(8, dim=1)  # [out, nb, 2]: each block's d, dmin
    scale = sup[..., :1] * m[..., :2].float()  # fp32 [out, nb, 2] (exact)
    isum = torch.einsum("rbhk,obhk->robh", qx, qs.reshape(out, nb, 2, 16).double())
    y = (isum * (scale.unsqueeze(0) * dx.reshape(-1, 1, nb, 1)).double()).sum((-1, -2))
    minimum = (sup[..., 1] * m[..., 2].float()).double()  # [out, nb]
    return y - torch.einsum("rb,ob->ro", xb.double().sum(-1), minimum)


@needs_kernels
@pytest.mark.parametrize("qtype", K_TYPES)
def test_k_int8_activations_compute_their_integer_arithmetic(qtype):
    weight, dense = k_weight(qtype, 40, 512, seed=int(qtype) + 1)
    fast = weight.with_int8_activations()
    assert fast.kind == weight.kind + "a8"
    # bytes per group and block of 32 inputs: 4-bit levels (q4_k), bytes (fp32 activations), 6 bits (8-bit ones)
    assert (weight.packed[1].shape[-1], fast.packed[1].shape[-1]) == ((288, 288) if qtype == T.Q4_K else (576, 448))
    x = torch.randn(13, 512, generator=torch.Generator().manual_seed(1))
    x[2, 32:64] = 0.0  # an all-zero block: scale 0
    x[5, 7] = 40.0  # one large value: the rest of its block rounds coarsely
    y = fast(x)
    ref = k_int8_reference(weight, x)
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() <= 2e-6
    exact = x.double() @ dense.double().t()
    assert ((y.double() - exact).norm() / exact.norm()).item() <= 3e-2
    for r in range(13):
        assert torch.equal(y[r], fast(x[r:r + 1])[0])
    for n in (5, 6, 7, 12):  # every tile size of the 8-lane passes (13 rows run as 5 + 4 + 4 or 4 + 3 + 3 + 3)
        assert torch.equal(fast(x[:n]), y[:n]), f"{n} rows"
    ahead, from_rows = native.prefetch_blocks(), native.prefetch_rows()
    try:
        for rows in (0, 1, 14):  # the rounding of the rows by every thread, or shared
            native.set_share_rows(rows)
            assert torch.equal(fast(x), y)
        for blocks, rows in ((0, 3), (24, 1), (48, 2)):  # prefetching moves no bit
            native.set_prefetch(blocks)
            native.set_prefetch_rows(rows)
            assert torch.equal(fast(x), y) and torch.equal(fast(x[:2]), y[:2])
        torch.set_num_threads(1)
        assert torch.equal(fast(x), y)
    finally:
        torch.set_num_threads(2)
        native.set_share_rows(3)
        native.set_prefetch(ahead)
        native.set_prefetch_rows(from_rows)


@needs_kernels
@pytest.mark.parametrize("qtype", [T.Q3_K, T.Q5_K, T.Q6_K, T.Q5_1])
@pytest.mark.parametrize("levels", ["top", "bottom"])
def test_k_int8_sums_at_the_levels_extremes_are_exact(qtype, levels):
    """The 8-bit-activation passes multiply the unsigned stored levels (Q6_K's q + 32: up to 63) two
    quads at a time in 16-bit lanes and take the zero point back times the row's sum: with every
    level at its largest (or smallest) value and every activation at +-127 the sums reach their
    bounds (4 * 63 * 127 = 32004 in a lane), where an overflow or a wrong zero point would be far
    off the reference."""
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = k_raw(qtype, 32, 512, seed=5)
    blocks = raw.reshape(32, -1, size)
    span = {T.Q3_K: (0, 96), T.Q5_K: (16, 176), T.Q6_K: (0, 192), T.Q5_1: (4, 24)}[qtype]
    blocks[..., span[0]:span[1]] = 0xFF if levels == "top" else 0
    kind, qs, d, m = native_blocks(int(qtype), raw, 32)
    weight = block_weight(kind, 512, qs, d, m)
    fast = weight.with_int8_activations()
    x = torch.ones(4, 512)
    x[1] = -1.0
    x[2, ::2] = -1.0  # signs alternating within every quad
    x[3] = torch.linspace(-3.0, 2.0, 512)
    y, ref = fast(x), k_int8_reference(weight, x)
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() <= 2e-6


def test_a_zero_point_the_8_bit_passes_cannot_shift_is_refused():
    """The 8-bit-activation passes subtract z * (the activations' sum) as a shift: a q6_k weight whose
    zero points are not 0 or a power of two is refused when packed for them, not computed wrongly."""
    kind, qs, d, m = native_blocks(int(T.Q3_K), k_raw(T.Q3_K, 16, 256, seed=3), 16)
    block_weight(kind, 256, qs, d, m).with_int8_activations().packed  # z = 4: taken
    m[..., 3] = 8  # another power of two: taken
    block_weight(kind, 256, qs, d, m).with_int8_activations().packed
    m[..., 3] = 5  # Q3_K's levels -4..3 plus 5 stay within 0..63, but 5 is no shift
    with pytest.raises(ValueError, match="power of two"):
        block_weight(kind, 256, qs, d, m).with_int8_activations().packed


@needs_kernels
def test_a_q4_k_weight_stacks_with_a_q6_k_one_in_8_bit_levels():
    """q|k|v with q and k in Q4_K and v in Q6_K (as a Q4_K_M file has them): one q6_k matmul, each
    output equal to its own weight's within fp32 rounding."""
    q, dq = k_weight(T.Q4_K, 32, 256, seed=1)
    v, dv = k_weight(T.Q6_K, 16, 256, seed=2)
    stacked = native.concat([q, v])
    assert stacked.kind == "q6_k" and stacked.out_features == 48
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2))
    ref = x.double() @ torch.cat([dq, dv]).double().t()
    for w in (stacked, stacked.with_int8_activations()):
        y = w(x)
        tol = 1e-5 if w is stacked else 3e-2
        assert ((y.double() - ref).norm() / ref.norm()).item() <= tol
    assert ((stacked(x)[:, :32] - q(x)).abs().max() / q(x).abs().max()).item() <= 1e-5


@needs_kernels
def test_weights_whose_kinds_share_no_layout_stack_as_parts():
    """q|k|v with a Q5_1 q and k and a Q8_0 v (a "Q5_K_M" file's layers): one matmul whose parts keep
    their own kinds, each output bit for bit its own weight's, with a bias, in both activation modes."""
    q, _ = k_weight(T.Q5_1, 32, 256, seed=3)
    v, dv = k_weight(T.Q6_K, 16, 256, seed=4)
    v8 = native.NativeWeight.q8_0(dv)
    stacked = native.concat([q, v8])
    assert stacked.kind == "stack" and stacked.out_features == 48
    bias = torch.randn(48)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    for a8 in (False, True):
        w = stacked.with_int8_activations() if a8 else stacked
        parts = [p.with_int8_activations() if a8 else p for p in (q, v8)]
        y = w.with_bias(bias)(x)
        assert torch.equal(y[:, :32], parts[0].with_bias(bias[:32])(x))
        assert torch.equal(y[:, 32:], parts[1].with_bias(bias[32:])(x))
        assert torch.equal(w(x)[2:3], w(x[2:3]))


def test_a_k_weight_needs_whole_super_blocks():
    with pytest.raises(ValueError, match="multiple of 256"):
        native.NativeWeight("q4_k", 16, 288, qs=torch.zeros(16, 288, dtype=torch.int8),
                            d=torch.zeros(16, 1, 2), m=torch.zeros(16, 9, 4, dtype=torch.int8))


@needs_kernels
def test_k_tensors_of_a_gguf_file_run_on_the_kernels_and_q2_k_is_named(tmp_path, capsys):
    from test_gguf_types import _write

    from ddspec.models.gguf_blocks import native_weights

    tensors = [("blk.0.attn_q.weight", k_raw(T.Q4_K, 32, 256, 1), T.Q4_K),
               ("blk.0.attn_v.weight", k_raw(T.Q6_K, 32, 256, 2), T.Q6_K),
               ("blk.0.ffn_down.weight", k_raw(T.Q5_K, 32, 512, 3), T.Q5_K),
               ("blk.0.ffn_gate.weight", k_raw(T.Q3_K, 32, 256, 4), T.Q3_K),
               ("blk.0.ffn_up.weight", k_raw(T.Q2_K, 32, 256, 5), T.Q2_K)]
    _write(tmp_path / "m.gguf", tensors)
    names = {"attn_q": "self_attn.q_proj", "attn_v": "self_attn.v_proj", "ffn_down": "mlp.down_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj"}
    hf = {n: f"layers.0.{names[n.split('.')[2]]}.weight" for n, _, _ in tensors}
    dense = {hf[n]: torch.from_numpy(gguf.dequantize(raw, t).reshape(32, -1).copy()) for n, raw, t in tensors}
    blocks = native_weights(tmp_path / "m.gguf", dense)
    assert {n: b.kind for n, b in blocks.items()} == {hf["blk.0.attn_q.weight"]: "q4_k", hf["blk.0.attn_v.weight"]: "q6_k",
                                                       hf["blk.0.ffn_down.weight"]: "q6_k", hf["blk.0.ffn_gate.weight"]: "q6_k"}
    assert "1 weight tensor (1 Q2_K) have no native kernel yet" in capsys.readouterr().err
    for name, weight in blocks.items():
        x = torch.randn(3, weight.in_features, generator=torch.Generator().manual_seed(0))
        ref = x.double() @ dense[name].double().t()
        assert ((weight(x).double() - ref).abs().max() / ref.abs().max()).item() <= 1e-4


def k_quantise(w: torch.Tensor, kind: str) -> native.NativeWeight:
    """A dense weight [out, in] as K blocks (a plain quantiser for tests: per 16 or 32 inputs a 6-bit
    or 8-bit scale under an fp16 super-block scale; Q4_K-like levels 0..15 with a minimum, or Q6_K-like
    signed levels -32..31)."""
    out, inp = w.shape
    nb, ns = inp // 32, inp // 256
    if kind == "q4_k":
        b = w.reshape(out, nb, 32)
        low = (-b.amin(-1)).clamp(min=0)  # [out, nb]
        span = (b.amax(-1) + low) / 15
        d = (span.reshape(out, ns, 8).amax(-1) / 63).to(torch.float16).float().clamp(min=1e-8)
        dmin = (low.reshape(out, ns, 8).amax(-1) / 63).to(torch.float16).float().clamp(min=1e-8)
        sc = (span / d.repeat_interleave(8, 1)).round().clamp(1, 63)
        mn = (low / dmin.repeat_interleave(8, 1)).round().clamp(0, 63)
        step, shift = (sc * d.repeat_interleave(8, 1)).unsqueeze(-1), (mn * dmin.repeat_interleave(8, 1)).unsqueeze(-1)
        q = ((b + shift) / step).round().clamp(0, 15)
        m = torch.stack([sc, sc, mn, torch.zeros_like(mn)], -1)
    else:
        b = w.reshape(out, nb * 2, 16)
        span = b.abs().amax(-1) / 31  # [out, nb * 2]
        d = (span.reshape(out, ns, 16).amax(-1) / 127).to(torch.float16).float().clamp(min=1e-8)
        dmin = torch.zeros_like(d)
        sc = (span / d.repeat_interleave(16, 1)).round().clamp(1, 127)
        q = (b / (sc * d.repeat_interleave(16, 1)).unsqueeze(-1)).round().clamp(-32, 31)
        m = torch.stack([sc[:, 0::2], sc[:, 1::2], torch.zeros_like(sc[:, 0::2]), torch.full_like(sc[:, 0::2], 32)], -1)
    return native.NativeWeight(kind, out, inp, qs=q.reshape(out, inp).to(torch.int8),
                               d=torch.stack([d, dmin], -1), m=m.to(torch.int8))


@pytest.fixture(scope="module")
def k_dir(tmp_path_factory):
    from ddspec.models.tiny import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("k") / "llama", "llama", seed=3, vocab_size=128, hidden=256,
                               intermediate=512, heads=4, kv_heads=2)


@needs_kernels
@pytest.mark.parametrize("activations", ["fp32", "int8"])
@pytest.mark.parametrize("method", ["chain", "eagle2", "ddd", "ddspec"])
def test_every_method_is_lossless_on_k_blocks(k_dir, method, activations, monkeypatch):
    """A target whose layers are Q4_K (q, k, gate, up) and Q6_K (v, o, down) blocks, as a Q4_K_M file
    has them: every matmul on the K kernels, and every method's greedy output equal to plain decoding."""
    from ddspec.config import StopConfig
    from ddspec.engine import Engine
    from ddspec.models import llama, loading
    from ddspec.models.loading import load_target
    from test_spec_engine import PROMPTS, eagle

    def blocks(path, weights):
        six = ("v_proj", "o_proj", "down_proj")
        return {name: k_quantise(t.float(), "q6_k" if any(s in name for s in six) else "q4_k")
                for name, t in weights.items() if t.dim() == 2 and t.shape[1] % 256 == 0 and "embed" not in name}

    monkeypatch.setattr(llama, "read_gguf_blocks", blocks)
    monkeypatch.setattr(loading, "_gguf_source", lambda spec: "blocks.gguf")
    monkeypatch.setenv("DDSPEC_KERNEL", "native")
    target = load_target(str(k_dir), impl="native", activations=activations)
    a8 = "a8" if activations == "int8" else ""
    layer = target.layers[0]
    assert (layer.qkv.native.kind, layer.gate_up.native.kind, layer.down.native.kind) == (f"q6_k{a8}", f"q4_k{a8}", f"q6_k{a8}")
    stop = StopConfig(max_new_tokens=24, stop_on_eos=False)
    for prompt in PROMPTS[:2]:
        ref = Engine(target).generate(prompt, stop).token_ids
        assert Engine(target, eagle(target, method)).generate(prompt, stop).token_ids == ref


@needs_kernels
@pytest.mark.parametrize("activations", ["fp32", "int8"])
def test_every_method_is_lossless_with_stacks_of_several_kinds(tiny_dirs, activations, monkeypatch):
    """A target whose q and k are Q5_1, v Q8_0 and the rest Q4_1: q|k|v runs as one stack of parts,
    and every method's greedy output equals plain decoding."""
    from ddspec.config import StopConfig
    from ddspec.engine import Engine
    from ddspec.models import llama, loading
    from ddspec.models.loading import load_target
    from test_spec_engine import PROMPTS, eagle

    def block(name, t):
        w = t.float().contiguous().numpy()
        qtype = T.Q5_1 if ("q_proj" in name or "k_proj" in name) else T.Q8_0 if "v_proj" in name else T.Q4_1
        kind, qs, d, m = native_blocks(int(qtype), gguf.quantize(w, qtype), w.shape[0])
        return block_weight(kind, w.shape[1], qs, d, m)

    monkeypatch.setattr(llama, "read_gguf_blocks", lambda path, weights: {
        n: block(n, t) for n, t in weights.items() if t.dim() == 2 and t.shape[1] % 32 == 0 and "embed" not in n})
    monkeypatch.setattr(loading, "_gguf_source", lambda spec: "blocks.gguf")
    monkeypatch.setenv("DDSPEC_KERNEL", "native")
    target = load_target(str(tiny_dirs["llama"]), impl="native", activations=activations)
    assert target.layers[0].qkv.native.kind == "stack"
    stop = StopConfig(max_new_tokens=24, stop_on_eos=False)
    for method in ("chain", "ddspec"):
        ref = Engine(target).generate(PROMPTS[0], stop).token_ids
        assert Engine(target, eagle(target, method)).generate(PROMPTS[0], stop).token_ids == ref
