"""MkDocs hook: render the option reference (docs/options.md) from hetfair's real parsers at build time.

Every console script of the hetfair distribution gets its parser's options, grouped as in ``--help``;
``hetfair-train`` also gets the flags and defaults of each built-in component. A console script this
file does not know fails the build, so the reference cannot fall behind the commands.
"""

from __future__ import annotations

import argparse
import re
from importlib.metadata import distribution
from typing import Any, Callable, Iterable

from mkdocs.exceptions import PluginError

from hetfair.criteria import CRITERION_REGISTRY
from hetfair.models import ARCH_REGISTRY, MODEL_REGISTRY, resolve_arch
from hetfair.optim import LR_SCHEDULER_REGISTRY, OPTIMIZER_REGISTRY
from hetfair.options import build_parser as train_parser
from hetfair.parallel import COMM_HOOK_REGISTRY
from hetfair.registry import Registry
from hetfair.tasks import TASK_REGISTRY
from hetfair_cli.export import build_parser as export_parser
from hetfair_cli.generate import build_parser as generate_parser
from hetfair_cli.lighthouse import build_parser as lighthouse_parser
from hetfair_cli.plan import plan_parser
from hetfair_cli.preprocess import build_parser as preprocess_parser
from hetfair_cli.validate import build_parser as validate_parser

PAGE = "options.md"
MARKER = "<!-- options-reference -->"
PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "hetfair-train": train_parser,
    "hetfair-validate": validate_parser,
    "hetfair-preprocess": preprocess_parser,
    "hetfair-export": export_parser,
    "hetfair-generate": generate_parser,
    "hetfair-lighthouse": lighthouse_parser,
    "hetfair-plan": plan_parser,
}
# Further sections of a console script whose flags depend on one of its own (``--task``).
VARIANTS: dict[str, dict[str, Callable[[], argparse.ArgumentParser]]] = {
    "hetfair-preprocess": {
        "hetfair-preprocess --task language_modeling": lambda: preprocess_parser("language_modeling")},
}
COMPONENT_REGISTRIES: tuple[Registry[Any], ...] = (
    TASK_REGISTRY, MODEL_REGISTRY, CRITERION_REGISTRY, OPTIMIZER_REGISTRY, LR_SCHEDULER_REGISTRY, COMM_HOOK_REGISTRY)
# The flags that choose a component: their --help lists what is installed, the reference what is built in.
CHOOSERS: dict[str, tuple[Registry[Any], ...]] = {
    "task": (TASK_REGISTRY,), "arch": (ARCH_REGISTRY, MODEL_REGISTRY), "criterion": (CRITERION_REGISTRY,),
    "optimizer": (OPTIMIZER_REGISTRY,), "lr_scheduler": (LR_SCHEDULER_REGISTRY,),
    "ddp_comm_hook": (COMM_HOOK_REGISTRY,)}


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise PluginError(f"docs/{PAGE} lost the {MARKER} line where the option reference goes")
    return markdown.replace(MARKER, render_reference())


def render_reference() -> str:
    scripts = {ep.name for ep in distribution("hetfair").entry_points if ep.group == "console_scripts"}
    unknown = sorted(scripts - set(PARSERS))
    if unknown:
        raise PluginError(f"docs/hooks/options_reference.py has no parser for {', '.join(unknown)}; add it to PARSERS")
    sections = []
    for script in (script for script in PARSERS if script in scripts):
        parser = PARSERS[script]()
        sections.append(f"## `{script}`\n\n{parser.description or ''}\n\n{render_groups(parser)}")
        for title, variant in VARIANTS.get(script, {}).items():
            parser = variant()
            sections.append(f"## `{title}`\n\n{parser.description or ''}\n\n{render_groups(parser)}")
        if script == "hetfair-train":
            sections.append(render_components())
    return "\n\n".join(sections)


def render_groups(parser: argparse.ArgumentParser) -> str:
    """One table per argument group, titled as in ``--help``."""
    blocks = []
    for group in parser._action_groups:  # argparse offers no public way to walk its groups
        actions = [action for action in group._group_actions if documented(action)]
        if actions:
            title = "options" if group.title in ("optional arguments", "options") else group.title
            blocks.append(f"### {title}\n\n{options_table(actions, parser.prog)}")
    return "\n\n".join(blocks)


