"""A fake compute device for the staging logic (common/staging.py) where no GPU is."""

from __future__ import annotations

import torch


class FakeDevice:
    """DeviceOps whose "device" is host memory, but whose copies behave as a GPU's: a copy to the
    host lands only at the synchronize, and a copy to the device reads its source then too
    (a source overwritten before the synchronize is an error, as it would corrupt a GPU's)."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []  # what `pinned` handed out
        self.log: list[tuple] = []  # ("h2d" | "d2h", shape, dtype) and ("sync",)
        self._h2d: list[tuple[torch.Tensor, torch.Tensor]] = []  # (source, its bytes at enqueue)
        self._d2h: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, value)

    def pinned(self, nbytes: int) -> torch.Tensor:
        buffer = torch.full((nbytes,), 0xAB, dtype=torch.uint8)  # garbage until written
        self.buffers.append(buffer)
        return buffer

    def _is_pinned(self, t: torch.Tensor) -> bool:
        ptr = t.untyped_storage().data_ptr()
        return any(b.untyped_storage().data_ptr() == ptr for b in self.buffers)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        assert self._is_pinned(host), "a non-blocking copy from pageable memory"
        self.log.append(("h2d", tuple(host.shape), host.dtype))
        self._h2d.append((host, host.clone()))
        return host.clone()

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        assert self._is_pinned(dst), "a non-blocking copy into pageable memory"
        assert (dst.shape, dst.dtype) == (src.shape, src.dtype)
        self.log.append(("d2h", tuple(src.shape), src.dtype))
        self._d2h.append((dst, src.clone()))

    def synchronize(self) -> None:
        for source, at_enqueue in self._h2d:
            assert torch.equal(source, at_enqueue), "an input buffer reused while copying"
        for dst, value in self._d2h:
            dst.copy_(value)
        self._h2d.clear()
        self._d2h.clear()
        self.log.append(("sync",))

    def count(self, kind: str) -> int:
        return sum(1 for entry in self.log if entry[0] == kind)
