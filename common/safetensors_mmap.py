"""Zero-copy, memory-mapped reading of safetensors files.

We parse the header ourselves (8-byte little-endian length, then JSON) so a corrupt file fails
with an error naming it, and map the data copy-on-write: tensors are views into the page cache,
only the pages of tensors actually touched are read, and nothing is ever written back. Processes
mapping one file share those pages: a weight used as stored costs a host one copy however many
processes hold it. A weight that is converted or repacked is read once and then `release`d: its
pages leave this process (they stay in the page cache), so a load's peak is the copies it keeps,
not those copies plus every page they were made from.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from common.errors import CheckpointError
from common.safetensors_header import read_header

DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,  # FP8 checkpoints (DeepSeek-V3, Qwen3 FP8), block-scaled
}


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


class SafetensorsFile:
    """One safetensors file: its header on open, tensor views on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tensors, self.metadata = _read_header(path)
        self._mmap: mmap.mmap | None = None
        self._base = 0  # the mapping's address once mapped

    def _mapped(self) -> mmap.mmap:
        if self._mmap is None:
            with open(self.path, "rb") as f:
                # ACCESS_COPY makes the buffer writable (torch.frombuffer warns on read-only
                # buffers) while guaranteeing the checkpoint on disk is never modified.
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self._base = torch.frombuffer(self._mmap, dtype=torch.uint8, count=1).data_ptr()
        return self._mmap

    def get(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        flat = torch.frombuffer(
            self._mapped(),
            dtype=info.dtype,
            count=info.nbytes // info.dtype.itemsize,
            offset=info.start,
        )
        return flat.view(info.shape)

    def joined(self, names: Sequence[str]) -> torch.Tensor | None:
        """The tensors `names` stacked along their first dimension as ONE view of the file, when
        the file stores them back to back with one dtype and the same trailing shape (a Qwen
        expert's gate_proj then up_proj); None otherwise, where only a copy could join them."""
        infos = [self.tensors[n] for n in names]
        first = infos[0]
        for before, after in zip(infos, infos[1:]):
            if (
                after.start != before.start + before.nbytes
                or after.dtype != first.dtype
                or after.shape[1:] != first.shape[1:]
                or not after.shape
            ):
                return None
        if not first.shape or first.nbytes == 0:
            return None
        flat = torch.frombuffer(
            self._mapped(),
            dtype=first.dtype,
            count=sum(i.nbytes for i in infos) // first.dtype.itemsize,
            offset=first.start,
        )
        return flat.view(-1, *first.shape[1:])

    def release(self, view: torch.Tensor) -> bool:
        """Drop this process's pages of `view` (a view of this file that nothing reads any more:
        it was converted or repacked into a copy); False when `view` is not a view of this file.

        Only pages wholly inside the view go, so a neighbour's partial page stays. Safe even if
        something did read them again: the mapping is private and never written, so a dropped
        page is read back from the page cache (madvise MADV_DONTNEED on a private file mapping)."""
        span = self._span(view)
        if span is None or self._mmap is None:
            return False
        first = -(-span[0] // mmap.PAGESIZE) * mmap.PAGESIZE
        last = span[1] // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first and hasattr(mmap, "MADV_DONTNEED"):  # Linux, macOS
            self._mmap.madvise(mmap.MADV_DONTNEED, first, last - first)
        return True

    def contains(self, view: torch.Tensor) -> bool:
        """Whether `view` is a contiguous view of this file's mapping."""
        return self._span(view) is not None

    def _span(self, view: torch.Tensor) -> tuple[int, int] | None:
        """[start, end) of `view` in the file, when it is a contiguous view of the mapping."""
        if self._mmap is None or view.numel() == 0 or not view.is_contiguous():
            return None
        start = view.data_ptr() - self._base
        end = start + view.numel() * view.element_size()
        return (start, end) if 0 <= start and end <= len(self._mmap) else None


def _read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    header, data_start, size = read_header(path)
    metadata = header.pop("__metadata__", None) or {}
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"corrupt safetensors header entry ({e!r})", file=str(path), tensor=name
            ) from e
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * dtype.itemsize or begin < 0 or data_start + end > size:
            raise CheckpointError(
                f"corrupt safetensors header: offsets [{begin}, {end}) do not fit shape {list(shape)} "
                f"of {entry['dtype']} inside a file of {size} bytes",
                file=str(path),
                tensor=name,
            )
        tensors[name] = TensorInfo(dtype, shape, data_start + begin, end - begin)
    return tensors, metadata
