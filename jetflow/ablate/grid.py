"""The grid of an ablation (`jetflow ablate FILE`): the YAML file, its cells and their configs.

The ablation file (configs/ablations/precision.yaml is the full example, with comments):

    name: precision                  # results go to results/<name>/ unless out_dir says otherwise
    base_config: configs/tiny.yaml   # a run config (relative to the working directory, else to this
                                     # file's directory), or null for the built-in defaults
    overrides: [train.steps=30]      # key=value applied to every cell
    grid:                            # the cells are the cross product of the axes, in this order
      precision.mode: [bf16, mixed, unified]           # a config key and its values
      length:                                          # a linked axis: each value (a mapping of
                                                       # full config keys) sets several keys at once
        - {id: len8, rollout.max_new_tokens: 8}
        - {id: len64, rollout.max_new_tokens: 64, task.params.num_operands: 16}
      algo.correction:                                 # a conditional axis: it only multiplies the
        values: [none, token_tis, token_mis, ais]      # cells that match `only_when` (keys set by
        only_when: {precision.mode: mixed}             # axes listed before it); the others keep
                                                       # the base value and get no label
      run.seed: [0, 1]
      # run.rl_seed: [1, 11, 12]     # RL replicates: other RL draws from each seed's warm-up (list it in
                                     # shared_warmup.ignore so that they share it)
    extra:                           # optional cells outside the grid: {id: ..., key: value, ...}
      - {id: mixed-seqtis, precision.mode: mixed, algo.correction: seq_tis}
    compare:                         # optional: variant pairs [a, b] whose difference of means a - b
      - [mixed-none, bf16]           # (with its standard error over the seeds) the report tabulates in
                                     # every setting (jetflow.ablate.report)
    shared_warmup:                   # optional: cells that differ only in these keys run one supervised
      ignore: [algo.correction]      # warm-up between them (jetflow.ablate.warmups)

A cell's id joins one label per axis (`mixed-token_mis-len64-seed0`): the value itself for
precision.mode and algo.correction, `len<N>` for rollout.max_new_tokens, `seed<N>` for run.seed,
`draw<N>` for run.rl_seed, `<last key part><value>` otherwise, the `id` of a linked value, or an axis' own `label: "lr{}"`.

Every cell's config is resolved and goes through the pre-run pass (jetflow.run.validate) before
anything runs, so a typo fails at once and names the cell.

place_cells gives each cell its variant and its setting: the line and the panel it is drawn in
(jetflow.ablate.figures states the rules), and the variant names that `compare` pairs.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jetflow.ablate.warmups import WARMUPS, SharedWarmup, parse_shared_warmup
from jetflow.config import Config, ConfigError, load_config
from jetflow.run.files import CONFIG_FILE
from jetflow.run.validate import validate_run

RUNS = "runs"
SEED_AXIS = "run.seed"
RL_SEED_AXIS = "run.rl_seed"
SEED_AXES = (SEED_AXIS, RL_SEED_AXIS)  # pooled over in a line, paired between lines (replicate)
Replicate = tuple[int, int]  # (run.seed, RL draw)
LINE_AXES = ("precision.mode", "precision.family", "algo.correction")
# Axis labels: "{}" is the value. Other keys get "<last key part><value>".
LABELS = {"precision.mode": "{}", "algo.correction": "{}", "rollout.max_new_tokens": "len{}", "run.seed": "seed{}",
          "run.rl_seed": "draw{}"}


@dataclass
class Cell:
    id: str
    settings: dict[str, Any]
    """The cell's own config keys (grid and extra), on top of the ablation's common overrides."""

    @property
    def overrides(self) -> list[str]:
        return [f"{k}={format_value(v)}" for k, v in self.settings.items()]


@dataclass
class Ablation:
    name: str
    source: Path
    base_config: Path | None
    overrides: list[str]
    cells: list[Cell]
    out_dir: Path
    grid: dict[str, Any] = field(default_factory=dict)
    compare: list[tuple[str, str]] = field(default_factory=list)
    """Variant pairs (a, b): the report's difference of means a - b per setting."""
    shared_warmup: SharedWarmup | None = None
    """Cells that would run the same supervised warm-up start from one (jetflow.ablate.warmups)."""

    def run_dir(self, cell: Cell) -> Path:
        return self.out_dir / RUNS / cell.id

    def warmup_groups(self) -> dict[str, str]:
        """cell id -> the name of the shared warm-up it starts from ({} without shared_warmup)."""
        return self.shared_warmup.groups(self.cells) if self.shared_warmup else {}

    def warmup_dir(self, name: str) -> Path:
        return self.out_dir / WARMUPS / name


