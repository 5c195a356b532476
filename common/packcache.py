"""Repacked weights kept in files that every process serving a checkpoint maps: one copy a host.

Where a weight is computed in a layout its checkpoint does not store (bfloat16 in moe-mesh's
panels, common/bf16.py), each process used to hold its own repacked copy: two replicas of one
expert group on a host held the group's weights twice. Here a weight set is packed once into a
file under $MOE_MESH_CACHE_DIR/packed/, and every process maps that file as the safetensors
checkpoint itself is mapped (private, never written), so they share its pages in the page cache,
and a restart maps it again instead of repacking.

A file holds one entry (an expert's gate|up and down) and, in its safetensors metadata, the key
it was built for (the checkpoint's content and the layout's version) and each tensor's CRC-32.
Before use a file's key and checksums are checked: a file built from another version of the
checkpoint (stale) or damaged (corrupt, truncated) is logged, rebuilt, and never used. Builders
of one checkpoint's directory take turns (an flock on it), so replicas starting together pack
once and map the same file. Where the cache cannot be written (read-only or full disk) the
weights stay in process memory, as without a cache, and that is logged.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import mmap
import os
import resource
import shutil
import struct
import tempfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from common import kernel_build
from common.errors import CheckpointError
from common.safetensors_mmap import DTYPES, SafetensorsFile

log = logging.getLogger(__name__)

FORMAT = "moe-mesh packed weights 1"
Sizes = dict[str, tuple[int, torch.dtype]]  # an entry's tensors: elements and dtype each
_CODES = {dtype: code for code, dtype in DTYPES.items()}  # torch dtype -> safetensors'


def enabled() -> bool:
    """MOE_MESH_PACK_CACHE: `on` (default) packs into files under the cache directory, `off`
    keeps each process's packed weights in its own memory."""
    return os.environ.get("MOE_MESH_PACK_CACHE", "on").lower() not in ("off", "0", "false", "no")


