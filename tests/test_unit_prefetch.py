"""FSDP2 prefetch in the order the units run (not the order they are declared), with the same training result."""

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from gem_ops.train.process_group import job_process_group
from gem_ops.train.unit_prefetch import UnitPrefetch


class Backwards(nn.Module):
    """Declares its layers first to last and runs them last to first."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x.sum()


def _trained(prefetch: bool) -> tuple[list[float], list[nn.Module], Backwards]:
    torch.manual_seed(0)
    model = Backwards()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = UnitPrefetch(model.layers) if prefetch else None
    losses = []
    for step in range(3):
        loss = model(torch.ones(4, 8) * (step + 1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if recorder is not None and step == 0:
            recorder.arm()
    return losses, (recorder.order if recorder else []), model


def test_units_prefetch_their_neighbours_in_the_order_they_ran_and_train_the_same():
    with job_process_group("cpu"):
        plain, _, _ = _trained(prefetch=False)
        prefetched, order, model = _trained(prefetch=True)
        assert order == list(reversed(model.layers))
        first, middle, last = order
        assert first._get_fsdp_state()._states_to_forward_prefetch == [middle._get_fsdp_state()]
        assert last._get_fsdp_state()._states_to_backward_prefetch == [middle._get_fsdp_state()]
        assert prefetched == plain
