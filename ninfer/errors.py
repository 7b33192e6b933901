"""User-facing error families. Each message names the problem and the fix; CLIs print it as one line."""


class NinferError(Exception):
    """Base of every error a user can cause; CLIs turn it into one line on stderr and exit 1."""


class ArtifactError(NinferError):
    """A .ninfer file is missing, truncated, corrupt or lacks a required binding."""


class GGUFError(NinferError):
    """A GGUF file is missing, truncated, corrupt or of the wrong architecture."""


class ConversionError(NinferError):
    """A conversion request cannot be carried out (bad flags, missing metadata, geometry mismatch)."""


class QuantFormatError(NinferError):
    """An unknown block format or a byte size that does not fit the format."""


class EngineConfigError(NinferError):
    """Engine or server settings that cannot work together (e.g. kv-capacity < max-context)."""


class RequestError(NinferError):
    """A request the engine refuses; `code` is the API error code (e.g. context_length_exceeded)."""

    def __init__(self, message: str, code: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param