@functools.cache
def raise_open_files_limit() -> None:
    """Each mapped file holds a descriptor (Python's mmap keeps a copy of it), one an expert: a
    process holding a large model's experts needs thousands, past the usual soft limit of 1,024.
    Raised to the hard limit once, as vLLM does at start-up."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class PackCache:
    """The packed-weight files of one checkpoint directory, valid for `key` (its content and
    the layout): $MOE_MESH_CACHE_DIR/packed/<hash of the checkpoint's path>/."""

    def __init__(self, checkpoint: Path, key: str) -> None:
        raise_open_files_limit()
        self.checkpoint, self.key = checkpoint.resolve(), key
        self.directory = directory(checkpoint)
        self._files: list[SafetensorsFile] = []  # mapped: their tensors are views of them

    def get(
        self, name: str, sizes: Sizes, fill: Callable[[dict[str, torch.Tensor]], None]
    ) -> dict[str, torch.Tensor]:
        """Entry `name`: flat tensors of `sizes` (elements and dtype each), as views of its file.
        Where no valid file exists, `fill` writes them into a new one in place (it packs straight
        into the file's pages: a build holds no second copy). On a cache that cannot be written,
        `fill` fills tensors of this process's own."""
        path = self.directory / f"{name}.safetensors"
        if (found := self._load(path)) is not None:
            return found
        try:
            if not self.directory.exists():
                self._start()
            turn = self._turn()
        except OSError as e:
            return self._in_memory(path, e, sizes, fill)
        with turn:
            if (found := self._load(path, quiet=True)) is not None:  # built while we waited
                return found
            for left in self.directory.glob("*.tmp"):  # a builder that died: none holds the turn
                left.unlink(missing_ok=True)
            try:
                self._write(path, sizes, fill)
            except OSError as e:
                return self._in_memory(path, e, sizes, fill)
        if (found := self._load(path)) is None:
            raise CheckpointError(
                "packed-weight cache file unreadable once written", file=str(path)
            )
        return found

    @staticmethod
    def _in_memory(
        path: Path, error: OSError, sizes: Sizes, fill: Callable
    ) -> dict[str, torch.Tensor]:
        log.warning("packed-weight cache %s unusable (%s): weights kept in memory", path, error)
        return in_memory(sizes, fill)

    def _load(self, path: Path, quiet: bool = False) -> dict[str, torch.Tensor] | None:
        """The file's tensors when its key and every checksum hold; None (logged unless `quiet`
        or missing) otherwise."""
        if not path.exists():
            return None
        try:
            file = SafetensorsFile(path)
            problem = self._problem(file)
        except (CheckpointError, OSError, ValueError) as e:
            problem = f"corrupt ({e})"
        if problem is not None:
            if not quiet:
                log.warning("packed-weight cache file %s is %s: rebuilding it", path, problem)
            return None
        self._files.append(file)
        return {name: file.get(name) for name in file.tensors}

    def _problem(self, file: SafetensorsFile) -> str | None:
        meta = file.metadata
        if meta.get("format") != FORMAT or meta.get("key") != self.key:
            return (
                f"stale (built for {meta.get('key')!r} in {meta.get('format')!r}, "
                f"this checkpoint and layout are {self.key!r})"
            )
        if sorted(file.tensors) != sorted(
            n[len("crc32.") :] for n in meta if n.startswith("crc32.")
        ):
            return "corrupt (its checksums do not list its tensors)"
        for name in file.tensors:
            if f"{checksum(file.get(name)):08x}" != meta[f"crc32.{name}"]:
                return f"corrupt (tensor {name!r} does not match its CRC-32)"
        return None

    def _write(self, path: Path, sizes: Sizes, fill: Callable) -> None:
        """A safetensors file of `sizes` tensors filled in place by `fill`, its checksums written
        into the header afterwards (reserved at their final width), renamed into place whole."""
        entries, at = {}, 0
        for n, (count, dtype) in sizes.items():
            nbytes = count * dtype.itemsize
            entries[n] = {
                "dtype": _CODES[dtype],
                "shape": [count],
                "data_offsets": [at, at + nbytes],
            }
            at += nbytes

        def header(sums: dict[str, int]) -> bytes:
            meta = {"format": FORMAT, "key": self.key}
            meta.update({f"crc32.{n}": f"{sums.get(n, 0):08x}" for n in sizes})
            text = json.dumps({"__metadata__": meta, **entries}).encode()
            return text + b" " * (-(8 + len(text)) % 64)  # tensors start on a cache line

        start = 8 + len(header({}))
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        try:
            with os.fdopen(fd, "r+b") as f:
                # Space taken now: a write through the mapping to a full disk is SIGBUS, not OSError.
                os.posix_fallocate(f.fileno(), 0, start + at)
                with mmap.mmap(f.fileno(), start + at) as mapped:
                    views = {
                        n: torch.frombuffer(
                            mapped,
                            dtype=sizes[n][1],
                            count=sizes[n][0],
                            offset=start + e["data_offsets"][0],
                        )
                        for n, e in entries.items()
                    }
                    fill(views)
                    sums = {n: checksum(v) for n, v in views.items()}
                    del views  # the mapping closes only once nothing views it
                f.seek(0)
                f.write(struct.pack("<Q", start - 8) + header(sums))
            os.replace(tmp, path)  # whole or not at all
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        log.info("packed %s into %s", ", ".join(sizes), path)

    def _start(self) -> None:
        """Makes this checkpoint's directory, naming the checkpoint in it, and removes those of
        checkpoints that no longer exist (tests and benches make many): a file in use stays
        mapped until its process ends."""
        root = self.directory.parent
        for other in root.glob("*/checkpoint") if root.exists() else ():
            with contextlib.suppress(OSError):
                if not Path(other.read_text()).exists():
                    shutil.rmtree(other.parent, ignore_errors=True)
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "checkpoint").write_text(str(self.checkpoint))

    def _turn(self) -> contextlib.AbstractContextManager[None]:
        """Exclusive among the processes building into this directory (opened here, so that a
        directory that cannot be opened fails before anything is built)."""
        fd = os.open(self.directory, os.O_RDONLY)

        @contextlib.contextmanager
        def held() -> Iterator[None]:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # releases the lock

        return held()


def in_memory(
    sizes: Sizes, fill: Callable[[dict[str, torch.Tensor]], None]
) -> dict[str, torch.Tensor]:
    """An entry's tensors filled in this process's own memory: without a cache."""
    tensors = {n: torch.empty(count, dtype=dtype) for n, (count, dtype) in sizes.items()}
    fill(tensors)
    return tensors


def checksum(t: torch.Tensor) -> int:
    """CRC-32 of a contiguous tensor's bytes, read in place (zlib's runs at ~3 GB/s here)."""
    data = t.contiguous().view(-1).view(torch.uint8).numpy()
    return zlib.crc32(memoryview(data))


def directory(checkpoint: Path) -> Path:
    """Where the packed files of the checkpoint at `checkpoint` live."""
    name = hashlib.sha256(str(checkpoint.resolve()).encode()).hexdigest()[:16]
    return kernel_build.cache_dir() / "packed" / name  # beside the built kernels: one setting
