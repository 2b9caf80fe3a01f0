"""One re-entrant lock per manager, taken once by every public method and property.

An engine thread (plan, ``apply_qk``, commit, preplan) and a KV-transfer thread (admit,
publish, ingest, remove: a disaggregated decode engine's) may share one manager. Every
public method reads or writes the same few objects (the counters, the slot map, the
plans, the upload's ring and graph buffers), most of them replaced rather than mutated
in place (a commit builds the new counters, then installs them), so two calls that
overlap lose one's work or index past an array the other has just grown. The lock
makes each public call atomic with respect to the others: what one call sees and
leaves is what some order of whole calls would see and leave.

:func:`serialized` wraps, in one place, every public function and property a class
defines (not its ``_private`` helpers, which run under the caller's lock);
:class:`~torch_bridge.PositionManager` applies it to itself and, through
``__init_subclass__``, to every subclass (``RopeManager``, an engine's own). The lock
is re-entrant, so a public method that calls another (``live`` calls ``pos_ids``)
takes it once more at no risk. ``apply_qk`` holds it across its launch: on CUDA the
launch is queued in microseconds; on the JAX path of a CPU manager the call runs
while the lock is held, and a transfer thread waits that long.

Its cost is one Python call with the method's own signature (built once, as
``dataclasses`` builds ``__init__``) and one uncontended ``RLock`` acquire and release
per public call: small beside a plan + commit (bench/RESULTS.md has both).

Example:
  >>> import threading
  >>> @serialized
  ... class Counter:
  ...     def __init__(self):
  ...         self._lock, self.value = threading.RLock(), 0
  ...     def add(self, n):
  ...         value = self.value       # read, then write: lost updates without the lock
  ...         self.value = value + n
  >>> counter = Counter()
  >>> threads = [threading.Thread(target=lambda: [counter.add(1) for _ in range(10000)])
  ...            for _ in range(4)]
  >>> for t in threads: t.start()
  >>> for t in threads: t.join()
  >>> counter.value
  40000
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional, TypeVar

import torch

__all__ = ["serialized", "traceable"]

T = TypeVar("T", bound=type)


class _Default:
    """A parameter default printed as the name the wrapper's namespace binds it to."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


# The wrapper's source: the method's own parameters, so that a call binds them once (a
# ``*args, **kwargs`` wrapper builds a tuple and a dict per call, twice the cost), and
# acquire / release rather than a ``with`` statement (whose ``__exit__`` call costs as much
# again). Every plan and commit pays this. A method marked :func:`traceable` takes no lock
# while torch.compile traces it (Dynamo cannot trace a lock and would break the graph
# there): the method then records a custom op, whose implementation calls the method
# again at run time, and that call takes the lock.
_WRAPPER = """def {name}{parameters}:{compile_check}
    _serialized_lock = {instance}._lock
    _serialized_lock.acquire()
    try:
        return _serialized_method({arguments})
    finally:
        _serialized_lock.release()
"""


def _locked(method: Optional[Callable[..., Any]]) -> Optional[Callable[..., Any]]:
    """``method`` run under ``self._lock``, with ``method``'s signature (None stays None:
    a property's missing setter)."""
    if method is None or getattr(method, "__serialized__", False):
        return method
    namespace: dict = {"_serialized_method": method, "_compiling": torch.compiler.is_compiling}
    compile_check = ""
    if getattr(method, "__traceable__", False):
        compile_check = "\n    if _compiling():\n        return _serialized_method({arguments})"
    parameters, arguments = [], []
    for i, parameter in enumerate(inspect.signature(method).parameters.values()):
        if parameter.default is not parameter.empty:
            namespace[f"_default{i}"] = parameter.default
            parameter = parameter.replace(default=_Default(f"_default{i}"))
        parameters.append(parameter.replace(annotation=parameter.empty))
        star = {parameter.VAR_POSITIONAL: "*", parameter.VAR_KEYWORD: "**"}.get(parameter.kind, "")
        keyword = parameter.kind is parameter.KEYWORD_ONLY
        arguments.append(f"{parameter.name}={parameter.name}" if keyword else star + parameter.name)
    signature = inspect.Signature(parameters)
    arguments = ", ".join(arguments)
    exec(_WRAPPER.format(  # noqa: S102 - our own source
        name=method.__name__, parameters=signature, instance=parameters[0].name,
        arguments=arguments, compile_check=compile_check.format(arguments=arguments)), namespace)
    locked = functools.wraps(method)(namespace[method.__name__])
    locked.__serialized__ = True  # type: ignore[attr-defined]
    return locked


F = TypeVar("F", bound=Callable[..., Any])


def traceable(method: F) -> F:
    """Mark a public method that ``torch.compile`` may trace (one that records a custom op
    when compiling): its lock wrapper then takes no lock while tracing."""
    method.__traceable__ = True  # type: ignore[attr-defined]
    return method


def serialized(cls: T) -> T:
    """Wrap every public function and property ``cls`` itself defines so that it runs under
    the instance's ``_lock`` (a ``threading.RLock`` its ``__init__`` creates first).

    Class and static methods are left alone (they hold no instance state), as are names
    starting with ``_``. Applying it twice wraps nothing twice.

    Returns:
      ``cls``, changed in place.
    """
    for name, member in list(vars(cls).items()):
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            setattr(cls, name, property(_locked(member.fget), _locked(member.fset),
                                        _locked(member.fdel), member.__doc__))
        elif inspect.isfunction(member):
            setattr(cls, name, _locked(member))
    return cls