def format_value(value: Any) -> str:
    """A YAML value as the right-hand side of a `key=value` override (parsed back as YAML)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, dict)):
        return json.dumps(value)  # JSON flow syntax is YAML
    text = str(value)
    if isinstance(value, float) and "e" in text and "." not in text:
        text = text.replace("e", ".0e")  # YAML 1.1 reads 1e-05 as a string, 1.0e-05 as a float
    try:
        same = yaml.safe_load(text) == value
    except yaml.YAMLError:
        same = False
    return text if same else json.dumps(text)


def _label(key: str, value: Any, fmt: str | None = None) -> str:
    fmt = fmt or LABELS.get(key, key.rsplit(".", 1)[-1] + "{}")
    return re.sub(r"[^A-Za-z0-9._+=-]+", "_", fmt.format(format_value(value).strip('"')))


def _parse_axis(name: str, spec: Any) -> tuple[list[tuple[str, dict]], dict]:
    """-> ([(label, settings), ...], only_when). Accepts a list or {values, only_when, label}."""
    only_when: dict = {}
    fmt = None
    if isinstance(spec, dict):
        unknown = set(spec) - {"values", "only_when", "label"}
        if unknown or "values" not in spec:
            raise ConfigError(f"grid axis {name!r}: a mapping axis needs `values` (and may have `only_when`, "
                              f"`label`); got keys {sorted(spec)}")
        only_when, fmt, spec = spec.get("only_when") or {}, spec.get("label"), spec["values"]
        if not isinstance(only_when, dict):
            raise ConfigError(f"grid axis {name!r}: only_when must map keys to a value or a list of values")
    if not isinstance(spec, list) or not spec:
        raise ConfigError(f"grid axis {name!r}: needs a non-empty list of values")
    values = []
    for v in spec:
        if isinstance(v, dict):  # a linked value: several keys at once
            settings = {k: x for k, x in v.items() if k != "id"}
            if not settings:
                raise ConfigError(f"grid axis {name!r}: value {v} sets no key")
            label = str(v["id"]) if "id" in v else "-".join(_label(k, x) for k, x in settings.items())
            values.append((label, settings))
        else:
            values.append((_label(name, v, fmt), {name: v}))
    return values, only_when


def _matches(settings: dict, only_when: dict) -> bool:
    def same(a, b):
        return format_value(a) == format_value(b)
    for key, want in only_when.items():
        wants = want if isinstance(want, list) else [want]
        if key not in settings or not any(same(settings[key], w) for w in wants):
            return False
    return True


def expand_grid(grid: dict[str, Any] | None, extra: list[dict] | None = None) -> list[Cell]:
    """The cells of a grid (cross product in axis order, conditional axes applied where they match)
    followed by the extra cells; ids must be unique."""
    partial: list[tuple[list[str], dict]] = [([], {})]
    seen_keys: set[str] = set()
    for name, spec in (grid or {}).items():
        values, only_when = _parse_axis(name, spec)
        missing = [k for k in only_when if k not in seen_keys]
        if missing:
            raise ConfigError(f"grid axis {name!r}: only_when keys {missing} are not set by an earlier axis")
        nxt = []
        for labels, settings in partial:
            if only_when and not _matches(settings, only_when):
                nxt.append((labels, settings))
                continue
            nxt += [([*labels, label], {**settings, **vs}) for label, vs in values]
        partial = nxt
        seen_keys.update(k for _, vs in values for k in vs)
    cells = [Cell("-".join(labels) or "base", settings) for labels, settings in partial] if grid else []
    for i, e in enumerate(extra or []):
        if not isinstance(e, dict) or not {k for k in e if k != "id"}:
            raise ConfigError(f"extra cell #{i}: needs a mapping of config keys, got {e!r}")
        settings = {k: v for k, v in e.items() if k != "id"}
        cells.append(Cell(str(e.get("id") or "-".join(_label(k, v) for k, v in settings.items())), settings))
    ids = [c.id for c in cells]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ConfigError(f"cell ids are not unique: {dupes} (give linked values or extra cells an `id`)")
    if not cells:
        raise ConfigError("the ablation has no cells: give it a `grid` or `extra` cells")
    return cells


def _resolve_path(p: str, source: Path) -> Path:
    path = Path(p)
    if path.is_absolute() or path.exists():
        return path
    beside = source.parent / path
    return beside if beside.exists() else path


def load_ablation(path: str | Path, out_dir: str | Path | None = None) -> Ablation:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"ablation file not found: {path}")
    spec = yaml.safe_load(path.read_text()) or {}
    known = {"name", "base_config", "overrides", "grid", "extra", "out_dir", "compare", "shared_warmup"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown keys {unknown}; valid keys: {sorted(known)}")
    name = spec.get("name") or path.stem
    overrides = spec.get("overrides") or []
    if isinstance(overrides, dict):
        overrides = [f"{k}={format_value(v)}" for k, v in overrides.items()]
    base = spec.get("base_config")
    base_path = _resolve_path(base, path) if base else None
    out = Path(out_dir or spec.get("out_dir") or Path("results") / name)
    ab = Ablation(name=name, source=path, base_config=base_path, overrides=[str(o) for o in overrides],
                  cells=expand_grid(spec.get("grid"), spec.get("extra")), out_dir=out, grid=spec.get("grid") or {})
    ab.compare = _parse_compare(spec.get("compare"), ab, path)
    ab.shared_warmup = parse_shared_warmup(spec.get("shared_warmup"), path)
    return ab


def _parse_compare(spec: Any, ab: Ablation, path: Path) -> list[tuple[str, str]]:
    """`compare: [[a, b], ...]`: pairs of variant names (the figures' lines) that the ablation has."""
    if spec is None:
        return []
    variants = list(dict.fromkeys(p.line for p in place_cells(ab)))
    if not isinstance(spec, list):
        raise ConfigError(f"{path}: compare must be a list of [variant, variant] pairs; variants: {variants}")
    pairs = []
    for pair in spec:
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(v, str) for v in pair)):
            raise ConfigError(f"{path}: compare entry {pair!r} is not a [variant, variant] pair")
        unknown = [v for v in pair if v not in variants]
        if unknown:
            raise ConfigError(f"{path}: compare names {unknown}, not variants of this ablation; variants: {variants}")
        pairs.append((pair[0], pair[1]))
    return pairs


