"""What a throughput run takes from its config before any model is built: the NeoBERT preset and overrides checked,
the default lengths, and the graphs dynamo may compile (`expected_graphs`, `recompile_limits`)."""

from __future__ import annotations

from typing import Sequence

import torch

from neobert.config.throughput import FLEX_MODELS, ThroughputConfig
from neobert.errors import ConfigError
from neobert.instruments.encoders import graphs_per_shape
from neobert.model import NeoBERTConfig
from neobert.model.config import HEAD_FIELDS, PRESETS, ModelFieldError


def check_model_overrides(config: ThroughputConfig) -> None:
    """neobert_preset must be a preset, and model_overrides must make a NeoBERTConfig of it whose packages are
    installed: else a ConfigError naming the key, before any work (every NeoBERT row would take them)."""
    if config.neobert_preset not in PRESETS:
        raise ConfigError(f"invalid config key 'neobert_preset': unknown {config.neobert_preset!r}; known presets: "
                          f"{sorted(PRESETS)}")
    if unknown := sorted(set(config.model_overrides) - set(NeoBERTConfig.__dataclass_fields__)):
        raise ConfigError(f"invalid config key 'model_overrides.{unknown[0]}': not a NeoBERTConfig field")
    if heads := [key for key in HEAD_FIELDS if key in config.model_overrides]:
        raise ConfigError(f"invalid config key 'model_overrides.{heads[0]}': a field of the model's heads; the job "
                          f"times the encoder alone")
    try:
        NeoBERTConfig.from_preset(config.neobert_preset, **config.model_overrides)
    except ModelFieldError as err:
        raise err.as_config_error("model_overrides.") from err
    except (ValueError, TypeError) as err:
        raise ConfigError(f"invalid config key 'model_overrides': {err}") from err


def default_lengths(device: torch.device) -> list[int]:
    return [128, 256, 512, 1024, 2048, 4096] if device.type == "cuda" else [128, 512]


def expected_graphs(config: ThroughputConfig, models: Sequence[str], lengths: Sequence[int],
                    candidates: Sequence[int]) -> int:
    """An estimate of the graphs one code object compiles in this run, given to dynamo as its recompile limit (past
    its own it would time eager without a word; here a miscount costs the model its rows instead). One static graph
    per shape a model runs, neobert and its neobert-<kernel> rows counted together; FlexAttention rows compile their
    mask and kernel inside transformers (twice a shape, again for grad mode); FA4 rows once per layer."""
    flex = any(name in FLEX_MODELS for name in models)
    sizes = len(set(candidates)) if config.compile or flex else 1
    shapes = len(config.layouts) * len(lengths) * sizes * (2 if flex else 1) + (4 if flex else 0)
    return shapes * sum(graphs_per_shape(name) if config.compiles(name) else 1 for name in models)


def recompile_limits(graphs: int):
    """Dynamo's limits raised to the run's `graphs` (`expected_graphs`), a model past them failing rather than timed
    in eager, and one static graph per shape."""
    limits = torch._dynamo.config
    return limits.patch(recompile_limit=max(limits.recompile_limit, graphs),
                        accumulated_recompile_limit=max(limits.accumulated_recompile_limit, graphs),
                        fail_on_recompile_limit_hit=True, automatic_dynamic_shapes=False)
