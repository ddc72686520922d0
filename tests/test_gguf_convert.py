"""ddspec's own GGUF converter (models/gguf_convert.py) writes the folder transformers' GGUF loader
writes: every weight bit for bit, the same config, and a tokenizer that encodes, decodes and
applies the chat template the same way. Checked on a tiny llama GGUF written here (all the tensor
types the converter reads), on the default model's file, and on tiny qwen3, gemma, gemma2, gemma3 and
phi3 files written from transformers' own models as llama.cpp's converter writes them (there also
against the model itself: config, weights and logits)."""

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


def write_tiny_llama(path: Path, types: dict[str, int], pre: str = "smollm", arch: str = "llama",
                     add_bos: bool = False, add_eos: bool | None = None, spm: bool = False,
                     rope_freqs: np.ndarray | None = None) -> None:
    """A random 2-layer llama GGUF (hidden 64, 4 heads, 2 kv heads) with a byte-level BPE
    vocabulary of 3 control tokens, the 256 bytes and a few merges (``spm``: the SentencePiece one of
    :func:`spm_vocab`); ``types`` maps a tensor kind (embd, attn, ffn, norm, output) to its GGML type;
    ``add_bos`` / ``add_eos``: the file's flags (``add_eos`` None: no flag)."""
    rng = np.random.default_rng(0)
    merges = ["Ġ t", "h e", "Ġt he", "a t", "Ġ c", "Ġc at", "i n", "Ġ s"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + _byte_tokens() + [m.replace(" ", "") for m in merges]
    if spm:
        tokens = spm_vocab(gemma=False)[0]
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
    if spm:
        _add_vocab(w, "spm", "default", add_bos, add_eos)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_pad_token_id(2)
        w.add_add_bos_token(add_bos)
        if add_eos is not None:
            w.add_add_eos_token(add_eos)
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
    if rope_freqs is not None:  # Llama 3.1+'s frequency divisors, as llama.cpp's converter writes them
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
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


def assert_same_folder(ours: Path, theirs: Path, texts=TEXTS, chat=CHAT, as_loaded=lambda tok: tok,
                       missed: tuple[str, ...] = (), tokenizers: bool = True) -> None:
    """Same config (but for the keys in ``missed``, which transformers' loader does not read from the
    file), weights bit for bit (ours: the fp32 tensors and the block weights the GGUF keeps, as
    load_weights gives them) and, with ``tokenizers``, the same tokenizer.json (``as_loaded``:
    transformers' file as its tokenizer class loads it) and the same ids, text and chat template from
    both tokenizers."""
    from safetensors.numpy import load_file

    from ddspec.models.loading import load_weights

    mine, ref = json.loads((ours / "config.json").read_text()), json.loads((theirs / "config.json").read_text())
    ref.pop("transformers_version", None)
    assert {k: v for k, v in mine.items() if k not in missed} == {k: v for k, v in ref.items() if k not in missed}
    zero = np.float32(0)  # but for the sign of zeros (a Q4_0 level 8 under a negative scale: -0.0 in gguf-py's form)
    wa = {k: v.numpy() + zero for k, v in load_weights(ours).items()}
    wb = {k: v + zero for k, v in load_file(str(theirs / "model.safetensors")).items()}
    assert wa.keys() == wb.keys()
    for name in wa:
        assert wa[name].shape == wb[name].shape and np.array_equal(wa[name].view(np.uint32), wb[name].view(np.uint32)), name
    if not tokenizers:
        return
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


def test_a_vocabulary_that_adds_bos_and_eos_converts_as_transformers_does(tmp_path):
    path = tmp_path / "bos.gguf"
    write_tiny_llama(path, {"embd": int(Q.Q8_0), "attn": int(Q.Q8_0), "ffn": int(Q.Q8_0), "norm": int(Q.F32)},
                     add_bos=True, add_eos=True)
    ours, theirs = both_conversions(path)
    assert_same_folder(ours, theirs)
    assert load_tokenizer(ours).encode("the cat") == [1, 86, 260, 264, 2]  # <|im_start|> t he Ġcat <|im_end|>


def test_a_llama_file_with_a_sentencepiece_vocabulary_converts_as_transformers_does(tmp_path):
    """A llama file with a SentencePiece vocabulary (Llama 2, Mistral, TinyLlama) that adds BOS: the
    same folder as transformers' conversion, q and k rows un-permuted as for a byte-level one."""
    path = tmp_path / "spm.gguf"
    write_tiny_llama(path, {"embd": int(Q.Q8_0), "attn": int(Q.Q4_0), "ffn": int(Q.F32), "norm": int(Q.F32)},
                     add_bos=True, spm=True)
    ours, theirs = both_conversions(path)
    assert_same_folder(ours, theirs, SPM_TEXTS)
    assert load_tokenizer(ours).encode("x") == [1, 306]  # <s> ▁x


def test_what_it_does_not_cover_is_left_to_transformers(tmp_path):
    types = {"embd": int(Q.F32), "attn": int(Q.F32), "ffn": int(Q.F32), "norm": int(Q.F32)}
    for kwargs, why in (({"arch": "starcoder2"}, "architecture"), ({"pre": "llama-bpe"}, "tokenizer"),
                        ({"arch": "qwen2"}, "without the bias"),
                        ({"arch": "qwen3"}, "qwen3 file without tensor blk.0.attn_q_norm.weight"),
                        ({"arch": "phi3"}, "phi3 file without tensor blk.0.attn_qkv.weight")):
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


# --- the other architectures: tiny models of transformers' own classes, written as llama.cpp's converter
# writes them (convert_hf_to_gguf.py's Qwen3Model, GemmaModel, Gemma2Model, Gemma3Model, Phi3MiniModel)

SPM_PIECES = ["▁", "e", "t", "h", "a", "c", "s", "i", "n", "o", "r", "l", "d", "w", "H", "x", "f", "u", "?", ".",
              "▁t", "he", "▁the", "▁c", "at", "▁cat", "▁s", "in", "▁sat", "on", "▁on", "▁m", "▁mat", "▁w", "or",
              "ld", "▁wor", "▁world", "▁he", "ll", "▁hell", "▁hello", "▁H", "▁Hello", "er", "▁user", "us", "▁x"]
SPM_TEXTS = ["Hello world!", " the cat sat on the mat.", "  two  spaces\n\tand a tab", "héllo 日本語 🙂",
             "<start_of_turn>user\nhi<end_of_turn>\n", "<|user|>\nWhat is 12 * 7?<|end|>\n<|assistant|>",
             "the\n\n\nthe", "hello hello world", "x", "   leading and trailing   "]


def spm_vocab(gemma: bool) -> tuple[list[str], list[float], list[int], dict[str, int]]:
    """(tokens, scores, token types, special ids) of a tiny SentencePiece vocabulary as llama.cpp writes
    one: Gemma's special tokens (and its whitespace pieces, stored as spaces, and newlines as
    user-defined tokens) or <unk> <s> </s> and Phi-3's chat tokens; the byte tokens <0x00>..<0xFF>
    (type 6); ▁ pieces ranked by score."""
    if gemma:
        head = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2), ("<mask>", 4), ("<start_of_turn>", 3),
                ("<end_of_turn>", 3), ("\n", 4), ("\n\n", 4), ("  ", 4), ("   ", 4), ("\t", 4), ("<unused0>", 4)]
        tail, ids = [], {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "unk_token_id": 3}
    else:
        head, ids = [("<unk>", 2), ("<s>", 3), ("</s>", 3)], {"unk_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
        tail = [("▁▁", 1), ("\n", 1), ("<|endoftext|>", 3), ("<|user|>", 4), ("<|assistant|>", 3), ("<|end|>", 3)]
    pieces = head + [(f"<0x{b:02X}>", 6) for b in range(256)] + [(t, 1) for t in SPM_PIECES] + tail
    tokens = [t for t, _ in pieces]
    scores = [0.0 if kind != 1 else -float(i) for i, (_, kind) in enumerate(pieces)]
    if not gemma:
        ids["pad_token_id"] = tokens.index("<|endoftext|>")
    return tokens, scores, [kind for _, kind in pieces], ids


BPE_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def _vocab_size(vocab: str) -> int:
    return len(spm_vocab(vocab == "gemma")[0]) if vocab != "bpe" else len(_byte_tokens()) + 11


def _add_vocab(w, vocab: str, pre: str, add_bos: bool | None = None, add_eos: bool | None = None) -> None:
    """``vocab``: "bpe" (write_tiny_llama's byte-level BPE, split ``pre``), "spm" or "gemma" (:func:`spm_vocab`)."""
    if vocab == "bpe":
        merges = ["Ġ t", "h e", "Ġt he", "a t", "Ġ c", "Ġc at", "i n", "Ġ s"]
        tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + _byte_tokens() + [m.replace(" ", "") for m in merges]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
        w.add_token_merges(merges)
        ids = BPE_IDS
    else:
        tokens, scores, types, ids = spm_vocab(vocab == "gemma")
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        if vocab == "gemma":
            w.add_eot_token_id(tokens.index("<end_of_turn>"))
            w.add_add_space_prefix(False)
    w.add_bos_token_id(ids["bos_token_id"])
    w.add_eos_token_id(ids["eos_token_id"])
    w.add_pad_token_id(ids["pad_token_id"])
    if "unk_token_id" in ids:
        w.add_unk_token_id(ids["unk_token_id"])
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    w.add_chat_template(TEMPLATE)


def tiny_model(arch: str, vocab: str, **settings):
    """A random transformers model of ``arch`` (hidden 64, 4 heads, 2 kv heads, head size 16, 2 layers,
    ``settings`` on top) whose special ids are ``vocab``'s; weights N(0, 0.2), norms around their
    neutral value (Gemma's: 0)."""
    import torch
    import transformers

    ids = {k: v for k, v in (BPE_IDS if vocab == "bpe" else spm_vocab(vocab == "gemma")[3]).items() if k != "unk_token_id"}
    classes = {"qwen3": "Qwen3Config", "gemma": "GemmaConfig", "gemma2": "Gemma2Config", "gemma3": "Gemma3TextConfig",
               "phi3": "Phi3Config"}
    common = dict(vocab_size=_vocab_size(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=2.0 ** -20)
    if arch != "phi3":
        common["head_dim"] = 16
    if arch in ("gemma2", "gemma3"):
        common["query_pre_attn_scalar"] = 16  # llama.cpp's: the head size (but for the 27B models)
    cfg = getattr(transformers, classes[arch])(**(common | ids | settings))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if name.endswith("norm.weight") else 0.2))
            if name.endswith("norm.weight") and not arch.startswith("gemma"):
                p.add_(1)
    return model


