"""Config constraints, declared beside each default and checked once at start-up.

Each module that owns a config section declares it once, as a `Section`: every field's
default beside its rule. Its `config()` is the module's `default_config()` and its `rules` the
module's `RULES`; `check` walks a config against those declarations and returns every
violation with its full key, the value given and what is allowed, so a run with several
mistakes reports them all at once, before any model is built. `Rule.invalid_values` gives
values each rule must reject: the test suite generates one bad config per declared
constraint from them, so a new field cannot skip validation.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any, Callable, Optional

class ConfigError(ValueError):
    """One or more config values are out of their declared range."""


class Refused(RuntimeError):
    """The run cannot start or go on, for a reason its message names (a busy workdir, no readable
    checkpoint, no sandbox): a refusal, not a bug, so the CLIs print it without a traceback."""


STARTUP_ERRORS = (ValueError, OSError, LookupError, Refused)  # a refused config, path, file, value or state


def cli(body: Callable[[], int], verbose: bool, prog: str) -> int:
    """A command line tool's `body()`, its refusals (STARTUP_ERRORS: a `ConfigError`, a missing
    file, a value it cannot use, a `Refused`) printed as `prog: error: ...` without a traceback, exit code
    2; `verbose` lets them raise with it. Anything else (a bug) keeps its traceback."""
    try:
        return body()
    except STARTUP_ERRORS as e:
        if verbose:
            raise
        print(f"{prog}: error: {e}\n{prog}: (--verbose shows the traceback)", file=sys.stderr)
        return 2


@dataclasses.dataclass(frozen=True)
class Rule:
    allowed: Any  # what the message says is allowed (or a function giving it, for open sets)
    ok: Callable[[Any], bool]
    invalid_values: tuple = ()  # values `ok` must reject (for the generated test)

    def problem(self, key: str, value) -> Optional[str]:
        try:
            good = self.ok(value)
        except (TypeError, ValueError):
            good = False
        allowed = self.allowed() if callable(self.allowed) else self.allowed
        return None if good else f"{key}={value!r}: expected {allowed}"


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def positive() -> Rule:
    return Rule("a finite number > 0", lambda x: _num(x) and math.isfinite(x) and x > 0, (0.0, -1.0, math.nan, math.inf))


def non_negative() -> Rule:
    return Rule("a finite number >= 0", lambda x: _num(x) and math.isfinite(x) and x >= 0, (-1.0, math.nan, math.inf))


def finite() -> Rule:
    return Rule("a finite number", lambda x: _num(x) and math.isfinite(x), (math.nan, math.inf))


def unit(low_open: bool = False) -> Rule:
    """[0, 1], or (0, 1] with low_open."""
    if low_open:
        return Rule("a number in (0, 1]", lambda x: _num(x) and 0 < x <= 1, (0.0, 1.5, math.nan))
    return Rule("a number in [0, 1]", lambda x: _num(x) and 0 <= x <= 1, (-0.1, 1.5, math.nan))


def below_one() -> Rule:
    return Rule("a number in [0, 1)", lambda x: _num(x) and 0 <= x < 1, (-0.1, 1.0, math.nan))


def at_least(low: float) -> Rule:
    return Rule(f"a finite number >= {low:g}", lambda x: _num(x) and math.isfinite(x) and x >= low,
                (low - 1.0, math.nan))


def integer(low: int = 0, extra: tuple = (), high: Optional[int] = None) -> Rule:
    """An int >= low, and <= high when given (or one of `extra`, e.g. -1 meaning 'unbounded')."""
    words = (f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}") + (
        f" (or {', '.join(map(str, extra))})" if extra else "")
    bad = tuple(v for v in (low - 1, low - 2) if v not in extra)[:1] + (1.5,) + (() if high is None else (high + 1,))
    return Rule(words, lambda x: _int(x) and ((x >= low and (high is None or x <= high)) or x in extra), bad)


def one_of(*choices) -> Rule:
    return Rule(f"one of {', '.join(map(repr, choices))}", lambda x: x in choices, ("not-a-choice",))


def boolean() -> Rule:
    return Rule("True or False", lambda x: isinstance(x, bool), ("yes",))


def text() -> Rule:
    return Rule("a string", lambda x: isinstance(x, str), (3,))


def anything() -> Rule:
    """A field whose every value is checked elsewhere (e.g. a path, checked by `paths`)."""
    return Rule("anything", lambda x: True)


class Section:
    """A config section declared in one table: `Section(lr=(1e-5, positive()), delay=Section(...))`,
    each field's default beside its rule (a nested `Section` for a group of fields)."""

    def __init__(self, **fields):
        for name, f in fields.items():
            if not isinstance(f, Section) and not (isinstance(f, tuple) and len(f) == 2 and isinstance(f[1], Rule)):
                raise TypeError(f"field {name!r}: expected (default, Rule) or a Section; got {f!r}")
        self.fields = fields

    def config(self, **over):
        """The defaults as a fresh ConfigDict (`over` replaces some of them)."""
        import ml_collections

        c = ml_collections.ConfigDict({k: f.config() if isinstance(f, Section) else f[0]
                                       for k, f in self.fields.items()})
        c.update(over)
        return c

    @property
    def rules(self) -> dict:
        """{field: Rule}, nested like the section."""
        return {k: f.rules if isinstance(f, Section) else f[1] for k, f in self.fields.items()}


def flatten(rules: dict, prefix: str = "") -> dict:
    """{"delay": {"kind": rule}} -> {"delay.kind": rule}."""
    out = {}
    for k, v in rules.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def leaves(config, prefix: str = "") -> dict:
    """Every leaf of a ConfigDict as {dotted key: value} (a dict-valued field is one leaf
    unless it is itself a ConfigDict)."""
    out = {}
    for k in config.keys():
        v = config[k]
        if hasattr(v, "keys") and not isinstance(v, dict):
            out.update(leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check(config, rules: dict, prefix: str = "") -> list:
    """Violations of `rules` ({dotted key: Rule}) in `config`, each as one message line (keys
    named `prefix` + key: a section checked alone still names its full key)."""
    values = leaves(config, prefix)
    return [msg for key, rule in rules.items() if key in values
            for msg in [rule.problem(key, values[key])] if msg]


def raise_all(problems: list, what: str = "invalid config value") -> None:
    """One ConfigError listing every problem (nothing when there is none)."""
    if problems:
        s = "s" if len(problems) > 1 else ""
        raise ConfigError(f"{what}{s}:\n  " + "\n  ".join(problems))
