"""ddspec's own GGUF converter (models/gguf_convert.py) writes the folder transformers' GGUF loader
writes: every weight bit for bit, the same config, and a tokenizer that encodes, decodes and
applies the chat template the same way. Checked on a tiny llama GGUF written here (all the tensor
types the converter reads) and on the default model's file."""

from __future__ import annotations

import functools
import json
import unicodedata
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


@functools.lru_cache(maxsize=1)
def _qwen2_vocab() -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types) for a tiny qwen2 GGUF: the default model's byte-level BPE
    vocabulary (49k tokens and merges, 17 control tokens) when it is installed, else the 256 bytes
    and a few merges; then, as Qwen's files have them, two more control tokens, two user-defined
    ones (type 4) and an unused one (type 5)."""
    from ddspec.models.gguf_blocks import GGUFLayout
    from ddspec.models.loading import default_gguf_path

    try:
        meta = GGUFLayout(default_gguf_path(), strings=("tokenizer.ggml.tokens", "tokenizer.ggml.merges")).metadata
        tokens, merges = list(meta["tokenizer.ggml.tokens"]), list(meta["tokenizer.ggml.merges"])
        types = [int(t) for t in meta["tokenizer.ggml.token_type"]]
    except Exception:  # noqa: BLE001 - the default model is not installed: a vocabulary of bytes
        merges = ["Ġ t", "h e", "Ġt he", "a t", "Ġ c", "Ġc at", "i n", "Ġ s"]
        tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + _byte_tokens() + [m.replace(" ", "") for m in merges]
        types = [3, 3, 3] + [1] * (len(tokens) - 3)
    extra = [("<|fim_prefix|>", 3), ("<|fim_suffix|>", 3), ("<tool_call>", 4), ("</tool_call>", 4), ("[PAD99999]", 5)]
    return tokens + [t for t, _ in extra], merges, types + [k for _, k in extra]


QWEN2_TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
                  "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                  "{%- endif %}")


def write_tiny_qwen2(path: Path, types: dict[str, int]) -> None:
    """A random 2-layer qwen2 GGUF (hidden 64, 4 heads, 2 kv heads, intermediate 128) as llama.cpp
    writes one: ``qwen2.*`` keys (no vocab size, no rope dimension), pre-tokenizer "qwen2", F32
    biases on q, k and v, and q/k rows in Hugging Face's order; ``types`` maps a tensor kind (embd,
    attn, ffn, norm, output) to its GGML type (``output`` absent: tied embeddings)."""
    rng = np.random.default_rng(2)
    tokens, merges, token_types = _qwen2_vocab()
    eos = tokens.index("<|im_end|>")
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("Tiny Qwen2")
    w.add_block_count(2)
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(7)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_eos_token_id(eos)
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(QWEN2_TEMPLATE)

    def tensor(name: str, shape: tuple[int, ...], kind: str):
        qtype = gguf.GGMLQuantizationType(types[kind])
        x = rng.normal(0, 0.3, shape).astype(np.float32) if len(shape) > 1 else 1 + rng.normal(0, 0.1, shape).astype(np.float32)
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, gguf.quantize(x, qtype), raw_dtype=qtype)

    tensor("token_embd.weight", (len(tokens), 64), "embd")
    for i in range(2):
        tensor(f"blk.{i}.attn_norm.weight", (64,), "norm")
        tensor(f"blk.{i}.ffn_norm.weight", (64,), "norm")
        for part, rows in (("attn_q", 64), ("attn_k", 32), ("attn_v", 32)):
            tensor(f"blk.{i}.{part}.weight", (rows, 64), "attn")
            w.add_tensor(f"blk.{i}.{part}.bias", rng.normal(0, 0.5, rows).astype(np.float32))
        tensor(f"blk.{i}.attn_output.weight", (64, 64), "attn")
        for part, rows, cols in (("ffn_gate", 128, 64), ("ffn_up", 128, 64), ("ffn_down", 64, 128)):
            tensor(f"blk.{i}.{part}.weight", (rows, cols), "ffn")
    tensor("output_norm.weight", (64,), "norm")
    if "output" in types:
        tensor("output.weight", (len(tokens), 64), "output")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def both_conversions(path: Path) -> tuple[Path, Path]:
    """(ours, transformers') conversions of the GGUF at ``path``, in folders beside it."""
    ours, theirs = path.parent / "ours", path.parent / "theirs"
    ours.mkdir()
    theirs.mkdir()
    gguf_convert.convert(path, ours)
    _convert_with_transformers(path, theirs)
    return ours, theirs


def assert_same_folder(ours: Path, theirs: Path, texts=TEXTS, chat=CHAT, as_loaded=lambda tok: tok) -> None:
    """Same config, weights bit for bit (ours: the fp32 tensors and the block weights the GGUF keeps,
    as load_weights gives them), same tokenizer.json (``as_loaded``: transformers' file as its
    tokenizer class loads it) and the same ids, text and chat template from both tokenizers."""
    from safetensors.numpy import load_file

    from ddspec.models.loading import load_weights

    mine, ref = json.loads((ours / "config.json").read_text()), json.loads((theirs / "config.json").read_text())
    ref.pop("transformers_version", None)
    assert mine == ref
    zero = np.float32(0)  # but for the sign of zeros (a Q4_0 level 8 under a negative scale: -0.0 in gguf-py's form)
    wa = {k: v.numpy() + zero for k, v in load_weights(ours).items()}
    wb = {k: v + zero for k, v in load_file(str(theirs / "model.safetensors")).items()}
    assert wa.keys() == wb.keys()
    for name in wa:
        assert wa[name].shape == wb[name].shape and np.array_equal(wa[name].view(np.uint32), wb[name].view(np.uint32)), name
    ta, tb = json.loads((ours / "tokenizer.json").read_text()), json.loads((theirs / "tokenizer.json").read_text())
    assert ta == as_loaded(tb)
    a, b = load_tokenizer(ours), load_tokenizer(theirs)
    for t in texts:
        assert a.encode(t) == b.encode(t), t
        assert a.decode(a.encode(t)) == b.decode(b.encode(t))
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(a, attr) == getattr(b, attr), attr
    assert a.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        b.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert list(a.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)) == \
        list(b.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))


Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("types", [
    {"embd": Q.Q8_0, "attn": Q.Q4_1, "ffn": Q.Q4_1, "norm": Q.F32},  # the default model's mix
    {"embd": Q.F16, "attn": Q.Q4_0, "ffn": Q.Q8_0, "norm": Q.F32, "output": Q.Q4_0},  # untied lm_head
    {"embd": Q.Q8_0, "attn": Q.Q5_0, "ffn": Q.Q5_1, "norm": Q.F32},  # a small model's "Q4_K_M" mix: Q5_0 rows
])
def test_tiny_gguf_converts_as_transformers_does(tmp_path, types):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, {k: int(v) for k, v in types.items()})
    assert_same_folder(*both_conversions(path))


