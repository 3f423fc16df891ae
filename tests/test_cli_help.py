"""`moeshard ... --help`: every option says what it does and shows its default, once (issue 16).

Walks the whole parser tree from `build_parser()`, nested subcommands (`bench`, `ledger`) too."""

from __future__ import annotations

import argparse

import pytest

from moeshard.cli import build_parser
from moeshard.moe.convert.converter import DEFAULT_EXPERT_FORMAT, DEFAULT_TRUNK_FORMAT


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("moeshard",)):
    """(command path, parser) for the parser and every subcommand under it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def _flat(text: str) -> str:
    return " ".join(text.split())


def _entry(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The action's entry in `parser`'s help (invocation and help text), on one line."""
    return _flat(parser._get_formatter()._format_action(action))


def _shows_default(action: argparse.Action) -> bool:
    """An option whose default means something by itself (not a flag's False, not None)."""
    return bool(action.option_strings) and action.nargs != 0 and action.default not in (None, "")


PARSERS = list(_parsers(build_parser()))
IDS = [" ".join(path) for path, _ in PARSERS]


@pytest.fixture(autouse=True)
def _columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")  # help as in a 100-column terminal, whatever runs this


def test_the_walk_reaches_nested_subcommands():
    paths = {" ".join(path) for path, _ in PARSERS}
    assert {"moeshard generate", "moeshard bench kernels", "moeshard ledger summary"} <= paths
    assert len(paths) > 20


@pytest.mark.parametrize("path,parser", PARSERS, ids=IDS)
def test_every_action_has_help(path, parser):
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help.strip(), f"{' '.join(path)} {name}: no help"
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                assert choice.help and choice.help.strip(), f"{' '.join(path)} {choice.dest}"


@pytest.mark.parametrize("path,parser", PARSERS, ids=IDS)
def test_every_default_shows_once(path, parser):
    text = _flat(parser.format_help())
    for action in parser._actions:
        name = f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}"
        entry = _entry(parser, action)
        if _shows_default(action):
            shown = f"(default: {action.default})"
            assert shown in text, f"{name}: {shown} not in its --help"
            assert entry.count(shown) == 1, f"{name}: {entry}"
        # a default spelled by hand ("(default 3)") next to the shown one, or a meaningless one
        assert entry.lower().count("default") <= 1, f"{name}: default twice: {entry}"
        assert "(default: None)" not in entry and "(default: False)" not in entry, name
        assert "(default: )" not in entry, name


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*argv, "--help"])
    assert exit_.value.code == 0
    return _flat(capsys.readouterr().out)


def test_convert_help_shows_the_formats_defaults(capsys):
    out = _help(capsys, "convert")
    assert "weight format of the experts (default: mxfp4 for a checkpoint that publishes" in out
    assert "a GGUF file's own type where it is one of these, a mix per layer kept too;" in out
    assert f"else {DEFAULT_EXPERT_FORMAT}). q4_K, q5_K, q6_K, iq4_nl, iq4_xs, q4_1," in out
    assert "q5_0, q5_1: only a GGUF file's own blocks" in out
    assert f"(everything but the experts; default: {DEFAULT_TRUNK_FORMAT}, or a GGUF" in out


def test_generate_help_shows_max_tokens_default(capsys):
    out = _help(capsys, "generate")
    assert (
        "--max-tokens MAX_TOKENS tokens to generate, fewer if one ends the text (default: 64)"
        in out
    )
    assert "--top-k TOP_K sample from the k likeliest tokens (0: all) (default: 0)" in out


def test_nested_subcommands_show_defaults_and_flags_do_not(capsys):
    out = _help(capsys, "bench", "kernels")
    assert "--samples SAMPLES timed samples per cell (median) (default: 7)" in out
    assert "--quick skip the big shapes --no-warmup-probe" in out  # a flag: nothing appended
    out = _help(capsys, "node")
    assert "--name NAME display name (default: hostname-port) --no-advertise" in out
    assert "--max-inflight MAX_INFLIGHT" in out and "at once (default: 8)" in out


def test_lines_do_not_break_inside_option_names_or_defaults(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "60")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["node", "--help"])
    lines = capsys.readouterr().out.splitlines()
    assert not any(line.rstrip().endswith(("--max-", "(default:")) for line in lines)
