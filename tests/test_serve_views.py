"""What the service's reads share: a lock per key (a song's picture is computed once, and no other song's waits)."""
import gc
import weakref

from yue2_vllm.serve.views import KeyedLocks


def test_a_lock_per_key_kept_while_someone_holds_it():
    locks = KeyedLocks()
    first = locks("a")
    with first:
        assert locks("a") is first and not locks("a").acquire(blocking=False)  # the same song waits
        other = locks("b")
        assert other is not first and other.acquire(blocking=False)  # another song does not
        other.release()
    gone = weakref.ref(first)
    del first, other
    gc.collect()
    assert gone() is None  # nothing is kept for a song once no one holds its lock
