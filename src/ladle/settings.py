"""Settings of every ``ladle`` subcommand: the command line, ``LADLE_*`` variables and, where a
command has ``--config``, a YAML file, resolved one way for all of them.

One rule names the variables: ``LADLE_``, then the subcommand's words, then the flag, in upper
case with dashes as underscores. ``ladle serve --max-num-seqs`` reads
``LADLE_SERVE_MAX_NUM_SEQS``, ``ladle cluster up --nodes`` reads ``LADLE_CLUSTER_UP_NODES``,
``ladle operator --lease-namespace`` reads ``LADLE_OPERATOR_LEASE_NAMESPACE``. The command line
wins, then the environment, then the file, then a named environment profile (``ladle serve
--env-profile prod``: defaults for a kind of deployment), then the default.

Flags are plain ``argparse`` arguments; ``attach`` takes over their values. argparse keeps the
syntax, and the value types of ``ladle.flag_types`` (``integer``, ``memory`` ...) are
applied by ``Settings.resolve`` to every source alike, so a mistake reads the same wherever it
was made: one line naming the setting, where it came from and what is allowed (exit code 2).
Nothing is read before the chosen subcommand runs, so one bad variable never breaks another
subcommand or ``--help``.

Only the standard library is imported here (``ladle --help`` must not pay for torch).
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from ladle.flag_types import (
    LOG_LEVELS,
    Invalid,
    boolean,
    http_url,
    log_level,
    number,
    yaml_problem,
)

ENV_PREFIX = "LADLE_"
# Where a command's resolver and name live in its parsed namespace.
_SETTINGS_DEST = "_ladle_settings"
_COMMAND_DEST = "_ladle_command"


class SettingError(ValueError):
    """A setting that cannot be used: the message names it, its source and what is allowed."""


def env_name(command: str, flag: str) -> str:
    """``("cluster up", "gpus-per-node")`` -> ``LADLE_CLUSTER_UP_GPUS_PER_NODE``."""
    words = [*command.split(), flag.removeprefix("--")]
    return ENV_PREFIX + "_".join(words).upper().replace("-", "_")


@dataclass(frozen=True)
class Default:
    """A default that help shows in words, or that is computed only when the command runs
    (``value`` is then a callable), such as ``hostname-pid``."""

    value: Any
    shown: str

    def get(self) -> Any:
        return self.value() if callable(self.value) else self.value

    def __str__(self) -> str:
        return self.shown


def add_log_level(parser: argparse.ArgumentParser | Any, default: str = "info") -> None:
    """``--log-level``, spelled and checked the same in every subcommand."""
    parser.add_argument(
        "--log-level",
        type=log_level,
        default=default,
        metavar="{" + ",".join(LOG_LEVELS) + "}",
        help="the least severe level logged",
    )


def add_tracing(parser: argparse.ArgumentParser | Any) -> None:
    """The OpenTelemetry flags, the same in the gateway and the runtime (the first is vLLM's)."""
    parser.add_argument(
        "--otlp-traces-endpoint",
        type=http_url,
        default=Default(None, "off"),
        metavar="URL",
        help="send OpenTelemetry traces over OTLP/HTTP to this collector's base URL (such as "
        "http://otel-collector:4318); no tracing without one",
    )
    parser.add_argument(
        "--trace-sample-ratio",
        type=number(0.0, 1.0),
        default=1.0,
        help="the share of new traces recorded; a request that arrives with a traceparent "
        "keeps its caller's sampling decision",
    )


class _EnvProfileAction(argparse._StoreAction):
    """``--env-profile``: carries its profiles, each a mapping of flag name to value."""

    profiles: Mapping[str, Mapping[str, Any]] = {}


def add_env_profile(
    parser: argparse.ArgumentParser | Any, profiles: Mapping[str, Mapping[str, Any]], doc: str
) -> None:
    """``--env-profile NAME``: a layer of defaults under the config file, chosen by the command
    line, the environment or the file itself (in that order)."""
    action = parser.add_argument(
        "--env-profile",
        action=_EnvProfileAction,
        choices=tuple(profiles),
        default=Default(None, "none"),
        help=f"defaults for a kind of deployment, under every other source ({doc})",
    )
    assert isinstance(action, _EnvProfileAction)
    action.profiles = profiles


# -- one command's settings -----------------------------------------------------------------


_BOOLEAN_ACTIONS = (argparse.BooleanOptionalAction, argparse._StoreTrueAction)


@dataclass
class _Setting:
    action: argparse.Action
    flag: str  # without dashes
    variable: str
    convert: Callable[[Any], Any] | None
    choices: tuple[Any, ...] | None
    default: Any

    @property
    def dest(self) -> str:
        return self.action.dest

    @property
    def is_bool(self) -> bool:
        return isinstance(self.action, _BOOLEAN_ACTIONS)

    @property
    def is_list(self) -> bool:
        return isinstance(self.action, argparse._AppendAction) or self.action.nargs in ("+", "*")


def _shown(value: Any, is_bool: bool) -> str | None:
    if isinstance(value, Default):
        return value.shown
    if is_bool:
        return "on" if value else "off"
    if value is None:
        return None
    if isinstance(value, list | tuple):
        return " ".join(map(str, value)) or "none"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


class Settings:
    """The resolver of one subcommand (``command`` is its words after ``ladle``).

    Takes the values out of argparse's hands: defaults become ``SUPPRESS`` (so that the parsed
    namespace holds only what was typed), types and choices move here, and every help line
    gains its default and its variable.
    """

    def __init__(self, parser: argparse.ArgumentParser, command: str) -> None:
        self.parser = parser
        self.command = command
        self.prefix = env_name(command, "")
        self.config: _Setting | None = None
        self.env_profile: _Setting | None = None
        self._settings: dict[str, _Setting] = {}
        for action in parser._actions:
            if not action.option_strings or isinstance(
                action, argparse._HelpAction | argparse._VersionAction
            ):
                continue
            flag = max(action.option_strings, key=len).removeprefix("--")
            if isinstance(action, argparse.BooleanOptionalAction):
                flag = action.option_strings[0].removeprefix("--")
            setting = _Setting(
                action=action,
                flag=flag,
                variable=env_name(command, flag),
                convert=action.type,  # type: ignore[arg-type]
                choices=tuple(action.choices) if action.choices is not None else None,
                default=action.default,
            )
            self._describe(setting)
            action.type = None
            action.metavar = action.metavar or getattr(setting.convert, "metavar", None)
            if setting.choices is not None:
                action.metavar = action.metavar or "{" + ",".join(map(str, setting.choices)) + "}"
                action.choices = None
            action.default = argparse.SUPPRESS
            if action.dest == "config":
                self.config = setting
            elif isinstance(action, _EnvProfileAction):
                self.env_profile = setting
            else:
                self._settings[action.dest] = setting

    @property
    def variables(self) -> set[str]:
        names = {s.variable for s in self._settings.values()}
        return names | {s.variable for s in (self.config, self.env_profile) if s is not None}

    def _describe(self, setting: _Setting) -> None:
        action = setting.action
        help_text = action.help or ""
        # argparse's BooleanOptionalAction appends its own "(default: %(default)s)".
        help_text = help_text.replace(" (default: %(default)s)", "")
        shown = _shown(setting.default, setting.is_bool)
        if "%(default)" in help_text:
            help_text = help_text.replace("%(default)s", shown or "none")
        extras = [f"default: {shown}"] if shown is not None else []
        extras.append(f"env {setting.variable}")
        action.help = f"{help_text} ({'; '.join(extras)})".strip()

    # -- resolution ---------------------------------------------------------------------------

    def resolve(
        self,
        typed: argparse.Namespace,
        environ: Mapping[str, str] | None = None,
        known: Iterable[str] = (),
    ) -> argparse.Namespace:
        """The namespace the command runs with; ``known`` are every command's variables, so
        that another command's variable is not taken for a misspelt one of this command."""
        env = os.environ if environ is None else environ
        self._check_variables(env, set(known))
        config_file = self._config_file(typed, env)
        from_file = self._from_file(config_file) if config_file is not None else {}
        profile = self._env_profile(typed, env, from_file)
        values = self.profile_values(profile)
        values.update(from_file)
        for setting in self._settings.values():
            raw = env.get(setting.variable)
            if raw is not None:
                values[setting.dest] = self._convert(setting, raw, f"{setting.variable}={raw!r}")
        for dest, raw in vars(typed).items():
            given = self._settings.get(dest)
            if given is not None:
                shown = " ".join(raw) if isinstance(raw, list) else raw
                values[dest] = self._convert(given, raw, f"--{given.flag} {shown!r}")
            elif dest != "config" and (self.env_profile is None or dest != self.env_profile.dest):
                values[dest] = raw
        for dest, setting in self._settings.items():
            if dest not in values:
                values[dest] = self._default(setting)
        if self.config is not None:
            values["config"] = config_file
        if self.env_profile is not None:
            values[self.env_profile.dest] = profile
        return argparse.Namespace(**values)

    def _env_profile(
        self, typed: argparse.Namespace, env: Mapping[str, str], from_file: dict[str, Any]
    ) -> str | None:
        """The profile's name: the command line's, else the environment's, else the file's
        (which ``_from_file`` took out of the file's values)."""
        setting = self.env_profile
        if setting is None:
            return None
        raw = getattr(typed, setting.dest, None)
        if raw is not None:
            return str(self._convert(setting, raw, f"--{setting.flag} {raw!r}"))
        raw = env.get(setting.variable)
        if raw is not None:
            return str(self._convert(setting, raw, f"{setting.variable}={raw!r}"))
        named = from_file.pop(setting.dest, None)
        return None if named is None else str(named)

    def profile_values(self, profile: str | None) -> dict[str, Any]:
        """What the named profile sets, converted as any other source's values are."""
        if profile is None or self.env_profile is None:
            return {}
        action = self.env_profile.action
        assert isinstance(action, _EnvProfileAction)
        by_flag = {s.flag: s for s in self._settings.values()}
        values = {}
        for flag, value in action.profiles[profile].items():
            setting = by_flag[flag]  # a profile naming no flag is a bug, caught by its test
            values[setting.dest] = self._convert(setting, value, f"env profile {profile}: {flag}")
        return values

    def _default(self, setting: _Setting) -> Any:
        value = setting.default
        if isinstance(value, Default):
            value = value.get()
        if isinstance(value, str) and setting.convert is not None:
            # As argparse does: a string default goes through the flag's type.
            value = self._convert(setting, value, f"the default of --{setting.flag}")
        return value

    def _check_variables(self, env: Mapping[str, str], known: set[str]) -> None:
        ours = self.variables
        for name in env:
            if name.startswith(self.prefix) and name not in ours and name not in known:
                close = difflib.get_close_matches(name, sorted(ours), n=1)
                hint = f"; did you mean {close[0]}?" if close else f" (see ladle {self.command} -h)"
                raise SettingError(f"{name} is not a setting of ladle {self.command}{hint}")
        for setting in self._settings.values():
            bare = ENV_PREFIX + setting.flag.upper().replace("-", "_")
            if bare in env and bare not in known and bare not in ours:
                print(
                    f"ladle {self.command}: warning: {bare} is not read; this command reads "
                    f"{setting.variable}",
                    file=sys.stderr,
                )

    def _config_file(self, typed: argparse.Namespace, env: Mapping[str, str]) -> Path | None:
        if self.config is None:
            return None
        raw = getattr(typed, "config", None)
        source = f"--{self.config.flag} {raw!r}"
        if raw is None:
            raw = env.get(self.config.variable)
            source = f"{self.config.variable}={raw!r}"
        if raw is None:
            return None
        if not raw.strip():
            # As for every other setting: an empty value is a mistake, not "no file".
            raise SettingError(f"{source}: must not be empty; name a YAML file, or leave it unset")
        path = Path(raw).expanduser()
        if not path.is_file():
            raise SettingError(f"{source}: no such file: {path}")
        return path

    def _from_file(self, path: Path) -> dict[str, Any]:
        import yaml

        try:
            data = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise SettingError(f"{path}: cannot read it: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise SettingError(f"{path}: {yaml_problem(exc)}") from None
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise SettingError(
                f"{path}: expected a mapping of flag names to values, such as 'max-num-seqs: 64'"
            )
        settings = [*self._settings.values(), *([self.env_profile] if self.env_profile else [])]
        by_flag = {s.flag: s for s in settings}
        values = {}
        for key, value in data.items():
            name = str(key).replace("_", "-").removeprefix("--")
            setting = by_flag.get(name)
            if setting is None:
                close = difflib.get_close_matches(name, sorted(by_flag), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise SettingError(
                    f"{path}: {key!r} is not a setting of ladle {self.command}{hint}"
                )
            if value is None:
                continue  # "key:" with nothing after it leaves the default
            values[setting.dest] = self._convert(setting, value, f"{path}: {key}={value!r}")
        return values

    def _convert(self, setting: _Setting, value: Any, source: str) -> Any:
        try:
            return self._value(setting, value)
        except Invalid as exc:
            raise SettingError(f"{source}: {exc}") from None

    def _value(self, setting: _Setting, value: Any) -> Any:
        if setting.is_bool:
            return value if isinstance(value, bool) else boolean(value)
        if setting.is_list:
            if isinstance(value, str):
                value = [item for item in value.split(",") if item.strip()]
            elif not isinstance(value, list):
                value = [value]
            return [self._one(setting, item) for item in value]
        if isinstance(value, list | dict | bool):
            raise Invalid(f"{_allowed(setting)}, not {type(value).__name__}")
        return self._one(setting, value)

    def _one(self, setting: _Setting, value: Any) -> Any:
        if isinstance(value, list | dict | bool):
            raise Invalid(f"{_allowed(setting)}, not {type(value).__name__}")
        if setting.convert is not None:
            try:
                value = setting.convert(str(value) if not isinstance(value, str) else value)
            except Invalid:
                raise
            except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
                message = str(exc) if isinstance(exc, argparse.ArgumentTypeError) else ""
                raise Invalid(message or _allowed(setting)) from None
        elif not isinstance(value, str):
            value = str(value)
        if setting.choices is not None and value not in setting.choices:
            raise Invalid(f"expected one of {', '.join(map(str, setting.choices))}")
        return value


def _allowed(setting: _Setting) -> str:
    convert = setting.convert
    allowed = getattr(convert, "allowed", None)
    if allowed is not None:
        return str(allowed)
    if convert is int:
        return "expected a whole number"
    if convert is float:
        return "expected a number"
    if setting.choices is not None:
        return f"expected one of {', '.join(map(str, setting.choices))}"
    return "expected a single value"


# -- the parser tree --------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (the usage of ``ladle serve`` alone is 30 lines) that
    point at ``--help`` and at the closest flag for a misspelt one. Flags are never
    abbreviated: a typo must not silently pick a flag, and variables and files take whole
    names too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments:"):
            flags = sorted(s for a in self._actions for s in a.option_strings)
            for word in message.split()[2:]:
                close = difflib.get_close_matches(word.split("=")[0], flags, n=1)
                if word.startswith("--") and close:
                    message += f" (did you mean {close[0]}?)"
                    break
        self.exit(2, f"{self.prog}: {message} (see '{self.prog} --help')\n")


def leaf_parsers(
    parser: argparse.ArgumentParser, words: Sequence[str] = ()
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every runnable subcommand below ``parser``, with its words (``"cluster up"``)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield " ".join(words), parser
        return
    seen: set[int] = set()
    for sub in subs:
        for name, child in sub.choices.items():
            if id(child) not in seen:
                seen.add(id(child))
                yield from leaf_parsers(child, [*words, name])


def attach_all(parser: argparse.ArgumentParser) -> None:
    """Give every subcommand below ``parser`` its ``Settings``."""
    for command, leaf in leaf_parsers(parser):
        leaf.set_defaults(**{_SETTINGS_DEST: Settings(leaf, command), _COMMAND_DEST: command})


def command_of(args: argparse.Namespace) -> str:
    return str(getattr(args, _COMMAND_DEST, ""))


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parse_args``, except that a stray argument is reported by the subcommand it was given
    to, which knows the flag it probably meant."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        settings = getattr(args, _SETTINGS_DEST, None)
        owner = settings.parser if isinstance(settings, Settings) else parser
        owner.error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def resolve(
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
    parser: argparse.ArgumentParser | None = None,
) -> argparse.Namespace:
    """The parsed command line of one subcommand, completed from its other sources; ``parser``
    (the whole tree) lets the check for misspelt variables tell other commands' apart."""
    settings: Settings = getattr(args, _SETTINGS_DEST)
    known: set[str] = set()
    if parser is not None:
        for _, leaf in leaf_parsers(parser):
            other = leaf.get_default(_SETTINGS_DEST)
            if isinstance(other, Settings) and other is not settings:
                known |= other.variables
    values = vars(settings.resolve(args, environ, known))
    values.pop(_SETTINGS_DEST, None)
    return argparse.Namespace(**values)
