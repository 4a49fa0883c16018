"""FSDP units: the groups of parameters that are gathered together, one per module.

A unit is a module whose parameters are gathered just before it runs and freed
after it returns. Every parameter belongs to the innermost unit that contains
its module; what no unit contains belongs to the *root* unit, gathered for the
whole of ``apply`` (as torch FSDP2 treats the root). A parameter used by modules
of different units (tied weights: GPT-2's embedding is also its output layer)
belongs to the innermost unit that contains all of them, the root at worst, so it
is gathered for as long as any of its users may run.

``units='auto'`` splits the model top-down: a module holding more than 1/8 of the
parameters is split into its children (unless it holds over a tenth of them
itself), and a module holding less than 1/256 stays with its enclosing unit; so
transformer blocks, ResNet stages and the layers of an MLP each become a unit. A
module that uses another unit's parameters outside that unit's forward gets them
gathered on the spot (``_fsdp_plan.Absent``). Or name the units: module paths
(``['h.0', 'h.1']``), module classes (``{Block}``), or a function
``(path, module) -> bool``; ``None`` keeps everything in the root unit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["Unit", "choose", "named_modules"]


@dataclasses.dataclass
class Unit:
    name: str  # the module's path; '' for the root
    module: nn.Module | None  # None for the root unit
    params: list[str]  # parameter names (functional's keys)


def _selected(
    skeleton: nn.Module, numel: dict[str, int], policy: Any, where: str, option: str = "fsdp_units"
) -> set[int]:
    """ids of the modules chosen as units (the root is always one), or as ``option``'s."""
    modules = dict(skeleton.named_modules())
    if policy is None:
        return set()
    if policy == "auto":
        return _auto(skeleton, numel)
    if callable(policy) and not isinstance(policy, type):
        return {id(m) for name, m in modules.items() if name and policy(name, m)}
    items = list(policy) if isinstance(policy, (list, tuple, set, frozenset)) else [policy]
    chosen: set[int] = set()
    for item in items:
        if isinstance(item, type) and issubclass(item, nn.Module):
            chosen |= {id(m) for name, m in modules.items() if name and isinstance(m, item)}
        elif isinstance(item, str):
            if item not in modules:
                known = [n for n in modules if n][:12]
                raise ValueError(
                    f"{where}: {option} names {item!r}, which is not a submodule; "
                    f"submodules include {known}. Give module paths as in "
                    "named_modules(), module classes, or a function (path, module) -> bool."
                )
            if item:
                chosen.add(id(modules[item]))
        else:
            raise TypeError(
                f"{where}: {option} must be 'auto', None, module paths, module classes "
                f"or a function (path, module) -> bool; got {item!r}."
            )
    return chosen


def _auto(skeleton: nn.Module, numel: dict[str, int]) -> set[int]:
    subtree: dict[str, int] = {}
    for name, n in numel.items():
        parts = name.split(".")[:-1]
        for k in range(len(parts) + 1):
            key = ".".join(parts[:k])
            subtree[key] = subtree.get(key, 0) + n
    total = subtree.get("", 0)
    cap, floor = total / 8, total / 256
    chosen: set[int] = set()

    def visit(path: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            here = f"{path}.{name}" if path else name
            n = subtree.get(here, 0)
            if not n:
                continue
            below = sum(subtree.get(f"{here}.{k}", 0) for k, _ in child.named_children())
            # A module holding much of its own parameters is kept whole: its forward may
            # use its children's too (MultiheadAttention uses out_proj.weight directly).
            if n > cap and below >= 0.9 * n:
                visit(here, child)
            elif n >= floor:
                chosen.add(id(child))

    visit("", skeleton)
    return chosen


def named_modules(skeleton: nn.Module, names: Any, where: str, option: str) -> set[int]:
    """ids of the submodules that ``names`` gives: module paths, module classes, or a
    function ``(path, module) -> bool`` (as for fsdp_units, other than 'auto')."""
    return _selected(skeleton, {}, names, where, option)


def choose(
    skeleton: nn.Module, names: list[str], policy: Any, where: str
) -> tuple[list[Unit], dict[str, list[str]]]:
    """The units for the parameters ``names``, root first, then in module order.

    Returns the units and, for each parameter, the paths of the modules that own it.
    """
    params = dict(skeleton.named_parameters())
    wanted = set(names)
    numel = {n: params[n].numel() for n in names}
    chosen = _selected(skeleton, numel, policy, where)
    by_path = dict(skeleton.named_modules(remove_duplicate=False))
    first: dict[int, str] = {}
    owners: dict[str, list[str]] = {}
    for full, p in skeleton.named_parameters(remove_duplicate=False):
        name = first.setdefault(id(p), full)
        if name in wanted:
            owners.setdefault(name, []).append(full.rpartition(".")[0])

    def innermost(path: str) -> str:
        parts = path.split(".") if path else []
        for k in range(len(parts), 0, -1):
            prefix = ".".join(parts[:k])
            if id(by_path[prefix]) in chosen:
                return prefix
        return ""

    units: dict[int, Unit] = {id(skeleton): Unit("", None, [])}
    for name in names:
        paths = owners[name]
        homes = {innermost(p) for p in paths}
        if len({id(by_path[h]) for h in homes}) > 1:
            # Tied across units: the innermost unit that contains every user.
            common = paths[0].split(".")
            for p in paths[1:]:
                other = p.split(".")
                k = 0
                while k < min(len(common), len(other)) and common[k] == other[k]:
                    k += 1
                common = common[:k]
            homes = {innermost(".".join(common))}
        home = min(homes)  # one module, perhaps shared at several paths
        module = by_path[home]
        if id(module) not in units:
            units[id(module)] = Unit(home, module, [])
        units[id(module)].params.append(name)
    return [u for u in units.values() if u.params or u.module is None], owners


def check_policy(policy: Any) -> Callable | Any:
    """Reject an fsdp_units value of a wrong kind early (at functional time)."""
    if policy is None or policy == "auto" or callable(policy):
        return policy
    if isinstance(policy, (str, type)) or isinstance(policy, (list, tuple, set, frozenset)):
        return policy
    raise TypeError(
        "pardist.functional: fsdp_units must be 'auto', None, module paths, module classes "
        f"or a function (path, module) -> bool; got {policy!r}."
    )
