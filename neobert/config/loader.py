"""Typed run configurations: YAML files and `key=value` overrides merged over a dataclass schema.

A misspelt key or a value of the wrong type is a `ConfigError` naming the key (a misspelt one with "did you mean
'x.y'?" for the nearest key of the schema), in one line, before any work starts; then the
schema's `resolve()` (when it has one) writes in what other keys decide, and its `validate()` (when it has one)
checks what types cannot, changing nothing: each once per load. A YAML file may start from another one with
`inherit: other.yaml` (a path relative to the file), which is how the stage-2, GLUE and ablation configs state
only what they change.

A config is named by a path or by the name of one shipped with the package (`neobert/configs/`): `neobert`,
`glue/rte`, `ablations/m05` (the `.yaml` may be left out). A key that moved is listed in the schema's
`RENAMED_KEYS` (old dotted key -> new one, which may sit in a free-form dict: `kernels` ->
`model_overrides.kernels`; a key inside a moved one moves with it): for one release the old key still works, with a
warning that names the new key. An override sets one item of a list by its index: `data.sources.0.weight=0`,
`phases[1].steps=2`.
"""

from __future__ import annotations

import difflib
import re
import warnings
from pathlib import Path
from typing import Any, Sequence, TypeVar

from omegaconf import BooleanNode, DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from neobert.errors import ConfigError

T = TypeVar("T")
INHERIT_KEY = "inherit"
PACKAGED_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def require(ok: bool, key: str, message: str) -> None:
    """The one way schemas reject a value: the message names the key."""
    if not ok:
        raise ConfigError(f"invalid config key {key!r}: {message}")


def packaged_config_names() -> list[str]:
    return sorted(str(p.relative_to(PACKAGED_CONFIGS).with_suffix("")) for p in PACKAGED_CONFIGS.rglob("*.yaml"))


def config_path(name_or_path: str | Path) -> Path:
    """A config file: an existing path, else one shipped with the package (`neobert`, `glue/rte`, or a packaged
    file such as `mteb_instructions.json`)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    for candidate in (PACKAGED_CONFIGS / path, PACKAGED_CONFIGS / f"{name_or_path}.yaml"):
        if not path.is_absolute() and candidate.is_file():
            return candidate
    raise ConfigError(f"config file {str(name_or_path)!r} does not exist (neither a path nor a packaged config; "
                      f"packaged: {', '.join(packaged_config_names())})")


def read_yaml(path: str | Path) -> DictConfig:
    """Reads a YAML config, resolving `inherit:` chains (child keys win)."""
    path = config_path(path)
    try:
        node = OmegaConf.load(path)
    except Exception as err:  # yaml errors have several types
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(err).split())}") from err
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values")
    parent = node.pop(INHERIT_KEY, None)
    if parent is None:
        return node
    return OmegaConf.merge(read_yaml(path.parent / str(parent)), node)


def load_config(schema: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Returns an instance of the dataclass `schema` with the file's values, then the overrides, applied,
    resolved and validated."""
    return _build(OmegaConf.structured(schema), schema, path, overrides)


def merge_overrides(config: T, overrides: Sequence[str]) -> T:
    """A copy of `config` (a schema instance built in Python) with `key=value` overrides applied, resolved and
    validated."""
    return _build(OmegaConf.structured(config), type(config), None, overrides)


def _build(config: DictConfig, schema: type, path: str | Path | None, overrides: Sequence[str]):
    OmegaConf.set_struct(config, True)
    _open_free_form_dicts(config)
    defaults = config
    renamed = getattr(schema, "RENAMED_KEYS", {})
    source = "defaults"
    try:
        if path is not None:
            source = str(path)
            config = OmegaConf.merge(config, _rename_keys(read_yaml(path), renamed, source))
        if overrides:
            source = "command-line overrides"
            bad = [o for o in overrides if "=" not in o]
            if bad:
                raise ConfigError(f"overrides must look like key=value, got {bad}")
            dotlist = [_rename_override(o, renamed) for o in overrides]
            _check_booleans(defaults, dotlist, source)
            config = _apply_overrides(config, dotlist, source)
        result = OmegaConf.to_object(config)
    except (ConfigKeyError, ConfigAttributeError) as err:
        key = getattr(err, "full_key", None) or ""
        raise ConfigError(f"{source}: unknown config key {key!r}{_did_you_mean(defaults, key)}") from err
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        message = str(getattr(err, "msg", None) or err).strip().splitlines()[0]  # OmegaConf adds types below
        section = re.search(r"(\w+) is not a subclass of (\w+)\. value: (.*)", message)
        if key is None and section:  # a scalar given for a whole section (merge errors carry no key)
            given, section_type, value = section.groups()
            key = _section_of_type(defaults, section_type)
            message = (f"is a section ({section_type}), not a value: got the {given} {value!r}; set its keys "
                       f"instead ({key}.<key>=...)")
        raise ConfigError(f"{source}: invalid config key {key!r}: {message}") from err
    if hasattr(result, "resolve"):
        result.resolve()
    if hasattr(result, "validate"):
        result.validate()
    return result


