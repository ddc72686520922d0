"""ddspec's own GGUF converter (models/gguf_convert.py) writes the folder transformers' GGUF loader
writes: every weight bit for bit, the same config, and a tokenizer that encodes, decodes and
applies the chat template the same way. Checked on a tiny llama GGUF written here (all the tensor
types the converter reads) and on the default model's file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ddspec.models import gguf_convert
from ddspec.models.loading import _convert_with_transformers, load_tokenizer

gguf = pytest.importorskip("gguf")

TEXTS = [
    "Hello world!  <|im_end|> x",
    "def f(x):\n\treturn x**2  # héllo 日本語 🙂",
    " leading space and  double  spaces\n\n\nnewlines",
    "<|im_start|>user\nWhat is 12 * 7?<|im_end|>\n",
    "the cat sat on the mat; then the cat ate.",
]
CHAT = [{"role": "user", "content": "Why is the sky blue?"}]
TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
            "'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _byte_tokens() -> list[str]:
    return list(gguf_convert._bytes_to_unicode().values())


def write_tiny_llama(path: Path, types: dict[str, int], pre: str = "smollm", arch: str = "llama") -> None:
    """A random 2-layer llama GGUF (hidden 64, 4 heads, 2 kv heads) with a byte-level BPE
    vocabulary of 3 control tokens, the 256 bytes and a few merges; ``types`` maps a tensor kind
    (embd, attn, ffn, norm, output) to its GGML type."""
    rng = np.random.default_rng(0)
    merges = ["Ġ t", "h e", "Ġt he", "a t", "Ġ c", "Ġc at", "i n", "Ġ s"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + _byte_tokens() + [m.replace(" ", "") for m in merges]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(16)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)

    def tensor(name: str, rows: int, cols: int, kind: str):
        qtype = gguf.GGMLQuantizationType(types[kind])
        x = rng.normal(0, 0.3, (rows, cols)).astype(np.float32) if rows > 1 else 1 + rng.normal(0, 0.1, cols).astype(np.float32)
        if rows == 1:
            x = x.reshape(cols)
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, x)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quantize(x, qtype), raw_dtype=qtype)

    tensor("token_embd.weight", len(tokens), 64, "embd")
    for i in range(2):
        tensor(f"blk.{i}.attn_norm.weight", 1, 64, "norm")
        tensor(f"blk.{i}.ffn_norm.weight", 1, 64, "norm")
        for part, rows, cols in (("attn_q", 64, 64), ("attn_k", 32, 64), ("attn_v", 32, 64), ("attn_output", 64, 64)):
            tensor(f"blk.{i}.{part}.weight", rows, cols, "attn")
        for part, rows, cols in (("ffn_gate", 128, 64), ("ffn_up", 128, 64), ("ffn_down", 64, 128)):
            tensor(f"blk.{i}.{part}.weight", rows, cols, "ffn")
    tensor("output_norm.weight", 1, 64, "norm")
    if "output" in types:
        tensor("output.weight", len(tokens), 64, "output")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def assert_same_folder(ours: Path, theirs: Path, texts=TEXTS) -> None:
    from safetensors.numpy import load_file

    mine, ref = json.loads((ours / "config.json").read_text()), json.loads((theirs / "config.json").read_text())
    ref.pop("transformers_version", None)
    assert mine == ref
    wa, wb = load_file(str(ours / "model.safetensors")), load_file(str(theirs / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for name in wa:
        assert wa[name].shape == wb[name].shape and np.array_equal(wa[name].view(np.uint32), wb[name].view(np.uint32)), name
    ta, tb = json.loads((ours / "tokenizer.json").read_text()), json.loads((theirs / "tokenizer.json").read_text())
    assert ta == tb
    a, b = load_tokenizer(ours), load_tokenizer(theirs)
    for t in texts:
        assert a.encode(t) == b.encode(t), t
        assert a.decode(a.encode(t)) == b.decode(b.encode(t))
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(a, attr) == getattr(b, attr), attr
    assert a.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == \
        b.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)


Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("types", [
    {"embd": Q.Q8_0, "attn": Q.Q4_1, "ffn": Q.Q4_1, "norm": Q.F32},  # the default model's mix
    {"embd": Q.F16, "attn": Q.Q4_0, "ffn": Q.Q8_0, "norm": Q.F32, "output": Q.Q4_0},  # untied lm_head
    {"embd": Q.Q8_0, "attn": Q.Q5_0, "ffn": Q.Q5_1, "norm": Q.F32},  # a small model's "Q4_K_M" mix: Q5_0 rows
])
def test_tiny_gguf_converts_as_transformers_does(tmp_path, types):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, {k: int(v) for k, v in types.items()})
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    theirs.mkdir()
    gguf_convert.convert(path, ours)
    _convert_with_transformers(path, theirs)
    assert_same_folder(ours, theirs)


def test_what_it_does_not_cover_is_left_to_transformers(tmp_path):
    types = {"embd": int(Q.F32), "attn": int(Q.F32), "ffn": int(Q.F32), "norm": int(Q.F32)}
    for kwargs, why in (({"arch": "qwen2"}, "architecture"), ({"pre": "llama-bpe"}, "tokenizer")):
        path = tmp_path / f"{why}.gguf"
        write_tiny_llama(path, types, **kwargs)
        with pytest.raises(gguf_convert.NotCovered, match=why):
            gguf_convert.convert(path, tmp_path)


def test_every_block_type_dequantises_as_gguf_py_does():
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, (6, 64)).astype(np.float32)
    for qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.BF16, Q.F16):
        raw = gguf.quantize(x, qtype)
        ref = gguf.dequantize(raw, qtype).reshape(6, 64)
        ours = gguf_convert.dequantize_tensor(int(qtype), [64, 6], np.ascontiguousarray(raw).view(np.uint8).reshape(-1))
        assert np.array_equal(ours.view(np.uint32), ref.astype(np.float32).view(np.uint32)), qtype.name


def test_default_model_converts_as_transformers_does(tmp_path):
    from ddspec.models.loading import default_gguf_path

    try:
        path = default_gguf_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"default model not installed: {e}")
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    theirs.mkdir()
    gguf_convert.convert(path, ours)
    _convert_with_transformers(path, theirs)
    prompts = Path(__file__).resolve().parents[2] / "shared" / "data" / "train" / "prompts.jsonl"
    texts = list(TEXTS)
    if prompts.is_file():
        lines = prompts.read_text().splitlines()
        texts += [json.loads(line)["turns"][0] for line in lines[::max(1, len(lines) // 20)]]
    assert_same_folder(ours, theirs, texts)


def test_a_file_it_does_not_cover_is_converted_by_transformers(tmp_path, capsys):
    from ddspec.models.loading import convert_gguf

    path = tmp_path / "bpe.gguf"
    write_tiny_llama(path, {"embd": int(Q.F32), "attn": int(Q.Q8_0), "ffn": int(Q.Q8_0), "norm": int(Q.F32)},
                     pre="llama-bpe")  # llama-3's split regex: transformers' table, not ours
    out = convert_gguf(path, tmp_path / "cache" / "bpe")
    assert "needs transformers' GGUF converter (tokenizer" in capsys.readouterr().err
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert [p.name for p in out.parent.iterdir()] == ["bpe"]  # no temporary folder left behind
    assert load_tokenizer(out).eos_token_id == 2 and json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
