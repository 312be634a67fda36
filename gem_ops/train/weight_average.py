"""An exponential moving average of the weights (Polyak averaging): what validation judges and training keeps.

Early stopping keeps the weights of one evaluated step. With the learning rate still high there, which
step's weights they are is partly the draw of the last batches, and models of different seeds differ by
it. The average over the recent steps is a steadier point of the same run, at the cost of one more copy
of the weights (off by default: `TrainConfig.weight_average_decay`).

The average is kept per rank over the tensors this rank holds (whole tensors on one rank, the local
shards of FSDP2's DTensors and of TorchRec's sharded tables), so it needs no communication. The live
weights and the average trade places in memory for validation (`swapped_in`); `keep` makes the average the weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

# Keys of the average's tensors in a checkpoint: per rank, since each rank averages its own shards.
CHECKPOINT_KEY = "weight_average"


def local_weight_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The floating-point tensors of the module's state as this rank holds them, aliasing the live
    weights (so writing them writes the model), each once however many names it has."""
    from torch.distributed.tensor import DTensor

    tensors, seen = [], set()
    for value in module.state_dict(keep_vars=True).values():
        if isinstance(value, DTensor):
            pieces = [value.to_local()]
        elif hasattr(value, "local_shards"):  # TorchRec's ShardedTensor
            pieces = [shard.tensor for shard in value.local_shards()]
        else:
            pieces = [value]
        for piece in pieces:
            key = (piece.data_ptr(), piece.dtype, tuple(piece.shape), piece.stride())
            if torch.is_floating_point(piece) and piece.numel() and key not in seen:
                seen.add(key)
                tensors.append(piece.detach())
    return tensors


class WeightAverage:
    """average ← average + (1 − d)(weights − average) after every step, with d = min(decay, (1 + n) / (10 + n))
    after n updates, so the first steps' weights (the initialisation) fade quickly."""

    def __init__(self, module: nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"TrainConfig.weight_average_decay must be within (0, 1), got {decay}")
        self.decay = decay
        self.live = local_weight_tensors(module)
        self.average = [t.clone() for t in self.live]
        self.updates = 0

    @torch.no_grad()
    def update(self) -> None:
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        torch._foreach_lerp_(self.average, self.live, 1.0 - d)
        self.updates += 1

    @torch.no_grad()
    def _swap(self) -> None:
        held = [t.clone() for t in self.live]
        torch._foreach_copy_(self.live, self.average)
        torch._foreach_copy_(self.average, held)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The average in the model's weights for the block, the live weights back after it."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    @torch.no_grad()
    def keep(self) -> None:
        """The average becomes the model's weights for good (the end of a run without validation); the average
        stays what it was, so a checkpoint saved now resumes from the kept weights and their average alike."""
        torch._foreach_copy_(self.live, self.average)

    def state_dict(self, rank: int) -> dict[str, torch.Tensor]:
        """The average under names of this rank's (ranks hold different shards), and its update count."""
        state = {f"{CHECKPOINT_KEY}.rank{rank}.{i}": t for i, t in enumerate(self.average)}
        state[f"{CHECKPOINT_KEY}.rank{rank}.updates"] = torch.tensor(self.updates)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor], rank: int) -> None:
        for i, t in enumerate(self.average):
            t.copy_(state[f"{CHECKPOINT_KEY}.rank{rank}.{i}"])
        self.updates = int(state[f"{CHECKPOINT_KEY}.rank{rank}.updates"])
