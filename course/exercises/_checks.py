"""The tiny check runner every exercise file uses: `python exNN_*.py` runs each `check_*` function in order.

A check passes, fails (AssertionError: the message says what was expected), or is still to do (the exercise
raises NotImplementedError with a hint, as in the student copies). Exit code 0 only when every check passes.
"""
from __future__ import annotations

import traceback


def run(namespace: dict) -> int:
    checks = [(name, fn) for name, fn in namespace.items() if name.startswith("check_") and callable(fn)]
    passed, todo, failed = 0, 0, 0
    for name, fn in checks:
        label = (fn.__doc__ or name).strip().splitlines()[0]
        try:
            fn()
        except NotImplementedError as err:
            todo += 1
            print(f"TODO  {label}\n      {err}")
        except AssertionError as err:
            failed += 1
            print(f"FAIL  {label}\n      {err}")
        except Exception:  # a bug in the learner's code: show where
            failed += 1
            print(f"ERROR {label}")
            traceback.print_exc()
        else:
            passed += 1
            print(f"ok    {label}")
    print(f"\n{passed} passed, {failed} failed, {todo} not implemented yet, of {len(checks)} checks")
    if passed == len(checks):
        print("all checks passed")
    return 0 if passed == len(checks) else 1
