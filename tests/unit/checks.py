"""What the Python tests without torch (test_shape, test_docs, test_deploy, test_metrics,
test_trace) share: counted checks, the "NAME: N passed, M failed" line every test prints, and
parts run in a work directory kept when a check failed."""
import shutil
import sys
import tempfile

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


def run_parts(name, *parts):
    """Runs each part(work) in one fresh directory, prints the summary and exits: 0 when every
    check passed (the directory removed), else 1 (kept, and said where)."""
    work = tempfile.mkdtemp(prefix=name + ".")
    try:
        for part in parts:
            part(work)
    finally:
        code = finish(name)
        if code == 0:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"logs kept in {work}")
    sys.exit(code)
