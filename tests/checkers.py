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

    return repr(dict(os.environ)) + open("/proc/self/environ", "rb").read().decode(errors="replace")
