"""Run ONNX's backend node tests through anygpu.onnx.Backend on one device and print the counts.

    python scripts/onnx_node_tests.py --device cpu            # all, with a summary
    python scripts/onnx_node_tests.py -k conv -v              # those matching a regex, each shown
    python scripts/onnx_node_tests.py --write-expected        # record today's failures (cpu)

Tests with string or sequence types are skipped (anygpu holds numeric tensors only). The
failures are compared with anygpu/onnx/expected_failures.txt: new failures and tests that pass
now are listed, and the exit status is 1 when a test fails that the file does not list.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="anygpu device (cpu, cuda, opencl, ...)")
    parser.add_argument("-k", dest="pattern", default=None, help="only tests matching a regex")
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per test")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per test")
    parser.add_argument("--write-expected", action="store_true",
                        help="write the failures to anygpu/onnx/expected_failures.txt")
    parser.add_argument("--slowest", type=int, default=0, help="list the N slowest tests")
    args = parser.parse_args(argv)

    from anygpu.onnx.testing import (node_cases, read_expected, reason_for, run_case,
                                     write_expected)

    start = time.perf_counter()
    cases = node_cases()
    if args.pattern:
        rx = re.compile(args.pattern)
        cases = [c for c in cases if rx.search(c.name)]
    expected = read_expected()
    results = []
    for i, case in enumerate(cases, 1):
        r = run_case(case, args.device, args.timeout)
        results.append(r)
        if not args.verbose and (i % 200 == 0 or i == len(cases)):
            done = collections.Counter(x.status for x in results)
            print(f"[{i}/{len(cases)}] {done['pass']} passed, {done['fail']} failed, "
                  f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        if args.verbose:
            extra = f"  {r.message}" if r.message else ""
            print(f"{r.status.upper():4} {r.seconds:6.2f}s {r.name}{extra}", flush=True)
    total = time.perf_counter() - start
    counts = collections.Counter(r.status for r in results)
    failed = {r.name: r.message for r in results if r.status == "fail"}
    new = sorted(n for n in failed if n not in expected)
    fixed = sorted(r.name for r in results if r.status == "pass" and r.name in expected)
    print(f"\n{len(results)} node tests on {args.device}: {counts['pass']} passed, "
          f"{counts['fail']} failed, {counts['skip']} skipped in {total:.0f} s")
    if args.slowest:
        for r in sorted(results, key=lambda r: -r.seconds)[:args.slowest]:
            print(f"  {r.seconds:7.2f}s {r.name}")
    if args.write_expected:
        # tests not run keep their entries; a listed reason outlives the raw error message
        kept = {n: m for n, m in expected.items() if n not in {r.name for r in results}}
        reasons = {n: expected.get(n) or reason_for(m) for n, m in failed.items()}
        write_expected({**kept, **reasons})
        print(f"wrote {len(kept) + len(reasons)} expected failures")
        return 0
    if fixed:
        print(f"{len(fixed)} listed as expected failures pass now: {' '.join(fixed)}")
    if new:
        print(f"{len(new)} fail that are not listed as expected failures:")
        for n in new:
            print(f"  {n}: {failed[n]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
