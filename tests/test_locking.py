"""torch_bridge.locking: every public manager method runs under the manager's one lock.

The threaded differential test (``test_manager_threads.py``) shows what the lock buys;
these check the wrapper itself, deterministically: the public API is all wrapped, a call
waits while another thread holds the lock, the lock is re-entrant, and a wrapped method
takes exactly the arguments (and defaults, by identity) the method takes.
"""

from __future__ import annotations

import inspect
import threading

import pytest

torch = pytest.importorskip("torch")

from torch_bridge import PositionConfig, PositionManager, RopeManager  # noqa: E402
from torch_bridge.locking import serialized  # noqa: E402

import jaxrope as jr  # noqa: E402


def _public(cls):
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") or isinstance(inspect.getattr_static(cls, name),
                                              (classmethod, staticmethod)):
            continue
        if isinstance(member, property):
            yield from ((f"{name}.{part}", f) for part, f in (("fget", member.fget),
                                                               ("fset", member.fset)) if f)
        elif inspect.isfunction(member):
            yield name, member


@pytest.mark.parametrize("cls", ["PositionManager", "RopeManager"])
def test_every_public_method_and_property_of_the_managers_takes_the_lock(cls):
    cls = {"PositionManager": PositionManager, "RopeManager": RopeManager}[cls]
    members = dict(_public(cls))
    expected = {"plan", "commit", "admit_retrieve", "ingest_request", "remove_request", "table.fget"}
    if cls is RopeManager:
        expected |= {"apply_qk", "apply_qk_and_append_kv", "launcher.fget", "launcher.fset"}
    assert expected <= set(members), expected - set(members)
    bare = [name for name, f in members.items() if not getattr(f, "__serialized__", False)]
    assert not bare, bare


def test_a_subclass_of_an_engine_is_serialized_too():
    class Engine(PositionManager):
        def extra(self) -> int:
            return 1

    assert Engine.extra.__serialized__ and Engine.extra(Engine(PositionConfig(), "cpu")) == 1


def test_a_call_waits_while_another_thread_holds_the_lock():
    mgr = RopeManager(PositionConfig(rope=jr.RopeConfig(head_dim=8)), "cpu")
    mgr.ingest_request("r0")
    done = threading.Event()
    worker = threading.Thread(target=lambda: (mgr.ingest_request("r1", {"text": 3}), done.set()))
    with mgr._lock:          # what a call on another thread holds while it runs
        worker.start()
        assert not done.wait(0.2)
        assert mgr.requests() == ["r0"]   # re-entrant: this thread's own calls go on
    assert done.wait(5) and mgr.position("r1", "text") == 3
    worker.join()


def test_the_wrapper_passes_every_argument_kind_and_the_defaults_themselves():
    marker = object()

    @serialized
    class Target:
        def __init__(self):
            self._lock = threading.RLock()

        def call(self, a, b=marker, /, c=(), *rest, d, e=marker, **extra):
            return a, b, c, rest, d, e, extra

    target = Target()
    assert target.call(1, d=4) == (1, marker, (), (), 4, marker, {})
    assert target.call(1, 2, 3, 9, 8, d=4, e=5, f=6) == (1, 2, 3, (9, 8), 4, 5, {"f": 6})
    assert str(inspect.signature(Target.call)) == str(inspect.signature(Target.call.__wrapped__))
    with pytest.raises(TypeError, match=r"Target.call\(\) missing 1 required keyword-only "
                                        r"argument: 'd'"):
        target.call(1)
