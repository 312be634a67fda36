"""FSDP2's explicit prefetch, in the order the units really run: each unit issues the all-gather of the unit that
runs after it in the forward (and before it in the backward) as soon as its own parameters are in, instead of
when the host reaches that next unit. On a host-bound step the host is no further ahead than the device, so the
default, issued from the next unit's pre-forward, leaves the all-gather exposed.

The order is the one the first step's forward shows (a unit's place: its first call), not the model's
declaration order; a unit that a later step skips only has its parameters gathered early for nothing."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


class UnitPrefetch:
    """Records the forward order of `units` (modules under fully_shard) until `arm()`, then sets each unit's
    forward and backward prefetch to its neighbours in that order."""

    def __init__(self, units: Sequence[nn.Module]):
        self.units = list(units)
        self.order: list[nn.Module] = []
        seen: set[int] = set()

        def record(module: nn.Module, args) -> None:
            if id(module) not in seen:
                seen.add(id(module))
                self.order.append(module)

        self._hooks = [unit.register_forward_pre_hook(record) for unit in self.units]

    def arm(self) -> list[str]:
        """Stops recording and sets the prefetches; returns the order as the units' class names."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for before, after in zip(self.order, self.order[1:]):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])
        return [type(unit).__name__ for unit in self.order]
