"""`llmgw completion bash|zsh`: shell completion for the whole command tree, generated from the parser itself by
shtab (so it never disagrees with the commands). Django-free: a node's `llmgw` completes too."""

from __future__ import annotations

import argparse

SHELLS = ("bash", "zsh")
HELP = 'print a shell completion script: eval "$(llmgw completion bash)" in ~/.bashrc (zsh: ~/.zshrc)'


def add_completion(sub, root: argparse.ArgumentParser) -> None:
    """`completion SHELL` under `sub`, completing everything `root` parses."""
    p = sub.add_parser("completion", help=HELP)
    p.add_argument("shell", choices=SHELLS)
    p.set_defaults(func=lambda o, out: completion(root, o["shell"], out))


def completion(root: argparse.ArgumentParser, shell: str, out) -> None:
    import shtab

    out.write(shtab.complete(root, shell=shell))
