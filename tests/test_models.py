"""Target implementations: native vs HF parity, tree forward parity, KV keep-path and truncate."""

from __future__ import annotations

import pytest
import torch

from conftest import FAMILIES

IMPLS = ("native", "hf")
TOL = 1e-4


def random_tree(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """parents [n] with parents[0] = -1 and parents[i] < i; depths [n]."""
    parents = torch.full((n,), -1, dtype=torch.long)
    depths = torch.zeros(n, dtype=torch.long)
    for i in range(1, n):
        parents[i] = int(torch.randint(0, i, (1,), generator=gen))
        depths[i] = depths[parents[i]] + 1
    return parents, depths


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    n = parents.numel()
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        if parents[i] >= 0:
            mask[i] = mask[parents[i]]
        mask[i, i] = True
    return mask


def path_to(parents: torch.Tensor, node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


@pytest.mark.parametrize("family", FAMILIES)
def test_native_matches_hf_logits(tiny_targets, family):
    native, hf = tiny_targets[(family, "native")], tiny_targets[(family, "hf")]
    tokens = torch.randint(0, native.info.vocab_size, (23,), generator=torch.Generator().manual_seed(1))
    outs = []
    for t in (native, hf):
        t.reset(64)
        outs.append(t.forward(tokens, torch.arange(23)))
    assert (outs[0].logits - outs[1].logits).abs().max() <= TOL
    assert (outs[0].features - outs[1].features).abs().max() <= TOL
    assert outs[0].logits.std() > 0.1  # not a degenerate model


def assert_tree_rows_equal_their_paths(target, cached: int, n: int = 14, seed: int = 7) -> None:
    """A random n-node tree after ``cached`` random tokens: every row's logits and features equal its
    path decoded alone after the same tokens (TOL)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = target.info.vocab_size
    prefix = torch.randint(0, vocab, (cached,), generator=gen)
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    parents, depths = random_tree(n, gen)
    target.reset(64)
    target.forward(prefix, torch.arange(cached))
    target.commit(torch.arange(cached))
    tree_out = target.forward(tokens, cached + depths, ancestor_mask(parents))
    for leaf in sorted(set(range(n)) - set(parents.tolist())):
        path = path_to(parents, leaf)
        target.truncate(cached)
        seq = target.forward(tokens[path], cached + torch.arange(len(path)))
        diff = (seq.logits - tree_out.logits[path]).abs().max()
        assert diff <= TOL, f"path {path}: max abs diff {diff}"
        assert (seq.features - tree_out.features[path]).abs().max() <= TOL


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("family", FAMILIES)
def test_tree_forward_matches_sequential_paths(tiny_targets, family, impl):
    assert_tree_rows_equal_their_paths(tiny_targets[(family, impl)], cached=9)


@pytest.mark.parametrize("impl", IMPLS)
def test_commit_keeps_accepted_path_then_decoding_continues(tiny_targets, impl):
    target = tiny_targets[("llama", impl)]
    gen = torch.Generator().manual_seed(3)
    vocab = target.info.vocab_size
    prefix = torch.randint(0, vocab, (6,), generator=gen)
    tokens = torch.randint(0, vocab, (10,), generator=gen)
    parents, depths = random_tree(10, gen)
    deepest = int(depths.argmax())
    path = path_to(parents, deepest)
    nxt = torch.randint(0, vocab, (1,), generator=gen)

    target.reset(64)
    target.forward(prefix, torch.arange(6))
    target.commit(torch.arange(6))
    target.forward(tokens, 6 + depths, ancestor_mask(parents))
    target.commit(torch.tensor(path))
    assert target.cache_length == 6 + len(path)
    after_tree = target.forward(nxt, torch.tensor([6 + len(path)]))

    target.reset(64)
    ref = target.forward(torch.cat([prefix, tokens[path], nxt]), torch.arange(7 + len(path)))
    assert (after_tree.logits[0] - ref.logits[-1]).abs().max() <= TOL


@pytest.mark.parametrize("impl", IMPLS)
def test_truncate_then_redecode(tiny_targets, impl):
    target = tiny_targets[("qwen2", impl)]
    tokens = torch.randint(0, target.info.vocab_size, (12,), generator=torch.Generator().manual_seed(5))
    target.reset(32)
    full = target.forward(tokens, torch.arange(12))
    target.truncate(8)
    assert target.cache_length == 8
    again = target.forward(tokens[8:], torch.arange(8, 12))
    assert (again.logits - full.logits[8:]).abs().max() <= TOL


def test_static_cache_keep_and_truncate():
    from ddspec.kv_cache import StaticKVCache

    cache = StaticKVCache(num_layers=2, num_kv_heads=1, head_dim=2, max_length=10)
    k = torch.arange(5, dtype=torch.float32).view(1, 1, 5, 1).expand(1, 1, 5, 2)
    for layer in range(2):
        cache.write(layer, k, -k)
    cache.advance(5)
    cache.keep(torch.tensor([0, 2, 4]))
    assert cache.length == 3
    assert cache.keys[0, 0, 0, :3, 0].tolist() == [0.0, 2.0, 4.0]
    assert cache.values[1, 0, 0, :3, 0].tolist() == [0.0, -2.0, -4.0]
    cache.truncate(1)
    assert cache.length == 1
    with pytest.raises(ValueError):
        cache.truncate(5)
    with pytest.raises(ValueError):
        cache.check_room(10)


def test_hidden_layers_are_returned(tiny_targets):
    native, hf = tiny_targets[("llama", "native")], tiny_targets[("llama", "hf")]
    tokens = torch.arange(2, 9)
    outs = []
    for t in (native, hf):
        t.reset(16)
        outs.append(t.forward(tokens, torch.arange(7), hidden_layers=(0, 1, 2)))
    for i in (0, 1, 2):
        assert (outs[0].hidden_states[i] - outs[1].hidden_states[i]).abs().max() <= TOL
    assert torch.equal(outs[0].hidden_states[0], native.embed(tokens))


@pytest.mark.parametrize("impl", IMPLS)
def test_last_logits_is_the_last_row_of_all(tiny_targets, impl):
    """A prefill asks for the last token's logits only: the same row, the same features and cache."""
    target = tiny_targets[("llama", impl)]
    tokens = torch.randint(0, target.info.vocab_size, (11,), generator=torch.Generator().manual_seed(4))
    outs = []
    for last in (False, True):
        target.reset(16)
        outs.append(target.forward(tokens, torch.arange(11), last_logits=last))
        outs.append(target.forward(tokens[:1], torch.tensor([11])))  # the cache it left behind
    assert outs[2].logits.shape == (1, target.info.vocab_size)
    assert (outs[2].logits - outs[0].logits[-1:]).abs().max() <= TOL
    assert torch.equal(outs[2].features, outs[0].features)
    assert (outs[3].logits - outs[1].logits).abs().max() <= TOL


def test_forward_batch_matches_single(tiny_targets):
    native = tiny_targets[("llama", "native")]
    gen = torch.Generator().manual_seed(2)
    a = torch.randint(0, 128, (10,), generator=gen)
    b = torch.randint(0, 128, (6,), generator=gen)
    batch = torch.zeros(2, 10, dtype=torch.long)
    batch[0], batch[1, :6] = a, b
    attn = torch.zeros(2, 10, dtype=torch.bool)
    attn[0], attn[1, :6] = True, True
    feats = native.forward_batch(batch, attn)
    for seq, row in ((a, 0), (b, 1)):
        native.reset(16)
        single = native.forward(seq, torch.arange(len(seq)))
        assert (feats[row, : len(seq)] - single.features).abs().max() <= TOL


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kernel", ["linear", "onednn", "native"])
def test_every_matmul_kernel_gives_the_same_logits(tiny_dirs, family, kernel, monkeypatch):
    """The kernels chosen per row count change speed, not results (1-5 rows, with a prefix; TOL)."""
    from ddspec.models.loading import load_target

    monkeypatch.setenv("DDSPEC_KERNEL", "mm")
    reference = load_target(str(tiny_dirs[family]), impl="native")
    monkeypatch.setenv("DDSPEC_KERNEL", kernel)
    other = load_target(str(tiny_dirs[family]), impl="native")
    assert other.layer_plan.needed == {kernel} and reference.layer_plan.needed == {"mm"}
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, other.info.vocab_size, (9,), generator=gen)
    for n in range(1, 6):
        tokens = torch.randint(0, other.info.vocab_size, (n,), generator=gen)
        mask = torch.ones(n, n, dtype=torch.bool).tril_()
        outs = []
        for t in (reference, other):
            t.reset(32)
            t.forward(prefix, torch.arange(9))
            outs.append(t.forward(tokens, torch.arange(9, 9 + n), mask))
        assert (outs[0].logits - outs[1].logits).abs().max() <= TOL
        assert (outs[0].features - outs[1].features).abs().max() <= TOL



@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
def test_hf_adapter_hands_its_cache_to_either_transformers_keyword(tiny_targets, keyword, monkeypatch):
    """transformers renamed forward's `past_key_values` to `cache` (5.17 has the old name, 5.24 the
    new); an unknown keyword lands in **kwargs without a word, and then no KV cache is kept at all."""
    import inspect

    from ddspec.models.hf_adapter import HFTarget

    target = tiny_targets[("mistral", "hf")]
    seen = []
    own = "cache" if "cache" in inspect.signature(type(target.model).forward).parameters else "past_key_values"

    def forward(**kwargs):  # the installed model under the keyword asked about
        seen.extend(k for k in kwargs if k in ("cache", "past_key_values"))
        return type(target.model).forward(target.model, **{(own if k == keyword else k): v for k, v in kwargs.items()})

    names = ("input_ids", "position_ids", "attention_mask", keyword, "use_cache", "output_hidden_states")
    forward.__signature__ = inspect.Signature([inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in names])
    monkeypatch.setattr(target.model, "forward", forward)
    adapter = HFTarget(target.model, target.info, target.tokenizer)
    adapter.reset(16)
    adapter.forward(torch.arange(5), torch.arange(5))
    adapter.commit(torch.arange(5))
    assert seen == [keyword] and adapter.cache_length == 5
    assert all(layer.keys.shape[2] == 5 for layer in adapter.cache.layers)


def test_masked_attention_on_a_gpu_leaves_cudnn_out(monkeypatch):
    """cuDNN's attention builds a plan per new shape, and a tree's keys grow every step: on a GPU
    the masked attention runs on the other backends (torch's choice on a CPU, or when asked)."""
    import contextlib

    from ddspec.models.base import masked_attention_backends

    assert isinstance(masked_attention_backends(torch.device("cpu")), contextlib.nullcontext)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with masked_attention_backends(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    monkeypatch.setenv("DDSPEC_CUDNN_ATTENTION", "1")
    assert isinstance(masked_attention_backends(torch.device("cuda")), contextlib.nullcontext)
