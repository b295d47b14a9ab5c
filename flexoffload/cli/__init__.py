"""The `flexoffload` command line: run, serve, bench, profile, plan, info, devices, models.

Text goes to stdout, timings and progress to stderr, `--json` prints one object for scripts. Bad input
is one line on stderr and a non-zero exit, never a traceback.

Each command is its own module, flexoffload/cli/<command>.py, ending in its click command; `main` imports a
command's module only when that command is asked for (or when the group's help lists them all), so
`flexoffload run` does not import the planners or the measurements `plan` and `profile` use. What several
commands share is in common.py.
"""

from __future__ import annotations

import importlib
import sys

import click

from flexoffload import __version__

# The commands, in the order the help lists them (click's own order before: sorted by name); each is the object of
# the same name in flexoffload/cli/<name>.py.
COMMANDS = ("bench", "devices", "info", "models", "plan", "profile", "run", "serve")

# Names scripts and tests import from flexoffload.cli, and the command module that defines each.
_EXPORTS = {"request_from_args": "run"}


class _LazyGroup(click.Group):
    """A group whose commands are imported when invoked (or listed by --help), not when the group is made."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        return getattr(importlib.import_module(f"{__name__}.{cmd_name}"), cmd_name)

    def resolve_command(self, ctx: click.Context, args: list[str]):
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as e:
            # click >= 8.4 suggests the closest of the group's registered commands ("Did you mean 'run'?"): here
            # they are COMMANDS, not registered
            no_such = getattr(click.exceptions, "NoSuchCommand", None)
            if no_such is None or not isinstance(e, no_such):
                raise
            raise no_such(e.command_name, possibilities=COMMANDS, ctx=ctx) from None


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="flexoffload")
def main():
    """Run GGUF models larger than the memory you give them, at the speed the disk allows."""
    _notes_on_stderr()


def _notes_on_stderr() -> None:
    """What flexoffload's modules say before and during long work (their INFO records: a measurement about to run,
    how far it is) goes to stderr as `flexoffload: ...` lines, as the commands' own notes do."""
    import logging

    log = logging.getLogger("flexoffload")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("flexoffload: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def __getattr__(name: str):
    """request_from_args, from the run command's module when first asked for."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
