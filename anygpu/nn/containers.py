"""Containers: ``Sequential``, ``ModuleList`` and ``ModuleDict`` (PyTorch's behaviour and
state_dict keys: submodules are named by position or by key)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterable, Iterator, Mapping

from anygpu.nn.module import Module, _addindent


class _ModuleSequence(Module):
    """What Sequential and ModuleList share: submodules addressed by position."""

    def _index(self, idx: int) -> str:
        n = len(self._modules)
        if not -n <= idx < n:
            raise IndexError(f"index {idx} is out of range")
        return list(self._modules)[idx % n]

    def _renumber(self, items: list[Module]) -> None:
        """Name ``items`` 0..n-1, as PyTorch does after a deletion or insertion."""
        self._modules.clear()
        for i, m in enumerate(items):
            self.add_module(str(i), m)

    def __setitem__(self, idx: int, module: Module) -> None:
        setattr(self, self._index(idx), module)

    def __delitem__(self, idx: int | slice) -> None:
        keys = list(self._modules)[idx] if isinstance(idx, slice) else [self._index(idx)]
        for k in keys:
            del self._modules[k]
        self._renumber(list(self._modules.values()))

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())

    def append(self, module: Module) -> Any:
        self.add_module(str(len(self)), module)
        return self

    def extend(self, modules: Iterable[Module]) -> Any:
        for m in modules:
            self.append(m)
        return self


class Sequential(_ModuleSequence):
    """Modules applied in order; also built from an OrderedDict of named modules.

    >>> import anygpu as ag
    >>> from anygpu import nn
    >>> m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    >>> m(ag.randn(5, 3)).shape, len(m), type(m[1]).__name__
    ((5, 1), 3, 'ReLU')
    """

    def __init__(self, *args: Any) -> None:
        super().__init__()
        if len(args) == 1 and isinstance(args[0], OrderedDict):
            for key, module in args[0].items():
                self.add_module(key, module)
        else:
            for idx, module in enumerate(args):
                self.add_module(str(idx), module)

    def __getitem__(self, idx: int | slice) -> Any:
        if isinstance(idx, slice):
            return type(self)(OrderedDict(list(self._modules.items())[idx]))
        return self._modules[self._index(idx)]

    def insert(self, index: int, module: Module) -> "Sequential":
        n = len(self._modules)
        if not -n <= index <= n:
            raise IndexError(f"index {index} is out of range")
        items = list(self._modules.values())
        items.insert(index % (n + 1) if index < 0 else index, module)
        self._renumber(items)
        return self

    def forward(self, input: Any) -> Any:
        for module in self:
            input = module(input)
        return input


class ModuleList(_ModuleSequence):
    """A list of modules whose parameters are registered (``"0.weight"``, ``"1.weight"``, ...).

    >>> from anygpu import nn
    >>> layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
    >>> len(layers), len(list(layers.parameters()))
    (3, 6)
    """

    def __init__(self, modules: Iterable[Module] | None = None) -> None:
        super().__init__()
        if modules is not None:
            self.extend(modules)

    def __getitem__(self, idx: int | slice) -> Any:
        if isinstance(idx, slice):
            return type(self)(list(self._modules.values())[idx])
        return self._modules[self._index(idx)]

    def __iadd__(self, modules: Iterable[Module]) -> "ModuleList":
        return self.extend(modules)

    def insert(self, index: int, module: Module) -> None:
        items = list(self._modules.values())
        items.insert(index, module)
        self._renumber(items)

    def _child_lines(self) -> list[str]:
        # runs of identical modules print once, as "(0-2): 3 x Linear(...)" (PyTorch's form)
        reprs = [repr(m) for m in self._modules.values()]
        lines: list[str] = []
        start = 0
        while start < len(reprs):
            end = start
            while end + 1 < len(reprs) and reprs[end + 1] == reprs[start]:
                end += 1
            body = _addindent(reprs[start], 2)
            if end == start:
                lines.append(f"({start}): {body}")
            else:
                lines.append(f"({start}-{end}): {end - start + 1} x {body}")
            start = end + 1
        return lines

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("ModuleList has no forward; iterate over it instead")


class ModuleDict(Module):
    """A dict of modules whose parameters are registered under their keys.

    >>> from anygpu import nn
    >>> heads = nn.ModuleDict({"a": nn.Linear(2, 3), "b": nn.Linear(2, 1)})
    >>> list(heads.state_dict())
    ['a.weight', 'a.bias', 'b.weight', 'b.bias']
    """

    def __init__(self, modules: Mapping[str, Module] | Iterable[tuple[str, Module]] | None = None
                 ) -> None:
        super().__init__()
        if modules is not None:
            self.update(modules)

    def __getitem__(self, key: str) -> Module:
        return self._modules[key]

    def __setitem__(self, key: str, module: Module) -> None:
        self.add_module(key, module)

    def __delitem__(self, key: str) -> None:
        del self._modules[key]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[str]:
        return iter(self._modules)

    def __contains__(self, key: str) -> bool:
        return key in self._modules

    def clear(self) -> None:
        self._modules.clear()

    def pop(self, key: str) -> Module:
        v = self[key]
        del self[key]
        return v

    def keys(self) -> Iterable[str]:
        return self._modules.keys()

    def items(self) -> Iterable[tuple[str, Module]]:
        return self._modules.items()

    def values(self) -> Iterable[Module]:
        return self._modules.values()

    def update(self, modules: Mapping[str, Module] | Iterable[tuple[str, Module]]) -> None:
        pairs = modules.items() if isinstance(modules, Mapping) else modules
        for key, m in pairs:
            self[key] = m

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("ModuleDict has no forward; index it instead")


__all__ = ["Sequential", "ModuleList", "ModuleDict"]
