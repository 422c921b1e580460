"""The errors bad input raises. Each message names the file, field, tensor or option and says what was expected; the
commands print it as one line and exit with status 2."""


class InputError(ValueError):
    """Input that cannot be used as given."""


class ConfigError(InputError):
    """A config value that is missing, inconsistent or not supported by granite-jax."""


class CheckpointError(InputError):
    """A checkpoint directory or file that cannot be loaded as it is."""


class GenerationError(InputError):
    """A generation request that cannot be served as given (invalid option, empty or too long prompt)."""
