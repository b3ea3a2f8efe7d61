"""Typed run configurations: YAML files and `key=value` overrides merged over a dataclass schema.

A misspelt key or a value of the wrong type is a `ConfigError` naming the key, before any work starts.
A YAML file may start from another one with `inherit: other.yaml` (a path relative to the file), which is
how the stage-2 and ablation configs state only what they change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

T = TypeVar("T")
INHERIT_KEY = "inherit"


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the offending key or file."""


def read_yaml(path: str | Path) -> DictConfig:
    """Reads a YAML config, resolving `inherit:` chains (child keys win)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        node = OmegaConf.load(path)
    except Exception as err:  # yaml errors have several types
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values")
    parent = node.pop(INHERIT_KEY, None)
    if parent is None:
        return node
    return OmegaConf.merge(read_yaml(path.parent / str(parent)), node)


def load_config(schema: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Returns an instance of the dataclass `schema` with the file's values, then the overrides, applied."""
    config = OmegaConf.structured(schema)
    OmegaConf.set_struct(config, True)
    _open_free_form_dicts(config)
    source = "defaults"
    try:
        if path is not None:
            source = str(path)
            config = OmegaConf.merge(config, read_yaml(path))
        if overrides:
            source = "command-line overrides"
            bad = [o for o in overrides if "=" not in o]
            if bad:
                raise ConfigError(f"overrides must look like key=value, got {bad}")
            config = OmegaConf.merge(config, OmegaConf.from_dotlist(list(overrides)))
        return OmegaConf.to_object(config)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        raise ConfigError(f"{source}: invalid config key {key!r}: {getattr(err, 'msg', err)}") from err


def flag_overrides(args: Any, values: Sequence[str] = (), lists: Sequence[str] = ()) -> list[str]:
    """The CLI's free `key=value` overrides (`args.overrides`) followed by one override per convenience flag that
    was given: `--model X` becomes `model=X` for each name in `values`, and the comma-separated `--tasks a,b`
    becomes `tasks=['a','b']` for each name in `lists` (items quoted, so paths and `sts:file` stay strings; the
    schema still converts '128' to an int field). A flag's name is its config key; flags win over the free ones."""
    overrides = list(args.overrides)
    for name in values:
        value = getattr(args, name)
        if value is not None:
            overrides.append(f"{name}={value}")
    for name in lists:
        value = getattr(args, name)
        if value is not None:
            overrides.append(f"{name}=[{','.join(repr(item.strip()) for item in value.split(','))}]")
    return overrides


def _open_free_form_dicts(node: DictConfig) -> None:
    """`Dict[str, X]` fields (e.g. model overrides) take any key; dataclass sections stay strict."""
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            if OmegaConf.get_type(child) is dict:
                OmegaConf.set_struct(child, False)
            else:
                _open_free_form_dicts(child)


def to_yaml(config: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))
