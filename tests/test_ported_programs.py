"""PyTorch programs port by renaming imports: programs written as PyTorch's own tutorials write
them (tests/ported/) run under PyTorch on the CPU and, with only their import lines rewritten,
under anygpu on every device, and give the same losses, accuracies and greedy samples.

Both runs start from the same weights and see the same batches: each program calls
``init_weights(model)`` after building a model (under PyTorch the hook records the weights as
NumPy, under anygpu it loads them), and its data, batch order and batch offsets come from NumPy
through names the test injects. Nothing random is compared: dropout is off, and the
multinomial samples that the language model draws are printed, not checked.
"""

from __future__ import annotations

import re
import statistics
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import anygpu as ag

torch = pytest.importorskip("torch")

PORTED = Path(__file__).parent / "ported"

# `import torch[.a.b] [as c]` and `from torch[.a] import names`, at the start of a line
_TORCH_IMPORT = re.compile(r"^(?:import (torch(?:\.\w+)*)(?: as (\w+))?"
                           r"|from (torch(?:\.\w+)*) import (.+))$")


def _anygpu_import(match: re.Match[str]) -> str:
    """The anygpu line that binds what the PyTorch import line ``match`` binds. A dotted
    ``import torch.nn as nn`` becomes ``from anygpu import nn``: kept as it is, it would load
    PyTorch's own ``torch.nn`` (Python resolves the dotted name by module, not through an
    alias; docs/from-pytorch.md, "Imports")."""
    module, alias, from_module, names = match.groups()
    if module is not None:
        parts = module.split(".")
        if alias is None or len(parts) == 1:  # `import torch.nn` binds `torch`, as `import torch`
            return f"import anygpu as {alias or 'torch'}"
        return f"from {'.'.join(['anygpu', *parts[1:-1]])} import {parts[-1]} as {alias}"
    return f"from anygpu{from_module[len('torch'):]} import {names}"


def port(source: str) -> str:
    """``source`` with its PyTorch import lines rewritten to import anygpu; every other line
    stays as it is."""
    lines = []
    for line in source.splitlines(keepends=True):
        match = _TORCH_IMPORT.match(line.rstrip("\n"))
        if match is None:
            if re.match(r"\s+(import|from)\s+torch\b", line):
                raise ValueError(f"an indented PyTorch import is not rewritten: {line!r}")
            lines.append(line)
        else:
            lines.append(_anygpu_import(match) + "\n")
    return "".join(lines)


def test_port_rewrites_only_the_import_lines() -> None:
    source = ("import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"
              "import torch.optim as optim\nfrom torch import nn, optim\n"
              "from torch.nn import functional as F\nfrom torch.optim import lr_scheduler\n"
              "from torch.utils.data import DataLoader, TensorDataset\nimport torchvision\n"
              "\nx = torch.ones(2)  # import torch\n")
    assert port(source) == (
        "import anygpu as torch\nfrom anygpu import nn as nn\n"
        "from anygpu.nn import functional as F\nfrom anygpu import optim as optim\n"
        "from anygpu import nn, optim\nfrom anygpu.nn import functional as F\n"
        "from anygpu.optim import lr_scheduler\n"
        "from anygpu.utils.data import DataLoader, TensorDataset\nimport torchvision\n"
        "\nx = torch.ones(2)  # import torch\n")
    with pytest.raises(ValueError, match="indented"):
        port("def f():\n    import torch\n")


# ---- what the test injects ----------------------------------------------------------------
class InitialWeights:
    """The ``init_weights(model)`` hooks of one program's two runs: under PyTorch each call
    records the model's state_dict as NumPy arrays; under anygpu the same call, in the same
    order, loads them as PyTorch code would, with ``load_state_dict``."""

    def __init__(self) -> None:
        self.states: list[dict[str, np.ndarray]] = []
        self.loaded = 0

    def record(self, model: Any) -> None:
        self.states.append({k: v.detach().cpu().numpy().copy()
                            for k, v in model.state_dict().items()})

    def load(self, model: Any) -> None:
        state = self.states[self.loaded]
        self.loaded += 1
        model.load_state_dict({k: ag.tensor(v) for k, v in state.items()})


