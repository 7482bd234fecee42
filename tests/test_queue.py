import threading
import time

import pytest

from jaxrl_llm.runtime.queue import QueueClosed, QueueTimeout, VersionedQueue


def test_concurrent_producers_bounded_no_loss_no_duplicates():
    q = VersionedQueue(maxsize=3)
    n_producers, per = 4, 200
    high_water = []
    stop = threading.Event()

    def produce(pid):
        for i in range(per):
            q.put((pid, i), version=0, timeout=10)

    def watch():
        while not stop.is_set():
            high_water.append(len(q))
            time.sleep(0.0005)

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(n_producers)]
    watcher = threading.Thread(target=watch)
    watcher.start()
    for t in threads:
        t.start()
    got = []
    for _ in range(n_producers * per):
        item, _ = q.get(learner_version=0, timeout=10)
        got.append(item)
        if len(got) % 50 == 0:
            time.sleep(0.01)  # a slow consumer: producers must block, not grow the queue
    for t in threads:
        t.join(timeout=10)
    stop.set()
    watcher.join()
    assert sorted(got) == sorted((p, i) for p in range(n_producers) for i in range(per))
    assert max(high_water) <= 3
    for p in range(n_producers):  # per-producer order is kept
        mine = [i for pid, i in got if pid == p]
        assert mine == sorted(mine)
    assert q.stats.accepted == q.stats.consumed == n_producers * per and q.stats.dropped == 0


def test_staleness_filter_is_exact():
    q = VersionedQueue(maxsize=10, max_staleness=2, policy="drop")
    for v in [0, 1, 2, 3, 4, 5]:
        q.put(f"b{v}", version=v)
    # learner at version 5: staleness 5,4,3 dropped; 2,1,0 kept (in order)
    assert [q.get(learner_version=5)[0] for _ in range(3)] == ["b3", "b4", "b5"]
    assert q.stats.dropped == 3 and q.stats.consumed == 3
    keep = VersionedQueue(maxsize=10, max_staleness=1, policy="keep")
    for v in [0, 3]:
        keep.put(v, version=v)
    assert [keep.get(learner_version=3)[0] for _ in range(2)] == [0, 3]
    assert keep.stats.over_stale == 1 and keep.stats.dropped == 0


def test_close_wakes_blocked_producer_and_drains_consumer():
    q = VersionedQueue(maxsize=1)
    q.put("a", 0)
    errors = []

    def blocked():
        try:
            q.put("b", 0)
        except QueueClosed as e:
            errors.append(e)

    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.05)
    q.close()
    t.join(timeout=5)
    assert not t.is_alive() and len(errors) == 1
    assert q.get(0, timeout=1) == ("a", 0)  # accepted items are still delivered
    with pytest.raises(QueueClosed):
        q.get(0, timeout=1)
    with pytest.raises(QueueClosed):
        q.put("c", 0)


def test_timeouts_and_bad_options():
    q = VersionedQueue(maxsize=1)
    with pytest.raises(QueueTimeout):
        q.get(0, timeout=0.05)
    q.put(1, 0)
    with pytest.raises(QueueTimeout):
        q.put(2, 0, timeout=0.05)
    with pytest.raises(ValueError, match="valid: drop, keep"):
        VersionedQueue(2, policy="skip")
    with pytest.raises(ValueError, match="maxsize"):
        VersionedQueue(0)