def _apply_overrides(config: DictConfig, dotlist: list[str], source: str) -> DictConfig:
    """The `key=value` overrides applied in order: merged as OmegaConf's dotlist, except those whose key goes
    through a list (`data.sources.0.weight=0`, `phases[1].steps=2`), which set that item's key (OmegaConf's dotlist
    would make the list a mapping {'0': ...} and fail to merge it: "Cannot merge incompatible container types")."""
    pending: list[str] = []
    for override in dotlist:
        key, _, value = override.partition("=")
        parts = LIST_INDEX.sub(r".\1", key.strip()).split(".")
        if not _goes_through_a_list(config, parts):
            pending.append(override)
            continue
        if pending:  # earlier overrides first: one may have replaced the list
            config, pending = OmegaConf.merge(config, OmegaConf.from_dotlist(pending)), []
        _set_through_lists(config, parts, key.strip(), OmegaConf.to_container(OmegaConf.from_dotlist(
            [f"value={value}"]))["value"], source)
    return OmegaConf.merge(config, OmegaConf.from_dotlist(pending)) if pending else config


def _check_booleans(schema: DictConfig, dotlist: list[str], source: str) -> None:
    """A boolean key takes true or false, as every boolean of the suite does (model.overrides' included): OmegaConf
    would read 2 as true."""
    for override in dotlist:
        key, _, value = (part.strip() for part in override.partition("="))
        parent, _, name = key.rpartition(".")
        try:
            section = OmegaConf.select(schema, parent) if parent else schema
        except OmegaConfBaseException:  # a key through a list (data.sources.0.weight): checked where it is set
            continue
        node = section._get_node(name) if isinstance(section, DictConfig) and name in section else None
        if isinstance(node, BooleanNode) and value.lower() not in ("true", "false"):
            raise ConfigError(f"{source}: invalid config key {key!r}: must be true or false, got {value}")


LIST_INDEX = re.compile(r"\[(\d+)\]")  # phases[1].steps, the form the error messages write, is phases.1.steps


def _goes_through_a_list(config: DictConfig, parts: list[str]) -> bool:
    """Whether a dotted key (split) names something inside a list of the config (a free-form dict's keys are
    its own: never)."""
    node = config
    for part in parts[:-1]:
        if not isinstance(node, DictConfig) or OmegaConf.get_type(node) is dict or part not in node:
            return False
        node = node._get_node(part)
        if isinstance(node, ListConfig):
            return True
    return False


def _set_through_lists(config: DictConfig, parts: list[str], key: str, value: Any, source: str) -> None:
    """Sets the key `parts` of `config`, indexing its lists by number; in a free-form dict (a phase's
    `overrides`) the rest of the key is one key, dotted as the YAML writes it. `key`: as the user wrote it."""
    node, walked = config, ""
    for i, part in enumerate(parts):
        if isinstance(node, DictConfig) and OmegaConf.get_type(node) is dict:
            with open_dict(node):
                node[".".join(parts[i:])] = value
            return
        if isinstance(node, ListConfig):
            size = len(node)
            if size == 0:
                raise ConfigError(f"{source}: invalid config key {key!r}: {walked} is empty: set the whole list "
                                  f"({walked}=[...])")
            indices = "index 0" if size == 1 else f"indices 0 to {size - 1}"
            if not part.isdigit():
                example = ".".join([walked, "0", *parts[i + 1:]])
                raise ConfigError(f"{source}: invalid config key {key!r}: {walked} is a list: give an item's index "
                                  f"({indices.split(' ', 1)[1]}), e.g. {example!r}")
            if int(part) >= size:
                raise ConfigError(f"{source}: invalid config key {key!r}: {walked} has {size} "
                                  f"item{'s' if size > 1 else ''} ({indices})")
        walked = f"{walked}.{part}" if walked else part
        try:
            if i == len(parts) - 1:
                OmegaConf.update(node, part, value, merge=True)
            else:
                node = node._get_node(int(part)) if isinstance(node, ListConfig) else node[part]
        except (ConfigKeyError, ConfigAttributeError) as err:
            raise ConfigError(f"{source}: unknown config key {key!r}{_did_you_mean(config, walked)}") from err
        except OmegaConfBaseException as err:
            message = str(getattr(err, "msg", None) or err).strip().splitlines()[0]
            raise ConfigError(f"{source}: invalid config key {key!r}: {message}") from err