GGUF_ARCHES = {"qwen3": "QWEN3", "gemma": "GEMMA", "gemma2": "GEMMA2", "gemma3": "GEMMA3", "phi3": "PHI3"}


def write_from_model(path: Path, model, arch: str, vocab: str, qtype: int | None = None, pre: str = "default") -> None:
    """``model`` as llama.cpp's converter writes it: its settings under the architecture's keys (Gemma 1
    and 2 without a rotary base, Phi-3 without a head size), the tensors under gguf-py's names, Gemma's
    norms as 1 + w, no ``output.weight`` when tied (Gemma 1 and 2: never), Phi-3's LongRoPE factors as
    tensors and its attention factor; the 2-D weights in ``qtype`` (F32 when None)."""
    import math

    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"Tiny {arch}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    full = rope.get("full_attention", rope)
    if arch != "phi3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if arch in ("qwen3", "gemma3", "phi3"):
        w.add_rope_freq_base(full["rope_theta"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3":
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        if full["rope_type"] == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        if cfg.final_logit_softcapping:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
    if arch == "phi3":
        original = cfg.original_max_position_embeddings
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * cfg.hidden_size) // cfg.num_attention_heads)
        w.add_sliding_window(cfg.sliding_window or 0)
        if rope["rope_type"] == "longrope":
            scale = cfg.max_position_embeddings / original
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
            w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    w.add_file_type(0 if qtype is None else 7)
    _add_vocab(w, vocab, pre)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, GGUF_ARCHES[arch]), cfg.num_hidden_layers)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and (cfg.tie_word_embeddings or arch in ("gemma", "gemma2")):
            continue
        x = t.detach().float().numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            x = x + np.float32(1)
        base, suffix = name.rsplit(".", 1)
        if qtype is not None and x.ndim == 2:
            w.add_tensor(f"{names.get_name(base)}.{suffix}", gguf.quantize(x, Q(qtype)), raw_dtype=Q(qtype))
        else:
            w.add_tensor(f"{names.get_name(base)}.{suffix}", x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# the settings transformers' GGUF loader does not read from these files (it keeps its config class's
# defaults): checked against the model the file was written from instead
MISSED = {"qwen3": ("head_dim",), "gemma2": ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"),
          "gemma3": ("query_pre_attn_scalar", "rope_parameters"), "phi3": ("original_max_position_embeddings", "rope_parameters")}
LINEAR = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
          "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "long_factor": [1.0, 1.5, 2.25, 4.0], "short_factor": [1.0, 1.125, 1.25, 1.5]}
ARCH_CASES = {  # id: (architecture, vocabulary, settings, 2-D weights' type, whether transformers can convert the file)
    "qwen3": ("qwen3", "bpe", dict(head_dim=128, tie_word_embeddings=False,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1e6}), None, True),
    "qwen3-head16-tied": ("qwen3", "bpe", dict(tie_word_embeddings=True), None, False),  # transformers keeps head_dim 128
    "gemma": ("gemma", "gemma", {}, None, False),  # transformers has no gemma (1) GGUF support
    "gemma2": ("gemma2", "gemma", dict(attn_logit_softcapping=20.0, final_logit_softcapping=10.0, sliding_window=4),
               None, True),
    "gemma3": ("gemma3", "gemma", dict(num_hidden_layers=6, sliding_window=4, rope_parameters=LINEAR), None, True),
    "gemma3-bpe-q8": ("gemma3", "bpe", dict(num_hidden_layers=6, sliding_window=4, tie_word_embeddings=False),
                      int(Q.Q8_0), True),
    "phi3": ("phi3", "spm", {}, None, True),
    "phi3-longrope": ("phi3", "spm", dict(max_position_embeddings=1024, original_max_position_embeddings=64,
                                          rope_parameters=LONGROPE), None, True),
    "phi3-q4": ("phi3", "spm", {}, int(Q.Q4_0), True),
}


