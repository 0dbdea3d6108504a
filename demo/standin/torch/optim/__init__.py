"""torch.optim of the stand-in."""

from torch.optim.optimizer import Optimizer


class SGD(Optimizer):
    pass


__all__ = ["SGD", "Optimizer"]
