"""The command line: help, clear errors (exit 2, no traceback), streaming output."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddspec.cli", *args], capture_output=True, text=True,
                          input=stdin, timeout=300)


def test_help_lists_commands():
    out = run_cli("--help")
    assert out.returncode == 0
    assert "generate" in out.stdout and "chat" in out.stdout


def test_help_does_not_load_torch():
    """`ddspec --help` (and every command's) answers at once: the parser imports no torch (3 s)."""
    code = ("import sys, ddspec.cli\n"
            "for cmd in ('generate', 'chat', 'bench', 'train', 'serve', 'calibrate', 'tune'):\n"
            "    try:\n"
            "        ddspec.cli.main([cmd, '--help'])\n"
            "    except SystemExit:\n"
            "        pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--temperature", "-0.5"], "--temperature"),
        (["--top-p", "2"], "--top-p"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--model", "/no/such/model"], "/no/such/model"),
        (["--model", "missing.gguf"], "GGUF file not found"),
        (["--threads", "0"], "--threads"),
        (["--impl", "hf", "--activations", "int8"], "--activations int8 needs the native implementation"),
    ],
)
def test_user_mistakes_are_one_line_errors(args, needle):
    out = run_cli("generate", "hi", *args)
    assert out.returncode == 2
    assert needle in out.stderr
    assert "Traceback" not in out.stderr


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "mamba", "vocab_size": 10, "hidden_size": 4, '
                                          '"num_hidden_layers": 1}')
    out = run_cli("generate", "hi", "--model", str(tmp_path), "--impl", "native")
    assert out.returncode == 2 and "mamba" in out.stderr and "Traceback" not in out.stderr


def test_broken_gguf_leaves_no_cache_entry(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    cache = tmp_path / "cache"
    out = subprocess.run([sys.executable, "-m", "ddspec.cli", "generate", "hi", "--model", str(bad)],
                         capture_output=True, text=True, env={**__import__("os").environ, "XDG_CACHE_HOME": str(cache)})
    assert out.returncode == 2 and "could not convert GGUF" in out.stderr
    assert "Traceback" not in out.stderr
    models = cache / "ddspec" / "models"
    assert not models.exists() or not any(models.iterdir())


def test_generate_streams_on_tiny_model(tiny_dirs):
    out = run_cli("generate", "hi", "--model", str(tiny_dirs["llama"]), "--max-new-tokens", "12")
    assert out.returncode == 0, out.stderr
    assert "tokens/s" in out.stderr and "prompt" in out.stderr


def test_chat_keeps_history_and_exits_on_eof(tiny_dirs):
    out = run_cli("chat", "--model", str(tiny_dirs["llama"]), "--max-new-tokens", "5", stdin="hello\nagain\n/reset\nbye\n")
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("tokens/s") == 3
    assert "history cleared" in out.stderr


def test_unknown_hub_id_fails_fast_with_a_message():
    out = run_cli("generate", "hi", "--model", "ddspec-tests/no-such-model-anywhere")
    assert out.returncode == 2 and "hub" in out.stderr and "Traceback" not in out.stderr
