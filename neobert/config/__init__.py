"""Every run's typed schema (one module per job) and the loader that fills them from YAML and `key=value`.

Shared sections: `neobert.config.common` (TrainerConfig with its DeepSpeedConfig, OptimizerConfig, SchedulerConfig,
LoggingConfig).
Jobs: `pretrain`, `glue`, `contrastive`, `mteb`, `throughput`, `pseudo_perplexity`, `ablations`, `gpu_check`
(a pretraining recipe's check on a GPU node).
The YAML files shipped with the package are in `neobert/configs/`.
"""

from neobert.config.common import DeepSpeedConfig, LoggingConfig, OptimizerConfig, SchedulerConfig, TrainerConfig
from neobert.config.loader import (ConfigError, config_path, flag_overrides, load_config, merge_overrides,
                                   packaged_config_names, read_yaml, require, to_yaml)

__all__ = [
    "ConfigError", "config_path", "flag_overrides", "load_config", "merge_overrides", "packaged_config_names",
    "read_yaml", "require", "to_yaml", "DeepSpeedConfig", "LoggingConfig", "OptimizerConfig", "SchedulerConfig",
    "TrainerConfig",
]
