"""Matmul kernels: each agrees with torch.mm; plans map row counts to kernels; the choice is
measured once and cached."""

from __future__ import annotations

import json

import pytest
import torch

from ddspec.models.kernels import BUCKETS, KERNELS, KernelPlan, Weight, choose_plan, measure_plan


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 16, 65])
def test_each_kernel_equals_mm(kernel, rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 48, generator=gen)
    x = torch.randn(1, rows, 48, generator=gen)
    got = Weight(w, {kernel})(x, kernel)
    assert got.shape == (1, rows, 96)
    assert (got - x @ w.t()).abs().max() <= 1e-4  # fp32 rounding of a 48-term sum


def test_dense_t_of_a_packed_weight_is_the_transpose():
    w = torch.randn(40, 24)
    assert torch.allclose(Weight(w, {"onednn"}).dense_t(), w.t(), atol=1e-6)


def test_plan_buckets():
    plan = KernelPlan(("mm",) + ("onednn",) * (len(BUCKETS) - 1))
    assert plan.kernel(1) == "mm" and plan.kernel(2) == plan.kernel(5) == plan.kernel(500) == "onednn"
    with pytest.raises(ValueError):
        KernelPlan(("mm",))


def test_measure_plan_picks_the_faster_kernel_per_bucket():
    weights = [[Weight(torch.randn(64, 32), {"mm", "linear"})]]
    plan = measure_plan(weights, ("mm", "linear"), reps=1)
    assert set(plan.kernels) <= {"mm", "linear"} and len(plan.kernels) == len(BUCKETS)


def test_choice_is_cached_and_a_forced_kernel_wins(tmp_path, monkeypatch):
    from ddspec.machine import OtherLoad

    monkeypatch.setattr(OtherLoad, "share", lambda self: 0.0)  # a quiet machine (see the next test)
    monkeypatch.setenv("DDSPEC_CACHE", str(tmp_path))
    monkeypatch.delenv("DDSPEC_KERNEL", raising=False)
    calls = []

    def measure(options):
        calls.append(options)
        return KernelPlan.uniform(options[-1])

    cpu, f32 = torch.device("cpu"), torch.float32
    first = choose_plan("test", [[8, 4]], cpu, f32, measure)
    again = choose_plan("test", [[8, 4]], cpu, f32, measure)
    assert first == again and len(calls) == 1
    entry = json.loads(next((tmp_path / "kernels").glob("*.json")).read_text())
    assert entry["kernels"] == list(first.kernels)
    monkeypatch.setenv("DDSPEC_KERNEL", "mm")
    assert choose_plan("test", [[8, 4]], cpu, f32, measure) == KernelPlan.uniform("mm")
    monkeypatch.setenv("DDSPEC_KERNEL", "fastest-please")
    with pytest.raises(ValueError, match="DDSPEC_KERNEL"):
        choose_plan("test", [[8, 4]], cpu, f32, measure)


def test_a_choice_timed_while_other_programs_load_the_cpu_is_not_cached(tmp_path, monkeypatch, capsys):
    """Measured beside a training job, torch's kernels beat ddspec's C kernels (whose two threads
    wait on each other while one core is taken) and a later quiet run decoded 8x slower with the
    cached choice: such a choice is used for the run, not cached."""
    from ddspec.machine import OtherLoad

    monkeypatch.setattr(OtherLoad, "share", lambda self: 0.8)
    monkeypatch.setenv("DDSPEC_CACHE", str(tmp_path))
    monkeypatch.delenv("DDSPEC_KERNEL", raising=False)
    calls = []

    def measure(options):
        calls.append(options)
        return KernelPlan.uniform(options[0])

    cpu, f32 = torch.device("cpu"), torch.float32
    assert choose_plan("busy", [[8, 4]], cpu, f32, measure) == KernelPlan.uniform(calls[0][0])
    assert "other programs used 80% of the CPU" in capsys.readouterr().err
    assert not (tmp_path / "kernels").exists() or not list((tmp_path / "kernels").glob("*.json"))
    choose_plan("busy", [[8, 4]], cpu, f32, measure)
    assert len(calls) == 2  # measured again


def test_cpu_name_tells_cpu_families_apart():
    """Kernel and cost caches are keyed by this name: a VM calls Zen 2 and Zen 5 hosts alike."""
    from ddspec.machine import cpu_name_from_cpuinfo

    block = "processor\t: {i}\nvendor_id\t: AuthenticAMD\ncpu family\t: {f}\nmodel\t\t: {m}\nmodel name\t: AMD EPYC\n\n"
    zen5 = block.format(i=0, f=26, m=2) + block.format(i=1, f=26, m=2)
    assert cpu_name_from_cpuinfo(zen5) == "AMD EPYC (family 26, model 2)"
    assert cpu_name_from_cpuinfo(block.format(i=0, f=23, m=49)) == "AMD EPYC (family 23, model 49)"
    assert cpu_name_from_cpuinfo("processor\t: 0\nmodel name\t: Some ARM\n") == "Some ARM"
    assert cpu_name_from_cpuinfo("processor\t: 0\n") is None
