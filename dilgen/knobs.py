"""dilgen's boolean environment knobs, read by one parser.

On: 1, true, yes, on. Off: 0, false, no, off, or empty (case and surrounding blanks do
not matter). Anything else is one KnobError naming the variable, the value and the
words it takes, never a guess.

  DILGEN_ALWAYS_COMPILE            default off
  DILGEN_POISON                    default off
  DILGEN_INTERPRET_OVERFLOW_CHECK  default off
  DILGEN_AOT                       default on
  DILGEN_REPLAY                    default on
  DILGEN_RING_LANE_WINDOWS         default off
"""
from __future__ import annotations

import os

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off", "")


class KnobError(ValueError):
    """A boolean environment variable holds a value that is neither on nor off."""


def flag(variable: str, default: bool) -> bool:
    """The boolean knob `variable` as set in the environment now, `default` when unset."""
    value = os.environ.get(variable)
    if value is None:
        return default
    word = value.strip().lower()
    if word in ON:
        return True
    if word in OFF:
        return False
    raise KnobError(f"{variable}={value!r} is not a boolean: set it to one of "
                    f"{', '.join(ON)} (on) or {', '.join(o for o in OFF if o)} or empty (off)")
