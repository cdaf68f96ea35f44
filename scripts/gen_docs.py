"""The docs site's generated pages, and its links into the repository.

    python scripts/gen_docs.py [--out DIR]    write the reference pages under DIR/reference/ (default DIR: site-ref/)
    mkdocs build --strict                     mkdocs.yml names this file as a hook: the same pages, built in

Three references, each generated from the code it documents, so that it cannot drift from it:
- the configuration reference (reference/config.md) from the config dataclasses of jetflow/config.py: every key
  under `Config`, its type, its default, the values a `Literal` type allows, and its description, the attribute's
  docstring (the string literal right after the field, read from the source with `ast`; jetflow.config_reference,
  which `jetflow config explain KEY` prints from too);
- the metrics reference (reference/metrics.md) from jetflow.metrics_registry, the list of every metric a run logs
  that the metrics logger checks its rows against;
- the command-line reference (reference/cli.md) from jetflow/cli.py's argparse parser: each subcommand's --help.

`undocumented_keys()` lists the config keys without a docstring (tests/unit/test_docs.py fails on any);
tests/unit/test_metrics_registry.py fails on a logged metric the registry does not document.

As a hook (mkdocs.yml `hooks:`), it also lets the pages link to the repository's own files, the way they read on
GitHub: a relative link that leaves docs/ (`../results/learning/README.md`, `../examples/own_task/`) must name a
file or directory that exists (else the build fails), and points at `repo_url` when mkdocs.yml sets one, else at
the file in the checkout the site was built from (site/ lies in it). An image that leaves docs/ is copied into
the site (under repo/).
"""

from __future__ import annotations

import argparse
import os
import posixpath
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script or loaded by mkdocs: the checkout's jetflow
    sys.path.insert(0, str(ROOT))

from jetflow.config_reference import (CONFIG_SOURCE, Key, attribute_docs, config_keys,  # noqa: E402, F401
                                      section_docs, undocumented_keys)

PAGES = ("reference/config.md", "reference/metrics.md", "reference/cli.md")


# The configuration reference ---------------------------------------------------------------------------------

def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def config_reference() -> str:
    """reference/config.md."""
    keys = config_keys()
    sections = section_docs()
    lines = ["# Configuration reference", "",
             "Generated from the config dataclasses of `jetflow/config.py` by `scripts/gen_docs.py`: every key a run",
             "config takes, its type, its default and its description (the field's docstring). Set a key in a YAML",
             "file (`--config F`, sections as below) or on the command line (`jetflow train section.key=value`);",
             "an unknown key or a value outside its choices is a one-line error naming the key and what is valid.",
             f"{len(keys)} keys.", ""]
    current = None
    for k in keys:
        section = k.key.rsplit(".", 1)[0]
        if section != current:
            current = section
            lines += ["", f"## `{section}`", ""]
            if sections.get(section):
                lines += [sections[section], ""]
            lines += ["| key | type | default | description |", "|---|---|---|---|"]
        doc = k.doc or "**(undocumented)**"
        if k.choices:
            doc += " Valid values: " + ", ".join(f"`{c}`" for c in k.choices) + "."
        lines.append(f"| `{k.key}` | `{_cell(k.type)}` | `{_cell(k.default)}` | {_cell(doc)} |")
    return "\n".join(lines) + "\n"


# The metrics reference ---------------------------------------------------------------------------------------

def metrics_reference() -> str:
    """reference/metrics.md: jetflow.metrics_registry's entries, family by family."""
    from jetflow import metrics_registry as reg
    families = [f for f in reg.FAMILIES if any(m.family == f for m in reg.METRICS)]  # FAMILIES' order
    lines = ["# Metrics reference", "",
             "Generated from `jetflow/metrics_registry.py` by `scripts/gen_docs.py`: every metric a run logs, what it",
             "measures, the rows that hold it and when it is logged. `metrics.jsonl` in the run directory has one JSON",
             "row per supervised warm-up step (phase `sft`), RL step (`rl`) and held-out evaluation (`eval`); a value",
             "that is NaN or infinite is written as `null`. The metrics logger checks every key against the registry",
             "and warns once about one it does not document, and `tests/unit/test_metrics_registry.py` fails on it.",
             "In the trackers (`run.loggers`) a key is prefixed by its phase unless it is an RL row's or carries",
             "the prefix already (`train/loss` of a warm-up row is `sft/train/loss`; `eval/pass@1` stays); MLflow",
             "writes `@` as `_`.", "",
             f"{sum(not m.is_pattern for m in reg.METRICS)} keys and {sum(m.is_pattern for m in reg.METRICS)} "
             "families of keys. In a family's key, " + "; ".join(
                 f"`{{{name}}}` is {what}" for name, (_, what) in reg.PLACEHOLDERS.items()) + ".", "",
             "Every row also holds:", ""]
    lines += [f"- `{name}`: {what}" for name, what in reg.ROW_FIELDS.items()]
    lines += ["", "Families: " + ", ".join(f"[`{f or 'other'}`](#{f or 'other'})" for f in families) + "."]
    for family in families:
        name = family or "other"
        lines += ["", f"## `{name}` {{#{name}}}", "", reg.FAMILIES.get(family, ""), "",
                  "| key | phases | logged when | meaning |", "|---|---|---|---|"]
        for m in (m for m in reg.METRICS if m.family == family):
            lines.append(f"| `{_cell(m.key)}` | {', '.join(m.phases)} | {_cell(m.when or 'always')} | "
                         f"{_cell(m.meaning)} |")
    return "\n".join(lines) + "\n"


