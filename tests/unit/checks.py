"""What the Python unit tests (test_shape.py, test_docs.py) share: counted checks and the
"NAME: N passed, M failed" line every test prints."""
import sys

_count = {"passed": 0, "failed": 0}


def check(cond, msg):
    if cond:
        _count["passed"] += 1
    else:
        _count["failed"] += 1
        print("FAIL: " + msg, file=sys.stderr)


def finish(name):
    """prints the summary; the exit status: 1 when a check failed"""
    print("%s: %d passed, %d failed" % (name, _count["passed"], _count["failed"]))
    return 1 if _count["failed"] else 0
