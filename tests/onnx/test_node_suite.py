"""ONNX's backend node tests (shipped in the onnx wheel) through anygpu.onnx.Backend on cpu.

A test listed in anygpu/onnx/expected_failures.txt may fail (it is reported as xfail with the
listed reason); any other failure fails here. A listed test that passes is reported with a
warning, so that the list shrinks as operators are added. Tests with string or sequence types
are skipped. ``python scripts/onnx_node_tests.py`` runs the same suite outside pytest.
"""

from __future__ import annotations

import os
import warnings

import pytest

pytest.importorskip("onnx")

from anygpu.onnx.testing import node_cases, read_expected, run_case  # noqa: E402

DEVICE = "cpu"
_selected = [n.strip().lower().partition(":")[0]
             for n in os.environ.get("ANYGPU_TEST_DEVICES", "").split(",") if n.strip()]
pytestmark = pytest.mark.skipif(bool(_selected) and DEVICE not in _selected,
                                reason="the node suite runs on cpu, which is not selected")

CASES = {c.name: c for c in node_cases()}
EXPECTED = read_expected()


def test_expected_failures_name_real_tests() -> None:
    unknown = sorted(set(EXPECTED) - set(CASES))
    assert not unknown, f"expected_failures.txt names tests that do not exist: {unknown[:10]}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_node(name: str) -> None:
    result = run_case(CASES[name], DEVICE)
    if result.status == "skip":
        pytest.skip(result.message)
    if name in EXPECTED:
        if result.status == "fail":
            pytest.xfail(EXPECTED[name])
        warnings.warn(f"{name} passes now: remove it from anygpu/onnx/expected_failures.txt",
                      stacklevel=1)
        return
    assert result.status == "pass", result.message
