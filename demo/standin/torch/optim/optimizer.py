"""torch.optim.optimizer of the stand-in: global step post-hooks, as in PyTorch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_post_hooks: list[Callable[[Any, tuple[Any, ...], dict[str, Any]], None]] = []


def register_optimizer_step_post_hook(
    hook: Callable[[Any, tuple[Any, ...], dict[str, Any]], None],
) -> None:
    _post_hooks.append(hook)


class Optimizer:
    def __init__(self, params: Any = None) -> None:
        self.params = params

    def step(self) -> None:
        for hook in list(_post_hooks):
            hook(self, (), {})
