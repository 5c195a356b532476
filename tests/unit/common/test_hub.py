"""common/hub.py: a Hugging Face id downloads only the files the mesh reads (no network)."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub.utils import filter_repo_objects

from common.errors import CheckpointError
from common.hub import resolve_checkpoint, wanted_files

# A repository as published: the checkpoint, and the same weights again in other formats.
LISTING = [
    ".gitattributes",
    "README.md",
    "config.json",
    "generation_config.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "pytorch_model-00001-of-00002.bin",
    "pytorch_model.bin.index.json",
    "consolidated.00.pt",
    "model-q4_k_m.gguf",
    "onnx/model.onnx",
    "onnx/model.safetensors",
    "original/model.safetensors",
    "metal/model.bin",
]
READ = {
    "config.json",
    "generation_config.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
}


def test_only_the_files_the_mesh_reads_are_wanted() -> None:
    assert set(wanted_files(LISTING)) == READ


def test_a_model_id_downloads_only_those_files(tmp_path: Path, monkeypatch) -> None:
    calls = []

    def fake_download(repo_id, revision=None, allow_patterns=None, ignore_patterns=None):
        """What snapshot_download does with a listing: huggingface_hub's own filter."""
        calls.append((repo_id, revision))
        kept = filter_repo_objects(
            LISTING, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns
        )
        for name in kept:
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text("x")
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert resolve_checkpoint("org/name@v1") == tmp_path
    assert calls == [("org/name", "v1")]
    fetched = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()}
    assert fetched == READ
    assert not any(name.endswith((".bin", ".pt", ".gguf", ".onnx", ".model")) for name in fetched)


def test_a_failed_download_is_a_checkpoint_error_naming_the_id(monkeypatch) -> None:
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(*args, **kwargs):
        raise LocalEntryNotFoundError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(CheckpointError, match="'org/name' is neither a directory"):
        resolve_checkpoint("org/name")


def test_a_directory_is_taken_as_it_is(tmp_path: Path) -> None:
    assert resolve_checkpoint(tmp_path) == tmp_path
    assert resolve_checkpoint(str(tmp_path)) == tmp_path
