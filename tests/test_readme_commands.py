"""The README's commands, run as a new user runs them: through the installed CLI, in a fresh
process, on an empty cache (``DDSPEC_CACHE``), with the default model and the shipped head.

The demo gets a cache with nothing in it (it converts the model, chooses the matmul kernels and
calibrates; it compiles the CPU kernels too unless ``make setup`` built them into the environment,
as it does for a new user); bench, calibrate, tune and train get the demo's cache without
its measured costs (bench and calibrate measure them on their own), chat gets the demo's whole
cache as a user's second command would, so the suite converts the GGUF, compiles and chooses the
kernels once. Short forms: few tokens, one or two prompts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

PROMPT = "Explain in three sentences why the sky is blue."


def ddspec(cache: Path, *args: str, stdin: str | None = None, cwd: Path | None = None,
           timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "DDSPEC_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "ddspec.cli", *args], capture_output=True, text=True, env=env,
                          input=stdin, timeout=timeout, cwd=cwd)


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n--- stderr ---\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr
    return result


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """`make demo`'s command on an empty cache (short: 24 new tokens)."""
    cache = tmp_path_factory.mktemp("empty-cache")
    assert not any(cache.iterdir())
    return cache, ddspec(cache, "generate", PROMPT, "--max-new-tokens", "24")


def copy_cache(cache: Path, to: Path, *, costs: bool) -> Path:
    """A copy of a cache (the model files hard-linked: nothing writes them), with or without its costs."""
    shutil.copytree(cache, to, copy_function=os.link, ignore=None if costs else shutil.ignore_patterns("costs"))
    return to


@pytest.fixture
def uncalibrated_cache(demo, tmp_path):
    """The demo's cache without its measured costs: the converted model, the compiled CPU kernels
    and the kernel choice (the demo made them on an empty cache), no cost entry."""
    return copy_cache(demo[0], tmp_path / "cache", costs=False)


def test_demo_command_on_an_empty_cache(demo):
    cache, result = demo
    ok(result)
    assert result.stdout.strip(), "no answer printed"
    assert "[ddspec] ddspec:" in result.stderr and "tokens/s" in result.stderr  # the summary line
    assert "converting" in result.stderr  # it really started from nothing: converted, then calibrated (below)
    entries = list((cache / "costs").glob("*.json"))
    assert len(entries) == 1 and json.loads(entries[0].read_text())["key"]["format"] >= 3


def test_bench_vanilla_and_ddspec_on_an_empty_cost_cache(uncalibrated_cache, tmp_path):
    out = tmp_path / "bench"
    ok(ddspec(uncalibrated_cache, "bench", "--prompts", "mt-bench", "--limit", "2",
              "--max-turns", "1", "--max-new-tokens", "16", "--methods", "vanilla,ddspec", "--out", str(out)))
    summary = (out / "summary.md").read_text()
    assert "ddspec" in summary and "vanilla" in summary


def test_chat_with_piped_input(demo, tmp_path):
    cache = copy_cache(demo[0], tmp_path / "cache", costs=True)  # a user's second command: everything measured
    result = ok(ddspec(cache, "chat", "--max-new-tokens", "12",
                       stdin="Hello!\n/reset\nName a colour.\n/exit\n"))
    assert "[history cleared]" in result.stderr
    assert result.stderr.count("[ddspec] ddspec:") == 2  # two answers, each with its summary


def test_calibrate_then_show(uncalibrated_cache):
    shown = ddspec(uncalibrated_cache, "calibrate", "--show")
    assert shown.returncode == 1 and "run `ddspec calibrate`" in shown.stderr
    measured = ok(ddspec(uncalibrated_cache, "calibrate"))
    assert "verify ms by N" in measured.stdout
    shown = ok(ddspec(uncalibrated_cache, "calibrate", "--show"))
    assert "old" in shown.stdout and "spread across rounds" in shown.stdout
    assert "policy memory" in shown.stdout and "none yet" in shown.stdout


def test_tune_short(uncalibrated_cache, tmp_path):
    result = ok(ddspec(uncalibrated_cache, "tune", "--prompts", "gsm8k", "--limit", "1",
                       "--max-new-tokens", "8", "--depths", "2", "--top-ks", "2", "--sizes", "3",
                       "--out", str(tmp_path / "tune")))
    assert "eagle2@d2k2n3" in result.stdout + result.stderr


def test_train_all_tiny(uncalibrated_cache, tmp_path):
    ok(ddspec(uncalibrated_cache, "train", "all", "--tiny", "--out", str(tmp_path / "t")))