def documented(action: argparse.Action) -> bool:
    return action.dest != "help" and action.help != argparse.SUPPRESS


def options_table(actions: Iterable[argparse.Action], prog: str) -> str:
    rows = ["| option | default | description |", "|---|---|---|"]
    rows += [f"| {invocation(action)} | {default(action)} | {description(action, prog)} |" for action in actions]
    return "\n".join(rows)


def invocation(action: argparse.Action) -> str:
    """``--flag METAVAR`` in code, aliases after it."""
    first, *aliases = action.option_strings or [action.dest]
    metavar = "" if action.nargs == 0 or (action.metavar is None and action.choices) else action.metavar
    if action.nargs != 0 and metavar is None:
        metavar = action.dest.upper()
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    text = f"`{first} {metavar}`" if metavar else f"`{first}`"
    return text + "".join(f" (also `{alias}`)" for alias in aliases)


def default(action: argparse.Action) -> str:
    if action.default is None or action.default is False or action.default == argparse.SUPPRESS or action.nargs == 0:
        return ""
    return f"`{action.default}`"


def description(action: argparse.Action, prog: str) -> str:
    text = (action.help or "") % {**vars(action), "prog": prog}  # argparse's own %(default)s expansion
    if action.dest in CHOOSERS and "; one of: " in text:
        builtin = sorted({name for registry in CHOOSERS[action.dest] for name in builtin_names(registry)})
        text = text.split("; one of: ")[0] + f"; built-in: {', '.join(builtin)} (plugins add their own)"
    if action.choices is not None and action.metavar is None:
        text += f"; one of: {', '.join(f'`{choice}`' for choice in action.choices)}"
    return one_line(text)


def one_line(text: str) -> str:
    """``text`` on one line (of a table): ``|`` and ``*`` escaped outside code spans."""
    parts = re.split(r"(`+[^`]*`+)", text.replace("\n", " "))
    return "".join(part if part.startswith("`") else part.replace("|", "\\|").replace("*", "\\*") for part in parts)


def render_components() -> str:
    """The built-in components of ``hetfair-train``: their own flags, the defaults they set, the archs."""
    parts = ["## Built-in components of `hetfair-train`",
             "Each chosen component adds its own flags to `hetfair-train` (and to its `--help`); every comm hook "
             "adds its flags with them, refused with another `--ddp-comm-hook`."]
    for registry in COMPONENT_REGISTRIES:
        for name in builtin_names(registry):
            parts.append(render_component(registry, name))
    parts.append(render_archs())
    return "\n\n".join(parts)


def builtin_names(registry: Registry[Any]) -> list[str]:
    return [name for name in registry.names() if registry.source(name).startswith("built-in")]


def render_component(registry: Registry[Any], name: str) -> str:
    component = registry.get(name)
    lines = [f"### {registry.kind} `{name}`", first_line(component.__doc__)]
    defaults = getattr(component, "option_defaults", None)
    if defaults:
        lines.append("Defaults it sets for core options: "
                     + ", ".join(f"`--{key.replace('_', '-')} {value}`" for key, value in defaults.items()) + ".")
    parser = argparse.ArgumentParser(prog="hetfair-train", add_help=False)
    component.add_args(parser)
    actions = [action for action in parser._actions if documented(action)]
    lines.append(options_table(actions, parser.prog) if actions else "No flags of its own.")
    return "\n\n".join(line for line in lines if line)


def render_archs() -> str:
    rows = ["### Architectures (`--arch`)", "", "| arch | model | defaults it sets |", "|---|---|---|"]
    for arch in builtin_names(ARCH_REGISTRY):
        model, defaults = resolve_arch(arch)
        settings = ", ".join(f"`--{key.replace('_', '-')} {value}`" for key, value in defaults.items())
        rows.append(f"| `{arch}` | `{model}` | {settings} |")
    return "\n".join(rows)


def first_line(doc: str | None) -> str:
    return one_line(doc.strip().splitlines()[0]) if doc else ""
