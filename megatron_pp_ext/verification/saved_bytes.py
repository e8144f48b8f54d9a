"""Bytes of activations autograd saves, counted as a run goes (the peak of what the schedule keeps alive)."""

from __future__ import annotations

from typing import Any


class SavedBytesMeter:
    """Live bytes of the tensors autograd saves for backward (parameters excluded), and their peak.

    A saved tensor counts from its pack until autograd drops it (after its backward); a storage saved
    several times counts once. Measures any forward-backward function alike (megatron's or ours)."""

    def __init__(self, param_storages: set[int]) -> None:
        self.params = param_storages
        self.refs: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self._hooks: Any = None

    def _pack(self, tensor: Any) -> Any:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.params or storage.nbytes() == 0:
            return tensor
        count = self.refs.get(ptr, 0)
        self.refs[ptr] = count + 1
        if count == 0:
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        return _Saved(self, tensor, ptr, storage.nbytes())

    def _release(self, ptr: int, nbytes: int) -> None:
        count = self.refs.pop(ptr) - 1
        if count:
            self.refs[ptr] = count
        else:
            self.live -= nbytes

    @staticmethod
    def _unpack(packed: Any) -> Any:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def __enter__(self) -> SavedBytesMeter:
        import torch

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


class _Saved:
    __slots__ = ("meter", "nbytes", "ptr", "tensor")

    def __init__(self, meter: SavedBytesMeter, tensor: Any, ptr: int, nbytes: int) -> None:
        self.meter, self.tensor, self.ptr, self.nbytes = meter, tensor, ptr, nbytes

    def __del__(self) -> None:
        self.meter._release(self.ptr, self.nbytes)
