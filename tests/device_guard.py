"""A guard that catches, on a CPU-only machine, the device mistakes that crash or slow a GPU run.

On CPU every tensor lands on the CPU whatever the code says, so a factory call that forgets its
device, or a `.tolist()` per sequence, goes unnoticed until the engine meets a GPU. This
`TorchFunctionMode` watches what the code *asks for* instead of where tensors end up:

- **implicit devices**: a factory call (`torch.tensor`, `zeros`, `arange`, ...) that names no
  device would put its tensor on the CPU next to CUDA tensors; one that names a device other
  than the engine's is allowed only as a pinned host staging buffer;
- **device→host synchronisations**: `.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `bool(t)`,
  `int(t)`, `float(t)`, `.to("cpu")` each stall the host until the device has caught up. The
  engine keeps host-side metadata in Python/numpy, so every such call on a tensor is one;
- **host→device transfers**: a tensor made from host data (`torch.tensor(list)`,
  `torch.as_tensor(ndarray)`, a host tensor's `.to(device)`) is one copy to the device; a step should make a fixed handful,
  not one per sequence or per layer.

`StepGuard.watch(engine)` wraps `engine.step` and records these per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode, resolve_name

FACTORIES = {
    "torch.tensor", "torch.as_tensor", "torch.zeros", "torch.ones", "torch.empty", "torch.full",
    "torch.arange", "torch.rand", "torch.randn", "torch.randint", "torch.linspace", "torch.eye",
    "torch.empty_strided", "torch.scalar_tensor",
}
FROM_HOST_DATA = {"torch.tensor", "torch.as_tensor"}
SYNCS = {
    "torch.Tensor.item", "torch.Tensor.tolist", "torch.Tensor.cpu", "torch.Tensor.numpy",
    "torch.Tensor.__bool__", "torch.Tensor.__int__", "torch.Tensor.__float__", "torch.Tensor.__index__",
}


@dataclass
class StepRecord:
    implicit_device: list[str] = field(default_factory=list)  # factory calls that named no device
    wrong_device: list[str] = field(default_factory=list)
    syncs: list[str] = field(default_factory=list)
    transfers: list[str] = field(default_factory=list)


class _Mode(TorchFunctionMode):
    def __init__(self, device: torch.device, record: StepRecord):
        super().__init__()
        self.device = device
        self.record = record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = resolve_name(func) or repr(func)
        if name in FACTORIES:
            self._check_factory(name, kwargs)
        elif name in SYNCS:
            self.record.syncs.append(name)
        elif name == "torch.Tensor.to":
            self._check_move(args, kwargs)
        return func(*args, **kwargs)

    def _check_factory(self, name: str, kwargs: dict) -> None:
        if name in FROM_HOST_DATA:
            self.record.transfers.append(name)
        device = kwargs.get("device")
        if device is None:
            self.record.implicit_device.append(name)
            return
        device = torch.device(device)
        if device.type != self.device.type and not kwargs.get("pin_memory", False):
            self.record.wrong_device.append(f"{name}(device={device})")


    def _check_move(self, args: tuple, kwargs: dict) -> None:
        target = kwargs.get("device")
        for arg in args[1:]:
            if isinstance(arg, (str, torch.device)):
                target = arg
        if target is None:
            return
        source, target = args[0].device.type, torch.device(target).type
        if target == "cpu" and source == self.device.type:
            self.record.syncs.append("torch.Tensor.to(cpu)")
        elif source == "cpu" and target != "cpu":
            self.record.transfers.append("torch.Tensor.to")


class StepGuard:
    """Records, for every `step()` of the watched engines, what the step asked of the device."""

    def __init__(self) -> None:
        self.steps: list[StepRecord] = []

    def watch(self, engine) -> None:
        original = engine.step
        device = engine.device

        def guarded_step():
            record = StepRecord()
            self.steps.append(record)
            with _Mode(device, record):
                return original()

        engine.step = guarded_step
