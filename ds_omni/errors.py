"""Errors caused by the user's input.

Each one says what is wrong, with the offending value, and how to fix it. The CLI prints them
without a traceback and exits with status 2; anything else is a bug in ds_omni and keeps its
traceback.
"""


class DsOmniError(Exception):
    """Base class: an error in a config, a path, the data or the launch, not in ds_omni itself."""


class ConfigError(DsOmniError):
    """A config file or field is missing, unknown or has a bad value."""


class CompositionError(ConfigError):
    """Two features of the plan do not compose (`ds_omni.config.composition`'s table)."""


class LaunchError(DsOmniError):
    """The world size, launcher environment or output directory does not fit the plan."""


class DataError(DsOmniError):
    """A dataset path, schema or sample cannot be used."""


class ModelError(DsOmniError):
    """A model directory, family, weights file or encoder/placeholder layout is wrong."""
