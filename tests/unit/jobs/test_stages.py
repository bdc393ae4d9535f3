"""The per-stage node timers: laps accumulate per stage, snapshots difference cleanly."""

from __future__ import annotations

import threading

from app.jobs.distributed.stages import Lap, StageClock, diff_snapshots


def test_laps_accumulate_per_stage_and_count_each_one() -> None:
    clock = StageClock()
    for _ in range(3):
        lap = Lap(clock)
        sum(range(1000))
        lap("claim")
        lap("store")
    snap = clock.snapshot()
    assert set(snap["stages"]) == {"claim", "store"}
    assert snap["stages"]["claim"][2] == 3
    assert snap["stages"]["store"][2] == 3
    assert all(wall >= 0 and cpu >= 0 for wall, cpu, _ in snap["stages"].values())


def test_a_snapshot_difference_counts_only_what_happened_between() -> None:
    clock = StageClock()
    clock.add("claim", 1.0, 0.5)
    before = clock.snapshot()
    clock.add("claim", 2.0, 0.25)
    clock.add("publish", 0.1, 0.1)
    diff = diff_snapshots(before, clock.snapshot())
    assert diff["stages"]["claim"] == [2.0, 0.25, 1]
    assert diff["stages"]["publish"] == [0.1, 0.1, 1]
    assert diff["peak_rss_kb"] > 0


def test_named_threads_report_their_cpu_time() -> None:
    clock = StageClock()
    done = threading.Event()
    started = threading.Event()

    def work() -> None:
        clock.name_thread("loop")
        started.set()
        done.wait()

    thread = threading.Thread(target=work)
    thread.start()
    started.wait()
    snap = clock.snapshot()
    done.set()
    thread.join()
    assert "loop" in snap["threads"]
    assert snap["threads"]["loop"] >= 0.0


def test_concurrent_adds_are_not_lost() -> None:
    clock = StageClock()

    def add() -> None:
        for _ in range(2000):
            clock.add("store", 0.0, 0.0)

    threads = [threading.Thread(target=add) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert clock.snapshot()["stages"]["store"][2] == 8000


def test_node_store_committer_threads_report_their_cpu_time() -> None:
    # the group commit's committer thread is found by its name (the db layer knows no stage clock)
    clock = StageClock()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="group-commit", daemon=True)
    thread.start()
    try:
        snap = clock.snapshot()
    finally:
        stop.set()
        thread.join()
    assert snap["threads"]["committer"] >= 0  # (other tests' idle committers may add theirs)
