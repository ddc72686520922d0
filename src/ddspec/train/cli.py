"""`ddspec train`: make an EAGLE-1/2 draft head for a target, in resumable stages.

    ddspec train data   --out runs/smollm2     # the target answers training prompts (+ features)
    ddspec train layers --out runs/smollm2 --fuse-layers 2,15   # optional: intermediate target layers
    ddspec train fit    --out runs/smollm2     # train the head, checkpointing
    ddspec train calibrate --out runs/smollm2 --val-sequences 128   # fit the greedy draft temperature
    ddspec train eval   --out runs/smollm2     # tau through the real engine on the eval sets
    ddspec train export --out runs/smollm2 --to FOLDER   # EAGLE-1/2 layout + model card
    ddspec train export --out RUN --format eagle3 --to FOLDER   # an EAGLE-3 head in RUN/head, EAGLE-3 layout
    ddspec train merge  --out runs/smollm2 --from runs/more   # add another run's data (after this run's)
    ddspec train all    --out runs/smollm2     # data, layers, fit, eval, export in order
    ddspec train all --tiny --out /tmp/t       # the whole pipeline on a tiny random model
    ddspec train data --arch eagle3 --out runs/e3   # data for an EAGLE-3 head (keeps layers 2, L/2, L-3)
    ddspec train fit  --arch eagle3 --out runs/e3 --draft-vocab 8192 --ttt-passes 3

Each stage logs to OUT/<stage>.log, shows a progress bar, records its wall time in
OUT/stages.json, and resumes where it stopped when run again with the same OUT.
"""

from __future__ import annotations

import argparse
import os

from ddspec.config import TreeConfig
from ddspec.models.tiny import FAMILIES as TINY_FAMILIES

STAGES = ("data", "layers", "merge", "fit", "calibrate", "eval", "export", "all")


def default_prompts() -> str:
    from ddspec.datasets import TRAIN_PROMPTS

    return str(TRAIN_PROMPTS)


