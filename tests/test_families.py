"""Model families: a family is its folder plus one ``hetfair.families`` entry point line.

The toy family (``tests/toy_family``) is "installed" by a ``*.dist-info`` written under ``tmp_path``
that holds nothing but that line; the commands then run as users type them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import TESTS_DIR
from hetfair import errors
from hetfair.families import FAMILY_REGISTRY, FamilySpec
from hetfair.models import MODEL_REGISTRY, HetfairModel
from hetfair.tasks import TASK_REGISTRY
from toy_family.family import FAMILY as TOY_SPEC

TOY_LINE = "toyfam = toy_family.family:FAMILY"
TOY_COMPONENTS = {"tasks": "toyfam", "models": "toyfam_linear", "archs": "toyfam_wide", "criteria": "toyfam_mse"}


def install(site: Path, dist: str, lines: dict[str, list[str]], modules: dict[str, str] | None = None) -> Path:
    """A ``dist-info`` of distribution ``dist`` under ``site`` declaring ``lines`` per entry-point group."""
    info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("".join(f"[{group}]\n" + "".join(f"{line}\n" for line in entries)
                                                   for group, entries in lines.items()))
    for module, code in (modules or {}).items():
        (site / f"{module}.py").write_text(code)
    return site


@pytest.fixture(scope="module")
def toy_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy family installed: one entry point line."""
    return install(tmp_path_factory.mktemp("site"), "hetfair-toy-family", {"hetfair.families": [TOY_LINE]})


def run(script: str, *argv: str, site: Path, cwd: Path) -> subprocess.CompletedProcess:
    """Run the installed console script ``script`` with the toy family's site (and tests/, its folder) on the path."""
    executable = Path(sys.executable).with_name(script)
    env = {key: value for key, value in os.environ.items() if key != "HETFAIR_DEBUG"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), str(TESTS_DIR), env.get("PYTHONPATH")]))
    return subprocess.run([str(executable), *argv], capture_output=True, text=True, cwd=cwd, env=env, timeout=300,
                          check=False)


def test_the_toy_family_preprocesses_trains_and_refuses_to_export(toy_site, tmp_path):
    preprocessed = run("hetfair-preprocess", "--task", "toyfam", "--destdir", str(tmp_path / "data"), "--num-samples",
                       "32", site=toy_site, cwd=tmp_path)
    assert preprocessed.returncode == 0, preprocessed.stderr
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["train.pt", "valid.pt"]

    trained = run("hetfair-train", "--task", "toyfam", "--data", str(tmp_path / "data"), "--arch", "toyfam_wide",
                  "--max-update", "4", "--log-interval", "1", "--log-format", "json", "--cpu",
                  "--save-dir", str(tmp_path / "ckpt"), site=toy_site, cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    records = [json.loads(line) for line in trained.stderr.splitlines() if line.startswith("{")]
    updates = [r for r in records if r["phase"] == "train_inner"]
    assert [r["num_updates"] for r in updates] == [1, 2, 3, 4]  # 32 points, 8 a batch: four updates in one epoch
    assert any(r["phase"] == "valid" for r in records)

    exported = run("hetfair-export", "--path", str(tmp_path / "ckpt" / "checkpoint_last.pt"), "--to", "hf",
                   str(tmp_path / "hf"), site=toy_site, cwd=tmp_path)
    assert exported.returncode == 2
    assert exported.stderr.strip().splitlines() == [
        f"hetfair-export: error: {tmp_path / 'ckpt' / 'checkpoint_last.pt'} holds a 'toyfam_linear' model, which does "
        f"not export to Hugging Face (its family 'toyfam' names no hf_exporter)"]


def test_hetfair_preprocess_offers_the_tasks_of_families_with_a_preprocessor(toy_site, tmp_path):
    result = run("hetfair-preprocess", "--task", "nothing", site=toy_site, cwd=tmp_path)
    assert result.returncode == 2
    assert "(choose from 'bert', 'language_modeling', 'toyfam')" in result.stderr  # not sentence_classification
    helped = run("hetfair-preprocess", "--task", "toyfam", "--help", site=toy_site, cwd=tmp_path)
    assert helped.returncode == 0 and "--num-samples" in helped.stdout and "--tokenizer" not in helped.stdout


def test_list_plugins_shows_the_family_and_each_of_its_components(toy_site, tmp_path):
    result = run("hetfair-train", "--list-plugins", site=toy_site, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = {tuple(line.split(None, 1)) for line in result.stdout.splitlines() if line.startswith("  ")}
    assert ("toyfam", f"distribution 'hetfair-toy-family' 1.0 (entry point {TOY_LINE}), preprocessor") in rows
    for kind, name in TOY_COMPONENTS.items():
        reference = getattr(TOY_SPEC, kind)[name]
        assert (name, f"distribution 'hetfair-toy-family' 1.0 (family toyfam: {name} = {reference})") in rows


LISTING_PROBE = """
import json, sys
from hetfair.criteria import CRITERION_REGISTRY
from hetfair.models import ARCH_REGISTRY, MODEL_REGISTRY
from hetfair.tasks import TASK_REGISTRY
names = [r.names() for r in (TASK_REGISTRY, MODEL_REGISTRY, ARCH_REGISTRY, CRITERION_REGISTRY)]
print(json.dumps({"names": names, "imported": sorted(m for m in sys.modules if m.startswith("toy_family"))}))
"""


def test_listing_a_family_imports_its_spec_only(toy_site, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(toy_site), str(TESTS_DIR)])}
    result = subprocess.run([sys.executable, "-c", LISTING_PROBE], capture_output=True, text=True, cwd=tmp_path,
                            env=env, timeout=300, check=True)
    report = json.loads(result.stdout)
    assert all(name in names for name, names in zip(TOY_COMPONENTS.values(), report["names"]))
    assert report["imported"] == ["toy_family", "toy_family.family"]


