"""Every command that README.md, benchmarks/README.md and docs/ tell a reader to run names a file or module that
exists, and its options parse: a moved or renamed script, or a renamed option, cannot leave a stale command behind.

A command is a `python` (python3, a venv's python, torchrun; behind `NAME=value`, taskset, ...) line of a code
block, line continuations joined and `NAME=value` assignments of the block expanded, or an inline code span of the
prose. `python -m torchtitan.train` parses its options through torchtitan.config.parse_args; a script of this
repository or a module of its packages is run in this process up to its own argument parsing (argparse's parse_args
and parse_known_args, torchtitan.config.parse_script_args, whose remaining options are the trainer's and go through
parse_args too, or torchtitan.config.parse_args alone), and stopped there. A command whose arguments hold a
placeholder (`...`, `[optional]`, `<value>`, `{a,b}`, an unset `$VARIABLE`, an upper-case word such as `OUT_DIR`)
or none at all is only checked to exist."""

import argparse
import bisect
import importlib.util
import os
import re
import runpy
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import torchtitan.config

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
PROJECT_PACKAGES = ("torchtitan", "scripts", "benchmarks")
REPOSITORY_FOLDERS = ("benchmarks", "docs", "scripts", "tests", "torchtitan", "train_configs")
PLACEHOLDER = re.compile(r"\.\.\.|…|\[|<|\{|\$|^[A-Z][A-Z0-9_]*$")  # ..., [opt], <x>, {a,b}, $X, OUT_DIR
INTERPRETER = re.compile(r"^(\S*/)?python(3(\.\d+)?)?$")
SHELL_OPERATORS = {"&&", "||", ";", "|", "&", "(", ")"}
ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=")


@dataclass(frozen=True)
class Command:
    where: str
    text: str
    target: str
    """A path relative to the repository (`scripts/plan.py`) or `-m module`."""
    args: tuple[str, ...]
    parsable: bool


def _expand(line: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?",
                  lambda m: variables.get(m.group(1), m.group(0)), line)


def _code_lines(text: str):
    """(line number, shell line) of the code blocks (fenced, or indented by four spaces), continuations joined and
    the block's own `NAME=value` lines expanded; then (line number, code span) of the prose's inline code."""
    in_block, variables, pending, prose = False, {}, "", []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            in_block, variables, pending = not in_block, {}, ""
            continue
        if not in_block:
            prose.append((number, line))
            if line.startswith("    "):
                yield number, line
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        line, pending = _expand(pending + line, variables), ""
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            words = []
        if words and all(ASSIGNMENT.match(word) for word in words):
            variables.update(word.split("=", 1) for word in words)
        yield number, line
    starts, offset = [], 0
    for _, line in prose:
        starts.append(offset)
        offset += len(line) + 1
    joined = "\n".join(line for _, line in prose)
    for match in re.finditer(r"`([^`]+)`", joined):
        index = bisect.bisect_right(starts, match.start()) - 1
        yield prose[index][0], " ".join(match.group(1).split())


def _simple_commands(line: str) -> list[list[str]]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    try:
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote: prose, not a command
        return []
    commands, current = [], []
    for token in tokens:
        if token in SHELL_OPERATORS:
            commands.append(current)
            current = []
        else:
            current.append(token)
    return [*commands, current]


def _command(words: list[str], where: str, text: str) -> Command | None:
    """The command that runs Python in `words`, after what wraps it (`NAME=value`, taskset, timeout, ...)."""
    starts = [i for i, word in enumerate(words) if INTERPRETER.match(word) or word == "torchrun"]
    if not starts:
        return None
    words = words[starts[0]:]
    if words[0] == "torchrun":
        scripts = [i for i, word in enumerate(words) if word.endswith(".py")]
        if not scripts:
            return None
        words = ["python", *words[scripts[0]:]]
    if len(words) < 2:
        return None
    if words[1] == "-m" and len(words) > 2:
        target, args = f"-m {words[2]}", words[3:]
    elif words[1].endswith(".py"):
        target, args = words[1], words[2:]
    else:
        return None
    parsable = bool(args) and not any(PLACEHOLDER.search(arg) for arg in args)
    return Command(where, text, target, tuple(args), parsable)


def documented_commands() -> list[Command]:
    commands = []
    for document in DOCUMENTS:
        name = str(document.relative_to(REPO))
        for number, line in _code_lines(document.read_text()):
            for words in _simple_commands(line):
                command = _command(words, f"{name}:{number}", line)
                if command is not None:
                    commands.append(command)
    return commands


COMMANDS = documented_commands()


