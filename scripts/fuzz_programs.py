"""Random programs against PyTorch beyond the test suite's fixed ones: the generator of
``tests/test_random_programs.py`` with fresh examples (not derandomized), every failing program
printed and the run continued.

    python scripts/fuzz_programs.py --device webgpu --examples 600 --seed 21
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--examples", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from hypothesis import HealthCheck, Phase, given, seed, settings
    from hypothesis import strategies as st

    import test_random_programs as programs

    ran, failing = [0], [0]

    @seed(args.seed)
    @settings(max_examples=args.examples, database=None, phases=[Phase.generate],
              derandomize=False, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def fuzz(data: Any) -> None:
        prog = data.draw(programs.programs(args.device), label="program")
        ran[0] += 1
        try:
            failures = programs.run_program(prog, args.device)
        except Exception as err:  # noqa: BLE001 (a crash is a finding too)
            failures = [f"raised {type(err).__name__}: {err}"]
        if failures:
            failing[0] += 1
            print(f"{prog}\n  " + "\n  ".join(failures), flush=True)

    fuzz()
    print(f"{args.device}: {ran[0]} programs, {failing[0]} failing")
    return 1 if failing[0] else 0


if __name__ == "__main__":
    sys.exit(main())
