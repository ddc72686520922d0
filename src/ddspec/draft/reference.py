"""Drafters for tests and sanity checks: an oracle and a random guesser.

- :class:`OracleDrafter` knows the target's own continuation (computed beforehand by plain
  decoding) and proposes it as a chain, so a correct engine accepts every drafted token and
  τ = depth + 1 on every step.
- :class:`RandomDrafter` proposes random tokens in a random tree, so almost nothing is
  accepted; the output must still equal plain decoding.
"""

from __future__ import annotations

import torch

from ddspec.draft.base import Drafter
from ddspec.models.base import TargetOutput
from ddspec.tree import DraftTree
from ddspec.verify import Verdict


class OracleDrafter(Drafter):
    def __init__(self, sequence: list[int], depth: int) -> None:
        self.sequence, self.depth = list(sequence), depth  # prompt + the target's continuation

    @property
    def max_tree_size(self) -> int:
        return self.depth + 1

    def reset(self, max_length: int) -> None:
        pass

    def resume(self, max_length: int, length: int) -> None:
        pass

    def prefill(self, prompt: torch.Tensor, target_out: TargetOutput, root: torch.Tensor) -> None:
        pass

    def propose(self, root: torch.Tensor, position: int) -> DraftTree:
        assert self.sequence[position] == int(root), "the oracle's sequence disagrees with the target"
        ahead = torch.tensor(self.sequence[position + 1 : position + 1 + self.depth], dtype=torch.long)
        return DraftTree.chain(root, ahead, torch.zeros(ahead.numel()))

    def observe(self, tree: DraftTree, verdict: Verdict, target_out: TargetOutput) -> None:
        pass


class RandomDrafter(Drafter):
    def __init__(self, vocab_size: int, size: int, seed: int = 0) -> None:
        self.vocab_size, self.size = vocab_size, size
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def max_tree_size(self) -> int:
        return self.size

    def reset(self, max_length: int) -> None:
        pass

    def resume(self, max_length: int, length: int) -> None:
        pass

    def prefill(self, prompt: torch.Tensor, target_out: TargetOutput, root: torch.Tensor) -> None:
        pass

    def propose(self, root: torch.Tensor, position: int) -> DraftTree:
        g, n = self.generator, self.size
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        depths = [0] * n
        tokens = [int(root)] + [0] * (n - 1)
        used: dict[int, set[int]] = {}
        for i in range(1, n):
            depths[i] = depths[parents[i]] + 1
            siblings = used.setdefault(parents[i], set())
            tok = int(torch.randint(0, self.vocab_size, (1,), generator=g))
            while tok in siblings:
                tok = (tok + 1) % self.vocab_size
            siblings.add(tok)
            tokens[i] = tok
        return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), -torch.tensor(depths).float())

    def observe(self, tree: DraftTree, verdict: Verdict, target_out: TargetOutput) -> None:
        pass
