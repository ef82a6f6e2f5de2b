"""Architecture rules: service -> workers -> pipelines, and what each layer may import.

Read from the source with ``ast`` (imports inside functions count too), so a lazy import
cannot slip past the rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Installed package name of each top-level folder.
PACKAGES = {"pipelines": "pairclean", "workers": "pairclean_workers", "service": "pairclean_service"}
FORBIDDEN = {
    "pipelines": {"pairclean_workers", "pairclean_service", "workers", "service", "ray", "fastapi", "starlette", "uvicorn", "prometheus_client", "sqlalchemy"},
    "workers": {"pairclean_service", "service", "fastapi", "starlette", "uvicorn"},
    "service": {"torch", "open_clip", "timm", "transformers", "pipelines", "workers"},
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_what_it_may(layer: str) -> None:
    offenders = []
    for path in sorted((REPO / layer).rglob("*.py")):
        bad = _imports(path) & FORBIDDEN[layer]
        if bad:
            offenders.append(f"{path.relative_to(REPO)} imports {sorted(bad)}")
    assert not offenders, "layering broken:\n" + "\n".join(offenders)


def test_relative_imports_stay_inside_their_package() -> None:
    # `from .. import x` inside a top-level folder would reach outside the installed package
    for layer in PACKAGES:
        for path in (REPO / layer).rglob("*.py"):
            depth = len(path.relative_to(REPO / layer).parts) - 1
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level > depth + 1:
                    pytest.fail(f"{path.relative_to(REPO)}: relative import leaves the package")


def test_pyproject_maps_folders_to_prefixed_names() -> None:
    import tomllib

    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["package-dir"] == {v: k for k, v in PACKAGES.items()}
    top_level = {p.split(".")[0] for p in cfg["packages"]}
    assert top_level == set(PACKAGES.values())
    # every sub-package of a folder is listed, or it would be missing from a wheel
    for folder, name in PACKAGES.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder).parts
            assert ".".join((name, *rel)) in cfg["packages"]


def test_trainer_import_is_light() -> None:
    import subprocess
    import sys

    code = "import sys, pairclean, pairclean.osa; print(sorted(m for m in ('torch', 'ray', 'fastapi', 'open_clip') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.slow
def test_wheel_installs_only_prefixed_top_level_names(tmp_path: Path) -> None:
    import subprocess
    import sys
    import zipfile

    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)],
        check=True, capture_output=True,
    )
    wheel = next(tmp_path.glob("pairclean-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == set(PACKAGES.values())
    # the trainer-facing package ships its data and typing marker
    assert "pairclean/py.typed" in names and "pairclean/data/sample/demo-000000.tar" in names
    # the job store's migrations run from the installed package (no alembic.ini, no checkout)
    migrations = "pairclean_service/migrations/"
    assert {migrations + "env.py", migrations + "script.py.mako", migrations + "versions/0001_jobs_and_keys.py"} <= set(names)
    # the web pages read their templates and static files from the package
    assert {"pairclean_service/templates/base.html", "pairclean_service/templates/job.html", "pairclean_service/static/pages.js",
            "pairclean_service/static/pages.css", "pairclean_service/static/favicon.svg"} <= set(names)


# The library's data flow as folders (docs/architecture.md): a stage imports only earlier
# stages and the shared vocabulary; the trainer-facing modules and the lite/ tools sit on top.
STAGES = ("read", "embed", "judge", "calibrate", "output", "job", "refine", "pseudo", "audit")
VOCABULARY = {"errors", "schema", "spec", "uris", "storage", "osa"}
TOP = {"sampler", "api", "losses", "openclip", "open_clip_train", "ray_data", "lite"}


def _library_imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module under pairclean, imported names) for every absolute import of the library."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] != "pairclean":
                continue
            names = [a.name for a in node.names]
            if len(parts) == 1:  # from pairclean import schema, __version__
                found += [(n, []) for n in names if n != "__version__"]
            else:
                found.append((".".join(parts[1:]), names))
        elif isinstance(node, ast.Import):
            found += [(a.name.split(".", 1)[1], []) for a in node.names if a.name.startswith("pairclean.")]
    return found


def _home(module: str) -> str:
    """The stage, vocabulary or top-level name a dotted module under pairclean belongs to."""
    return module.split(".")[0]


def test_stages_import_only_earlier_stages_and_the_vocabulary() -> None:
    lib = REPO / "pipelines"
    offenders = []
    for path in sorted(lib.rglob("*.py")):
        rel = path.relative_to(lib).with_suffix("").parts
        own = rel[0]
        if own in TOP or own == "__init__":
            continue
        for module, _ in _library_imports(path):
            home = _home(module)
            if home in VOCABULARY or home == own:
                continue
            if own in VOCABULARY:
                offenders.append(f"{path.relative_to(REPO)} (vocabulary) imports {module}")
            elif home not in STAGES or STAGES.index(home) > STAGES.index(own):
                offenders.append(f"{path.relative_to(REPO)} (stage {own}) imports {module}")
    assert not offenders, "stage order broken:\n" + "\n".join(offenders)


def test_stage_folders_exist_in_flow_order() -> None:
    present = [s for s in STAGES if (REPO / "pipelines" / s / "__init__.py").exists()]
    # every stage that exists is a folder; the vocabulary stays at the top as single modules
    assert {"read", "embed", "calibrate", "output", "job", "refine", "pseudo"} <= set(present)
    assert all((REPO / "pipelines" / f"{v}.py").exists() for v in VOCABULARY)


def test_no_private_name_is_imported_across_modules() -> None:
    offenders = []
    for layer, package in PACKAGES.items():
        for path in sorted((REPO / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if not isinstance(node, ast.ImportFrom):
                    continue
                module = node.module or ""
                if node.level == 0 and not module.startswith(tuple(PACKAGES.values())):
                    continue
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private:
                    offenders.append(f"{path.relative_to(REPO)} imports {private} from {module or '.'}")
    assert not offenders, "private names imported across modules:\n" + "\n".join(offenders)
