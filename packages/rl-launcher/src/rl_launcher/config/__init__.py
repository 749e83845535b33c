"""A run's configuration: the typed tree (:mod:`.schema`), loading YAML and command-line
overrides into it (:mod:`.loader`), the checks across sections (:mod:`.checks`) and the
docs/config.md generator (``python -m rl_launcher.config.docs``).

The tree's classes are importable from here: ``from rl_launcher.config import TrainConfig``.
"""

from rl_launcher.config.schema import (
    BOUNDS,
    AlgorithmConfig,
    BackendConfig,
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    DatasetConfig,
    EngineConfig,
    EvalConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    RolloutConfig,
    TrainConfig,
)

__all__ = [
    "BOUNDS",
    "AlgorithmConfig",
    "BackendConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "DataConfig",
    "DatasetConfig",
    "EngineConfig",
    "EvalConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RolloutConfig",
    "TrainConfig",
]
