"""Exceptions raised by ragblend."""


class RagblendError(ValueError):
    """Bad input or an unsupported setup, with a message that names the problem."""


class UnsupportedModelError(RagblendError):
    """The model's architecture has no layer-wise adapter."""