class EpochOrder:
    """A sampler (DataLoader takes any iterable of indices): each epoch a new permutation of
    ``range(n)`` from a fixed seed, the same sequence in both runs."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.rng = np.random.default_rng(seed)

    def __iter__(self) -> Iterator[int]:
        return iter(self.rng.permutation(self.n).tolist())

    def __len__(self) -> int:
        return self.n


def offsets_drawer(lib: Any, seed: int) -> Callable[[int, tuple[int, ...]], Any]:
    """``draw_offsets(high, size)``, standing for ``torch.randint(high, size)``: int64 tensors
    of ``lib`` from a NumPy generator, the same sequence in both runs."""
    rng = np.random.default_rng(seed)
    return lambda high, size: lib.tensor(rng.integers(0, high, size))


def corner_squares(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Images (n, 3, 16, 16) of noise in [0, 0.5) with a brighter 6x6 square in one of the
    four corners, whose index (0..3) is the label."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, n)
    images = rng.uniform(0.0, 0.5, (n, 3, 16, 16)).astype(np.float32)
    for image, label in zip(images, labels):
        row, col = divmod(int(label), 2)
        image[:, 10 * row:10 * row + 6, 10 * col:10 * col + 6] += 1.0
    return images, labels


def corpus(n_sentences: int, seed: int) -> str:
    """Short sentences of a tiny grammar: text a character model learns something of in a
    few dozen steps."""
    rng = np.random.default_rng(seed)
    nouns, verbs = ["cat", "dog", "bird", "fox"], ["sat on", "ran to", "saw", "hid by"]
    adjectives, places = ["big", "red", "old", "shy"], ["the mat", "a log", "the barn"]
    return "".join(f"the {rng.choice(adjectives)} {rng.choice(nouns)} {rng.choice(verbs)} "
                   f"{rng.choice(places)}.\n" for _ in range(n_sentences))


def run_program(name: str, lib: Any, weights: InitialWeights, **names: Any) -> dict[str, Any]:
    """Run tests/ported/``name`` under ``lib`` (``torch`` as written, ``anygpu`` ported) with
    ``names`` injected; returns the program's global namespace."""
    source = (PORTED / name).read_text()
    if lib is ag:
        source, hook, seed = port(source), weights.load, ag.manual_seed
    else:
        hook, seed = weights.record, torch.manual_seed
    seed(0)
    namespace: dict[str, Any] = {"__name__": f"ported_{Path(name).stem}",
                                 "init_weights": hook, **names}
    exec(compile(source, f"{PORTED / name} ({lib.__name__})", "exec"), namespace)
    if lib is ag:
        _check_no_torch(namespace)
        assert weights.loaded == len(weights.states)
    return namespace


def _check_no_torch(namespace: dict[str, Any]) -> None:
    """The anygpu run used no PyTorch module, class or object (a ``class Net(nn.Module)`` of
    the program derives from anygpu's Module)."""
    for key, value in namespace.items():
        if isinstance(value, types.ModuleType):
            origins = [value.__name__]
        else:
            origins = [c.__module__ for c in (value if isinstance(value, type)
                                              else type(value)).__mro__]
        assert not any(o.startswith("torch") for o in origins), (
            f"the ported program's {key} comes from {origins}")


def test_programs_differ_only_in_their_import_lines() -> None:
    for path in sorted(PORTED.glob("*.py")):
        source = path.read_text()
        changed = [(a, b) for a, b in zip(source.splitlines(), port(source).splitlines())
                   if a != b]
        assert changed and all(_TORCH_IMPORT.match(a) for a, _ in changed), path.name
        assert "import anygpu as torch" in port(source), path.name


# ---- comparisons ----------------------------------------------------------------------------
def assert_curves_match(got: list[float], ref: list[float], rtol: float, name: str) -> None:
    """Per-step losses within ``rtol * (1 + step / 10)`` of PyTorch's (atol rtol / 10).

    Both libraries compute in float32 but sum in different orders (BLAS and convolution
    blocking, reductions split across threads or work-groups), so the first step's loss already
    differs in its last bits, and every update feeds those differences into the next step's
    weights: the curves drift apart slowly, about linearly over a few dozen steps, while the
    losses themselves change by percents. A tolerance that grows with the step keeps the
    check tight where it can be. (Measured on cpu, opencl and webgpu: at most 3e-7 relative
    over these programs' steps; 1e-4 leaves room for other BLAS libraries and GPUs.)"""
    assert len(got) == len(ref), f"{name}: {len(got)} steps, PyTorch ran {len(ref)}"
    steps = np.arange(len(ref))
    tol = rtol * (1 + steps / 10)
    diff = np.abs(np.asarray(got) - np.asarray(ref))
    bad = np.nonzero(diff > tol * np.abs(ref) + rtol / 10)[0]
    assert bad.size == 0, (f"{name}: step {bad[0]} loss {got[bad[0]]!r}, PyTorch's "
                           f"{ref[bad[0]]!r} (tolerance {tol[bad[0]]:.2g} relative)\n"
                           f"anygpu  {np.round(got, 5).tolist()}\n"
                           f"PyTorch {np.round(ref, 5).tolist()}")


def report_step_times(name: str, device: str, ours: list[float], theirs: list[float]) -> None:
    """Print the step times (seen with ``pytest -s``): steps 2 and 10, and the median."""
    def text(times: list[float]) -> str:
        return (f"step 2 {times[2] * 1e3:.1f} ms, step 10 {times[10] * 1e3:.1f} ms, "
                f"median {statistics.median(times) * 1e3:.1f} ms")
    print(f"\n{name} on {device}: anygpu {text(ours)}; PyTorch (cpu) {text(theirs)}")


