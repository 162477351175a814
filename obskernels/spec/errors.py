"""The errors both backends raise (so neither imports the other's, nor the front's)."""

from __future__ import annotations

__all__ = ["KernelUnsupportedError", "HeldStatisticsError"]


class KernelUnsupportedError(NotImplementedError):
    """The triton backend does not cover this case (raised before any launch).

    Under a forced "triton" backend it reaches the caller; under "auto" the
    operation falls back to the reference with one logged message.
    """


class HeldStatisticsError(ValueError):
    """Held statistics that cannot merge with a new value's: ``new_shape`` is
    the shape the value's statistics have (the observer words the message)."""

    def __init__(self, message: str, new_shape: tuple):
        super().__init__(message)
        self.new_shape = tuple(new_shape)
