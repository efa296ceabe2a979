"""The command line as typed, made into what argparse reads, before argparse reads it.

argparse reports three common slips badly, or after other errors that hide them:

- a misspelt option (``--precison.dtype``, ``--stpes 3``) is "unrecognized arguments" at the
  end of the parse, after "the following arguments are required: --steps", with no suggestion:
  here it is refused first, with the closest option;
- a negative value (``--memory-budget -1GiB``) reads as an option, and the option then
  "expected one argument": here it is joined to its option (``--memory-budget=-1GiB``), so that
  the option's own check says what is wrong with it;
- ``--resume=true`` is "ignored explicit argument": here a flag takes ``=true`` and ``=false``.

Nothing here imports torch or the config: ``--help`` must answer at once.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping, Sequence

from torchturbo.output.suggest import closest
from torchturbo.output.units import BOOLEAN_WORDS

#: A value that starts with a minus and a digit: a negative number, size or duration.
_NEGATIVE = re.compile(r"^-[0-9.]")
_FLAGS = (argparse._StoreTrueAction, argparse._StoreFalseAction)


class TokenError(ValueError):
    """A token argparse would misread; the message names it and the fix."""


def prepared(
    tokens: Sequence[str], actions: Mapping[str, argparse.Action], stop: set[str]
) -> list[str]:
    """``tokens`` as argparse should read them (see the module docstring), or a
    :class:`TokenError`. ``actions`` are the parser's options by name; the tokens from the
    first one in ``stop`` (a subcommand) on, and after ``--``, are left to whoever reads them."""
    out: list[str] = []
    index = 0
    while index < len(tokens):
        token = tokens[index]
        if token == "--" or token in stop:
            return out + list(tokens[index:])
        index += 1
        if not token.startswith("--"):
            out.append(token)
            continue
        name, equals, value = token.partition("=")
        action = resolve(name, actions)
        if isinstance(action, _FLAGS) and equals:
            out.extend(_flag(name, value, action))
            continue
        following = tokens[index] if index < len(tokens) else ""
        if not equals and _takes_one_value(action) and _NEGATIVE.match(following):
            out.append(f"{token}={following}")
            index += 1
            continue
        out.append(token)
    return out


def resolve(name: str, actions: Mapping[str, argparse.Action]) -> argparse.Action | None:
    """The action ``name`` stands for: itself, or the one option it abbreviates (argparse
    takes ``--plan`` for ``--planned-steps``; never a dotted config name, which must be exact:
    ``--precision.dtyp`` is a typo, not an abbreviation). None when several options start
    with it (argparse reports that); a :class:`TokenError` with the closest option when none
    does."""
    if name in actions:
        return actions[name]
    starting = [option for option in actions if option.startswith(name) and "." not in name]
    if len(starting) > 1:
        return None
    if len(starting) == 1 and "." not in starting[0]:
        return actions[starting[0]]
    from torchturbo.config.options import renamed_option  # only for an unknown option

    if (renamed := renamed_option(name)) is not None:
        raise TokenError(f"{name} is now {renamed}")
    long_options = [option for option in actions if option.startswith("--")]
    match = closest(name, long_options)
    if match is not None:
        raise TokenError(f"unknown option {name} (did you mean {match}?)")
    if "." in name:
        raise TokenError(
            f"unknown option {name}: config options are --SECTION.FIELD as in turbo.toml"
        )
    raise TokenError(f"unknown option {name}")


def _flag(name: str, value: str, action: argparse.Action) -> list[str]:
    """``--resume=true`` as ``--resume``, ``--resume=false`` as nothing (the default)."""
    meaning = BOOLEAN_WORDS.get(value.strip().lower())
    if meaning is None:
        raise TokenError(f"{name}={value}: a flag takes true or false ({name}=true is {name})")
    sets = isinstance(action, argparse._StoreTrueAction)
    return [name] if meaning == sets else []


def _takes_one_value(action: argparse.Action | None) -> bool:
    return action is not None and action.nargs is None and not isinstance(action, _FLAGS)
