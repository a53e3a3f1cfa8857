"""Hugging Face Hub model names in a recipe: `model.hf_path: meta-llama/Llama-3.2-1B` (and
`data.tokenizer`), resolved to a folder of huggingface_hub's local cache.

A value that is not an existing path and reads `ORG/NAME` is a Hub id. `load_recipe` replaces it
with its snapshot folder (HF_HUB_CACHE/models--ORG--NAME/snapshots/<revision>/), so everything
after the recipe (validation, the workers, RUN_DIR/recipe.yaml, which then pins the revision)
sees a local folder. How it gets there is the caller's `hub` mode:

- `cache`: the cache only, never the network (`config`, `plan`, the workers);
- `download`: a snapshot not cached (or missing files) is fetched with huggingface_hub's
  `snapshot_download`, with its progress bars, unless HF_HUB_OFFLINE is set. fsdprun's launcher
  runs it once per node before any worker starts (every node runs its own launcher);
- `wait`: under torchrun, local rank 0 downloads and the node's other ranks wait for the cache.

A snapshot already cached is used as it is (`fsdprun download ID` fetches the newest). Never
imports torch; huggingface_hub only when a recipe names a Hub id.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from fsdprun.errors import UserError

# ORG/NAME as the Hub spells repository ids (huggingface_hub's validate_repo_id).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")
# What a training run reads of a model repository: its configs, safetensors weights, tokenizer
# files and chat templates; not the duplicate PyTorch/Meta formats (*.bin, original/*.pth).
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
TOKENIZER_FILES = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
IGNORED = ["original/*"]
WAIT_POLL_S = 1.0


def is_hub_id(value: str, base: Path | None = None) -> bool:
    """`ORG/NAME`, and no file or folder of that name (against `base`, else the working dir)."""
    if not _HUB_ID.fullmatch(value) or value.endswith((".json", ".bin", ".yaml")):
        return False
    return not ((base / value) if base is not None else Path(value)).exists()


def _lacks(folder: Path, *, model: bool) -> str | None:
    """What a snapshot lacks of what `model.hf_path` (config and weights) or `data.tokenizer`
    (tokenizer files) reads, in words; None when it holds it."""
    if model:
        weights = ("model.safetensors", "model.safetensors.index.json")
        if not any((folder / w).is_file() for w in weights):
            return "weight files (model.safetensors or model.safetensors.index.json)"
        return None if (folder / "config.json").is_file() else "config.json"
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if any((folder / n).is_file() for n in names):
        return None
    return f"tokenizer files ({', '.join(names)})"


def _snapshot(hub_id: str) -> Path | None:
    """The cached snapshot folder of `hub_id` (complete or not), never the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(hub_id, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None


def _cached(hub_id: str, *, model: bool) -> Path | None:
    folder = _snapshot(hub_id)
    return folder if folder is not None and _lacks(folder, model=model) is None else None


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _token_hint() -> str:
    return "log in with `hf auth login` (huggingface-cli login) or set HF_TOKEN"


def _copy_hint(hub_id: str) -> str:
    # huggingface_hub's cache keeps a model in HF_HUB_CACHE/models--ORG--NAME.
    return (
        f"or copy its folder models--{hub_id.replace('/', '--')} from the cache of a machine "
        f"that has it into {_cache_dir()}"
    )


def _download(hub_id: str, *, key: str, model: bool, downloading: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        folder = snapshot_download(
            hub_id, allow_patterns=MODEL_FILES if model else TOKENIZER_FILES,
            ignore_patterns=IGNORED,
        )  # fmt: skip
    except GatedRepoError as e:
        raise UserError(
            f"{key}: '{hub_id}' is a gated model: accept its license on "
            f"https://huggingface.co/{hub_id}, then {_token_hint()}"
        ) from e
    except RepositoryNotFoundError as e:
        raise UserError(
            f"{key}: '{hub_id}' is not a model on the Hugging Face Hub (or a private one: "
            f"{_token_hint()}); or give a local folder"
        ) from e
    except RevisionNotFoundError as e:
        raise UserError(f"{key}: '{hub_id}' has no such revision on the Hub") from e
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        # No connection (LocalEntryNotFoundError then says the network is unreachable), or the
        # Hub refused: the cache cannot be filled from here.
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if downloading:  # `fsdprun download` itself: what to change on this machine
            from huggingface_hub import constants

            raise UserError(
                f"'{hub_id}': cannot download from the Hugging Face Hub at {constants.ENDPOINT} "
                f"({reason}); run this where the Hub is reachable (HF_ENDPOINT, HTTPS_PROXY), "
                f"{_copy_hint(hub_id)}"
            ) from e
        raise UserError(
            f"{key}: cannot download '{hub_id}' from the Hugging Face Hub ({reason}); download it "
            f"where there is a network (`fsdprun download {hub_id}`) into the same cache "
            f"({_cache_dir()}), then set HF_HUB_OFFLINE=1"
        ) from e
    return Path(folder)


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_folder(
    hub_id: str, *, key: str, mode: str = "cache", wait_s: float = 600, downloading: bool = False
) -> Path:
    """The local snapshot folder of a Hub id, by `mode` (see the module docstring).

    Args:
        key: the recipe key that names it, for the messages.
        wait_s: how long `wait` waits for the node's local rank 0 to fill the cache.
        downloading: the caller is `fsdprun download`, so a message names what to change here
            (HF_HUB_OFFLINE, the network), not that command again.

    Raises:
        UserError: not cached where nothing may be downloaded (offline, or `cache`), gated,
            unknown, or the Hub unreachable; one line naming the fix.
    """
    try:
        import huggingface_hub  # noqa: F401
    except ImportError as e:
        raise UserError(
            f"{key}: '{hub_id}' is a Hugging Face Hub id, which needs huggingface_hub: pip "
            "install 'fsdprun[hf]'; or give a local folder"
        ) from e
    model = key == "model.hf_path"
    folder = _cached(hub_id, model=model)
    if folder is not None:
        return folder
    if mode == "wait":
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            time.sleep(WAIT_POLL_S)
            folder = _cached(hub_id, model=model)
            if folder is not None:
                return folder
        raise UserError(
            f"{key}: '{hub_id}' did not appear in the Hugging Face cache ({_cache_dir()}) within "
            f"{wait_s:g} s (local rank 0 downloads it); `fsdprun download {hub_id}` first"
        )
    if mode == "download" and not _offline():
        return _download(hub_id, key=key, model=model, downloading=downloading)
    if downloading:  # and offline
        raise UserError(
            f"'{hub_id}': not in the Hugging Face cache ({_cache_dir()}), and HF_HUB_OFFLINE is "
            "set, which forbids downloading: run this again without it (unset HF_HUB_OFFLINE) "
            f"where the Hub is reachable, {_copy_hint(hub_id)}"
        )
    if _offline():
        # Unsetting it helps only a command that downloads; `config` and `plan` never do.
        here = "unset HF_HUB_OFFLINE to download it here, or " if mode == "download" else ""
        fix = (
            f"{here}run `fsdprun download {hub_id}` without HF_HUB_OFFLINE where the Hub is "
            "reachable, into this cache"
        )
        why = "and HF_HUB_OFFLINE is set"
    else:
        fix = f"run `fsdprun download {hub_id}` (with a network)"
        why = "and this command never downloads"
    partial = _snapshot(hub_id)
    if partial is not None:
        # A download cut short, or one that asked for other files (the tokenizer's only).
        raise UserError(
            f"{key}: the cached snapshot of {hub_id} has no {_lacks(partial, model=model)} "
            f"({partial}) {why}; {fix}, to fetch them, or give a local folder"
        )
    raise UserError(
        f"{key}: '{hub_id}' is no folder here and not in the Hugging Face cache "
        f"({_cache_dir()}) {why}; {fix}, or give a local folder"
    )


def hub_mode_of_worker(env: dict[str, str] | os._Environ) -> str:
    """Under an external launcher: local rank 0 of each node downloads, the others wait."""
    return "download" if env.get("LOCAL_RANK", "0") == "0" else "wait"
