"""Fine-tuning data from the Hugging Face Hub, failing at once when the Hub cannot be reached.

Offline, `datasets.load_dataset` retries for about 25 s before the user learns to pass local files.
So the Hub is probed first (a TCP connection); when it does not answer, or HF_HUB_OFFLINE /
HF_DATASETS_OFFLINE asks, the dataset comes from the local cache or is refused at once."""

from __future__ import annotations

import os
import socket
from typing import Any
from urllib.parse import urlparse


class HubUnreachable(ConnectionError):
    """The Hub did not answer (or offline mode was asked for) and the dataset is not cached."""


def offline_requested() -> bool:
    """Whether the environment asks for offline mode (read now: `datasets` read it at its import)."""
    flags = (os.environ.get(k, "").lower() for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    return any(flag in ("1", "true", "yes", "on") for flag in flags)


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hub (or HF_ENDPOINT) accepts a connection within `timeout` seconds."""
    if offline_requested():
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError:
        return False
    return True


def load_hub_dataset(name: str, config: str | None, split: str) -> Any:
    """`datasets.load_dataset(name, config, split=split)`: from the Hub when it answers, else from
    the local cache at once (offline mode for `datasets` and `huggingface_hub` for this call only),
    raising `HubUnreachable` when the dataset is not there."""
    import datasets
    import huggingface_hub.constants as hub_constants

    if hub_reachable():
        return datasets.load_dataset(name, config, split=split)
    saved = datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        return datasets.load_dataset(name, config, split=split)
    except Exception as err:  # datasets raises many types: ConnectionError, FileNotFoundError, ...
        where = "offline mode is set" if offline_requested() else "the Hub is unreachable"
        raise HubUnreachable(f"{where} and {name} is not in the local datasets cache") from err
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved
