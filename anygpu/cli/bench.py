"""``anygpu bench train|infer``: the seed CNN benchmark, one training step (forward, backward,
Adam) or one inference pass of a standard model, beside PyTorch on the same device
(``anygpu bench llm``, a language model's prefill and decode, is in anygpu/llm/bench.py).

    anygpu bench train --model resnet50 --batch 16 --size 224 --device cuda --compare torch
    anygpu bench infer --model all --device all --steps 20 --json > rows.json
    anygpu bench plot rows.json more-rows.json --plot seed.png

Each row: the first step on its own line (compiling and tuning included), then the median time
of ``--steps`` steps after two warm-up steps, images per second and the peak device memory of a
step (the allocator's high-water mark, weights and optimizer state included, as PyTorch's
``max_memory_allocated``). Steps run under ``anygpu.jit`` unless ``--no-jit`` is given (a
plain loop, as most programs are written; its rows also give the kernels of a step and the
host time per kernel, ``host_per_kernel``). Precisions: ``fp32`` (exact float32 products, tf32
off on both sides), ``tf32`` (``set_float32_matmul_precision("high")``, PyTorch's tf32 on)
and ``bf16`` (``anygpu.autocast``: products and convolutions in bfloat16 with float32
weights, PyTorch's autocast with channels_last beside it). ``--compare torch torch-compile``
runs PyTorch eager and ``torch.compile`` (CUDA-graph mode on a GPU: ``mode="reduce-overhead"``,
the optimizer's step compiled too) beside; the compiled row's first step is its compile time and
its peak memory is taken from its first step on (the CUDA graphs' pools are taken at capture).
``--plot PNG`` draws the rows as a bar chart (matplotlib: the ``plot`` extra); ``anygpu bench
plot`` draws the rows of several runs' ``--json`` output as one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import numpy as np

MODELS = ("alexnet", "resnet18", "resnet50", "vgg16", "mobilenet_v2")
PRECISIONS = ("fp32", "tf32", "bf16")
WARMUP = 2


@dataclass
class Row:
    framework: str  # "anygpu" or "torch"
    device: str
    mode: str  # "train" or "infer"
    model: str
    precision: str
    batch: int
    size: int
    steps: int
    jit: bool
    first_step_s: float
    ms: float  # median time of a step
    images_per_s: float
    peak_mib: float | None  # None where the framework cannot say (PyTorch on the processor)
    ratio: float | None = None  # anygpu's time over PyTorch eager's, on anygpu's rows
    ratio_compiled: float | None = None  # anygpu's time over torch.compile's, on anygpu's rows
    # without jit: the kernels of a step and the host time per kernel (graph building,
    # scheduling, launching), see ``host_per_kernel``
    kernels: int | None = None
    host_us_per_kernel: float | None = None


# ---- anygpu ------------------------------------------------------------------------------------
class _CompileProgress:
    """While the first step runs: the kernels compiled so far and the time, on one line of the
    terminal (a single summary line where the output is not a terminal)."""

    def __init__(self, device: Any, label: str):
        self.device, self.label = device, label
        self.before = len(device._programs)
        self.done = threading.Event()
        self.start = time.perf_counter()
        self.live = sys.stderr.isatty()
        self.thread = threading.Thread(target=self._show, daemon=True)

    def compiled(self) -> int:
        return len(self.device._programs) - self.before

    def _show(self) -> None:
        spin = "|/-\\"
        k = 0
        while not self.done.wait(0.25):
            k += 1
            sys.stderr.write(f"\r{self.label}: first step {spin[k % 4]} {self.compiled()} "
                             f"kernels compiled, {time.perf_counter() - self.start:.0f} s ")
            sys.stderr.flush()

    def __enter__(self) -> "_CompileProgress":
        if self.live:
            self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.done.set()
        if self.live:
            self.thread.join()
            sys.stderr.write("\r" + " " * 78 + "\r")
            sys.stderr.flush()


def _precision(precision: str) -> Any:
    """Set the float32 product precision; the autocast context for bf16 (else a no-op)."""
    import contextlib

    import anygpu as ag

    ag.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
    if precision == "bf16":
        if not hasattr(ag, "autocast"):
            raise SystemExit("anygpu bench: --precision bf16 needs anygpu.autocast, which this "
                             "version does not have")
        return lambda: ag.autocast(dtype=ag.bfloat16)
    return contextlib.nullcontext


def run_anygpu(mode: str, model_name: str, batch: int, size: int, device: str, steps: int,
               precision: str, use_jit: bool = True, profile: str | None = None) -> Row:
    import anygpu as ag
    from anygpu import models
    from anygpu.nn import functional as F

    dev = ag.get_device(device)
    context = _precision(precision)
    ag.manual_seed(0)
    model = getattr(models, model_name)().to(dev.name)
    rng = np.random.default_rng(0)
    x = ag.tensor(rng.standard_normal((batch, 3, size, size), np.float32), device=dev.name)
    y = ag.tensor(rng.integers(0, 1000, batch), device=dev.name)
    if mode == "train":
        model.train()
        opt = ag.optim.Adam(model.parameters(), lr=1e-4)

        def step(x: Any, y: Any) -> Any:
            opt.zero_grad()
            with context():
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss
    else:
        model.eval()

        def step(x: Any, y: Any) -> Any:
            with ag.no_grad(), context():
                return model(x)

    run: Callable[[Any, Any], Any] = ag.jit(step) if use_jit else step

    def timed() -> float:
        start = time.perf_counter()
        out = run(x, y)
        out.realize()
        dev.synchronize()
        return time.perf_counter() - start

    label = f"anygpu {mode} {model_name} on {dev.name}"
    with _CompileProgress(dev, label) as progress:
        first = timed()
    if not progress.live:
        print(f"{label}: first step {first:.1f} s, {progress.compiled()} kernels compiled",
              file=sys.stderr)
    for _ in range(WARMUP):
        timed()
    dev.allocator.peak = dev.allocator.in_use
    times = [timed() for _ in range(steps)]
    peak = dev.allocator.peak / 2**20
    if profile:
        _profile_steps(timed, profile)
    ms = statistics.median(times) * 1e3
    row = Row("anygpu", dev.name, mode, model_name, precision, batch, size, steps, use_jit,
              first, ms, batch / ms * 1e3, peak)
    if not use_jit:
        host, row.kernels = host_per_kernel(lambda: run(x, y).realize(), dev, min(steps, 5))
        row.host_us_per_kernel = host / max(row.kernels, 1) * 1e6
    return row


def host_per_kernel(step: Callable[[], Any], dev: Any, steps: int) -> tuple[float, int]:
    """(median host seconds of ``step``, kernels it launches). On a GPU the launches are queued
    without waiting, so the host time is the step's time until it returns, before the device
    is synchronized; on the processor the kernels run in the calling thread, so it is the
    step's time less the time spent in the kernels' calls."""
    from anygpu.graph import schedule

    spent = [0.0]  # seconds inside kernel calls
    calls = [0]
    launch = schedule.Launch.__call__

    def counted(self: Any, wait: bool = False) -> Any:
        start = time.perf_counter()
        try:
            return launch(self, wait)
        finally:
            spent[0] += time.perf_counter() - start
            calls[0] += 1

    schedule.Launch.__call__ = counted  # type: ignore[method-assign]
    try:
        host = []
        for _ in range(max(steps, 1)):
            spent[0], calls[0] = 0.0, 0
            dev.synchronize()
            start = time.perf_counter()
            step()
            returned = time.perf_counter() - start
            dev.synchronize()
            host.append(returned - spent[0] if dev.info.is_cpu else returned)
    finally:
        schedule.Launch.__call__ = launch  # type: ignore[method-assign]
    return statistics.median(host), calls[0]


def _profile_steps(timed: Callable[[], float], path: str) -> None:
    """Three more steps under the profiler: its summary printed, its trace written to ``path``.
    A jit step that runs as one device graph is run launch by launch here, so that the table
    names its kernels."""
    import anygpu as ag

    with ag.profile(split_graphs=True) as prof:
        for _ in range(3):
            timed()
    print(prof.summary())
    prof.export_chrome_trace(path)
    print(f"trace written to {path} (open it in ui.perfetto.dev)")


# ---- PyTorch -----------------------------------------------------------------------------------
def torch_device(device: str) -> str:
    """The device PyTorch runs on beside anygpu's ``device``: the same GPU where anygpu runs
    on one (through any API), else the processor."""
    import torch

    import anygpu as ag

    if ag.get_device(device).info.is_cpu or not torch.cuda.is_available():
        return "cpu"
    index = int(device.split(":")[1]) if device.startswith("cuda:") else 0
    return f"cuda:{index}"


def run_torch(mode: str, model_name: str, batch: int, size: int, device: str, steps: int,
              precision: str, compiled: bool = False) -> Row:
    """PyTorch's step, eager or (``compiled``) through ``torch.compile``: on a GPU in its
    CUDA-graph mode (``mode="reduce-overhead"``), the model's forward and backward compiled
    and the optimizer's step too; its first step is the compile time."""
    try:
        import torch
        import torchvision
    except ImportError as err:
        raise SystemExit(f"anygpu bench --compare torch needs torch and torchvision ({err})") \
            from err
    tdev = torch.device(device)
    cuda = tdev.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    model = getattr(torchvision.models, model_name)(weights=None).to(tdev)
    fmt = torch.channels_last if precision == "bf16" else torch.contiguous_format
    model = model.to(memory_format=fmt)
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.standard_normal((batch, 3, size, size), np.float32), device=tdev)
    x = x.contiguous(memory_format=fmt)
    y = torch.tensor(rng.integers(0, 1000, batch), device=tdev)

    def context() -> Any:
        import contextlib
        if precision == "bf16":
            return torch.autocast(tdev.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    forward = model
    compile_mode = "reduce-overhead" if cuda else None
    if compiled:
        forward = torch.compile(model, mode=compile_mode)
    if mode == "train":
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        update = torch.compile(opt.step, mode=compile_mode) if compiled else opt.step

        def step() -> None:
            if compiled:
                torch.compiler.cudagraph_mark_step_begin()
            opt.zero_grad()
            with context():
                loss = torch.nn.functional.cross_entropy(forward(x), y)
            loss.backward()
            update()
    else:
        model.eval()

        def step() -> None:
            if compiled:
                torch.compiler.cudagraph_mark_step_begin()
            with torch.no_grad(), context():
                forward(x)

    def timed() -> float:
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(tdev)
        return time.perf_counter() - start

    if cuda and compiled:  # CUDA graphs take their memory while captured, in the first steps
        torch.cuda.synchronize(tdev)
        torch.cuda.reset_peak_memory_stats(tdev)
    first = timed()
    for _ in range(WARMUP):
        timed()
    if cuda and not compiled:
        torch.cuda.reset_peak_memory_stats(tdev)
    times = [timed() for _ in range(steps)]
    peak = torch.cuda.max_memory_allocated(tdev) / 2**20 if cuda else None
    ms = statistics.median(times) * 1e3
    return Row("torch.compile" if compiled else "torch", str(tdev), mode, model_name, precision,
               batch, size, steps, False, first, ms, batch / ms * 1e3, peak)


# ---- the command -------------------------------------------------------------------------------
def _devices(names: Sequence[str]) -> list[str]:
    """Device names, ``all`` expanded to every device of every backend available here."""
    from anygpu.runtime.registry import BACKENDS, backend_module, get_device

    out: list[str] = []
    for name in names:
        if name != "all":
            out.append(get_device(name).name)
            continue
        for backend in BACKENDS:
            try:
                if backend_module(backend).device_count() > 0:
                    out.append(get_device(backend).name)
            except Exception as err:  # a backend that is missing here is left out, and said so
                print(f"{backend}: not available ({err})", file=sys.stderr)
    return list(dict.fromkeys(out))


def format_table(rows: Sequence[Row]) -> str:
    compiled = any(r.ratio_compiled is not None for r in rows)
    head = (f"{'framework':13s} {'device':9s} {'mode':5s} {'model':13s} {'prec':4s} "
            f"{'batch':>5s} {'size':>4s} {'first s':>8s} {'ms/step':>9s} {'img/s':>8s} "
            f"{'peak MiB':>9s} {'ratio':>6s}" + (f" {'/compile':>8s}" if compiled else ""))
    lines = [head, "-" * len(head)]
    for r in rows:
        peak = f"{r.peak_mib:9.0f}" if r.peak_mib is not None else f"{'n/a':>9s}"
        ratio = f"{r.ratio:5.2f}x" if r.ratio is not None else ""
        name = r.framework + ("" if r.framework != "anygpu" or r.jit else "*")
        line = (f"{name:13s} {r.device:9s} {r.mode:5s} {r.model:13s} {r.precision:4s} "
                f"{r.batch:5d} {r.size:4d} {r.first_step_s:8.1f} {r.ms:9.2f} "
                f"{r.images_per_s:8.1f} {peak} {ratio:>6s}")
        if r.ratio_compiled is not None:
            line += f" {r.ratio_compiled:7.2f}x"
        lines.append(line)
    plain = [r for r in rows if not r.jit and r.framework == "anygpu"]
    if plain:
        lines.append("* without jit; host time per kernel (graph building, scheduling, "
                     "launching): " + ", ".join(
                         f"{r.model} {r.host_us_per_kernel:.0f} us ({r.kernels} kernels a step)"
                         for r in plain if r.host_us_per_kernel is not None))
    return "\n".join(lines)


def plot(rows: Sequence[Row], path: str, runs: Sequence[int] | None = None) -> None:
    """Draw ``rows`` as a bar chart in ``path``: a panel per mode (training, inference), a
    group of bars per anygpu row (model, device, precision) with PyTorch eager's and
    torch.compile's times for the same model, mode, precision, batch and size beside, and
    anygpu's time over PyTorch eager's above its bar. ``runs`` numbers each row's run (rows
    read from several files): a peer's row from the anygpu row's own run is drawn beside it
    (the one its ratio was taken from), else the first run's that has one; an anygpu row
    that a later run repeats is drawn once, from its first run. Needs matplotlib (the
    ``plot`` extra)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise SystemExit(f"--plot needs matplotlib (pip install 'anygpu[plot]'): {err}") from err
    runs = list(runs) if runs is not None else [0] * len(rows)

    def config(r: Row) -> tuple:
        return (r.mode, r.model, r.precision, r.batch, r.size)

    first: dict[tuple, int] = {}  # an anygpu row's configuration, device and jit -> its run
    peer: dict[tuple, float] = {}  # (run or -1 for any, framework, configuration) -> ms
    for run, r in zip(runs, rows):
        if r.framework == "anygpu":
            first.setdefault(config(r) + (r.device, r.jit), run)
        else:
            peer.setdefault((run, r.framework) + config(r), r.ms)
            peer.setdefault((-1, r.framework) + config(r), r.ms)  # the first run's
    ours = [r for run, r in zip(runs, rows) if r.framework == "anygpu" and
            first[config(r) + (r.device, r.jit)] == run]
    run_of = {id(r): run for run, r in zip(runs, rows)}

    def beside(name: str, r: Row) -> float:  # a peer's time beside anygpu's row; nan: no bar
        return peer.get((run_of[id(r)], name) + config(r),
                        peer.get((-1, name) + config(r), np.nan))

    if not ours:
        raise SystemExit("anygpu bench: nothing to plot (no anygpu rows)")
    modes = list(dict.fromkeys(r.mode for r in ours))
    widest = max(sum(r.mode == m for r in ours) for m in modes)
    fig, axes = plt.subplots(len(modes), 1, figsize=(max(6.0, 1.2 * widest + 2), 4.2 * len(modes)),
                             squeeze=False)
    peers = ("torch", "PyTorch eager"), ("torch.compile", "torch.compile")
    for ax, mode in zip(axes[:, 0], modes):
        mine = [r for r in ours if r.mode == mode]
        shown = [(name, label) for name, label in peers
                 if any(not np.isnan(beside(name, r)) for r in mine)]
        width = 0.8 / (1 + len(shown))
        xs = np.arange(len(mine))
        bars = ax.bar(xs - 0.4 + width / 2, [r.ms for r in mine], width, label="anygpu")
        for i, (name, label) in enumerate(shown, 1):
            ax.bar(xs - 0.4 + width * (i + 0.5), [beside(name, r) for r in mine], width,
                   label=label)
        for bar, r in zip(bars, mine):
            if r.ratio is not None:
                top = (bar.get_x() + bar.get_width() / 2, bar.get_height())
                ax.annotate(f"{r.ratio:.2f}x", top, ha="center", va="bottom", fontsize=7)
        ax.set_xticks(xs, [f"{r.model}\n{r.device}\n{r.precision}" for r in mine], fontsize=8)
        ax.set_ylabel("ms per step (lower is better)")
        drawn = [r.ms for r in rows if r.mode == mode]
        if max(drawn) > 20 * min(drawn):  # models an order of magnitude apart: all readable
            ax.set_yscale("log")
            ax.set_ylabel("ms per step (log scale, lower is better)")
        sizes = sorted({(r.batch, r.size) for r in mine})
        ax.set_title(f"{'training step' if mode == 'train' else 'inference'}, " + ", ".join(
            f"batch {b}, {s}x{s}" for b, s in sizes) + " (anygpu over PyTorch eager above)",
            fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}")


def read_rows(paths: Sequence[str], runs: list[int] | None = None) -> list[Row]:
    """The rows that ``anygpu bench ... --json`` printed into the files ``paths`` (other lines,
    such as the first step's, are skipped); each row's file, as its index in ``paths``,
    appended to ``runs`` where given."""
    fields = set(Row.__dataclass_fields__)
    needed = {"framework", "mode", "model", "ms"}
    rows: list[Row] = []
    for run, path in enumerate(paths):
        try:
            with open(path) as f:
                lines = f.readlines()
        except OSError as err:
            raise SystemExit(f"anygpu bench plot: cannot read {path}: {err}") from err
        for number, line in enumerate(lines, 1):
            if not line.startswith("{"):
                continue
            try:
                data = json.loads(line)
                if not isinstance(data, dict) or not needed <= set(data):
                    raise ValueError("not a row of anygpu bench --json")
                rows.append(Row(**{k: v for k, v in data.items() if k in fields}))
                if runs is not None:
                    runs.append(run)
            except (ValueError, TypeError) as err:
                raise SystemExit(f"anygpu bench plot: {path}, line {number}: {err}") from err
    if not rows:
        raise SystemExit(f"anygpu bench plot: no rows in {', '.join(paths)} (write them with "
                         "anygpu bench train|infer ... --json > rows.json)")
    return rows


def plot_main(args: argparse.Namespace) -> int:
    runs: list[int] = []
    rows = read_rows(args.files, runs)
    print(format_table(rows))
    plot(rows, args.plot, runs)
    return 0


def add_parser(sub: Any) -> None:
    from anygpu.llm import bench as llm_bench

    parser = sub.add_parser("bench", help="time a CNN's training step or inference, or a "
                           "language model's prefill and decode, beside PyTorch")
    modes = parser.add_subparsers(dest="mode", required=True)
    p = argparse.ArgumentParser(add_help=False)  # the flags train and infer share
    p.add_argument("--model", default=["resnet18"], nargs="+",
                   help=f"{', '.join(MODELS)}, or all (any torchvision-named model anygpu has)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--device", default=["cpu"], nargs="+", help="device names, or all")
    p.add_argument("--steps", type=int, default=10, help="timed steps after the warm-up")
    p.add_argument("--precision", choices=PRECISIONS, default=["fp32"], nargs="+")
    p.add_argument("--compare", choices=("torch", "torch-compile"), nargs="+", default=[],
                   help="run PyTorch beside on the same device: eager, and/or torch.compile "
                   "(CUDA-graph mode on a GPU; its first step is its compile time)")
    p.add_argument("--no-jit", action="store_true", help="plain steps, not captured by jit")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.add_argument("--plot", metavar="PNG", help="draw the table as a bar chart")
    p.add_argument("--profile", metavar="TRACE",
                   help="profile three more steps: print the summary, write a Chrome trace")
    for mode, what in (("train", "a training step"), ("infer", "an inference pass")):
        modes.add_parser(mode, parents=[p], help=f"time {what} of a CNN").set_defaults(func=main)
    q = modes.add_parser("plot", help="draw the rows of earlier runs' --json output as one chart")
    q.add_argument("files", nargs="+", help="files holding anygpu bench ... --json output")
    q.add_argument("--plot", metavar="PNG", required=True, help="the chart to write")
    q.set_defaults(func=plot_main)
    llm_bench.add_parser(modes)


def main(args: argparse.Namespace) -> int:
    models = list(MODELS) if "all" in args.model else list(args.model)
    precisions = list(args.precision)
    if args.batch < 1 or args.size < 32 or args.steps < 1:
        raise SystemExit("anygpu bench: --batch and --steps must be at least 1, --size 32")
    rows: list[Row] = []
    for device in _devices(args.device):
        for model in models:
            for precision in precisions:
                row = run_anygpu(args.mode, model, args.batch, args.size, device, args.steps,
                                 precision, use_jit=not args.no_jit, profile=args.profile)
                new = [row]
                for peer_name in args.compare:
                    peer = run_torch(args.mode, model, args.batch, args.size,
                                     torch_device(device), args.steps, precision,
                                     compiled=peer_name == "torch-compile")
                    if peer.framework == "torch":
                        row.ratio = row.ms / peer.ms
                    else:
                        row.ratio_compiled = row.ms / peer.ms
                    new.append(peer)
                rows += new
                for r in new:
                    if args.json:
                        print(json.dumps(asdict(r)), flush=True)
    if not args.json:
        print(format_table(rows))
    if args.plot:
        plot(rows, args.plot)
    return 0
