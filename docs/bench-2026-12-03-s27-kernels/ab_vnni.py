import json, os, sys, torch
torch.set_num_threads(2)
from ddspec import native
from ddspec.bench import target as bt
from ddspec.config import TreeConfig
import ddspec.bench.target as T
orig = TreeConfig.__init__
t8 = bt.load_int8()
from ddspec.models.loading import load_target
t32 = load_target("default", impl="native")
# draft levels with the context tokens off (a random 256-token prompt would add ~200 of them)
import ddspec.draft.eagle as E
_Init = E.EagleDrafter.__init__
def init(self, head, target, tree, *a, **k):
    from dataclasses import replace
    _Init(self, head, target, replace(tree, context_vocab=int(os.environ.get("CTX", "0"))), *a, **k)
E.EagleDrafter.__init__ = init
res = {"vnni": native.vnni_flags(), "int8": bt.forward_times(t8, 256, sizes=(1, 2, 4, 8, 16), reps=15),
       "fp32": bt.forward_times(t32, 256, sizes=(1, 4, 8), reps=9),
       "level": bt.draft_level_times(t32, top_ks=(1, 4, 10), reps=25)}
print(json.dumps({k: ({n: round(v, 2) for n, v in d.items()} if isinstance(d, dict) else d) for k, d in res.items()}))
