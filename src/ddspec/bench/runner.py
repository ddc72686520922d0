"""Running every method on every prompt, fairly, and logging one record per generation.

Arms (one per method name):
- our engine: every name of :data:`ddspec.methods.METHODS` (``vanilla`` = plain decoding,
  the others through :func:`ddspec.methods.make_drafter`), so a policy added there is
  benchmarked without touching this file;
- Hugging Face ``generate`` on the same weights: ``hf`` (plain greedy / sampling) and
  ``hf-lookup`` (assisted generation with prompt lookup), see :data:`HF_ARMS`;
- ``llama.cpp``: the CPU peer decoding the same GGUF (its quantised weights and rounding, so its
  outputs are not expected to equal ours) with the same prompt ids, greedy: llama.cpp's own
  ``llama-server`` when one is found (:mod:`ddspec.bench.llama_server`), else llama-cpp-python.
  Optional: the arm is skipped with a message when neither is there or the model is not a GGUF.

Fairness rules (docs/design.md §3): one warm-up generation per arm before timing; for each
(prompt, turn) every repeat runs every arm, in an order shuffled from one round to the next
(seeded by the round: the same in every run), so that no arm always follows the same one (a
CPU's caches hold part of the weights between generations, and the first steps of an arm pay
for the state the one before left: llama.cpp's own weights, a 60-token tree's fp32 lm_head; in
the rotated order used until 2026-12-04, plain decoding followed llama.cpp in 6 rounds of 7);
the same stop rules for all (``max_new_tokens``, EOS, which counts as a generated token); new
tokens are the ids each arm produced, never re-tokenised text; the wall time of one generation
is measured here, around the whole call, with the same clock for every arm (prefill included).

A record (one line of ``records.jsonl``) per (prompt, turn, method)::

    source, question_id, category, turn (1-based), method, prompt_tokens,
    new_tokens, wall_time (median over repeats, s), wall_times (every repeat), finish_reason,
    decoding_steps, accept_lengths [accepted + 1 per step], draft_ms, verify_ms (means per step),
    tree_sizes [nodes per step], output_ids

Step fields and output ids come from the repeat with the median wall time; HF arms leave
``decoding_steps``, ``draft_ms`` and ``verify_ms`` null and the step lists empty. Multi-turn
prompts are answered turn by turn with each method's own earlier answers in its history.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ddspec.bench.generation import Generation
from ddspec.bench.prompts import Prompt
from ddspec.config import SamplingConfig, StopConfig, TreeConfig
from ddspec.errors import DdspecError
from ddspec.machine import device_sync
from ddspec.methods import HEADLESS, METHODS, split_method, tree_config
from ddspec.prompts import chat_prompt_ids

if TYPE_CHECKING:  # the engine (and torch) load when a run starts, not when the CLI parser is built
    from ddspec.engine import Engine

# HF arms: name -> extra keyword arguments of `model.generate`
HF_ARMS: dict[str, dict] = {"hf": {}, "hf-lookup": {"prompt_lookup_num_tokens": 10}}
LLAMA_CPP = "llama.cpp"
# llama.cpp's own speculative decoding, as llama-server runs it: llama.cpp@draft = its draft-model
# speculation with --draft-model's GGUF (its default draft lengths); llama.cpp@ngram = its n-gram
# lookup of the context (--spec-type ngram-simple), the counterpart of ddspec's lookup
LLAMA_CPP_MODES = ("draft", "ngram")
WARMUP_TOKENS = 32  # enough for the prefill and several draft/verify steps
RECORDS_FILE = "records.jsonl"
SETTINGS_FILE = "run.json"


def method_names() -> tuple[str, ...]:
    """Every benchmarkable method: vanilla, the HF arms, then the engine's other methods."""
    return ("vanilla",) + tuple(HF_ARMS) + (LLAMA_CPP,) + tuple(m for m in METHODS if m != "vanilla")


def parse_methods(text: str, base: TreeConfig = TreeConfig()) -> list[str]:
    names = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    valid = method_names()
    unknown = [m for m in names if m.partition("@")[0] not in valid
               or (m.startswith(LLAMA_CPP + "@") and m.partition("@")[2] not in LLAMA_CPP_MODES)]
    if unknown:
        raise DdspecError(f"unknown method{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} in --methods: "
                          f"valid methods are {', '.join(valid)} (a tree method may carry its own sizes, "
                          f"e.g. eagle2@d3k4n8; llama.cpp@{' or llama.cpp@'.join(LLAMA_CPP_MODES)}: llama.cpp's speculation)")
    for m in names:
        if m == f"{LLAMA_CPP}@draft" and base.draft_model is None:
            raise DdspecError(f"{m} is llama.cpp's draft-model speculation: give the draft model with --draft-model FILE.gguf")
        if "@" in m and not m.startswith(LLAMA_CPP):
            tree_config(m, base)  # a bad size spec fails here, before any model loads
    if not names:
        raise DdspecError(f"--methods is empty: give a comma-separated list of {', '.join(valid)}")
    return names


