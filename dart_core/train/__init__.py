"""Training pipeline of the DART draft head (issue 5): self-distilled data
(:mod:`~dart_core.train.data`), teacher features
(:mod:`~dart_core.train.features`) and the trainer
(:mod:`~dart_core.train.trainer`); CLI ``python -m dart_core.train``."""

from dart_core.train.data import DataConfig
from dart_core.train.trainer import TrainConfig, train

__all__ = ["DataConfig", "TrainConfig", "train"]
