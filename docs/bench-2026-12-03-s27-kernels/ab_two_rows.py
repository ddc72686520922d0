import json, os, pathlib, torch
torch.set_num_threads(2)
from ddspec import native
if os.environ.get("N2") == "generic":
    native.SOURCE = pathlib.Path("/tmp/kern_generic.c")
from ddspec.bench import target as bt
from ddspec.models.loading import load_target
t32 = load_target("default", impl="native")
print(json.dumps({"n2": os.environ.get("N2", "pair"), "fp32": {n: round(v, 2) for n, v in bt.forward_times(t32, 256, sizes=(1, 2, 3, 4), reps=25).items()}}))
