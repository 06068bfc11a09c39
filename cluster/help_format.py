"""`pdserve serve --help`'s layout: each flag's default shown as `vllm serve --help` shows it."""

from __future__ import annotations

import argparse
import copy


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to each flag's help, as vLLM's --help shows it, where X says
    something: not for unset (None) or off (False) flags, nor where the help already
    explains its default."""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and _shows_default(action):
            action = copy.copy(action)  # argparse prints no help line for a help-less flag
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if _shows_default(action) and "default" not in text:
            text = f"{text} (default: %(default)s)"
        return text


def _shows_default(action: argparse.Action) -> bool:
    default = action.default
    worth = default is not None and default is not False and default is not argparse.SUPPRESS
    return worth and bool(action.option_strings)
