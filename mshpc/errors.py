"""User-facing errors: one line each, saying what, where and the valid choices."""


class MshpcError(Exception):
    """Base of every error a user can cause; the CLI prints it as one line and exits 2."""


class ConfigError(MshpcError):
    """A config key, value or combination is invalid."""


class DataError(MshpcError):
    """Input data is missing, malformed or fails its checksum."""


class LaunchError(MshpcError):
    """The launcher environment is inconsistent or a rank could not be started."""


class CheckpointError(MshpcError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model."""


class KernelError(MshpcError):
    """The fused kernels were asked for (model.fused_kernels: on) but cannot be built or loaded."""