# The command-line reference ----------------------------------------------------------------------------------

def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_reference() -> str:
    """reference/cli.md: `jetflow --help`, then each subcommand's --help (from jetflow.cli.build_parser)."""
    os.environ["COLUMNS"] = "110"  # argparse wraps to the terminal: a fixed width, the same page everywhere
    from jetflow.cli import build_parser
    parser = build_parser()
    subs = _subcommands(parser)
    lines = ["# Command-line reference", "",
             "Generated from `jetflow/cli.py`'s argparse parser by `scripts/gen_docs.py`: each command's `--help`.",
             "Commands that take a config also take any number of `key=value` overrides (the",
             "[configuration reference](config.md)). `jetflow --debug COMMAND ...` shows the traceback of an error",
             "that is otherwise one line ([troubleshooting](../troubleshooting.md)).", "",
             "Commands: " + ", ".join(f"[`{name}`](#jetflow-{name})" for name in subs) + ".", "",
             "## `jetflow`", "", "```text", parser.format_help().rstrip(), "```"]
    for name, sub in subs.items():
        lines += ["", f"## `jetflow {name}` {{#jetflow-{name}}}", "", "```text", sub.format_help().rstrip(), "```"]
    return "\n".join(lines) + "\n"


def pages() -> dict[str, str]:
    """{path under docs/: its Markdown} of every generated page."""
    return {"reference/config.md": config_reference(), "reference/metrics.md": metrics_reference(),
            "reference/cli.md": cli_reference()}


# The mkdocs hook ---------------------------------------------------------------------------------------------

LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]+)\)")
IMAGE = (".png", ".svg", ".jpg", ".jpeg", ".gif")
REPO_PREFIX = "repo/"  # where an image from outside docs/ lands in the site


def _outbound(src_uri: str, target: str) -> str | None:
    """The repository path a link of page `src_uri` leads to when it leaves docs/, else None."""
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return None
    path = target.split("#", 1)[0]
    if not path:
        return None
    joined = posixpath.normpath(posixpath.join("docs", posixpath.dirname(src_uri), path))
    return None if joined == "docs" or joined.startswith("docs/") else joined


def _docs_images(docs_dir: Path) -> set[str]:
    """The repository images the pages embed from outside docs/."""
    found = set()
    for md in docs_dir.rglob("*.md"):
        src = md.relative_to(docs_dir).as_posix()
        for bang, _, target in LINK.findall(md.read_text()):
            path = _outbound(src, target)
            if bang and path and path.lower().endswith(IMAGE):
                found.add(path)
    return found


def on_files(files, config):
    """The generated reference pages, and the images the pages embed from the repository."""
    from mkdocs.structure.files import File
    for path, text in pages().items():
        files.append(File.generated(config, path, content=text))
    for path in sorted(_docs_images(Path(config["docs_dir"]))):
        if (ROOT / path).is_file():
            files.append(File.generated(config, REPO_PREFIX + path, abs_src_path=str(ROOT / path)))
    return files


_missing: list[str] = []


def on_pre_build(config):
    _missing.clear()


def on_page_markdown(markdown, page, config, files):
    """Links that leave docs/: checked against the repository; an image becomes the site's copy, any other link
    `repo:PATH`, resolved once the page is HTML (on_page_content)."""
    src = page.file.src_uri

    def rewrite(m: re.Match) -> str:
        bang, text, target = m.groups()
        path = _outbound(src, target)
        if path is None:
            return m.group(0)
        fragment = target[len(target.split("#", 1)[0]):]
        if not (ROOT / path).exists():
            _missing.append(f"{src}: link to {target} ({path} is not in the repository)")
            return m.group(0)
        if bang and path.lower().endswith(IMAGE):
            rel = posixpath.relpath(REPO_PREFIX + path, posixpath.dirname(src) or ".")
            return f"{bang}[{text}]({rel})"
        return f"{bang}[{text}](repo:{path}{fragment})"
    return LINK.sub(rewrite, markdown)


def on_page_content(html, page, config, files):
    """`repo:PATH` -> repo_url/blob/main/PATH, or the path from the built page to PATH in the checkout."""
    repo_url = (config.get("repo_url") or "").rstrip("/")
    page_dir = Path(config["site_dir"]) / posixpath.dirname(page.file.dest_uri)

    def resolve(m: re.Match) -> str:
        path = m.group(2)
        if repo_url:
            return f'{m.group(1)}="{repo_url}/blob/main/{path}"'
        return f'{m.group(1)}="{os.path.relpath(ROOT / path, page_dir)}"'
    return re.sub(r'(href|src)="repo:([^"]+)"', resolve, html)


def on_post_build(config):
    if _missing:
        from mkdocs.exceptions import PluginError
        raise PluginError("links to files that are not in the repository:\n  " + "\n  ".join(_missing))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="site-ref", help="directory to write the generated pages into")
    args = ap.parse_args(argv)
    for path, text in pages().items():
        out = Path(args.out) / path
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(out)
    missing = undocumented_keys()
    if missing:
        print(f"config keys without a docstring: {missing}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
