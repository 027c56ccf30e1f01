"""Exceptions raised by ragblend."""


class RagblendError(ValueError):
    """Bad input or an unsupported setup, with a message that names the problem."""


class UnsupportedModelError(RagblendError):
    """The model's architecture has no layer-wise adapter."""


class CorruptEntryError(RagblendError):
    """A stored KV entry failed verification while being read (it has been dropped).

    ``key`` names the entry, so the caller can treat that chunk as a miss and recompute it.
    """

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"KV entry {key[:16]}… is unusable: {reason}")
        self.key = key
        self.reason = reason
