"""MkDocs hooks (mkdocs.yml): the command-line reference is written from tokenmill's own argument parser when the
site builds, so it lists every flag with its help and default as `tokenmill serve --help` does."""

from __future__ import annotations

import argparse
from typing import Any

from tokenmill.cli import build_parser

MARK = "<!-- the command-line reference, generated -->"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def cli_reference() -> str:
    """Each subcommand's usage and flags, in its groups, as its --help prints them."""
    parts = []
    for name, parser in _subcommands(build_parser(bench_flags=True)).items():
        parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=110, max_help_position=40)
        parts.append(f"## tokenmill {name}\n\n```text\n{parser.format_help().rstrip()}\n```\n")
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    return markdown.replace(MARK, cli_reference()) if MARK in markdown else markdown
