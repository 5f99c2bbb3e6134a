"""``Module`` and ``Parameter``, with PyTorch's names and state_dict keys.

Parameters, buffers and submodules assigned as attributes register themselves, so a model written
for ``torch.nn`` ports line by line and its checkpoints load with the same keys:

>>> import anygpu as ag
>>> from anygpu import nn
>>> class Net(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.fc = nn.Linear(4, 2)
...         self.register_buffer("scale", ag.ones(2))
...     def forward(self, x):
...         return self.fc(x) * self.scale
>>> list(Net().state_dict())
['scale', 'fc.weight', 'fc.bias']
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import numpy as np

from anygpu import dtype as dt
from anygpu.runtime.registry import canonical
from anygpu.tensor import Tensor, parse_to, realize, zeros_like


class Parameter(Tensor):
    """A Tensor that a Module registers as a parameter; ``requires_grad`` is True by default.

    >>> import anygpu as ag
    >>> p = Parameter(ag.zeros(3))
    >>> p.requires_grad, p.shape
    (True, (3,))
    """

    __slots__ = ()

    def __init__(self, data: Any = None, requires_grad: bool = True):
        if data is None:
            data = np.zeros((0,), np.float32)
        lazy = data.lazy if isinstance(data, Tensor) else Tensor(data).lazy
        super().__init__(lazy, requires_grad=requires_grad)

    def __repr__(self) -> str:
        return "Parameter containing:\n" + super().__repr__()


class _IncompatibleKeys(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]

    def __repr__(self) -> str:
        if not self.missing_keys and not self.unexpected_keys:
            return "<All keys matched successfully>"
        return (f"_IncompatibleKeys(missing_keys={self.missing_keys}, "
                f"unexpected_keys={self.unexpected_keys})")


def _shape_text(shape: tuple[int, ...]) -> str:
    return f"torch.Size({list(shape)})"


def _addindent(text: str, spaces: int) -> str:
    lines = text.split("\n")
    if len(lines) == 1:
        return text
    return lines[0] + "\n" + "\n".join(" " * spaces + line for line in lines[1:])


def _detached(t: Tensor) -> Tensor:
    """``t.detach()``; for a tensor that is not a buffer of its own (an optimizer keeps
    parameters as views of one flat buffer) a node over it, so that reading the result does
    not turn the parameter itself into a separate copy."""
    return t.detach() if t.lazy.realized else Tensor(t.lazy.contiguous())


class Module:
    """Base class of every layer: subclass it, assign layers and parameters in ``__init__`` and
    compute in ``forward``. Calling the module runs ``forward``.

    >>> import anygpu as ag
    >>> from anygpu import nn
    >>> m = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    >>> m(ag.randn(2, 3)).shape
    (2, 4)
    >>> [name for name, _ in m.named_parameters()]
    ['0.weight', '0.bias']
    """

    training: bool
    _optional_keys: tuple[str, ...] = ()  # local state keys a checkpoint may leave out

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args or kwargs:
            raise TypeError(f"{type(self).__name__}.__init__() got unexpected arguments")
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_non_persistent_buffers_set", set())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_forward_pre_hooks", OrderedDict())
        object.__setattr__(self, "_forward_hooks", OrderedDict())

    forward: Callable[..., Any]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for hook in list(self._forward_pre_hooks.values()):
            res = hook(self, args)
            if res is not None:
                args = res if isinstance(res, tuple) else (res,)
        out = self.forward(*args, **kwargs)
        for hook in list(self._forward_hooks.values()):
            res = hook(self, args, out)
            if res is not None:
                out = res
        return out

    def _hook_handle(self, table: "OrderedDict[int, Any]", hook: Callable[..., Any]) -> Any:
        key = max(table, default=-1) + 1
        table[key] = hook

        class Handle:
            def remove(self) -> None:
                table.pop(key, None)

        return Handle()

    def register_forward_pre_hook(self, hook: Callable[..., Any]) -> Any:
        """``hook(module, args)`` before ``forward``; a non-None result replaces the args."""
        return self._hook_handle(self._forward_pre_hooks, hook)

    def register_forward_hook(self, hook: Callable[..., Any]) -> Any:
        """``hook(module, args, output)`` after ``forward``; a non-None result replaces it."""
        return self._hook_handle(self._forward_hooks, hook)

    # ---- registration ----------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        params = self.__dict__.get("_parameters")
        if isinstance(value, Parameter):
            if params is None:
                raise AttributeError("cannot assign parameters before Module.__init__() call")
            self._drop(name, keep=self._parameters)
            self.register_parameter(name, value)
        elif params is not None and name in params:
            if value is not None:
                raise TypeError(f"cannot assign '{type(value).__name__}' as parameter '{name}' "
                                "(anygpu.nn.Parameter or None expected)")
            self.register_parameter(name, None)
        elif isinstance(value, Module):
            if params is None:
                raise AttributeError("cannot assign module before Module.__init__() call")
            self._drop(name, keep=self._modules)
            self._modules[name] = value
        elif params is not None and name in self._modules:
            if value is not None:
                raise TypeError(f"cannot assign '{type(value).__name__}' as child module "
                                f"'{name}' (anygpu.nn.Module or None expected)")
            self._modules[name] = None
        elif params is not None and name in self._buffers:
            if value is not None and not isinstance(value, Tensor):
                raise TypeError(f"cannot assign '{type(value).__name__}' as buffer '{name}' "
                                "(anygpu.Tensor or None expected)")
            self._buffers[name] = value
        else:
            object.__setattr__(self, name, value)

    def _drop(self, name: str, keep: "OrderedDict[str, Any] | None" = None) -> None:
        """Forget ``name`` everywhere but in ``keep``, the table about to get the new value:
        a replaced parameter or submodule keeps its place (``seq[0] = m``, state_dict order)."""
        self.__dict__.pop(name, None)
        for table in (self._parameters, self._buffers, self._modules):
            if table is not keep:
                table.pop(name, None)
        self._non_persistent_buffers_set.discard(name)

    def __getattr__(self, name: str) -> Any:
        d = self.__dict__
        for table in ("_parameters", "_buffers", "_modules"):
            if table in d and name in d[table]:
                return d[table][name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __delattr__(self, name: str) -> None:
        for table in (self._parameters, self._buffers, self._modules):
            if name in table:
                del table[name]
                self._non_persistent_buffers_set.discard(name)
                return
        object.__delattr__(self, name)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self._parameters) | set(self._buffers)
                      | set(self._modules))

    @staticmethod
    def _check_name(name: str, kind: str) -> None:
        if not isinstance(name, str):
            raise TypeError(f"{kind} name should be a string, got {type(name).__name__}")
        if not name or "." in name:
            raise KeyError(f"{kind} name can't be empty or contain \".\", got {name!r}")

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        self._check_name(name, "parameter")
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(f"cannot assign '{type(param).__name__}' object to parameter "
                            f"'{name}' (anygpu.nn.Parameter or None required)")
        if name in self.__dict__ or name in self._buffers or name in self._modules:
            raise KeyError(f"attribute '{name}' already exists")
        self._parameters[name] = param

    def register_buffer(self, name: str, tensor: Tensor | None, persistent: bool = True) -> None:
        """A tensor that is state but not a parameter (running statistics, masks).
        Non-persistent buffers stay out of ``state_dict``."""
        self._check_name(name, "buffer")
        if tensor is not None and not isinstance(tensor, Tensor):
            raise TypeError(f"cannot assign '{type(tensor).__name__}' object to buffer "
                            f"'{name}' (anygpu.Tensor or None required)")
        if name in self._parameters or name in self._modules or (
                name in self.__dict__ and name not in self._buffers):
            raise KeyError(f"attribute '{name}' already exists")
        if tensor is not None:
            tensor.realize()  # state, computed once here rather than within every step using it
        self._buffers[name] = tensor
        if persistent:
            self._non_persistent_buffers_set.discard(name)
        else:
            self._non_persistent_buffers_set.add(name)

    def add_module(self, name: str, module: "Module | None") -> None:
        self._check_name(name, "module")
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"{type(module).__name__} is not a Module subclass")
        if name in self._parameters or name in self._buffers or (
                name in self.__dict__ and name not in self._modules):
            raise KeyError(f"attribute '{name}' already exists")
        self._modules[name] = module

    register_module = add_module

    def get_submodule(self, target: str) -> "Module":
        mod = self
        for part in target.split(".") if target else []:
            child = mod._modules.get(part)
            if child is None:
                raise AttributeError(f"{mod._get_name()} has no submodule `{part}`")
            mod = child
        return mod

    def get_parameter(self, target: str) -> Parameter:
        path, _, name = target.rpartition(".")
        mod = self.get_submodule(path)
        if name not in mod._parameters:
            raise AttributeError(f"{mod._get_name()} has no parameter `{name}`")
        return mod._parameters[name]

    # ---- iteration -------------------------------------------------------------------------
    def named_modules(self, memo: set[int] | None = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[tuple[str, "Module"]]:
        if memo is None:
            memo = set()
        if remove_duplicate:
            if id(self) in memo:
                return
            memo.add(id(self))
        yield prefix, self
        for name, mod in self._modules.items():
            if mod is None:
                continue
            sub = prefix + ("." if prefix else "") + name
            yield from mod.named_modules(memo, sub, remove_duplicate)

    def modules(self) -> Iterator["Module"]:
        for _, m in self.named_modules():
            yield m

    def named_children(self) -> Iterator[tuple[str, "Module"]]:
        seen: set[int] = set()
        for name, mod in self._modules.items():
            if mod is not None and id(mod) not in seen:
                seen.add(id(mod))
                yield name, mod

    def children(self) -> Iterator["Module"]:
        for _, m in self.named_children():
            yield m

    def _named_members(self, table: str, prefix: str, recurse: bool,
                       remove_duplicate: bool = True) -> Iterator[tuple[str, Tensor]]:
        seen: set[int] = set()
        mods = self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate) if recurse \
            else [(prefix, self)]
        for mod_prefix, mod in mods:
            for name, value in getattr(mod, table).items():
                if value is None or (remove_duplicate and id(value) in seen):
                    continue
                seen.add(id(value))
                yield mod_prefix + ("." if mod_prefix else "") + name, value

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, Parameter]]:
        yield from self._named_members("_parameters", prefix, recurse,  # type: ignore[misc]
                                       remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, Tensor]]:
        yield from self._named_members("_buffers", prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]:
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    # ---- modes, gradients ------------------------------------------------------------------
    def train(self, mode: bool = True) -> "Module":
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        self.training = mode
        for m in self.children():
            m.train(mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def requires_grad_(self, requires_grad: bool = True) -> "Module":
        for p in self.parameters():
            p.requires_grad = requires_grad
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad = zeros_like(p.grad)

    def apply(self, fn: Callable[["Module"], None]) -> "Module":
        """Call ``fn`` on every submodule (children first), then on this module."""
        for m in self.children():
            m.apply(fn)
        fn(self)
        return self

    # ---- devices and dtypes ----------------------------------------------------------------
    def _apply_tensors(self, fn: Callable[[Tensor], Tensor]) -> "Module":
        """Replace every parameter's and buffer's data (and gradient) by ``fn`` of it, keeping
        the Tensor objects, so optimizers holding them stay valid."""
        moved: list[Tensor] = []
        seen: set[int] = set()
        for m in self.modules():
            for table in (m._parameters, m._buffers):
                for t in table.values():
                    if t is None or id(t) in seen:
                        continue
                    seen.add(id(t))
                    new = fn(Tensor(t.lazy)).lazy
                    if new is not t.lazy:  # unchanged ones stay as they are (maybe views)
                        t.lazy = new
                        moved.append(t)
                    if t.grad is not None:
                        grad = fn(Tensor(t.grad.lazy))
                        if grad.lazy is not t.grad.lazy:
                            t.grad = grad
                            moved.append(grad)
        realize(*moved)
        return self

    def to(self, *args: Any, **kwargs: Any) -> "Module":
        """``to(device)``, ``to(dtype)`` or ``to(device, dtype)``: moves parameters and buffers
        in place; a dtype applies to the floating-point ones only, as in PyTorch."""
        device, dtype = parse_to(args, kwargs)
        if dtype is not None and not dtype.is_float:
            raise TypeError(f"Module.to only accepts floating point dtypes, got {dtype.name}")
        dev = canonical(device) if device is not None else None

        def fn(t: Tensor) -> Tensor:
            if dtype is not None and t.dtype.is_float:
                t = t.cast(dtype)
            if dev is not None and t.device != dev:
                t = t.to(dev)
            return t

        return self._apply_tensors(fn)

    def cpu(self) -> "Module":
        return self.to("cpu")

    def cuda(self, device: int | None = None) -> "Module":
        return self.to("cuda" if device is None else f"cuda:{device}")

    def float(self) -> "Module":
        return self.to(dt.float32)

    def half(self) -> "Module":
        return self.to(dt.float16)

    def bfloat16(self) -> "Module":
        return self.to(dt.bfloat16)

    # ---- state -----------------------------------------------------------------------------
    def _local_state(self, keep_vars: bool) -> "OrderedDict[str, Tensor]":
        out: OrderedDict[str, Tensor] = OrderedDict()
        for name, p in self._parameters.items():
            if p is not None:
                out[name] = p if keep_vars else _detached(p)
        for name, b in self._buffers.items():
            if b is not None and name not in self._non_persistent_buffers_set:
                out[name] = b if keep_vars else _detached(b)
        return out

    def state_dict(self, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> "OrderedDict[str, Tensor]":
        """Parameters and persistent buffers by their dotted names (PyTorch's keys), detached
        unless ``keep_vars``."""
        if destination is None:
            destination = OrderedDict()
        for name, t in self._local_state(keep_vars).items():
            destination[prefix + name] = t
        for name, m in self._modules.items():
            if m is not None:
                m.state_dict(destination=destination, prefix=prefix + name + ".",
                             keep_vars=keep_vars)
        return destination

    def _state_targets(self, prefix: str = "") -> Iterator[tuple[str, Tensor, bool]]:
        """(key, tensor, optional) for every entry ``state_dict`` holds."""
        for name, t in self._local_state(True).items():
            yield prefix + name, t, name in self._optional_keys
        for name, m in self._modules.items():
            if m is not None:
                yield from m._state_targets(prefix + name + ".")

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> _IncompatibleKeys:
        """Copy values into the parameters and buffers, in place (the Tensor objects stay).

        Values may be anygpu Tensors, NumPy arrays or torch tensors; they are cast to each
        entry's dtype (kept as given with ``assign=True``) and moved to its device. Missing or
        unexpected keys raise with ``strict`` (else they are returned); shape mismatches always
        raise, and nothing is changed when anything raises.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"Expected state_dict to be dict-like, got {type(state_dict)}.")
        targets = list(self._state_targets())
        known = {k for k, _, _ in targets}
        missing = [k for k, _, opt in targets if k not in state_dict and not opt]
        unexpected = [k for k in state_dict if k not in known]
        errors: list[str] = []
        if strict:
            if missing:
                errors.append("Missing key(s) in state_dict: "
                              + ", ".join(f'"{k}"' for k in missing) + ". ")
            if unexpected:
                errors.append("Unexpected key(s) in state_dict: "
                              + ", ".join(f'"{k}"' for k in unexpected) + ". ")
        plan: list[tuple[Tensor, Any]] = []
        for key, target, _ in targets:
            if key not in state_dict:
                continue
            value = state_dict[key]
            shape = tuple(getattr(value, "shape", np.shape(value)))
            if shape != target.shape:
                errors.append(f"size mismatch for {key}: copying a param with shape "
                              f"{_shape_text(shape)} from checkpoint, the shape in current model "
                              f"is {_shape_text(target.shape)}.")
                continue
            plan.append((target, value))
        if errors:
            raise RuntimeError(f"Error(s) in loading state_dict for {self._get_name()}:\n\t"
                               + "\n\t".join(errors))
        loaded = []
        for target, value in plan:
            dtype = None if assign else target.dtype
            if isinstance(value, Tensor):
                new = value.to(target.device)
                new = (new.cast(dtype) if dtype is not None else new).contiguous()
            else:
                new = Tensor(value, device=target.device, dtype=dtype)
            target.lazy = new.lazy
            loaded.append(new)
        realize(*loaded)
        return _IncompatibleKeys(missing, unexpected)

    # ---- printing ----------------------------------------------------------------------------
    def _get_name(self) -> str:
        return type(self).__name__

    def extra_repr(self) -> str:
        """Extra text inside this module's ``repr`` (its configuration); '' by default."""
        return ""

    def _child_lines(self) -> list[str]:
        return [f"({key}): " + _addindent(repr(m), 2) for key, m in self._modules.items()]

    def __repr__(self) -> str:
        extra = self.extra_repr()
        extra_lines = extra.split("\n") if extra else []
        child_lines = self._child_lines()
        lines = extra_lines + child_lines
        body = ""
        if lines:
            if len(extra_lines) == 1 and not child_lines:
                body = extra_lines[0]
            else:
                body = "\n  " + "\n  ".join(lines) + "\n"
        return f"{self._get_name()}({body})"


__all__ = ["Module", "Parameter"]