def test_a_family_component_clashing_with_a_plugin_names_both(toy_site, tmp_path, monkeypatch):
    install(tmp_path, "hetfair-test-other", {"hetfair.tasks": ["toyfam = other_toy:Task"]},
            {"other_toy": "raise RuntimeError('imported while checking a clash')\n"})
    monkeypatch.syspath_prepend(str(toy_site))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert TASK_REGISTRY.definitions("toyfam") == [
        "distribution 'hetfair-test-other' 1.0 (entry point toyfam = other_toy:Task)",
        f"distribution 'hetfair-toy-family' 1.0 (family toyfam: toyfam = toy_family.task:ToyFamTask)"]
    with pytest.raises(errors.DuplicateComponentError, match="'hetfair-test-other'.* and .*'hetfair-toy-family'"):
        TASK_REGISTRY.get("toyfam")


BROKEN_SPECS = {  # broken_spec.py -> what the one line says
    "raises": ("raise ImportError('libtoy.so: cannot open shared object file')\n",
               "failed to import: ImportError: libtoy.so: cannot open shared object file"),
    "not-a-spec": ("FAMILY = {'name': 'broken'}\n", "names a dict, not a hetfair.families.FamilySpec"),
    "misnamed": ("from hetfair.families import FamilySpec\nFAMILY = FamilySpec(name='other')\n",
                 "names the spec of family 'other'; give the entry point the family's name"),
}


@pytest.mark.parametrize("case", BROKEN_SPECS, ids=list(BROKEN_SPECS))
def test_a_family_that_does_not_load_is_one_line_and_breaks_nothing_else(case, tmp_path, monkeypatch):
    code, cause = BROKEN_SPECS[case]
    install(tmp_path, "hetfair-test-broken-family", {"hetfair.families": ["broken = broken_spec:FAMILY"]},
            {"broken_spec": code})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "broken_spec", raising=False)
    [failure] = FAMILY_REGISTRY.failures()
    assert "'hetfair-test-broken-family'" in failure and cause in failure and "\n" not in failure
    assert "bert" in TASK_REGISTRY.names()  # the other families still list and load
    assert TASK_REGISTRY.get("bert").__name__ == "BertTask"
    with pytest.raises(errors.ComponentNotKnownError) as caught:
        TASK_REGISTRY.get("toy_missing_task")
    assert str(caught.value).endswith(f"; {failure}")  # the name may be the broken family's


def test_a_specs_component_lists_are_read_only():
    spec = FamilySpec(name="fixed", tasks={"t": "m:T"})
    with pytest.raises(TypeError):
        spec.tasks["u"] = "m:U"  # type: ignore[index]


BUILTIN = {family.name: family for family in FAMILY_REGISTRY.all() if family.package.startswith("hetfair.")}


def test_hetfair_ships_its_families_as_specs():
    assert sorted(BUILTIN) == ["bert", "classification", "hf_encoder", "lm"]
    assert {family.entry_point.distribution for family in BUILTIN.values()} == {"hetfair"}


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_a_builtin_specs_references_are_what_its_components_use(name):
    """Every reference imports; each model's export and units methods and its Hugging Face flag are the spec's."""
    family = BUILTIN[name]
    spec = family.spec
    for kind in TOY_COMPONENTS:
        for component, reference in getattr(spec, kind).items():
            assert callable(family.load(reference, kind)), (kind, component)
    assert callable(family.load(spec.sharding_units, "sharding_units"))
    if spec.preprocessor:
        preprocessor = family.preprocessor()
        assert callable(preprocessor.build_parser) and callable(preprocessor.preprocess)
    for model in spec.models:
        cls = MODEL_REGISTRY.get(model)
        assert family.hf_exporter() is cls.export_hf
        own_units = f"{cls.__module__}:{cls.__name__}.sharding_units"
        assert spec.sharding_units in (own_units, "hetfair.hf_encoder.units:layer_units")  # the latter: hf_encoder's
        cuts = cls.pipeline_stage is not HetfairModel.pipeline_stage  # the model defines its stages
        assert spec.pipeline_stage == (f"{cls.__module__}:{cls.__name__}.pipeline_stage" if cuts else None)
        if spec.pipeline_stage:
            assert family.load(spec.pipeline_stage, "pipeline_stage") is cls.pipeline_stage
        parser = argparse.ArgumentParser()
        cls.add_args(parser)
        assert spec.hf_import_flag in parser._option_string_actions, "the flag that reads a Hugging Face folder"


def test_the_plugin_page_shows_the_toy_familys_spec_as_it_stands():
    page = (TESTS_DIR.parent / "docs" / "plugins.md").read_text()
    assert f"```python\n# toy_family/family.py\n{(TESTS_DIR / 'toy_family' / 'family.py').read_text()}```" in page
    assert f'{TOY_LINE.split(" = ")[0]} = "{TOY_LINE.split(" = ")[1]}"' in page
