"""The design's rules that a reading of one module cannot see: outside vit/engines/ and
vit/run/compat.py no code branches on an engine's name; it asks the engine's spec
(vit.engines.registry)."""

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest
from helpers import run_cmd

from bench.runs import CONFIGS, RUN_ENGINES
from vit.core.paths import ROOT
from vit.engines.registry import NAMES, SPECS

# as --engine and as a module name
ENGINE_NAMES = frozenset(NAMES) | {n.replace("-", "_") for n in NAMES}
MAY_NAME_ENGINES = ("vit/engines/", "vit/run/compat.py")
# Literals equal to an engine name that are not a dispatch on --engine, each with why.
NOT_DISPATCH = {
    ("bench/async_pipeline.py", "async-pipeline"): "the bench command and its table row named "
    "after what they measure",
    ("vit/run/ds_schema.py", "pipeline"): "DeepSpeed's own JSON section 'pipeline'",
}


def _literals(node: ast.AST) -> list[str]:
    """The string constants a comparison operand or key is, or holds (a tuple, list or set of
    them)."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]


def engine_name_uses(source: str) -> list[tuple[int, str, str]]:
    """(line, how, name) for each engine name compared (==, !=, in, is, match/case), used as a key
    (a dict literal's, a subscript's) or named in a constant list of engines, in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            uses = [
                ("compared", v)
                for operand in [node.left, *node.comparators]
                for v in _literals(operand)
            ]
        elif isinstance(node, ast.MatchValue):
            uses = [("matched", v) for v in _literals(node.value)]
        elif isinstance(node, ast.Dict):
            uses = [
                ("a dict key", v) for key in node.keys if key is not None for v in _literals(key)
            ]
        elif isinstance(node, ast.Subscript):
            uses = [("a subscript", v) for v in _literals(node.slice)]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(
            node.value, (ast.Tuple, ast.List, ast.Set)
        ):
            # PIPELINES = ("pipeline", "async-pipeline"), for `engine in PIPELINES`
            names = _literals(node.value)
            every = len(names) == len(node.value.elts) and set(names) <= ENGINE_NAMES
            uses = [("in a list of engines", v) for v in names] if every else []
        else:
            continue
        found += [(node.lineno, how, v) for how, v in uses if v in ENGINE_NAMES]
    return found


def checked_files() -> list[Path]:
    files = [*(ROOT / "vit").rglob("*.py"), *(ROOT / "bench").rglob("*.py"), *ROOT.glob("*.py")]
    return [f for f in files if not f.relative_to(ROOT).as_posix().startswith(MAY_NAME_ENGINES)]


def test_no_module_outside_the_engines_and_the_compatibility_table_branches_on_an_engine_name():
    files = checked_files()
    assert ROOT / "vit" / "train.py" in files and ROOT / "bench" / "runs.py" in files
    assert not any(f.is_relative_to(ROOT / "vit" / "engines") for f in files)
    offences, excused = [], set()
    for f in files:
        rel = f.relative_to(ROOT).as_posix()
        for line, how, name in engine_name_uses(f.read_text()):
            if (rel, name) in NOT_DISPATCH:
                excused.add((rel, name))
            else:
                offences.append(f"{rel}:{line}: '{name}' {how}")
    assert excused == NOT_DISPATCH.keys(), (
        "an exception no longer needed: remove it from NOT_DISPATCH"
    )
    assert not offences, (
        "engine names branched on outside vit/engines/ and vit/run/compat.py; "
        "ask the engine's "
        "spec (vit.engines.registry) instead:\n" + "\n".join(offences)
    )


@pytest.mark.parametrize(
    "code, how",
    [
        ("if engine == 'ddp': pass", "compared"),
        ("ok = 'zero' != engine", "compared"),
        ("if par.engine in ('pipeline', 'async-pipeline'): pass", "compared"),
        ("if 'pipeline' in name: pass", "compared"),
        ("match engine:\n    case 'async-pipeline':\n        pass", "matched"),
        ("CONFIGS = {'ddp': 'zero0.json'}", "a dict key"),
        ("x = DEFAULTS['zero']", "a subscript"),
        ("DEEPSPEED_ENGINES = ('zero', 'pipeline')", "in a list of engines"),
        ("import_module('vit.engines.' + name) if name == 'async_pipeline' else None", "compared"),
    ],
)
def test_the_check_finds_each_way_of_branching_on_a_name(code, how):
    assert {u[1] for u in engine_name_uses(code)} == {how}


def test_the_check_leaves_spec_questions_and_other_strings_alone():
    code = (
        "if spec(engine).pipeline and par.partition == 'balanced': pass\n"
        "opts = ['--engine', 'pipeline']\nfor name in ('zero2', 'ddp'): pass\nprint(f'--engine "
        "{engine}')\n"
        "d = {'zero_stage': 0}\n"
        "name.startswith('pipeline')"
    )
    assert engine_name_uses(code) == []


@pytest.mark.ranks
def test_the_registry_and_the_compatibility_table_load_without_torch():
    """The command line and its checks read the registry before anything heavy is imported."""
    r = run_cmd(
        [
            sys.executable,
            "-c",
            "import sys, vit.engines, vit.run.compat, "
            "vit.run.cli; "
            "from vit.engines import build; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', "
            "'deepspeed')))",
        ],
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_every_registered_engine_has_its_module_its_json_and_a_benchmark_run():
    for spec in SPECS.values():
        assert callable(importlib.import_module(spec.module).build), spec.module
        assert (ROOT / "deepspeed_configs" / spec.default_ds_config).is_file(), (
            spec.default_ds_config
        )
        assert spec.zero_stage is None or spec.zero_stage in spec.zero_stages, spec.name
    assert {engine.name for engine, _ in RUN_ENGINES.values()} == set(NAMES)
    assert all((CONFIGS / config).is_file() for _, config in RUN_ENGINES.values())


# Where the docs list every engine: the option tables' `--engine a\|b\|...` (README.md,
# docs/training.md) and the folders of docs/architecture.md's engines/ section.
ENGINE_LIST = re.compile(r"`--engine ((?:[a-z-]+\\\|)+[a-z-]+)`")


def docs_missing_engines(readme: str, training: str, architecture: str) -> dict[str, list[str]]:
    """Per doc, the registered engines one of its engine lists leaves out."""
    missing = {}
    for doc, text in (("README.md", readme), ("docs/training.md", training)):
        lists = [names.split("\\|") for names in ENGINE_LIST.findall(text)] or [[]]
        if lack := sorted({n for names in lists for n in NAMES if n not in names}):
            missing[doc] = lack
    folders = architecture.partition("\n### engines/\n")[2].partition("\n### ")[0]
    if lack := [n for n in NAMES if f"`{n.replace('-', '_')}/`" not in folders]:
        missing["docs/architecture.md"] = lack
    return missing


def test_the_docs_engine_lists_name_every_registered_engine():
    texts = [(ROOT / doc).read_text() for doc in ("README.md", "docs/training.md")]
    assert docs_missing_engines(*texts, (ROOT / "docs/architecture.md").read_text()) == {}


def test_the_engine_list_check_sees_an_engine_left_out():
    line = "| engine | `--engine zero\\|pipeline\\|ddp` |"
    folders = "\n### engines/\n\n- `zero/`, `pipeline/`\n\n### planner/\n- `ddp/`"
    assert docs_missing_engines(line, line, folders) == {
        doc: ["async-pipeline", "diloco"] for doc in ("README.md", "docs/training.md")
    } | {"docs/architecture.md": ["async-pipeline", "ddp", "diloco"]}