# -- arms ------------------------------------------------------------------------------------
class Arm(Protocol):
    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Generation: ...


class EngineArm:
    """A ddspec :class:`Engine` (plain decoding or a drafter)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Generation:
        device = self.engine.target.device
        device_sync(device)
        t0 = time.perf_counter()
        result = self.engine.generate(prompt_ids, StopConfig(max_new_tokens=max_new_tokens))
        device_sync(device)
        wall = time.perf_counter() - t0
        return Generation(result.token_ids, wall, result.stats.finish_reason, result.stats.steps)


class HFArm:
    """Hugging Face ``model.generate`` with the same stop rules as the engine."""

    def __init__(self, model, eos_ids: tuple[int, ...], max_position: int, sampling: SamplingConfig,
                 extra: dict) -> None:
        self.model, self.eos_ids, self.max_position = model, list(eos_ids), max_position
        self.sampling, self.extra = sampling, extra

    def _decoding_kwargs(self) -> dict:
        s = self.sampling
        if s.greedy:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k}

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Generation:
        import torch

        if len(prompt_ids) >= self.max_position:
            raise DdspecError(f"the prompt is {len(prompt_ids)} tokens but the model's context window is "
                              f"{self.max_position}: shorten the prompt (or the chat history)")
        device = self.model.device
        x = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        budget = min(max_new_tokens, self.max_position - len(prompt_ids))  # the engine's budget
        if self.sampling.seed is not None:
            torch.manual_seed(self.sampling.seed)
        device_sync(device)
        t0 = time.perf_counter()
        out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=budget,
                                  eos_token_id=self.eos_ids, pad_token_id=self.eos_ids[0],
                                  **self._decoding_kwargs(), **self.extra)
        device_sync(device)
        wall = time.perf_counter() - t0
        ids = out[0, len(prompt_ids):].tolist()  # output.shape[1] - prompt_len new tokens
        finish = "eos" if ids and ids[-1] in self.eos_ids else "length"
        return Generation(ids, wall, finish, None)


class LlamaCppArm:
    """llama.cpp through llama-cpp-python on a GGUF file: greedy, the same prompt ids and stop rules."""

    def __init__(self, gguf: Path, eos_ids: tuple[int, ...], max_position: int, threads: int) -> None:
        from llama_cpp import Llama

        self.eos_ids, self.max_position = set(eos_ids), max_position
        self.llm = Llama(model_path=str(gguf), n_ctx=min(max_position, 8192), n_threads=threads,
                         n_threads_batch=threads, n_batch=512, verbose=False)

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Generation:
        budget = min(max_new_tokens, self.max_position - len(prompt_ids))
        ids: list[int] = []
        t0 = time.perf_counter()
        self.llm.reset()  # no KV reuse between generations: every arm prefills its whole prompt
        for token in self.llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                       reset=True):
            ids.append(int(token))
            if token in self.eos_ids or len(ids) >= budget:
                break
        wall = time.perf_counter() - t0
        return Generation(ids, wall, "eos" if ids and ids[-1] in self.eos_ids else "length", None)


LLAMA_CPP_BUILD = 'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36'
# llama.cpp's AMX kernels (compiled in by GGML_NATIVE on a Xeon with AMX) crash in its first decode of this model
LLAMA_CPP_NO_AMX = ('CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8" '
                    'pip install --force-reinstall --no-deps llama-cpp-python==0.3.36')

_TRIAL = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=256, n_threads=int(sys.argv[2]), n_threads_batch=int(sys.argv[2]), verbose=False)
for i, _ in enumerate(llm.generate([1, 2, 3, 4, 5, 6, 7, 8], top_k=1, temp=0.0, reset=True)):
    if i == 3:
        break
"""