def _section_of_type(schema: DictConfig, type_name: str, prefix: str = "") -> str | None:
    """The dotted key of the first section of the schema whose dataclass is named `type_name`."""
    for key in schema.keys():
        child = schema._get_node(key)
        if isinstance(child, DictConfig):
            if getattr(OmegaConf.get_type(child), "__name__", None) == type_name:
                return f"{prefix}{key}"
            found = _section_of_type(child, type_name, f"{prefix}{key}.")
            if found:
                return found
    return None


def _did_you_mean(schema: DictConfig, key: str) -> str:
    """`; did you mean 'x.y'?` for the schema key nearest to a misspelt `key` (the keys beside it first, then the
    same name in another section), or the keys that section has when none is near."""
    parent, _, leaf = key.rpartition(".")
    section = OmegaConf.select(schema, parent) if parent else schema
    if not isinstance(section, DictConfig):
        return ""
    siblings = [str(k) for k in section.keys()]
    near = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    if near:
        return f"; did you mean {'.'.join(filter(None, (parent, near[0])))!r}?"
    everywhere = _dotted_keys(schema)
    elsewhere = [k for k in everywhere if k.rpartition(".")[2] == leaf]
    elsewhere = elsewhere or difflib.get_close_matches(key, everywhere, n=1, cutoff=0.8)
    if elsewhere:
        return f"; did you mean {elsewhere[0]!r}?"
    return f"; the keys{f' of {parent!r}' if parent else ''} are: {', '.join(siblings)}"


def _dotted_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Every leaf key of a structured config, dotted (free-form dicts count as leaves)."""
    keys = []
    for key in node.keys():
        child = node._get_node(key)
        dotted = f"{prefix}{key}"
        if isinstance(child, DictConfig) and OmegaConf.get_type(child) is not dict:
            keys += _dotted_keys(child, dotted + ".")
        else:
            keys.append(dotted)
    return keys


def _warn_renamed(old: str, new: str, source: str) -> None:
    warnings.warn(f"{source}: config key {old!r} is deprecated and will be removed in the next release; "
                  f"use {new!r}", FutureWarning, stacklevel=4)


def _rename_override(override: str, renamed: dict[str, str]) -> str:
    """The override under its key's new name; a key inside a moved section or dict moves with it
    (`neobert_overrides.kernels` -> `model_overrides.kernels`)."""
    key, _, value = override.partition("=")
    key = key.strip()
    old = key if key in renamed else next((old for old in renamed if key.startswith(old + ".")), None)
    if old is not None:
        new = renamed[old] + key[len(old):]
        _warn_renamed(key, new, "command line")
        return f"{new}={value}"
    moved = sorted(new for old, new in renamed.items() if old.startswith(key + "."))
    if moved:
        raise ConfigError(f"invalid config key {key!r}: this section was split; set its keys one by one: "
                          f"{', '.join(moved)}")
    return override


def _rename_keys(node: DictConfig, renamed: dict[str, str], source: str) -> DictConfig:
    missing = object()
    for old, new in renamed.items():
        value = OmegaConf.select(node, old, default=missing)
        if value is missing:
            continue
        if OmegaConf.select(node, new, default=missing) is not missing:
            raise ConfigError(f"{source}: both {old!r} (deprecated) and {new!r} are set; keep {new!r}")
        _warn_renamed(old, new, source)
        parent_key, _, leaf = old.rpartition(".")
        parent = OmegaConf.select(node, parent_key) if parent_key else node
        del parent[leaf]
        while parent_key and not OmegaConf.select(node, parent_key):  # drop sections the move emptied
            grand_key, _, name = parent_key.rpartition(".")
            del (OmegaConf.select(node, grand_key) if grand_key else node)[name]
            parent_key = grand_key
        OmegaConf.update(node, new, value, merge=True, force_add=True)
    return node


def flag_overrides(args: Any, values: Sequence[str] = (), lists: Sequence[str] = ()) -> list[str]:
    """The CLI's free `key=value` overrides (`args.overrides`) followed by one override per convenience flag that
    was given: `--model X` becomes `model=X` for each name in `values`, and the comma-separated `--tasks a,b`
    becomes `tasks=['a','b']` for each name in `lists` (items quoted, so paths and `sts:file` stay strings; the
    schema still converts '128' to an int field). A flag's name is its config key; a flag and a free override of
    the same key are a ConfigError (which one was meant?)."""
    overrides = list(args.overrides)
    for name in (*values, *lists):
        value = getattr(args, name)
        if value is None:
            continue
        given = [o for o in args.overrides if o.partition("=")[0].strip() == name]
        if given:
            raise ConfigError(f"--{name.replace('_', '-')} {value} and {given[0]} both set {name!r}: give one of them")
        overrides.append(f"{name}={value}" if name in values
                         else f"{name}=[{','.join(repr(item.strip()) for item in value.split(','))}]")
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