def _module_file(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__main__.py"):
        if path.is_file():
            return path
    return None


class _Parsed(BaseException):
    """Raised where the command's options are parsed, so that nothing of its work runs."""


def _stop_after_parsing(monkeypatch):
    """The outermost parse of the command line raises _Parsed once it has parsed: argparse's (parse_args calls
    parse_known_args, and a subcommand's parser is called from inside its parent's), a script's own options before
    the trainer's (parse_script_args, after the trainer's are parsed too), or the trainer's alone (parse_args)."""
    parse_args, parse_known_args = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    parse_script_args, parse_trainer_args = torchtitan.config.parse_script_args, torchtitan.config.parse_args
    depth = [0]

    def outermost(parse):
        def parse_then_stop(*args, **kwargs):
            depth[0] += 1
            try:
                parsed = parse(*args, **kwargs)
                if parse is parse_script_args and parsed[1]:  # the rest is the trainer's options
                    parse_trainer_args(parsed[1])
            finally:
                depth[0] -= 1
            if depth[0]:
                return parsed
            raise _Parsed
        return parse_then_stop

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", outermost(parse_args))
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", outermost(parse_known_args))
    monkeypatch.setattr(torchtitan.config, "parse_script_args", outermost(parse_script_args))
    monkeypatch.setattr(torchtitan.config, "parse_args", outermost(parse_trainer_args))


def _parse(command: Command, monkeypatch, capsys) -> None:
    if command.target == "-m torchtitan.train":  # its main also sets up logging and the process's end
        try:
            torchtitan.config.parse_args(list(command.args))
        except SystemExit as e:
            assert e.code == 0 and {"-h", "--help"} & set(command.args), f"{command.where}: {command.text}"
        return
    _stop_after_parsing(monkeypatch)
    monkeypatch.setattr(sys, "argv", [command.target.removeprefix("-m "), *command.args])
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.chdir(REPO)
    path = _module_file(command.target.removeprefix("-m ")) if command.target.startswith("-m ") else \
        REPO / command.target
    try:
        runpy.run_path(str(path), run_name="__main__")
    except _Parsed:
        return
    except SystemExit as e:  # a parse error exits 2; --help exits 0 after printing
        assert e.code in (0, None) and {"-h", "--help"} & set(command.args), \
            f"{command.where}: {command.text}\n{capsys.readouterr().err}"
        return
    raise AssertionError(f"{command.where}: {command.target} ran to its end without parsing its options")


def _label(command: Command) -> str:
    return f"{command.where} {command.target}"


def test_the_documents_hold_commands_of_every_kind():
    """The extraction finds what it must (a check of this test's reading): scripts, modules and the trainer,
    commands behind variables and continuations, and most of them with options that can be parsed."""
    targets = {command.target for command in COMMANDS}
    assert {"scripts/plan.py", "-m torchtitan.train", "-m scripts.convert_checkpoint"} <= targets
    assert len(COMMANDS) > 80
    assert sum(command.parsable for command in COMMANDS) > 0.6 * len(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=_label)
def test_the_documented_command_names_what_exists_and_its_options_parse(command, monkeypatch, capsys):
    for arg in command.args:  # a file or folder of the repository given as an argument (pytest's tests, say)
        if arg.split("/")[0] in REPOSITORY_FOLDERS and "/" in arg and not PLACEHOLDER.search(arg):
            assert (REPO / arg).exists(), f"{command.where}: no {arg} ({command.text})"
    if command.target.startswith("-m "):
        module = command.target.removeprefix("-m ")
        if module.split(".")[0] not in PROJECT_PACKAGES:
            assert importlib.util.find_spec(module) is not None, f"{command.where}: no module {module}"
            return
        assert _module_file(module) is not None, f"{command.where}: no module {module} ({command.text})"
    else:
        assert (REPO / command.target).is_file(), f"{command.where}: no file {command.target} ({command.text})"
    if command.parsable:
        _parse(command, monkeypatch, capsys)


def test_every_script_the_documents_name_exists():
    """Scripts named in the prose too (`benchmarks/turns.py` takes turns...), not only in commands."""
    named = {(str(document.relative_to(REPO)), match.group(0))
             for document in DOCUMENTS
             for match in re.finditer(r"\b(?:scripts|benchmarks)/[\w/.-]*\w\.(?:py|sh)\b", document.read_text())}
    assert sorted((where, path) for where, path in named if not (REPO / path).is_file()) == []


def test_the_benchmarks_readme_lists_every_benchmark():
    """benchmarks/README.md has a row for each file of benchmarks/ (what it measures, the doc figure it makes, how
    long it runs), and none for a file that is gone."""
    listed = set(re.findall(r"^\| `([\w.]+\.(?:py|sh))` \|", (REPO / "benchmarks" / "README.md").read_text(), re.M))
    present = {path.name for path in (REPO / "benchmarks").iterdir() if path.suffix in (".py", ".sh")}
    assert listed == present
