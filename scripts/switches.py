"""Experiment switches for the benchmarks: an integer attribute of one of coda_cute's op modules
(``mlp_fp8.SIDE_SMS_DOWN_WGRAD``, ``attention_fp8.SIDE_SMS_QKV_FORWARD``, ...) set while a timed
step runs, forward and backward both, so that a switch is timed in the same turns as the default."""

from __future__ import annotations

import importlib
import re
from typing import Callable

#: the op modules whose integer switches a benchmark may set
OWNERS = ("mlp_fp8", "attention_fp8")


def parse(items, owners: tuple = OWNERS) -> list:
    """``[MODULE.]NAME=VALUE`` strings as (module, name, value) triples: MODULE one of ``owners``
    (default the first), NAME an integer attribute of it, VALUE an integer. A ValueError names the
    item and the rule."""
    settings = []
    for item in items:
        key, sep, value = item.partition("=")
        owner, _, name = key.rpartition(".")
        owner = owner or owners[0]
        if not sep or owner not in owners or not re.fullmatch(r"-?\d+", value):
            raise ValueError(f"a switch is [MODULE.]NAME=VALUE with MODULE one of {owners} and VALUE an integer, "
                             f"got {item!r}")
        module = importlib.import_module(f"coda_cute.ops.{owner}")
        current = getattr(module, name, None)
        if not isinstance(current, int) or isinstance(current, bool):
            raise ValueError(f"{owner}.{name} is not an integer switch (got {item!r})")
        settings.append((module, name, int(value)))
    return settings


def label(settings) -> str:
    """``module.NAME=VALUE, ...`` for a table or a JSON record."""
    return ", ".join(f"{m.__name__.rsplit('.', 1)[-1]}.{name}={value}" for m, name, value in settings)


def switched(step: Callable, settings) -> Callable:
    """``step`` with each (module, name, value) of ``settings`` set while it runs, restored after."""
    def run():
        before = [getattr(m, name) for m, name, _ in settings]
        for m, name, value in settings:
            setattr(m, name, value)
        try:
            return step()
        finally:
            for (m, name, _), value in zip(settings, before):
                setattr(m, name, value)
    return run