@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_other_architectures_convert_as_their_models_are(tmp_path, case):
    """A qwen3, gemma, gemma2, gemma3 or phi3 file written from a transformers model converts to that
    model: its config (every key the model saves; transformers' GGUF conversion's config too where it
    has one, but for the settings it does not read), every weight (Gemma's norms: 1 + w bit for bit,
    the w = value - 1 transformers' conversion also gives; block weights as transformers dequantises
    them), its logits (F32 files), and transformers' tokenizer."""
    import torch

    from ddspec.models.gguf_blocks import MANIFEST
    from ddspec.models.loading import load_hf_target, load_weights, model_info, read_config

    arch, vocab, settings, qtype, comparable = ARCH_CASES[case]
    model = tiny_model(arch, vocab, **settings)
    path = tmp_path / f"{case}.gguf"
    write_from_model(path, model, arch, vocab, qtype, pre="qwen2" if arch == "qwen3" else "default")
    ours = tmp_path / "ours"
    ours.mkdir()
    gguf_convert.convert(path, ours)
    source = tmp_path / "source"
    model.save_pretrained(source)
    mine, want = read_config(ours), read_config(source)
    want.pop("transformers_version")
    assert {k: mine.get(k) for k in want} == want
    assert mine["_model_name_or_path"] == f"Tiny {arch}"

    weights = {k: v.numpy() for k, v in load_weights(ours).items()}
    reference = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    if mine["tie_word_embeddings"]:
        reference.pop("lm_head.weight")
    assert weights.keys() == reference.keys()
    one = np.float32(1)
    for name, w in weights.items():
        if arch.startswith("gemma") and name.endswith("norm.weight"):  # the norm scales by 1 + w: that is exact
            assert np.array_equal((one + w).view(np.uint32), (one + reference[name]).view(np.uint32)), name
        elif qtype is None:
            assert np.array_equal(w.view(np.uint32), reference[name].view(np.uint32)), name
    held = json.loads((ours / MANIFEST).read_text())["tensors"]
    assert all(not n.endswith("norm.weight") for n in held) and (qtype is None) == (not held)
    if arch == "phi3" and qtype is not None:
        assert held["model.layers.1.self_attn.qkv_proj.weight"] == ["blk.1.attn_qkv.weight", 0]
        assert held["model.layers.0.mlp.gate_up_proj.weight"] == ["blk.0.ffn_up.weight", 0]
    if qtype is None:  # the folder ddspec's HF target loads (from_config, the weights, tied) gives the model's logits
        tok = load_tokenizer(ours)
        target = load_hf_target(ours, model_info(mine, tok, ours, case), tok, "cpu", torch.float32)
        ids = (torch.arange(1, 13) * 37 % mine["vocab_size"])[None]
        with torch.no_grad():
            got, ref = target.model(ids).logits, model(ids).logits
        assert ref.abs().max() > 1 and torch.allclose(got, ref, atol=1e-4, rtol=0), float((got - ref).abs().max())
    gen = json.loads((ours / "generation_config.json").read_text())
    assert gen["eos_token_id"] == ([1, 6] if vocab == "gemma" else want["eos_token_id"])  # Gemma: <eos>, <end_of_turn>

    if comparable:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        _convert_with_transformers(path, theirs)
        texts = SPM_TEXTS if vocab != "bpe" else QWEN2_TEXTS if arch == "qwen3" else TEXTS
        texts = [t for t in texts if unicodedata.is_normalized("NFC", t)]  # (Qwen2's NFC: see _qwen2_as_loaded)
        # a byte-level vocabulary in a Gemma file: transformers' folder loads as GemmaTokenizer, which puts
        # Gemma's SentencePiece spacing back (and cannot encode); its tokenizer straight from the file is
        # ours, but for the <mask> GemmaTokenizer appends past the model's vocabulary
        gemma_bpe = arch.startswith("gemma") and vocab == "bpe"
        assert_same_folder(ours, theirs, texts, CHAT, _qwen2_as_loaded if arch == "qwen3" else (lambda tok: tok),
                           missed=MISSED[arch], tokenizers=not gemma_bpe)
        if gemma_bpe:
            from transformers import AutoTokenizer

            direct, tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name), load_tokenizer(ours)
            spec = json.loads(direct.backend_tokenizer.to_str())
            spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < mine["vocab_size"]]
            assert json.loads((ours / "tokenizer.json").read_text()) == spec
            assert all(tok.encode(t) == direct.encode(t) for t in texts)


