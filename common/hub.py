"""`--checkpoint` as a directory or a Hugging Face model id (`org/name`, optionally `@revision`).

An id is resolved through huggingface_hub's cache first, so a model downloaded once (or copied into
HF_HOME / HF_HUB_CACHE) serves without network; HF_HUB_OFFLINE=1 forbids downloads altogether.
Every service and command that takes --checkpoint resolves it here, through the settings type
`CheckpointPath`.

A download fetches only the files the mesh reads (`ALLOW_PATTERNS`): repositories often publish the
same weights again as PyTorch .bin/.pt, GGUF or ONNX files, which would multiply the download.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

from pydantic import BeforeValidator

from common.errors import CheckpointError

# org/name[@revision]: what the Hub accepts as a model id, and never an existing relative path.
_MODEL_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")
# What the services read from a checkpoint: weights (common/checkpoint.py), config
# (common/arch), tokenizer and chat template (common/tokenizer.py, chat_template.py). Also the
# few-kB files transformers reads beside them (generation_config.json, special tokens), so that
# a snapshot is a whole transformers checkpoint for a parity check. fnmatch patterns against
# paths in the repository, where `*` crosses folders: IGNORE_PATTERNS keeps to the top folder,
# the checkpoint itself (gpt-oss publishes its weights again under original/ and metal/).
ALLOW_PATTERNS = (
    "*.safetensors",
    "model.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
IGNORE_PATTERNS = ("*/*",)


def wanted_files(paths: list[str]) -> list[str]:
    """The files of a repository listing that a download fetches (huggingface_hub's own filter)."""
    from huggingface_hub.utils import filter_repo_objects

    return list(
        filter_repo_objects(
            paths, allow_patterns=list(ALLOW_PATTERNS), ignore_patterns=list(IGNORE_PATTERNS)
        )
    )


def resolve_checkpoint(value: str | Path | None) -> Path | None:
    """A local directory as given; a model id as its snapshot directory in the Hub cache."""
    if value is None or isinstance(value, Path) and value.exists():
        return value
    text = str(value)
    if Path(text).exists() or not _MODEL_ID.fullmatch(text):
        return Path(text)  # a missing directory is reported by the checkpoint loader, by its path
    repo_id, _, revision = text.partition("@")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision or None,
                allow_patterns=list(ALLOW_PATTERNS),
                ignore_patterns=list(IGNORE_PATTERNS),
            )
        )
    except LocalEntryNotFoundError:
        raise CheckpointError(
            f"{text!r} is neither a directory nor a model in the Hugging Face cache, and it "
            "cannot be downloaded (offline: HF_HUB_OFFLINE=1, or no network)"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise CheckpointError(f"cannot fetch {text!r} from the Hugging Face Hub ({e})") from None


CheckpointPath = Annotated[Path, BeforeValidator(resolve_checkpoint)]
