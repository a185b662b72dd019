"""Counting the ATen ops a region runs, by name: what tests of recomputation compare."""

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class OpCalls(TorchDispatchMode):
    """`with OpCalls() as ops: ...` then `ops.calls["mm"]`: how many times each op ran inside."""

    def __init__(self):
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