def llama_cpp_trial(gguf: Path, threads: int, timeout: float = 300.0) -> str | None:
    """Decode a few tokens with llama.cpp in a child process: None if it works, else why not.

    A llama.cpp build can die in its own kernels on some CPUs (llama-cpp-python 0.3.36 built with
    GGML_NATIVE on a Xeon with AMX: a segmentation fault in its first decode of the default model),
    which would end the whole bench; trying it in a child first turns that into a skipped arm."""
    import signal
    import subprocess
    import sys

    from ddspec.machine import cpu_flags

    try:
        r = subprocess.run([sys.executable, "-c", _TRIAL, str(gguf), str(threads)], capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"llama.cpp's trial decode of {gguf.name} did not finish in {timeout:.0f} s"
    if r.returncode == 0:
        return None
    if r.returncode < 0:
        how = f"was killed by {signal.Signals(-r.returncode).name}"
    else:
        last = (r.stderr.strip().splitlines() or ["no message"])[-1]
        how = f"failed ({last})"
    amx = " with its AMX kernels" if "amx_int8" in cpu_flags() else ""
    fix = f"; rebuild it without them: {LLAMA_CPP_NO_AMX}" if amx else f"; reinstall it: {LLAMA_CPP_BUILD}"
    return f"llama.cpp's trial decode of {gguf.name} in a child process {how}: this build of it does not run here{amx}{fix}"


def llama_cpp_arm(target, model_spec: str, sampling: SamplingConfig, threads: int,
                  llama_server: str | None = None, mode: str = "", draft_model: str | None = None) -> Arm | str:
    """The llama.cpp arm, or why it cannot run here (a one-line reason): llama.cpp's own server
    binary when one is found (:mod:`ddspec.bench.llama_server`), else llama-cpp-python."""
    import importlib.util
    import sys

    from ddspec.bench.llama_server import LlamaServerArm, find_server
    from ddspec.models.loading import DEFAULT_MODEL, default_gguf_path

    if not sampling.greedy:
        return "the llama.cpp arm decodes greedily only (--temperature 0)"
    gguf = default_gguf_path() if model_spec == DEFAULT_MODEL else Path(model_spec)
    if gguf.suffix != ".gguf" or not gguf.is_file():
        return f"the llama.cpp arm needs a GGUF model (--model default or a .gguf file), not {model_spec}"
    server = find_server(llama_server)
    if server is not None:
        print(f"[ddspec] the {LLAMA_CPP} arm runs {server} (its own timings: prefill + decoding)", file=sys.stderr)
        extra: tuple[str, ...] = ()
        if mode == "draft":
            if draft_model is None or Path(draft_model).suffix != ".gguf":
                return f"llama.cpp's draft-model speculation needs --draft-model FILE.gguf, not {draft_model}"
            extra = ("-md", str(draft_model))
        elif mode == "ngram":
            extra = ("--spec-type", "ngram-simple")
        return LlamaServerArm(server, gguf, target.info.eos_token_ids, target.info.max_position, threads,
                              extra_args=extra)
    if mode:
        return f"llama.cpp's speculation ({LLAMA_CPP}@{mode}) runs on its server binary: give --llama-server PATH"
    if importlib.util.find_spec("llama_cpp") is None:
        return ("no llama-server binary (--llama-server PATH, see docs/benchmarks.md) and llama-cpp-python is not "
                f"installed (optional: {LLAMA_CPP_BUILD}, about 10 minutes to build)")
    print(f"[ddspec] the {LLAMA_CPP} arm runs through llama-cpp-python's Python loop, which understates llama.cpp "
          "(give --llama-server PATH to measure its own server)", file=sys.stderr)
    failed = llama_cpp_trial(gguf, threads)
    if failed:
        return failed
    return LlamaCppArm(gguf, target.info.eos_token_ids, target.info.max_position, threads)


def build_arms(methods: list[str], target, head_spec: str | None, tree: TreeConfig, sampling: SamplingConfig,
               load_hf_model, model_spec: str = "default", threads: int = 1,
               llama_server: str | None = None) -> dict[str, Arm]:
    """One arm per method name; ``load_hf_model()`` is called (once) only if an HF arm is asked for.
    An arm that cannot run here (llama.cpp without llama-cpp-python) is left out with a message."""
    import sys

    from ddspec.engine import Engine
    from ddspec.methods import make_drafter, uses_draft_model

    arms: dict[str, Arm] = {}
    hf_model = None
    head = None  # loaded once, shared by every tree method
    for m in methods:
        if m.partition("@")[0] == LLAMA_CPP:
            arm = llama_cpp_arm(target, model_spec, sampling, threads, llama_server, m.partition("@")[2],
                                tree.draft_model)
            if isinstance(arm, str):
                print(f"[ddspec] skipping the {m} arm: {arm}", file=sys.stderr)
            else:
                arms[m] = arm
            continue
        if m in HF_ARMS:
            hf_model = hf_model if hf_model is not None else load_hf_model()
            arms[m] = HFArm(hf_model, target.info.eos_token_ids, target.info.max_position, sampling, HF_ARMS[m])
            continue
        try:
            if split_method(m)[0] not in HEADLESS and head is None and not uses_draft_model(m, target, head_spec, tree):
                from ddspec.methods import resolve_head

                head = resolve_head(head_spec, target)
            drafter = make_drafter(m, target, head, tree)
        except DdspecError as e:
            raise type(e)(f"method {m}: {e}") from None
        arms[m] = EngineArm(Engine(target, drafter, sampling, method=m))
    return arms


# -- records ---------------------------------------------------------------------------------
def _median_index(values: list[float]) -> int:
    """Index of the (lower) median value."""
    order = sorted(range(len(values)), key=values.__getitem__)
    return order[(len(values) - 1) // 2]


def make_record(prompt: Prompt, turn: int, method: str, prompt_ids: list[int], runs: list[Generation]) -> dict:
    walls = [g.wall_s for g in runs]
    rep = runs[_median_index(walls)]
    steps = rep.steps
    return {
        "source": prompt.source,
        "question_id": prompt.question_id,
        "category": prompt.category,
        "turn": turn,
        "method": method,
        "prompt_tokens": len(prompt_ids),
        "new_tokens": len(rep.output_ids),
        "wall_time": statistics.median(walls),
        "wall_times": walls,
        "finish_reason": rep.finish_reason,
        "decoding_steps": None if steps is None else len(steps),
        "accept_lengths": [s.accepted + 1 for s in steps or ()],
        "draft_ms": statistics.fmean(s.draft_ms for s in steps) if steps else None,
        "verify_ms": statistics.fmean(s.verify_ms for s in steps) if steps else None,
        "tree_sizes": [s.tree_size for s in steps or ()],
        # the cost-aware method's own forecast, and the same quantities measured (decoding steps only)
        "predicted_tokens": sum(s.predicted_tokens for s in steps) if steps else None,
        "predicted_ms": sum(s.predicted_ms for s in steps) if steps else None,
        "step_ms": sum(s.draft_ms + s.verify_ms + s.gap_ms for s in steps) if steps else None,
        # decoding alone (prefill excluded): our decoding steps, or what the arm reports (llama.cpp's server)
        "decode_tokens": len(rep.output_ids) - 1 if steps else rep.decoding[0] if rep.decoding else None,
        "decode_ms": (sum(s.draft_ms + s.verify_ms + s.gap_ms for s in steps) if steps
                      else 1e3 * rep.decoding[1] if rep.decoding else None),
        "output_ids": rep.output_ids,
    }


REQUIRED_FIELDS = ("source", "question_id", "turn", "method", "new_tokens", "wall_time", "output_ids")


def record_id(record: dict) -> tuple:
    return (record["source"], record["question_id"], record["turn"], record["method"])


def read_records(path: Path) -> list[dict]:
    """Records of an earlier run. A last line without its newline was cut short (a killed run): it
    is removed from the file, so that the next record starts on a line of its own."""
    raw = path.read_bytes()
    complete = raw[: raw.rfind(b"\n") + 1]
    if len(complete) < len(raw):
        with path.open("r+b") as f:
            f.truncate(len(complete))
    records: list[dict] = []
    for lineno, line in enumerate(complete.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            missing = [f for f in REQUIRED_FIELDS if f not in rec]
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError):
            rec, missing = None, []
        if rec is None or missing:
            what = f"lacks {', '.join(missing)}" if missing else "is not a JSON record"
            raise DdspecError(f"{path}, line {lineno} {what}: the file is not a ddspec bench log; "
                              "use another --out, or remove the file to start over")
        records.append(rec)
    return records


def check_run_dir(out: Path, settings: dict, resume: bool) -> None:
    """Refuse to mix runs: without --resume the folder must be new; with it, the settings must match."""
    records, saved = out / RECORDS_FILE, out / SETTINGS_FILE
    if not resume:
        if records.exists() and records.stat().st_size:
            raise DdspecError(f"{out} already holds {RECORDS_FILE}: pass --resume to continue that run, "
                              "or choose another --out")
        return
    if not saved.is_file():
        return
    try:
        before = json.loads(saved.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DdspecError(f"cannot read {saved}: {e}") from None
    changed = [f"{k}: {before.get(k)!r} then, {v!r} now" for k, v in settings.items() if before.get(k) != v]
    if changed:
        raise DdspecError(f"--resume: {out} was run with other settings ({'; '.join(changed)}); "
                          "use the same ones, or another --out")


class RecordLog:
    """records.jsonl, appended to and flushed one line per record."""

    def __init__(self, out: Path, settings: dict, resume: bool) -> None:
        out.mkdir(parents=True, exist_ok=True)
        path = out / RECORDS_FILE
        self.records = read_records(path) if resume and path.is_file() else []
        self.by_id = {record_id(r): r for r in self.records}
        (out / SETTINGS_FILE).write_text(json.dumps(settings, indent=1) + "\n")
        self.file = path.open("a" if resume else "w", encoding="utf-8")

    def add(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self.records.append(record)
        self.by_id[record_id(record)] = record

    def find(self, prompt: Prompt, turn: int, method: str) -> dict | None:
        return self.by_id.get((prompt.source, prompt.question_id, turn, method))

    def close(self) -> None:
        self.file.close()


# -- the run ---------------------------------------------------------------------------------
@dataclass(slots=True)
class Outcome:
    note: str | None = None  # why the run stopped early, for the summary
    error: BaseException | None = None  # the crash to re-raise once the summary is written
    interrupted: bool = False  # Ctrl-C


def arm_order(arms: list[str], round_index: int) -> list[str]:
    """The order the arms run in round ``round_index``: a shuffle seeded by the round (reproducible),
    so that over a run each arm follows each of the others about as often."""
    order = list(arms)
    random.Random(round_index).shuffle(order)
    return order


class Bench:
    """Runs arms over prompts into a RecordLog (what is already in the log is skipped)."""

    def __init__(self, arms: dict[str, Arm], tokenizer, log: RecordLog, max_new_tokens: int, repeats: int) -> None:
        self.arms, self.tokenizer, self.log = arms, tokenizer, log
        self.max_new_tokens, self.repeats = max_new_tokens, repeats
        self.rounds = 0  # seeds the order of the arms in each round
        self.where = ""  # the generation running now, for progress and error messages

    def pending(self, prompts: list[Prompt]) -> list[tuple[Prompt, int, str]]:
        return [(p, t, m) for p in prompts for t in range(1, len(p.turns) + 1) for m in self.arms
                if self.log.find(p, t, m) is None]

    def run(self, prompts: list[Prompt]) -> Outcome:
        from tqdm import tqdm

        todo = self.pending(prompts)
        bar = tqdm(total=len(todo) * self.repeats, unit="gen", desc="bench", disable=None, dynamic_ncols=True)
        try:
            for m in dict.fromkeys(m for _, _, m in todo):  # 1. warm-up, untimed
                self._at(bar, f"{m} (warm-up)")
                warm = chat_prompt_ids(self.tokenizer, [{"role": "user", "content": prompts[0].turns[0]}])
                self.arms[m].generate(warm, min(self.max_new_tokens, WARMUP_TOKENS))
            for prompt in prompts:  # 2. timed generations, interleaved
                histories: dict[str, list[dict[str, str]]] = {m: [] for m in self.arms}
                for turn, message in enumerate(prompt.turns, 1):
                    for history in histories.values():
                        history.append({"role": "user", "content": message})
                    self._run_turn(prompt, turn, histories, bar)
                    for m, history in histories.items():
                        answer = self.log.find(prompt, turn, m)["output_ids"]
                        history.append({"role": "assistant",
                                        "content": self.tokenizer.decode(answer, skip_special_tokens=True)})
        except KeyboardInterrupt:
            return Outcome(note=f"stopped by the user (Ctrl-C) during {self.where}", interrupted=True)
        except Exception as e:  # noqa: BLE001 - reported in the summary, then re-raised by the caller
            kind = "" if isinstance(e, DdspecError) else f"{type(e).__name__} "
            return Outcome(note=f"{kind}during {self.where}: {e}", error=e)
        finally:
            bar.close()
        return Outcome()

    def _at(self, bar, where: str) -> None:
        self.where = where
        bar.set_postfix_str(where, refresh=False)

    def _run_turn(self, prompt: Prompt, turn: int, histories: dict[str, list[dict[str, str]]], bar) -> None:
        self._at(bar, f"{prompt.source}/{prompt.question_id} turn {turn}")
        todo = [m for m in self.arms if self.log.find(prompt, turn, m) is None]
        prompt_ids = {m: chat_prompt_ids(self.tokenizer, histories[m]) for m in todo}
        runs: dict[str, list[Generation]] = {m: [] for m in todo}
        for _ in range(self.repeats):
            order = arm_order(todo, self.rounds)
            self.rounds += 1
            for m in order:
                self._at(bar, f"{m} on {prompt.source}/{prompt.question_id} turn {turn}")
                runs[m].append(self.arms[m].generate(prompt_ids[m], self.max_new_tokens))
                bar.update()
        for m in todo:
            self.log.add(make_record(prompt, turn, m, prompt_ids[m], runs[m]))
