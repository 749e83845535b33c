"""The driver's and the trainers' garbage-collection pauses (rl_launcher.infra.gc_pauses)."""

import gc

from rl_launcher.infra.gc_pauses import GcPauses, freeze_startup


def test_pauses_are_counted_per_take_and_stop_after_close():
    pauses = GcPauses()
    gc.disable()  # only the collections below
    try:
        gc.collect()  # a full collection
        gc.collect(0)
        taken = pauses.take()
        assert taken["gc/collections_full"] == 1
        assert taken["time/gc"] >= taken["time/gc_max"] > 0
        assert pauses.take() == {"time/gc": 0.0, "time/gc_max": 0.0, "gc/collections_full": 0.0}
    finally:
        gc.enable()
        pauses.close()
    gc.collect()
    assert pauses.take() == {"time/gc": 0.0, "time/gc_max": 0.0, "gc/collections_full": 0.0}
    pauses.close()  # twice is harmless


def test_freeze_excludes_what_exists_from_later_collections():
    try:
        alive = [[i] for i in range(1000)]  # tracked objects created before the freeze
        frozen = freeze_startup()
        assert frozen >= len(alive) and gc.get_freeze_count() == frozen
        assert not any(obj is alive for obj in gc.get_objects())  # no longer walked
    finally:
        gc.unfreeze()
