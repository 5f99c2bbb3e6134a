"""Neural-network building blocks. ``anygpu.nn.functional`` holds the functional forms."""

from anygpu.nn import functional

__all__ = ["functional"]
