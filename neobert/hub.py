"""One fast answer to "can the Hugging Face hub be reached?", so that offline runs fail (or fall back) in
seconds instead of sitting through the hub client's retries."""

from __future__ import annotations

import functools
import os
import socket
from urllib.parse import urlparse


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
