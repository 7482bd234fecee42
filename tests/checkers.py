"""Reward checks for worker-pool tests: module-level (picklable) and light to import, since
every fresh worker process imports this module."""

import time


def sleep_then(seconds, value):
    time.sleep(seconds)
    return value


def hang(*args):
    time.sleep(60)


def fraction_equal(completion, target, seconds=0.0):
    """A slow reward check: the fraction of completion tokens equal to `target`."""
    time.sleep(seconds)
    return sum(t == target for t in completion) / len(completion) if completion else 0.0


def shout(n):
    """A tool that prints far more than any observation may hold."""
    return "x" * n


def connect(port):
    """A tool that tries the network: a TCP connection to 127.0.0.1:port."""
    import socket

    s = socket.create_connection(("127.0.0.1", port), timeout=2)
    s.close()
    return "connected"


def write_here(name):
    """A tool that writes a file in its working directory and says where that is."""
    import os

    with open(name, "w") as f:
        f.write("scratch")
    return os.getcwd()


def environment():
    """A tool that reports what it can see of its process's environment, both ways."""
    import os

    try:
        started = open("/proc/self/environ", "rb").read().decode(errors="replace")
    except OSError as e:  # the sandbox mounts no /proc
        started = f"no /proc: {type(e).__name__}"
    return repr(dict(os.environ)) + started


def reach(paths, pid):
    """A tool that tries what it must not: read each of `paths`, write beside the first, signal
    process `pid` (its learner's). Returns one line per attempt: what happened."""
    import os

    out = []
    for path in paths:
        try:
            with open(path, "rb") as f:
                out.append(f"read {path}: {f.read(64)!r}")
        except OSError as e:
            out.append(f"refused {path}: {type(e).__name__}")
    for attempt, act in (("write", lambda: open(os.path.join(os.path.dirname(paths[0]), "planted"), "w")),
                         ("signal", lambda: os.kill(pid, 0))):
        try:
            act()
            out.append(f"{attempt} done")
        except OSError as e:
            out.append(f"refused {attempt}: {type(e).__name__}")
    return "\n".join(out)


def fork_children(n, name, then_hang=False):
    """A tool that forks `n` children named `name` (each sleeps a minute) and, with `then_hang`,
    hangs itself. Returns how many forks succeeded."""
    import ctypes
    import os
    import time

    made = 0
    for _ in range(n):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME: /proc/PID/comm
            os.setsid()  # out of the worker's process group: only the namespace still holds it
            time.sleep(60)
            os._exit(0)
        made += 1
    if then_hang:
        time.sleep(60)
    return str(made)


def write_fd(n):
    """A tool that writes `n` bytes straight to file descriptor 1, past Python's streams."""
    import os

    view = memoryview(b"w" * n)
    while view:
        view = view[os.write(1, view):]
    return "wrote"
