"""Shared fixtures: tiny random models (built once per session) and thread settings."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(2)
# the cost-aware method's memory of earlier runs (calibrate.PolicyMemory) stays off in tests: a test's
# drafter must not start from what another test (or an earlier test session) learned; the tests of
# that memory turn it on themselves
os.environ["DDSPEC_POLICY_MEMORY"] = "0"

FAMILIES = ("llama", "qwen2", "mistral")


@pytest.fixture(autouse=True)
def _quiet_machine(monkeypatch):
    """Measured costs are not cached while other programs load the CPU, and a test run may share it
    (with a build, a benchmark, another test run): tests see a quiet machine unless they say
    otherwise, so that a test of what a calibration caches does not depend on what else runs."""
    from ddspec.machine import OtherLoad

    monkeypatch.setattr(OtherLoad, "share", lambda self: 0.0)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, object]:
    from ddspec.models.tiny import make_tiny_model_dir

    root = tmp_path_factory.mktemp("tiny")
    return {f: make_tiny_model_dir(root / f, f, seed=i) for i, f in enumerate(FAMILIES)}


@pytest.fixture(scope="session")
def tiny_targets(tiny_dirs) -> dict[tuple[str, str], object]:
    """(family, impl) -> target, for impl in native / hf."""
    from ddspec.models.loading import load_target

    return {(f, impl): load_target(str(d), impl=impl) for f, d in tiny_dirs.items() for impl in ("native", "hf")}


@pytest.fixture(scope="session")
def default_native():
    from ddspec.models.loading import load_target

    return load_target("default", impl="native")


@pytest.fixture(scope="session")
def default_hf():
    from ddspec.models.loading import load_target

    return load_target("default", impl="hf")


@pytest.fixture(autouse=True)
def _exact_draft_weights(monkeypatch):
    """Tests compare drafting with the head's own maths: exact head weights unless a test asks for
    quantised drafting weights (DDSPEC_DRAFT_WEIGHTS; q4_1a8 is the native default) itself."""
    if "DDSPEC_DRAFT_WEIGHTS" not in os.environ:
        monkeypatch.setenv("DDSPEC_DRAFT_WEIGHTS", "exact")
