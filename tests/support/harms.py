"""Things model code and a busy engine do that the observer must never turn into harm, each run in a process of its
own, with the plugin registered (as vLLM registers it) or not at all (the control).

    python -m tests.support.harms CASE on|off

prints one JSON line: what the case saw. `tests/torch/test_observer_never_harms.py` runs each case both ways under a
timeout (a hang is a timeout, a crash a signal) and compares. Every case builds real transformers caches.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import gc
import json
import os
import random
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

SAMPLE_INTERVAL_S = "0.002"  # a sampler busy all the time: whatever a sample can collide with, it does


def switch(plugin: bool) -> None:
    """Register the plugin as vLLM does (before transformers is imported), sampling every SAMPLE_INTERVAL_S."""
    if plugin:
        os.environ["KV_EXPORTER_OBSERVE_INTERVAL"] = SAMPLE_INTERVAL_S
        from kv_exporter import register

        register()


def start_sampling(plugin: bool) -> None:
    if plugin:
        from kv_exporter.plugin import observe

        observe.start(lambda observation: None)


def sample(plugin: bool) -> Any:
    if not plugin:
        return None
    from kv_exporter.plugin import observe

    return observe.observe(pause=lambda: None)


def kv(positions: int, width: int = 8) -> tuple[Any, Any]:
    import torch

    return torch.randn(1, 2, positions, width), torch.randn(1, 2, positions, width)


# -- K/V in reference cycles -------------------------------------------------------------------------------------


def cycles(plugin: bool) -> dict[str, Any]:
    """50 caches (1 MiB of K/V each) in each kind of cycle through their own attributes, dropped: all must be
    collected, their `__del__` run and their tensors freed."""
    switch(plugin)
    from transformers import DynamicCache

    class Counted(DynamicCache):
        deleted = 0

        def __del__(self) -> None:
            Counted.deleted += 1

    class Request:
        cache: Any = None

    def request(cache: Any) -> None:
        holder = Request()
        holder.cache, cache.request = cache, holder

    kinds: dict[str, Callable[[Any], None]] = {
        "self": lambda cache: setattr(cache, "me", cache),
        "layer": lambda cache: setattr(cache.layers[0], "cache", cache),
        "request": request,
        "bound_method": lambda cache: setattr(cache, "hook", cache.get_seq_length),
    }
    start_sampling(plugin)
    found: dict[str, Any] = {}
    for kind, tie in kinds.items():
        Counted.deleted = 0
        caches, tensors = [], []
        for _ in range(50):
            cache = Counted()
            cache.update(*kv(8192), 0)  # 2 x 512 KiB
            tie(cache)
            caches.append(weakref.ref(cache))
            tensors.append(weakref.ref(cache.layers[0].keys))
        sample(plugin)  # read by the ledger at least once
        del cache
        gc.collect()
        sample(plugin)
        gc.collect()
        found[kind] = {
            "alive": sum(ref() is not None for ref in caches),
            "deleted": Counted.deleted,
            "tensors alive": sum(ref() is not None for ref in tensors),
        }
    return found


# -- forks while sampling ----------------------------------------------------------------------------------------


def forks(plugin: bool) -> dict[str, Any]:
    """200 children forked at random moments while the sampler and the model thread work on 300 caches (some with
    a layer whose K is served by a slow property); each child makes, fills, samples and releases caches, then exits.
    A child that has not exited 30 s after the last fork is hung."""
    switch(plugin)
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class SlowLayer(DynamicLayer):
        @property  # type: ignore[misc]
        def keys(self) -> Any:
            time.sleep(0.0005)
            return self.__dict__.get("_slow_keys")

        @keys.setter
        def keys(self, value: Any) -> None:
            self.__dict__["_slow_keys"] = value

    caches = [DynamicCache() for _ in range(300)]
    for index, cache in enumerate(caches):
        cache.update(*kv(4), 0)
        if index % 10 == 0:
            cache.layers.append(SlowLayer())
    start_sampling(plugin)
    children, rng = [], random.Random(7)
    for _ in range(200):
        for cache in rng.sample(caches, 20):
            cache.update(*kv(1), 0)
        time.sleep(rng.uniform(0, 0.004))
        pid = os.fork()
        if pid == 0:
            _child(plugin)
        children.append(pid)
    deadline, statuses = time.monotonic() + 30, {}
    while len(statuses) < len(children) and time.monotonic() < deadline:
        for pid in children:
            if pid not in statuses:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    statuses[pid] = os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    hung = [pid for pid in children if pid not in statuses]
    for pid in hung:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    return {"forked": len(children), "hung": len(hung), "failed": sum(code != 0 for code in statuses.values())}


def _child(plugin: bool) -> None:
    try:
        from transformers import DynamicCache

        for _ in range(3):
            cache = DynamicCache()
            cache.update(*kv(4), 0)
            copied = copy.deepcopy(cache)
            sample(plugin)
            del cache, copied
            gc.collect()
        code = 0
    except BaseException:
        code = 1
    os._exit(code)


# -- a lock the model holds while it releases a cache ---------------------------------------------------------------


def lock_inversion(plugin: bool) -> dict[str, Any]:
    """The model thread holds its own lock while it drops caches; a layer class serves its K through a property
    that takes the same lock. The run must finish (the process's timeout says when it does not)."""
    switch(plugin)
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    lock = threading.Lock()

    class Guarded(DynamicLayer):
        @property  # type: ignore[misc]
        def keys(self) -> Any:
            with lock:
                return self.__dict__.get("_guarded_keys")

        @keys.setter
        def keys(self, value: Any) -> None:
            self.__dict__["_guarded_keys"] = value

    start_sampling(plugin)
    done = 0
    for _ in range(300):
        cache = DynamicCache()
        cache.layers.append(Guarded())
        cache.update(*kv(4), 0)
        kept = [DynamicCache() for _ in range(5)]
        for other in kept:
            other.update(*kv(4), 0)
        with lock:
            del cache, kept
            gc.collect()
        done += 1
    return {"finished": done}


# -- calls through wrapped methods --------------------------------------------------------------------------------


def calls(plugin: bool) -> dict[str, Any]:
    """Cache classes whose `update` (and `crop`) take every form Python allows, called validly and invalidly: every
    outcome (result, or exception type and message) must be the same with the plugin and without; and the plain
    caches beside them are still observed."""
    switch(plugin)
    import torch
    from transformers import DynamicCache
    from transformers.utils.deprecation import deprecate_kwarg

    def accepts_old_name(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)  # reports `function`'s parameters, accepts others
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            kwargs.pop("legacy", None)
            return function(self, *args, **kwargs)

        return wrapper

    def free_update(key: Any, value: Any, layer: Any, *rest: Any) -> str:
        return f"free {type(layer).__name__} {len(rest)}"

    class Callable_:
        def __call__(self, *args: Any, **kwargs: Any) -> str:
            return f"callable {len(args)} {sorted(kwargs)}"

    class Deprecated(DynamicCache):
        @deprecate_kwarg("cache_kwargs", new_name="extra", version="99.0")
        def update(self, key_states: Any, value_states: Any, layer_idx: int, extra: Any = None) -> Any:
            return DynamicCache.update(self, key_states, value_states, layer_idx)

    class Wrapped(DynamicCache):
        @accepts_old_name
        def update(self, key_states: Any, value_states: Any, layer_idx: int) -> Any:
            return DynamicCache.update(self, key_states, value_states, layer_idx)

    class Lambda(DynamicCache):
        update = lambda self, key, value, layer, *rest: DynamicCache.update(self, key, value, layer)  # noqa: E731

    class Partial(DynamicCache):
        update = functools.partial(free_update)

    class CallableObject(DynamicCache):
        update = Callable_()

    class Static(DynamicCache):
        update = staticmethod(free_update)

    class ClassMethod(DynamicCache):
        @classmethod
        def update(cls, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
            return f"classmethod {cls.__name__} {len(args)}"

    class Builtin(DynamicCache):
        update = max  # type: ignore[assignment]

    class PositionalOnly(DynamicCache):
        def update(self, key_states: Any, value_states: Any, layer_idx: int, /, cache_kwargs: Any = None) -> Any:
            return DynamicCache.update(self, key_states, value_states, layer_idx)

        def crop(self, max_length: int, /) -> None:
            DynamicCache.crop(self, max_length)

    class KeywordOnly(DynamicCache):
        def update(self, key_states: Any, value_states: Any, *, layer_idx: int, cache_kwargs: Any = None) -> Any:
            return DynamicCache.update(self, key_states, value_states, layer_idx)

    key, value = kv(3)
    attempts: dict[str, Callable[[Any], Any]] = {
        "positional": lambda c: c.update(key, value, 0),
        "keywords": lambda c: c.update(key_states=key, value_states=value, layer_idx=0),
        "layer as keyword": lambda c: c.update(key, value, layer_idx=0),
        "old keyword": lambda c: c.update(key, value, 0, cache_kwargs={}),
        "legacy keyword": lambda c: c.update(key, value, 0, legacy=True),
        "too few": lambda c: c.update(key),
        "too many": lambda c: c.update(key, value, 0, None, None, None),
        "unknown keyword": lambda c: c.update(key, value, 0, nonsense=1),
        "self as keyword": lambda c: c.update(key, value, 0, self=c),
        "unbound": lambda c: type(c).update(c, key, value, 0),
        "unbound, nothing": lambda c: type(c).update(),
        "builtin args": lambda c: c.update(1, 2),
        "crop": lambda c: c.crop(1),
        "crop as keyword": lambda c: c.crop(max_length=1),
    }
    classes = [Deprecated, Wrapped, Lambda, Partial, CallableObject, Static, ClassMethod, Builtin, PositionalOnly]
    classes.append(KeywordOnly)
    outcomes: dict[str, dict[str, Any]] = {}
    kept = []
    for cls in classes:
        found = outcomes[cls.__name__] = {}
        for name, attempt in attempts.items():
            cache = cls()
            kept.append(cache)
            try:
                result = attempt(cache)
                found[name] = ["ok", _describe(result, torch)]
            except Exception as exc:  # the outcome under test
                found[name] = ["error", type(exc).__name__, str(exc)]
    good = DynamicCache()
    good.update(*kv(16), 0)
    observation = sample(plugin)
    result: dict[str, Any] = {"outcomes": outcomes}
    if observation is not None:
        from kv_exporter.cachebytes import measure_cache_bytes

        result["state"] = observation.state.value
        result["reason"] = observation.reason
        good_bytes = measure_cache_bytes(good).allocated_bytes
        result["good counted"] = any(owner.bytes >= good_bytes for owner in observation.owners)
        result["unreadable"] = sorted({item.reason.value for item in observation.unreadable})
    return result


def _describe(result: Any, torch: Any) -> Any:
    if isinstance(result, tuple):
        return [_describe(item, torch) for item in result]
    if isinstance(result, torch.Tensor):
        return ["tensor", list(result.shape)]
    return repr(result)


# -- a release while the ledger reads, a sample before `__init__` ---------------------------------------------------


def release_mid_reading(plugin: bool) -> dict[str, Any]:
    """A declarer's child makes a cache of the declared geometry; at its first reading (which asks whether the
    geometry is declared) the model drops it. Later samples must show nothing held. And a sample landing between a
    cache's `__new__` and its `__init__` must neither count it unreadable nor warn."""
    switch(plugin)
    import torch
    from torch import nn
    from transformers import DynamicCache

    from kv_exporter.manifest import Declaration
    from kv_exporter.plugin import observe
    from kv_exporter.plugin.observe.owners import ModelMap
    from tests.support.cache_models import declare, full_config

    config = full_config()
    kept: list[Any] = []

    class Child(nn.Module):
        def forward(self) -> None:
            cache = DynamicCache()
            for layer in range(config.num_hidden_layers):
                cache.update(*kv(4, config.head_dim), layer)
            kept.append(cache)

    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.child = Child()

    model = Parent()
    declaration = Declaration.from_spec("", declare(config, torch.float32, 8, "a window"))
    found: dict[str, Any] = {}
    warned: list[str] = []
    if plugin:
        import logging

        handler = logging.Handler()
        handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("vllm.kv_exporter").addHandler(handler)
        observe.attach(model, [declaration])
        declares = ModelMap.declares

        def dropping(self: ModelMap, owner: str, shape: Any) -> bool:
            kept.clear()  # the model lets the cache go while the ledger reads it
            gc.collect()
            return declares(self, owner, shape)

        ModelMap.declares = dropping  # type: ignore[method-assign]
        model.child()
        samples = [observe.observe(pause=lambda: None) for _ in range(3)]
        ModelMap.declares = declares  # type: ignore[method-assign]
        found["later"] = [
            [(o.owner, o.bytes, o.peak_bytes, o.caches) for o in s.owners if o.bytes or o.peak_bytes or o.caches]
            for s in samples[1:]
        ]

        class SampledEarly(DynamicCache):
            def __init__(self) -> None:
                found["before init"] = [
                    [item.reason.value, item.caches] for item in observe.observe(pause=lambda: None).unreadable
                ]
                super().__init__()

        early = SampledEarly()
        early.update(*kv(4), 0)
        found["after init"] = [[item.reason.value, item.caches] for item in observe.observe().unreadable]
        found["warnings"] = [text for text in warned if "cannot be read" in text]
    else:
        model.child()
        kept.clear()
    return found


# -- memory after a crowd of caches ----------------------------------------------------------------------------------


def crowd(plugin: bool) -> dict[str, Any]:
    """300,000 caches live at once (each updated once, so each holds K and V), sampled, then freed: what the process
    keeps afterwards (RSS) is compared with the control's."""
    switch(plugin)
    from transformers import DynamicCache

    key, value = kv(1, 2)
    baseline = _rss()
    caches = []
    for _ in range(300_000):
        cache = DynamicCache()
        cache.update(key.clone(), value.clone(), 0)
        caches.append(cache)
    sample(plugin)
    peak = _rss()
    del caches, cache
    gc.collect()
    sample(plugin)
    sample(plugin)
    gc.collect()
    # Freed heap that glibc has not handed back yet is the allocator's, not anything kept: without a trim the
    # control alone kept 272.8-279.8 MiB over runs and the plugin's arm 277-284 MiB, before and after this stop's
    # changes alike, which put one fresh clone's +10.2 MiB across the 10 MiB bound. Both arms are trimmed alike.
    ctypes.CDLL(None).malloc_trim(0)
    return {"kept MiB": (_rss() - baseline) / 2**20, "peak MiB": (peak - baseline) / 2**20}


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


CASES: dict[str, Callable[[bool], dict[str, Any]]] = {
    "cycles": cycles,
    "forks": forks,
    "lock_inversion": lock_inversion,
    "calls": calls,
    "release_mid_reading": release_mid_reading,
    "crowd": crowd,
}


def main() -> None:
    case, mode = sys.argv[1], sys.argv[2]
    result = CASES[case](mode == "on")
    print(json.dumps(result), flush=True)
    os._exit(0)  # no exit handlers: a hung sampler thread must not hide a result


if __name__ == "__main__":
    main()