def cell_config(ab: Ablation, cell: Cell, resume: bool = False) -> Config:
    extra = [f"run.out_dir={ab.out_dir / RUNS}", f"run.name={cell.id}"] + (["run.resume=true"] if resume else [])
    return load_config(ab.base_config, [*ab.overrides, *cell.overrides, *extra])


def warmup_config(ab: Ablation, name: str) -> Config:
    """A shared warm-up's run: its first cell's config with no RL step, in warmups/. (Its held-out evaluation
    stays: eval.num_prompts also decides which prompts are held out of training, the warm-up's included.) The
    warm-up there may have been made under another name and other values of the keys it does not read (a copy of
    another ablation's: configs/ablations/learning-length-draws.yaml); any other difference is refused."""
    cell = next(c for c in ab.cells if c.id == name)
    unread = [*(ab.shared_warmup.ignore if ab.shared_warmup else []), "run.name"]
    resume = ["run.resume=true", f"run.allow_changes=[{','.join(unread)}]"] if ab.warmup_dir(name).exists() else []
    return load_config(ab.base_config, [*ab.overrides, *cell.overrides, "train.steps=0",
                                        f"run.out_dir={ab.out_dir / WARMUPS}", f"run.name={name}", *resume])


def resolve_cells(ab: Ablation, cells: list[Cell]) -> dict[str, Config]:
    """Every cell's config, through the pre-run pass (a cell whose run directory exists resumes it, with
    the same config; so does a cell that starts from a shared warm-up); raise ConfigError naming the first
    bad cell."""
    configs, shared = {}, ab.warmup_groups()
    for cell in cells:
        try:
            cfg = cell_config(ab, cell, resume=ab.run_dir(cell).exists() or cell.id in shared)
            if cell.id in shared and not cfg.train.sft_warmup_steps:
                raise ConfigError("shared_warmup: this cell has no supervised warm-up (train.sft_warmup_steps=0)")
            validate_run(cfg)
        except ConfigError as e:
            raise ConfigError(f"cell {cell.id!r} ({' '.join(cell.overrides)}): {e}") from None
        configs[cell.id] = cfg
    return configs


