import statistics, time, torch
torch.set_num_threads(2)
from ddspec.config import TreeConfig
from ddspec.draft.eagle import EagleDrafter
from ddspec.methods import resolve_head
from ddspec.models.loading import load_target
target = load_target("default", impl="native")
head = resolve_head(None, target)
gen = torch.Generator().manual_seed(1)
prefix = 256
prompt = torch.randint(0, target.info.vocab_size, (prefix,), generator=gen)
for k in (1, 10):
    for E in (0, 32, 128, 256):
        drafter = EagleDrafter(head, target, TreeConfig(top_k=k, depth=6, total_tokens=60, context_vocab=max(E, 0)))
        target.reset(prefix + 8)
        out = target.forward(prompt, torch.arange(prefix), None, drafter.hidden_layers)
        drafter.reset(prefix + 8)
        drafter.prefill(prompt, out, prompt[-1])
        if drafter.context is not None:
            E = drafter.context.size
        hidden = torch.randn(k, 576)
        ts = []
        for _ in range(300):
            t = time.perf_counter(); drafter.logprobs(hidden).topk(k, dim=-1); ts.append(time.perf_counter() - t)
        print(f"top_k {k} E {E}: logprobs+topk {statistics.median(ts[20:])*1e3:.3f} ms")
