"""Hot ops: a plain-PyTorch reference for each (`reference`), fast versions beside it."""

from ninfer.kernels import reference

__all__ = ["reference"]