# ---- the programs -------------------------------------------------------------------------
def test_cifar_classifier(device: str) -> None:
    """The CIFAR-10 tutorial's training and evaluation loops, a Dataset subclass and SGD
    with momentum: 32 steps, then accuracy overall and per class."""
    train_images, train_labels = corner_squares(128, seed=1)
    test_images, test_labels = corner_squares(32, seed=2)
    data = dict(train_images=train_images, train_labels=train_labels,
                test_images=test_images, test_labels=test_labels)
    weights = InitialWeights()
    ref = run_program("cifar_classifier.py", torch, weights, device="cpu", **data)
    got = run_program("cifar_classifier.py", ag, weights, device=device, **data)
    assert_curves_match(got["losses"], ref["losses"], 1e-4, "training loss")
    assert got["predictions"] == ref["predictions"]
    assert (got["correct"], got["total"]) == (ref["correct"], ref["total"])
    assert got["correct_pred"] == ref["correct_pred"]
    assert ref["losses"][-1] < 0.8 * ref["losses"][0], "the program should learn something"
    report_step_times("cifar_classifier", device, got["step_times"], ref["step_times"])


# cold kernel cache, 2 busy cores: about 3 minutes on cpu (every step compiles again: the batch
# windows are cut from a slice, train_data = data[:n]) and 10 on opencl (PoCL compiles ~400
# kernels, half of them for generation's growing context)
@pytest.mark.slow
def test_char_transformer(device: str) -> None:
    """nanoGPT's lecture model (hand-written heads with a ``tril`` buffer, LayerNorm,
    AdamW, estimate_loss under no_grad) for 12 steps, then greedy generation."""
    text = corpus(120, seed=3)
    weights = InitialWeights()
    ref = run_program("char_transformer.py", torch, weights, device="cpu", text=text,
                      draw_offsets=offsets_drawer(torch, seed=4))
    got = run_program("char_transformer.py", ag, weights, device=device, text=text,
                      draw_offsets=offsets_drawer(ag, seed=4))
    assert_curves_match(got["train_losses"], ref["train_losses"], 1e-4, "training loss")
    np.testing.assert_allclose(got["eval_losses"], ref["eval_losses"], rtol=5e-4,
                               err_msg="estimate_loss")
    assert got["greedy_text"] == ref["greedy_text"]
    assert ref["train_losses"][-1] < 0.8 * ref["train_losses"][0]
    report_step_times("char_transformer", device, got["step_times"], ref["step_times"])


# cold kernel cache, 2 busy cores: 30 s on cpu, 2 minutes on opencl
@pytest.mark.slow
def test_finetune_checkpoint(device: str, tmp_path: Path) -> None:
    """Pretrain, torch.save a general checkpoint, torch.load it into a new model and
    optimizer, resume; then freeze the backbone, replace and rescale the head in place and
    fine-tune it with StepLR, evaluating each epoch."""
    images, labels = corner_squares(64, seed=5)
    val_images, val_labels = corner_squares(32, seed=6)
    ft_images, ft_labels = images.copy(), labels // 2  # top or bottom
    ft_val_images, ft_val_labels = val_images.copy(), val_labels // 2
    data = dict(images=images, labels=labels, val_images=val_images, val_labels=val_labels,
                ft_images=ft_images, ft_labels=ft_labels, ft_val_images=ft_val_images,
                ft_val_labels=ft_val_labels)
    weights = InitialWeights()
    runs = {}
    for lib, dev in ((torch, "cpu"), (ag, device)):
        folder = tmp_path / lib.__name__
        folder.mkdir()
        runs[lib] = run_program("finetune_checkpoint.py", lib, weights, device=dev,
                                checkpoint_dir=folder, train_sampler=EpochOrder(64, seed=7),
                                **data)
    ref, got = runs[torch], runs[ag]
    for curve in ("pretrain_losses", "resume_losses", "finetune_losses"):
        assert_curves_match(got[curve], ref[curve], 1e-4, curve)
    assert got["resumed_from"][0] == ref["resumed_from"][0]
    np.testing.assert_allclose(got["resumed_from"][1], ref["resumed_from"][1], rtol=1e-3)
    assert got["pretrain_correct"] == ref["pretrain_correct"]
    assert got["trainable"] == ref["trainable"] == 34
    np.testing.assert_allclose(got["learning_rates"], ref["learning_rates"], rtol=1e-6)
    np.testing.assert_allclose(got["history"], ref["history"], rtol=1e-3, atol=1e-4)
    assert got["final_state"].keys() == ref["final_state"].keys()
    for key, value in ref["final_state"].items():
        np.testing.assert_allclose(got["final_state"][key], value, rtol=1e-3, atol=1e-4,
                                   err_msg=key)
    report_step_times("finetune_checkpoint", device, got["step_times"], ref["step_times"])


def test_transfer_learning_train_model(device: str) -> None:
    """The transfer-learning tutorial's ``train_model`` as written, on a custom-dataset
    tutorial style Dataset."""
    images, labels = corner_squares(64, seed=8)
    val_images, val_labels = corner_squares(32, seed=9)
    data = dict(images=images, labels=labels, val_images=val_images, val_labels=val_labels)
    weights = InitialWeights()
    ref = run_program("transfer_learning.py", torch, weights, device="cpu",
                      train_sampler=EpochOrder(64, seed=10), **data)
    got = run_program("transfer_learning.py", ag, weights, device=device,
                      train_sampler=EpochOrder(64, seed=10), **data)
    assert_curves_match(got["step_losses"], ref["step_losses"], 1e-4, "training loss")