def test_what_it_does_not_cover_is_left_to_transformers(tmp_path):
    types = {"embd": int(Q.F32), "attn": int(Q.F32), "ffn": int(Q.F32), "norm": int(Q.F32)}
    for kwargs, why in (({"arch": "qwen3"}, "architecture"), ({"pre": "llama-bpe"}, "tokenizer"),
                        ({"arch": "qwen2"}, "without the bias")):
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


QWEN2_TEXTS = TEXTS + [
    "The quick brown fox jumps over the lazy dog. It's 2024, isn't it? They'll say we'd've known.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n        self.items.append(x)\n",
    "1234567890 + 3.14159 = 1237.2; 10,000,000 items",
    "it's IT'S they're We'VE i'm you'll she'd",
    "héllo 你好 (привет) — naïve café",
    "he\u0301llo: an \u00e9 written as e and a combining accent",  # NFC folds it as Qwen2's tokenizer does
    "\t\tindented\r\n  \n\n   trailing   ",
    "<tool_call>{\"name\": \"f\"}</tool_call><|fim_prefix|>x<|fim_suffix|>",
]
QWEN2_CHAT = [{"role": "system", "content": "You are a coding assistant."},
              {"role": "user", "content": "Write `def add(a, b):` in Python, it's urgent!\n```python\n```"}]


def _qwen2_as_loaded(tok: dict) -> dict:
    """transformers' tokenizer.json of a qwen2 GGUF as the Qwen2Tokenizer that loads it works: it puts
    Qwen2's NFC normalizer back (the file has none); ByteLevel's trim_offsets moves offsets only."""
    tok = json.loads(json.dumps(tok))
    assert tok["normalizer"] is None
    tok["normalizer"] = {"type": "NFC"}
    tok["pre_tokenizer"]["pretokenizers"][1]["trim_offsets"] = False
    return tok


@pytest.mark.parametrize("types", [
    {"embd": Q.Q8_0, "attn": Q.Q8_0, "ffn": Q.Q8_0, "norm": Q.F32},  # tied embeddings
    {"embd": Q.F32, "attn": Q.F32, "ffn": Q.Q8_0, "norm": Q.F32, "output": Q.Q8_0},  # untied lm_head
])
def test_tiny_qwen2_converts_as_transformers_does(tmp_path, types):
    """A qwen2 file: Qwen2's config, biases, q/k rows left in llama.cpp's (= Hugging Face's) order,
    Qwen2's split, all as transformers' conversion has them."""
    path = tmp_path / "qwen.gguf"
    write_tiny_qwen2(path, {k: int(v) for k, v in types.items()})
    ours, theirs = both_conversions(path)
    assert_same_folder(ours, theirs, QWEN2_TEXTS, QWEN2_CHAT, as_loaded=_qwen2_as_loaded)
    cfg = json.loads((ours / "config.json").read_text())
    assert {k: cfg[k] for k in ("model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
                                "num_attention_heads", "num_key_value_heads", "use_sliding_window")} == \
        {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "use_sliding_window": False}
    assert cfg["rms_norm_eps"] == pytest.approx(1e-6) and cfg["rope_parameters"]["rope_theta"] == 1e6
    assert cfg["tie_word_embeddings"] == ("output" not in types) and "head_dim" not in cfg
    if "output" not in types:  # the tokenizer transformers builds straight from the file: the same ids
        from transformers import AutoTokenizer

        direct, mine = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name), load_tokenizer(ours)
        for t in QWEN2_TEXTS:
            if unicodedata.is_normalized("NFC", t):  # (that tokenizer has no NFC normalizer)
                assert mine.encode(t) == direct.encode(t), t


def test_qwen2_is_not_left_to_transformers(tmp_path, capsys):
    from ddspec.models.loading import convert_gguf

    path = tmp_path / "qwen.gguf"
    write_tiny_qwen2(path, {"embd": int(Q.Q8_0), "attn": int(Q.Q8_0), "ffn": int(Q.F32), "norm": int(Q.F32)})
    out = convert_gguf(path, tmp_path / "cache" / "qwen")  # raises nothing, and takes no fallback
    assert "needs transformers' GGUF converter" not in capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
    cfg = {"num_attention_heads": 4, "num_key_value_heads": 2}
    assert [gguf_convert.rotary_heads(arch, f"blk.0.{t}", cfg) for arch in ("qwen2", "llama")
            for t in ("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_v.weight")] == [0, 0, 0, 0, 4, 2, 4, 0]
