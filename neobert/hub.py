"""Two answers about the Hugging Face hub: is a name a hub name at all (`is_hub_name`: the one rule, so a mistyped
local path is reported as missing instead of as a download), and can the hub be reached (`hub_reachable`: one fast
answer, so that offline runs fail, or fall back, in seconds instead of sitting through the hub client's retries)."""

from __future__ import annotations

import functools
import os
import re
import socket
from pathlib import PurePath
from urllib.parse import urlparse

# Suffixes of local files (data, weights, configs, checkpoints): a name ending in one is a path, never a hub name.
FILE_SUFFIXES = frozenset({".jsonl", ".json", ".txt", ".parquet", ".csv", ".tsv", ".arrow", ".safetensors", ".bin",
                           ".pt", ".pth", ".ckpt", ".yaml", ".yml", ".gz", ".zip", ".tar", ".zst"})
_HUB_NAME = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)?")  # the hub's repository-id characters


def is_hub_name(name: str) -> bool:
    """Whether `name` is a hub name (`owner/name`, or a legacy bare name such as `bert-base-uncased`) rather than a
    local path. The one rule every loader uses, applied to names that do not exist on disk: a hub name has at most
    one `/`, does not start with `/`, `.` or `~`, holds only the hub's characters (letters, digits, `_`, `.`, `-`:
    no `\\`, `*`, `:` or space) and does not end in a file suffix (.jsonl, .txt, .parquet, .safetensors, ...).
    Anything else is a path, and a path that does not exist is reported as such."""
    name = str(name)
    if name.startswith((".", "~")) or not _HUB_NAME.fullmatch(name):
        return False
    return PurePath(name).suffix.lower() not in FILE_SUFFIXES


class HubUnreachableError(RuntimeError):
    """Raised when a hub resource is needed and the hub cannot be reached."""


@functools.lru_cache(maxsize=None)
def hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return False
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def require_hub(resource: str, config_key: str) -> None:
    """Fails fast, naming the config key that points the run at local files instead."""
    if not hub_reachable():
        raise HubUnreachableError(
            f"{resource!r} must be downloaded from the Hugging Face hub, which cannot be reached from this "
            f"machine (or HF_HUB_OFFLINE is set). Set `{config_key}` to local files instead."
        )