def select(cells: list[Cell], only: list[str] | None) -> list[Cell]:
    """Cells whose id matches any of `only` (exact ids or shell patterns such as 'mixed-*')."""
    if not only:
        return cells
    unmatched = [p for p in only if not any(fnmatch.fnmatchcase(c.id, p) for c in cells)]
    if unmatched:
        raise ConfigError(f"--only {unmatched} matches no cell; cells: {[c.id for c in cells]}")
    return [c for c in cells if any(fnmatch.fnmatchcase(c.id, p) for p in only)]


# Where each cell is drawn and compared: its variant (line) and setting (panel).

@dataclass
class Placed:
    """One cell where it is drawn: its variant (`line`) in one setting (`panel`)."""
    cell: Cell
    run_dir: Path
    line: str
    panel: str
    mode: str | None
    panel_key: tuple = ()
    """The panel's label on each panel axis, in grid order."""


def replicate(cell: Cell) -> Replicate:
    """Which repeat of its variant a cell is, where a line's cells are pooled and two lines' are paired: its
    run.seed and its RL draw (run.rl_seed, else run.seed)."""
    seed, draw = int(cell.settings.get(SEED_AXIS, 0)), cell.settings.get(RL_SEED_AXIS)
    return seed, seed if draw is None else int(draw)


def _axis_labels(ab: Ablation, cell: Cell) -> dict[str, str]:
    """axis name -> the label of the value this cell took on it (axes the cell skipped are absent). Where
    several values of a linked axis agree with the cell (len256 and len256-lr3e-5, which adds train.lr), the
    one that sets the most keys is the cell's."""
    labels = {}
    for name, spec in ab.grid.items():
        agree = [(len(settings), label) for label, settings in _parse_axis(name, spec)[0]
                 if all(k in cell.settings and format_value(cell.settings[k]) == format_value(v)
                        for k, v in settings.items())]
        if agree:
            labels[name] = max(agree, key=lambda a: a[0])[1]  # the first of the most specific
    return labels


def _mode(run_dir: Path, cell: Cell) -> str | None:
    if "precision.mode" in cell.settings:
        return str(cell.settings["precision.mode"])
    cfg_file = run_dir / CONFIG_FILE
    if cfg_file.exists():
        return ((yaml.safe_load(cfg_file.read_text()) or {}).get("precision") or {}).get("mode")
    return None


def place_cells(ab: Ablation) -> list[Placed]:
    """Where each cell is drawn and compared: its variant (the figures' line; `compare` names these) and
    its setting (the panel). See jetflow.ablate.figures for the rules."""
    axes = [a for a in ab.grid if a not in SEED_AXES]
    line_axes = [a for a in axes if a in LINE_AXES] or axes[:1]
    panel_axes = [a for a in axes if a not in line_axes]
    grid_ids = _grid_ids(ab)
    rows = []
    for cell in ab.cells:
        labels = _axis_labels(ab, cell)
        line = "-".join(labels[a] for a in line_axes if a in labels)
        if not line or cell.id not in grid_ids:  # an extra cell: its own line, named by its id
            line = cell.id.replace(f"-seed{cell.settings.get(SEED_AXIS)}", "")  # less its seed and panel
            line = "-".join(part for part in line.split("-") if part not in {labels.get(a) for a in panel_axes})
        rows.append((cell, tuple(labels.get(a) for a in panel_axes), line))
    # A grid cell that a conditional panel axis skipped (`only_when`; e.g. bf16 under a recipe-family
    # axis of mixed and unified) is drawn in every panel that agrees with the panel labels it has.
    full = list(dict.fromkeys(key for cell, key, _ in rows if cell.id in grid_ids and None not in key))
    placed = []
    for cell, key, line in rows:
        keys = [key]
        if cell.id in grid_ids and None in key and full:
            keys = [k for k in full if all(own is None or own == k_i for own, k_i in zip(key, k))] or keys
        run_dir = ab.run_dir(cell)
        for k in keys:
            panel = "-".join(label for label in k if label is not None) or "all cells"
            placed.append(Placed(cell, run_dir, line, panel, _mode(run_dir, cell), k))
    return placed


def _grid_ids(ab: Ablation) -> set[str]:
    return {c.id for c in expand_grid(ab.grid)} if ab.grid else set()
