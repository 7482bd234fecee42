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
