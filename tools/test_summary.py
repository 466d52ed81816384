#!/usr/bin/env python3
"""Prints what tools/test.sh ran: ctest's tests (passed / failed / skipped, by label), and inside the pytest
test, pytest's own counts, so that "100% tests passed" can never hide that the GPU half did not run.

    tools/test_summary.py CTEST_JUNIT.xml [PYTEST_JUNIT.xml] [GPU_TEST_NAMES.txt]

GPU_TEST_NAMES.txt: ctest's tests labelled gpu, one a line (`ctest -N -L gpu`).
"""
import collections
import os
import sys
import xml.etree.ElementTree as ET


def cases(path):
    if not os.path.exists(path):
        return []
    root = ET.parse(path).getroot()
    out = []
    for tc in root.iter("testcase"):
        status = tc.get("status")
        if tc.find("failure") is not None or tc.find("error") is not None or status == "fail":
            state = "failed"
        elif tc.find("skipped") is not None or status in ("notrun", "disabled", "skipped"):
            state = "skipped"
        else:
            state = "passed"
        skipped = tc.find("skipped")
        reason = (skipped.get("message") or "").strip() if skipped is not None else ""
        out.append((tc.get("name"), state, reason))
    return out


def main(argv):
    ctest = cases(argv[1]) if len(argv) > 1 else []
    if not ctest:
        print("test summary: no ctest results")
        return 1
    n = collections.Counter(state for _, state, _ in ctest)
    ran = n["passed"] + n["failed"]
    print(f"\n==== tests: {len(ctest)} in ctest: {ran} ran ({n['passed']} passed, {n['failed']} failed), "
          f"{n['skipped']} skipped")
    if n["skipped"]:
        gpu_names = set()
        if len(argv) > 3 and os.path.exists(argv[3]):
            gpu_names = {line.strip() for line in open(argv[3]) if line.strip()}
        gpu = sum(1 for name, state, _ in ctest if state == "skipped" and name in gpu_names)
        other = [name for name, state, _ in ctest if state == "skipped" and name not in gpu_names]
        print(f"     skipped: {n['skipped']}: {gpu} GPU tests (label gpu: no GPU visible here)"
              + (f", {len(other)} others: {', '.join(other[:5])}" if other else ""))
    py = cases(argv[2]) if len(argv) > 2 else []
    if py:
        m = collections.Counter(state for _, state, _ in py)
        reasons = collections.Counter(r.split(":")[-1].strip() or "?" for _, s, r in py if s == "skipped")
        print(f"     pytest (one ctest test): {len(py)} cases: {m['passed']} passed, {m['failed']} failed, "
              f"{m['skipped']} skipped" + (": " + "; ".join(f"{c} x {r}" for r, c in reasons.most_common(3))
                                          if reasons else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
