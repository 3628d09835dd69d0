"""The Python tests' process starter: it imports torch once and forks each rank process a test
starts from itself, instead of a new interpreter importing torch again (about 2.7 s of CPU a
process on the suite's 2-core machine, where a test of 4 ranks starts them by the dozen), and
torch._dynamo, which the first optimizer a process builds imports (3.3 s more).

harness.spawn talks to it over a SOCK_SEQPACKET socket (the fd number in argv[1]): a request is
JSON {"argv", "env", "cwd"} with the fd its output goes to (SCM_RIGHTS); the answer is
{"pid"} (or {"error"}), and each child's end later {"exit": pid, "code"} (Popen's returncode:
the exit status, or minus the signal). A child is what `python SCRIPT ARGS` or `python -c CODE
ARGS` would be: sys.argv, sys.path[0] and PYTHONPATH's entries, the environment and the working
directory set before the script runs as __main__; atexit, sys.exit and uncaught exceptions as in
any interpreter (its teardown of the modules skipped: end()). What torch fixed when it was imported here is the same for every child (the
environment of the test); torch's thread count follows the child's OMP_NUM_THREADS. The
zygote ends when the test's end of the socket closes.
"""
import json
import os
import select
import signal
import socket
import sys

import torch  # noqa: F401  (the import every child would make; nothing runs in it here)
import torch.distributed  # noqa: F401
import torch.nn.functional  # noqa: F401
import torch.utils.checkpoint  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401

# torch.optim.Optimizer's constructor imports torch._dynamo (through torch._compile) the first
# time one is built: about 3.3 s of CPU, more than importing torch itself, in every rank process
# of every test that builds an optimizer. Build one here, so the children inherit what it loaded.
torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])

BASE_PATH = list(sys.path[1:])  # this interpreter's path without its script's directory
BASE_PYTHONPATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def child(sock, req, out_fd):
    """In the forked child: become the process req describes and run it; never returns."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    sock.close()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(null)
    os.close(out_fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base = [p for p in BASE_PATH if p not in BASE_PYTHONPATH]
    args = req["argv"][1:]
    try:
        run(args, extra, base)
        code = 0
    except SystemExit as e:  # as the interpreter reads sys.exit's argument
        if e.code is None or isinstance(e.code, int):
            code = (e.code or 0) & 0xFF
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # as the interpreter: sys.last_* set, then the hook
        sys.last_type, sys.last_value, sys.last_traceback = sys.exc_info()
        sys.last_exc = sys.last_value
        sys.excepthook(*sys.exc_info())
        code = 1
    end(code)


def end(code):
    """The interpreter's exit without its finalization: non-daemon threads joined, atexit's
    functions run, Python's and C's stdio buffers flushed, then _exit (the interpreter's teardown
    of torch's modules takes over a second, for nothing that reaches a test; C's atexit handlers
    and C++ destructors are skipped: torch's call back into Python without the GIL, and
    libshard has none: a dying rank's connections close with the process, as on a crash)."""
    import atexit
    import ctypes
    import threading
    threading._shutdown()
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    ctypes.CDLL(None).fflush(None)
    os._exit(code)


def run(args, extra, base):
    """args (python's, after the interpreter) run as __main__"""
    if args[0] == "-c":
        sys.argv = ["-c"] + args[2:]
        sys.path[:] = [""] + extra + base
        code = compile(args[1], "<string>", "exec")
        main = type(sys)("__main__")
        main.__builtins__ = __builtins__
        sys.modules["__main__"] = main
        exec(code, main.__dict__)
    else:
        import runpy
        sys.argv = args
        sys.path[:] = [os.path.dirname(os.path.abspath(args[0]))] + extra + base
        runpy.run_path(args[0], run_name="__main__")


def serve(sock):
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        while True:  # every child that ended, reported once
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            sock.send(json.dumps({"exit": pid,
                                  "code": os.waitstatus_to_exitcode(status)}).encode())
        if sock not in ready:
            continue
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 22, 1)
        if not msg:
            return  # the test ended
        req = json.loads(msg)
        if len(fds) != 1:
            sock.send(json.dumps({"error": "a request without its output fd"}).encode())
            continue
        pid = os.fork()
        if pid == 0:
            child(sock, req, fds[0])  # the child runs the request and exits from inside it
        os.close(fds[0])
        sock.send(json.dumps({"pid": pid}).encode())


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