@pytest.mark.parametrize("arch, add_bos, add_eos", [
    ("llama", None, None),  # no flags: BOS added (transformers' default for a sentencepiece vocabulary)
    ("phi3", False, True),
    ("gemma2", True, False),
    ("gemma3", None, None),
])
def test_sentencepiece_vocabulary_converts_as_transformers_does(tmp_path, arch, add_bos, add_eos):
    """A SentencePiece vocabulary (tokens, scores, types with the byte tokens) becomes the tokenizer.json
    transformers builds from it (BPE with byte fallback, merges recovered from the scores or, for Gemma,
    the order), with the same ids, text and special tokens on text with spaces, newlines, bytes and
    control tokens."""
    from transformers import AutoTokenizer

    from ddspec.models.gguf_blocks import GGUFLayout

    path = tmp_path / f"{arch}.gguf"
    vocab = "gemma" if arch.startswith("gemma") else "spm"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    _add_vocab(w, vocab, "default", add_bos, add_eos)
    w.add_tensor("token_embd.weight", np.zeros((_vocab_size(vocab), 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    meta = GGUFLayout(path, strings=("tokenizer.ggml.tokens", "tokenizer.ggml.merges")).metadata
    tok, tok_cfg = gguf_convert._tokenizer(meta, arch)
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    (ours / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert tok == json.loads(theirs.backend_tokenizer.to_str())
    mine = load_tokenizer(ours)
    for text in SPM_TEXTS:
        assert mine.encode(text) == theirs.encode(text), text
        assert mine.decode(mine.encode(text)) == theirs.decode(theirs.encode(text)), text
        assert mine.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False), text
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(mine, attr) == getattr(theirs, attr), attr
    assert mine.encode("x")[0] == (mine.bos_token_id if add_bos is not False else mine.encode("x", add_special_tokens=False)[0])
    assert (mine.encode("x")[-1] == mine.eos_token_id) == bool(add_eos)


def test_the_architectures_name_their_tensors_as_their_models_do():
    """hf_name gives each tensor llama.cpp writes (gguf-py's names for the model's weights) the model's
    own name; llama's and qwen2's names are as before."""
    from ddspec.models.gguf_blocks import hf_name

    for arch, key in GGUF_ARCHES.items():
        model = tiny_model(arch, "bpe")
        names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, key), model.config.num_hidden_layers)
        for name in model.state_dict():
            if name == "lm_head.weight" and arch in ("gemma", "gemma2"):  # tied, always (gguf-py has no output for them)
                continue
            base, suffix = name.rsplit(".", 1)
            assert hf_name(f"{names.get_name(base)}.{suffix}", arch) == name.removeprefix("model."), (arch, name)
    assert hf_name("blk.3.ffn_norm.weight") == hf_name("blk.3.ffn_norm.weight", "qwen2") == \
        "layers.3.post_attention_layernorm.weight"
    assert hf_name("blk.3.ffn_norm.weight", "gemma2") == "layers.3.pre_feedforward_layernorm.weight"
    assert hf_name("blk.0.attn_q_norm.weight") is None and hf_name("blk.0.attn_qkv.weight", "llama") is None
    assert hf_name("blk.0.attn_q.bias", "qwen2") == "layers.0.self_attn.q_proj.bias"


def test_a_llama3_file_keeps_its_rope_frequencies(tmp_path):
    """A Llama 3.1+ file stores its RoPE scaling as ``rope_freqs`` (per-frequency divisors computed
    from the "llama3" settings): the folder carries them as transformers' "longrope" with those
    factors, and the model equals the same weights under transformers' own "llama3" scaling."""
    import math

    import torch
    import transformers

    from ddspec.models.loading import load_target

    llama3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 16, "rope_theta": 10000.0}
    freqs = 1.0 / (10000.0 ** (np.arange(0, 16, 2, dtype=np.float32) / 16))
    factors = []
    for f in freqs:  # llama.cpp's LlamaModel.generate_extra_tensors
        wavelen, old = 2 * math.pi / f, 16
        if wavelen < old / 4.0:
            factors.append(1.0)
        elif wavelen > old / 1.0:
            factors.append(32.0)
        else:
            smooth = (old / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / 32.0 + smooth))
    f32 = int(gguf.GGMLQuantizationType.F32)
    path = tmp_path / "llama3.gguf"
    write_tiny_llama(path, {k: f32 for k in ("embd", "attn", "ffn", "norm", "output")}, rope_freqs=np.array(factors))
    native = load_target(str(path))
    cfg = native.hf_config
    assert cfg["rope_parameters"]["rope_type"] == "longrope" and cfg["rope_parameters"]["short_factor"] == pytest.approx(factors)
    tokens = torch.randint(0, 200, (40,), generator=torch.Generator().manual_seed(0))
    native.reset(64)
    ours = native.forward(tokens, torch.arange(40)).logits
    hf = load_target(str(path), impl="hf")  # the folder through transformers ("longrope")
    hf.reset(64)
    assert (hf.forward(tokens, torch.arange(40)).logits - ours).abs().max() <= 1e-4
    same = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**cfg, "rope_parameters": llama3}))
    same.load_state_dict(hf.model.state_dict())
    with torch.no_grad():
        assert (same(input_ids=tokens.view(1, -1)).logits[0] - ours).abs().max() <= 1e-3