def add_parser(sub) -> None:
    from ddspec.args import add_model_args

    p = sub.add_parser("train", help="train an EAGLE draft head for a model (resumable stages)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=STAGES, help="which stage to run (all = every stage in order)")
    p.add_argument("--out", required=True, help="run folder: data shards, checkpoints, logs, results")
    p.add_argument("--tiny", action="store_true",
                   help="a tiny random model and a few prompts: the whole pipeline in about a minute")
    p.add_argument("--tiny-family", default="llama", choices=TINY_FAMILIES,
                   help="the tiny model's family with --tiny (default llama; the windowed families get a "
                        "16-token sliding window, shorter than the tiny prompts and answers)")
    p.add_argument("--prompts", default=default_prompts(),
                   help="training prompts JSONL, plain or .gz (question_id/id, category, turns); default: the "
                        "15,586 training prompts shipped with ddspec (ddspec/data/README.md). Never the "
                        "evaluation files.")
    p.add_argument("--arch", default="eagle", choices=("eagle", "eagle3"),
                   help="eagle = an EAGLE-1/2 head (default); eagle3 = an EAGLE-3 head in the published layout: "
                        "one layer reading the target's residual streams at the inputs of layers 2, L/2 and L-3 "
                        "(kept by the data stage), its own draft vocabulary, trained on its own outputs "
                        "(--ttt-passes) against the target's distribution")
    g = p.add_argument_group("data")
    g.add_argument("--response-tokens", type=int, default=600_000,
                   help="stop generating once this many response tokens exist (default 600000)")
    g.add_argument("--max-new-tokens", type=int, default=256, help="longest response per prompt (default 256)")
    g.add_argument("--batch-size", type=int, default=16, help="prompts decoded together (default 16)")
    g.add_argument("--sampled-answers", type=int, default=0, metavar="N",
                   help="after the greedy pass, answer the --sample-sources prompts N more times with "
                        "temperature sampling: more target-written data once the prompts are used up (default 0)")
    g.add_argument("--first-sampled-pass", type=int, default=1, metavar="K",
                   help="number the sampled passes from K (each pass has its own prompt order and seeds, so "
                        "passes K.. answer with new text where an earlier run made passes 1..K-1; default 1)")
    g.add_argument("--greedy-pass", action=argparse.BooleanOptionalAction, default=True,
                   help="answer the prompt mix greedily before any sampled pass (default); --no-greedy-pass makes "
                        "only sampled answers: new data for a head already trained on the greedy ones")
    g.add_argument("--second-turns", type=int, default=0, metavar="N",
                   help="after the greedy pass, follow up to N of its answers to the --sample-sources prompts with "
                        "a second user turn (another prompt of those sources) and answer it greedily: data whose "
                        "context holds an earlier exchange, as a chat's later turns do (default 0)")
    g.add_argument("--temperature", type=float, default=0.7,
                   help="sampling temperature of the sampled passes (default 0.7)")
    g.add_argument("--sample-sources", default=None, metavar="SRC[:CAP],...",
                   help="prompt sources the sampled passes answer, each with an optional cap "
                        "(default: every source but the capped math and code ones)")
    p.add_argument("--from", dest="from_run", default=None, metavar="OTHER_RUN",
                   help="merge: the run folder whose data (shards and fused-layer states) is added after this "
                        "run's own, hard-linked where possible; a rerun adds nothing twice")
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=float, default=2.0)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per optimiser step")
    g.add_argument("--draft-vocab", type=int, default=0,
                   help="train and ship a reduced draft vocabulary of this many tokens (0 = full)")
    g.add_argument("--checkpoint-every", type=int, default=200,
                   help="write train_state.pt every this many steps (default 200) and at the end")
    g.add_argument("--checkpoint-minutes", type=float, default=10.0,
                   help="also write it once this many minutes have passed since the last one (default 10): "
                        "an interrupted fit resumes losing at most that much work")
    g.add_argument("--warmup-steps", type=int, default=100, help="linear learning-rate warm-up (default 100)")
    g.add_argument("--noise", type=float, default=0.1,
                   help="half-width of the uniform noise added to the input features (default 0.1)")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0)")
    g.add_argument("--p-weight", type=float, default=0.1,
                   help="weight of the cross-entropy against the target's distribution, beside the feature "
                        "regression's 1.0 (default 0.1, EAGLE-1's)")
    g.add_argument("--ttt-passes", type=int, default=1, metavar="K",
                   help="training-time test: also train draft depths 2..K on the head's own predicted "
                        "features, with the engine's attention pattern (about K times the compute; default 1 = "
                        "plain EAGLE-1 teacher forcing)")
    g.add_argument("--val-sequences", type=int, default=0, metavar="N",
                   help="hold out the last N sequences (the newest shards), score them every --eval-every "
                        "steps and keep the head that does best on them (default 0 = keep the last step); "
                        "`calibrate` fits the draft temperature on the same N")
    g.add_argument("--prompt-loss", action="store_true",
                   help="also train on prompt positions (the target's features and distribution there are "
                        "computed anyway), not only on the response")
    g.add_argument("--eval-every", type=int, default=50, help="steps between held-out scores (default 50)")
    g.add_argument("--init-from", default=None, metavar="HEAD",
                   help="start from the weights of an earlier head (a folder: an EAGLE-1/2 head, or with "
                        "--arch eagle3 an EAGLE-3 head reading the same layers) instead of random ones: a warm "
                        "start when more data arrives. The draft vocabulary is still chosen from this run's data, "
                        "unless --keep-draft-vocab")
    g.add_argument("--keep-draft-vocab", action="store_true",
                   help="with --init-from (an EAGLE-1/2 head): keep that head's draft vocabulary instead of counting "
                        "this run's tokens: for a round on new data alone, whose token counts would favour its "
                        "own kind of text (chat answers only, say)")
    g.add_argument("--fuse-layers", default=None, metavar="A,B",
                   help="make a head that also reads the target's residual stream at the inputs of these layers "
                        "(HF hidden_states indices, e.g. 2,15 of 30), fused into its input feature at committed "
                        "positions (after EAGLE-3). Given to `data`, the states are kept as the answers are generated (no "
                        "extra cost); otherwise the `layers` stage runs the target over the data once more up to "
                        "the deepest of them (it fills any shard that lacks them). With --init-from a plain head, the fusion "
                        "starts at zero, i.e. exactly at that head")
    g.add_argument("--head-layers", type=int, default=0, metavar="N",
                   help="decoder layers in the head (default: as the --init-from head, else 1). More layers "
                        "than the --init-from head has start as the identity, so the deeper head begins "
                        "exactly at the earlier one; each layer costs draft time at every draft depth")
    g.add_argument("--head-ffn", type=int, default=0, metavar="N",
                   help="the head's MLP width (default: the --init-from head's, else the target's). Narrower "
                        "than a large target's layers: a smaller, faster head for the same data (an EAGLE-1/2 head)")
    g = p.add_argument_group("evaluation / export")
    g.add_argument("--eval-limit", type=int, default=20, help="first turns per eval file (default 20)")
    g.add_argument("--eval-new-tokens", type=int, default=128)
    g.add_argument("--eval-turns", type=int, default=1, metavar="N",
                   help="evaluate the first N turns of each prompt (MT-bench has 2; turn k follows plain "
                        "decoding's answers to the earlier ones). Default 1")
    g.add_argument("--eval-sets", default="mt_bench,humaneval,gsm8k",
                   help="comma-separated eval files, each optionally with its own prompt count: "
                        "mt_bench:80,humaneval:20 (default: all three, --eval-limit each)")
    g.add_argument("--eval-full-vocab", action=argparse.BooleanOptionalAction, default=True,
                   help="with a reduced draft vocabulary, also measure the head over the full vocabulary")
    g.add_argument("--eval-replay", action="store_true",
                   help="check each tree against plain decoding's answer instead of verifying it on the target: "
                        "the same trees and tau (greedy), without a target forward per step (a 60-node tree on a "
                        "large target costs 10-20 tokens' time on a CPU); no speed is measured")
    g.add_argument("--context-vocab", type=int, default=TreeConfig().context_vocab, metavar="N",
                   help="eval: context tokens a reduced draft vocabulary may add, as `ddspec generate --context-vocab` "
                        f"(default {TreeConfig().context_vocab}; 0 = the head's own vocabulary only)")
    g.add_argument("--against", default=None, metavar="HEAD",
                   help="eval: also run this head (a folder; 'shipped' = the model's shipped head) on the same "
                        "prompts, side by side: tau and draft ms of both in one run")
    g.add_argument("--to", default=None,
                   help="export: the head folder to write; calibrate: the head folder whose config gets the "
                        "temperature (default OUT/head; e.g. a shipped head, fitted on this run's held-out data)")
    g.add_argument("--format", default=None, choices=("eagle", "eagle3"),
                   help="export: eagle = the EAGLE-1/2 layout; eagle3 = the published EAGLE-3 layout (config and "
                        "keys vLLM and SGLang read), for an EAGLE-3 head. Default: the head's own layout")
    add_model_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ddspec.train.pipeline import run_stages

    return run_stages(args)
