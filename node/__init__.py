"""The learner: Python API, training loop glue, CLI."""

__version__ = "0.1.0"
