import resource
import sys

import pytest

from pagedattn.runtime import frames
from pagedattn.runtime.frames import call_with_frame_room

CALLS = 200


def _big_frame():
    return 1


# a callee whose frame (~8 KiB) often does not fit in what is left of a 16 KiB chunk
_big_frame.__code__ = _big_frame.__code__.replace(co_stacksize=_big_frame.__code__.co_stacksize + 1024)


def _calls() -> int:
    return sum(_big_frame() for _ in range(CALLS))


def _at_depth(depth: int, fn):
    return _at_depth(depth - 1, fn) if depth else fn()


def _faults(depth: int, room: bool) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    _at_depth(depth, (lambda: call_with_frame_room(_calls)) if room else _calls)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(sys.version_info < (3, 11), reason="frames are heap objects before CPython 3.11")
def test_calls_at_any_depth_do_not_map_a_chunk_each():
    depths = range(0, 160, 3)
    without = max(_faults(d, room=False) for d in depths)
    if without < CALLS:
        pytest.skip("this CPython keeps its frame-stack chunks: nothing to work around")
    # some depth faulted in a fresh chunk for every call; with room, no depth does
    assert max(_faults(d, room=True) for d in depths) < CALLS // 10


def test_returns_raises_and_nests():
    assert call_with_frame_room(lambda: 7) == 7
    with pytest.raises(KeyError):
        call_with_frame_room(lambda: {}["x"])
    assert not frames._inside.active  # an exception leaves no state for the next call
    # a nested call runs in the outer one's room, without a spacer frame of its own
    assert call_with_frame_room(lambda: call_with_frame_room(lambda: sys._getframe().f_back.f_code.co_name)) \
        == "call_with_frame_room"


def test_each_thread_gets_its_own_room():
    # a serving thread's steps get their spacer even while another thread runs inside one (the flag is per thread)
    import threading

    frames_seen = {}
    inside = threading.Event()
    release = threading.Event()

    def outer():
        def hold():
            inside.set()
            release.wait(10)
        call_with_frame_room(hold)

    def other():
        frames_seen["other"] = call_with_frame_room(lambda: sys._getframe().f_back.f_code.co_name)

    t1 = threading.Thread(target=outer)
    t1.start()
    assert inside.wait(10)
    t2 = threading.Thread(target=other)
    t2.start()
    t2.join(10)
    release.set()
    t1.join(10)
    assert frames_seen["other"] == "_call"  # the spacer's own frame, not call_with_frame_room's pass-through
