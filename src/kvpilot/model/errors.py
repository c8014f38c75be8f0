"""Errors a user can hit while loading a model: each message names the file and what to do."""


class ModelLoadError(Exception):
    """A model could not be loaded: missing or corrupt file, unsupported architecture, shape mismatch."""
