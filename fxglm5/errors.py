"""The exceptions fxglm5 raises on bad input.

Every error names what was wrong (a file, a tensor, a config field, an input) so that a user can fix the
input without reading a traceback; the CLI prints ``str(err)`` on one line and exits non-zero.
"""


class Fxglm5Error(Exception):
    """Base class of every error fxglm5 raises on purpose."""


class ConfigError(Fxglm5Error, ValueError):
    """config.json (or a Glm5Config) is invalid or inconsistent; the message names the field."""


class CheckpointError(Fxglm5Error, ValueError):
    """A checkpoint file or tensor is missing, malformed or does not fit the config."""


class InputError(Fxglm5Error, ValueError):
    """A runtime input (token id, shape, dtype, position, block id, forward context) is invalid."""


class CacheFullError(InputError):
    """The paged KV cache has no room for a request; other requests are unaffected."""


class PassError(Fxglm5Error, RuntimeError):
    """A compiler pass failed, or (strict mode) an expected match was not found."""
