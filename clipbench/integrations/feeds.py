"""What an engine's loss call feeds clipbench's loss (`Feeds`), declared once per engine, and every
refusal of a run's components derived from it and the registries' metadata.

    FEEDS = Feeds("TRL's loss call", passes=("entropy",), corrections=Counterparts(...), ...)
    FEEDS.refusal("aggregation", "prompt-mean")   # "aggregation 'prompt-mean' reads each row's prompt
                                                  #  group, which TRL's loss call does not pass"
    FEEDS.refusal("objective", "grpo")            # None: the engine can run it
    FEEDS.settings("correction", slot)            # a mapped component's own settings in the engine
    FEEDS.describe("objective")                   # what `clipbench engines` shows

The declarations sit where each engine's loss call is written: the built-in loop's in
engines/builtin.py, TRL's (ClipbenchGRPOTrainer) in integrations/trl_settings.py, verl's (its
registered policy losses and the launcher's overrides) in integrations/verl_settings.py.
engines/keys.py judges every component key of a run config (config.schema.SLOTS) by them, and the
trainers' own entry points refuse by them too.

A slot's components are either run by clipbench's own code (`OWN`: every registered one whose needs
the call passes) or mapped onto the engine's own (`Counterparts`: by name, each one's settings and
the parameters it needs). What a component needs is its registry's metadata (`needs`): the given
inputs a rule reads (objectives.inputs.GIVEN), and each row's prompt group (`GROUPS`) for an
aggregation registered with needs_groups. A rule is always clipbench's own (it is the engine's loss).
So a component registered later that an engine cannot feed is refused at the preflight in one line,
not on the engine's workers. Nothing here imports torch until a registry is read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from clipbench.config.schema import SLOTS

GROUPS = "groups"  # each row's prompt group (objectives.inputs.Counts.groups): an aggregation with needs_groups
OWN = None  # a slot clipbench's own code runs: every registered component whose needs the call passes
Params = Mapping[str, Any]


@dataclass(frozen=True)
class Counterpart:
    """The engine's own counterpart of one component: its settings (a mapping, or a function of the
    component's validated parameters), and the parameters it needs (`when`; `only`: the same in
    words, shown and said in the refusal)."""

    settings: Mapping[str, Any] | Callable[[Params], dict] = field(default_factory=dict)
    only: str = ""
    when: Callable[[Params], bool] | None = None

    def of(self, params: Params) -> dict[str, Any]:
        return dict(self.settings(params) if callable(self.settings) else self.settings)


@dataclass(frozen=True)
class Counterparts:
    """A slot mapped onto the engine's own setting (`setting`, in words): the components it has
    (`of`, by clipbench's name); `note` ends a refusal (what to use instead)."""

    setting: str
    of: Mapping[str, Counterpart]
    note: str = ""

    def refusal(self, noun: str, name: str, params: Params) -> str | None:
        found = self.of.get(name)
        if found is None:
            why = f"{noun} '{name}' has no counterpart in {self.setting} (it has {', '.join(self.of)})"
        elif found.when is not None and not found.when(params):
            why = f"{noun} '{name}' has a counterpart in {self.setting} only with {found.only}"
        else:
            return None
        return why + (f"; {self.note}" if self.note else "")


@dataclass(frozen=True)
class Feeds:
    """What one engine's loss call passes to clipbench's loss, and how it runs each slot.

    call:          the loss call, in words ("TRL's loss call"): the refusals name it
    passes:        the given rule inputs (objectives.inputs.GIVEN fields) and GROUPS it passes
    aggregations:  OWN (clipbench's aggregation is the loss's) or the engine's own Counterparts
    corrections:   OWN (clipbench's sampler correction) or the engine's own Counterparts
    advantages:    OWN (clipbench's advantage estimator) or the engine's own Counterparts
    """

    call: str
    passes: tuple[str, ...] = ()
    aggregations: Counterparts | None = OWN
    corrections: Counterparts | None = OWN
    advantages: Counterparts | None = OWN

    def mapped(self, slot: str) -> Counterparts | None:
        """The engine's own counterparts of a slot's components, or OWN (the objective: always OWN)."""
        return {"aggregation": self.aggregations, "correction": self.corrections, "advantage": self.advantages}.get(
            slot, OWN
        )

    def refusal(self, slot: str, name: str, params: Params | None = None) -> str | None:
        """Why the engine cannot run component `name` (with its validated `params`) in `slot`
        (config.schema.SLOTS: objective, correction, aggregation, advantage), or None."""
        noun = SLOTS[slot].noun
        mapped = self.mapped(slot)
        if mapped is not OWN:
            return mapped.refusal(noun, name, params or {})
        missing = [n for n in needs(slot, name) if n not in self.passes]
        if not missing:
            return None
        return f"{noun} '{name}' reads {_what(missing[0])}, which {self.call} does not pass"

    def settings(self, slot: str, component) -> dict[str, Any]:
        """The engine's own settings of a (validated) component `Slot` of a mapped slot."""
        return self.mapped(slot).of[component.name].of(component.params)

    def describe(self, slot: str) -> str:
        """What the engine runs of the slot's registry, derived (`clipbench engines`): '' when every
        registered component."""
        mapped = self.mapped(slot)
        refused = [n for n in components(slot) if self.refusal(slot, n, _defaults(slot, n))]
        if mapped is not OWN:
            has = ", ".join(f"{n} ({c.only})" if c.only else n for n, c in mapped.of.items())
            return f"has {has}" + (f"; no counterpart: {', '.join(refused)}" if refused else "")
        if not refused:
            return ""
        shown = [f"{n} (reads {', '.join(_short(m) for m in needs(slot, n) if m not in self.passes)})" for n in refused]
        return "refused: " + ", ".join(shown)

    def passes_line(self) -> str:
        """The given inputs and prompt groups the call passes, in words (`clipbench engines`)."""
        return ", ".join(map(_short, self.passes)) if self.passes else "none"


# ---------------------------------------------------------------------------------------------
# The registries' metadata


def components(slot: str) -> list[str]:
    """The names a slot's registry holds now (plugins included; the correction 'none' first)."""
    # PLC0415, deferred: the registries pull in torch
    from clipbench.config.slots import slot_components  # noqa: PLC0415

    return list(slot_components(slot))


def needs(slot: str, name: str) -> tuple[str, ...]:
    """What component `name` of `slot` reads from the engine's loss call, by its registry's
    metadata: a rule, the given inputs it names; an aggregation with needs_groups, GROUPS."""
    # PLC0415, deferred: the registries pull in torch
    from clipbench.objectives import METHODS  # noqa: PLC0415
    from clipbench.objectives.aggregation import needs_groups  # noqa: PLC0415
    from clipbench.objectives.inputs import GIVEN  # noqa: PLC0415

    if slot == "objective":
        return tuple(i for i in METHODS.lookup(name).inputs if i in GIVEN)
    if slot == "aggregation":
        return (GROUPS,) if needs_groups(name) else ()
    return ()


def _what(need: str) -> str:
    """A need in words: a given input's hint and name, or the prompt groups."""
    from clipbench.objectives.inputs import GIVEN  # noqa: PLC0415 - objectives pulls in torch

    return "each row's prompt group" if need == GROUPS else f"{GIVEN[need]['hint']} (the input '{need}')"


def _short(need: str) -> str:
    return "prompt groups" if need == GROUPS else need


def _defaults(slot: str, name: str) -> dict[str, Any]:
    """The component's default parameters (what `describe` judges a mapped one by)."""
    # PLC0415, deferred: the registries pull in torch
    from clipbench.config.slots import slot_components  # noqa: PLC0415

    return dict(slot_components(slot).get(name, {}))
