"""ONNX's backend node tests (``onnx.backend.test``, shipped in the onnx wheel) run through
``anygpu.onnx.Backend``: the cases, which are skipped, one case's run, and the list of tests
known to fail (``expected_failures.txt`` beside this module, one ``name: reason`` a line).

Tests whose inputs or outputs are strings or sequences, or that build sequences, are skipped:
anygpu holds numeric tensors only.

>>> from anygpu.onnx.testing import read_expected
>>> isinstance(read_expected(), dict)
True
"""

from __future__ import annotations

import contextlib
import re
import signal
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import onnx

EXPECTED_FAILURES = Path(__file__).with_name("expected_failures.txt")

_SEQUENCE_OPS = {"SequenceConstruct", "SequenceAt", "SequenceInsert", "SequenceErase",
                 "SequenceLength", "SequenceEmpty", "SplitToSequence", "ConcatFromSequence",
                 "SequenceMap", "StringConcat", "StringSplit", "StringNormalizer",
                 "RegexFullMatch", "TfIdfVectorizer", "LabelEncoder"}


@dataclass
class Result:
    name: str
    status: str  # "pass", "fail", "skip"
    message: str = ""
    seconds: float = 0.0


def node_cases() -> list[Any]:
    """ONNX's node test cases (about 1,900 in onnx 1.23), in name order."""
    from onnx.backend.test.loader import load_model_tests

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        cases = load_model_tests(kind="node")
    return sorted(cases, key=lambda c: c.name)


def _graphs(g: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    yield g
    for n in g.node:
        for a in n.attribute:
            if a.HasField("g"):
                yield from _graphs(a.g)
            for sub in a.graphs:
                yield from _graphs(sub)


def skip_reason(model: onnx.ModelProto) -> str | None:
    """Why a test is out of scope (strings, sequences), or None."""
    for g in _graphs(model.graph):
        for v in list(g.input) + list(g.output) + list(g.value_info):
            kind = v.type.WhichOneof("value")
            inner = v.type.optional_type.elem_type.WhichOneof("value") \
                if kind == "optional_type" else None
            if kind == "sequence_type" or inner == "sequence_type":
                return "sequence type"
            if kind == "tensor_type" and v.type.tensor_type.elem_type == onnx.TensorProto.STRING:
                return "string type"
        for n in g.node:
            if n.op_type in _SEQUENCE_OPS:
                return f"sequence or string operator {n.op_type}"
    return None


class Timeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``Timeout`` after ``seconds`` (main thread only; elsewhere no limit)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise Timeout(f"did not finish in {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_case(case: Any, device: str, limit: float = 120.0) -> Result:
    """Run one node test case on ``device``; compare as ONNX's runner does."""
    from onnx.backend.test.runner import Runner

    from anygpu.onnx.backend import Backend

    reason = skip_reason(case.model)
    if reason:
        return Result(case.name, "skip", reason)
    start = time.perf_counter()
    try:
        with time_limit(limit), warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            rep = Backend.prepare(case.model, device)
            for inputs, expected in case.data_sets:
                inputs = [onnx.numpy_helper.to_array(i) if isinstance(i, onnx.TensorProto)
                          else i for i in inputs]
                expected = [onnx.numpy_helper.to_array(o) if isinstance(o, onnx.TensorProto)
                            else o for o in expected]
                outputs = rep.run(inputs)
                Runner.assert_similar_outputs(expected, outputs, rtol=case.rtol,
                                              atol=case.atol)
    except Exception as err:  # a failing test is a result, whatever it raised
        text = f"{type(err).__name__}: {err}".strip().splitlines()
        message = " ".join(line.strip() for line in text[:4])[:300]
        return Result(case.name, "fail", message, time.perf_counter() - start)
    return Result(case.name, "pass", "", time.perf_counter() - start)


def read_expected(path: Path = EXPECTED_FAILURES) -> dict[str, str]:
    """The tests expected to fail: name -> reason."""
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, reason = line.partition(":")
        out[name.strip()] = reason.strip()
    return out


def reason_for(message: str) -> str:
    """A short reason for a failure, from its message."""
    match = re.search(r"operator (\S+) is not supported", message)
    if match:
        return f"operator {match.group(1)} is not implemented"
    match = re.search(r"element type (\S+), which is not supported", message)
    if match:
        return f"element type {match.group(1)} is not supported"
    match = re.search(r"of type (\w+_type); only tensors", message)
    if match:
        return f"{match.group(1).replace('_type', '')} values are not supported"
    return message


def write_expected(failures: dict[str, str], path: Path = EXPECTED_FAILURES) -> None:
    header = ("# ONNX backend node tests that fail on anygpu's cpu device: name: reason.\n"
              "# Regenerate with: python scripts/onnx_node_tests.py --write-expected\n")
    lines = [f"{name}: {reason}" for name, reason in sorted(failures.items())]
    path.write_text(header + "\n".join(lines) + "\n")


__all__ = ["node_cases", "skip_reason", "run_case", "read_expected", "write_expected", "Result",
           "reason_for", "EXPECTED_FAILURES"]
