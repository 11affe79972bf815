"""What a user gets from `pip install .` / `pip wheel .` (not the editable dev install): what the
build compiles, the version in its three places, the console scripts, and (slow) the wheel's
files when built from a clean copy of the repository."""
import ast
import importlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile

import pytest
import torch

import patrickstar

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYPROJECT = os.path.join(ROOT, "pyproject.toml")


def _pyproject():
    with open(PYPROJECT, "rb") as f:
        return tomllib.load(f)


def _settings(state):
    reader = pytest.importorskip("scikit_build_core.settings.skbuild_read_settings")
    return reader.SettingsReader.from_file(PYPROJECT, state=state).settings


def test_wheel_builds_only_the_extension_outside_the_dev_build_dir():
    # Note [What pip builds] in pyproject.toml.
    settings = _settings("wheel")
    assert settings.cmake.define["PS_BUILD_PYTHON"] == "ON"
    assert settings.cmake.define["PS_BUILD_TESTS"] == "OFF", settings.cmake.define
    assert settings.cmake.define["PS_BUILD_BENCHMARKS"] == "OFF", settings.cmake.define
    assert os.path.normpath(settings.build_dir) != "build", settings.build_dir


def test_editable_install_still_builds_what_ctest_runs():
    settings = _settings("editable")
    assert settings.build_dir == "build"
    assert settings.cmake.define == {"PS_BUILD_PYTHON": "ON", "PS_BUILD_TESTS": "ON",
                                     "PS_BUILD_BENCHMARKS": "ON"}


def test_version_agrees_in_pyproject_cmake_and_package():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        cmake_version = re.search(r"project\(\w+ VERSION ([0-9.]+)", f.read()).group(1)
    assert _pyproject()["project"]["version"] == cmake_version == patrickstar.__version__


def _third_party_imports():
    """Top-level names of the non-stdlib modules the package's sources import."""
    names = set()
    for directory, _, files in os.walk(os.path.join(ROOT, "python", "patrickstar")):
        for file in (f for f in files if f.endswith(".py")):
            with open(os.path.join(directory, file)) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"patrickstar"}


def test_declared_dependencies_are_what_the_package_imports():
    # torch is imported but not declared, on purpose (pyproject.toml): the build and the
    # extension need the torch already installed. Every other import must be declared, and
    # nothing the package never imports (tqdm, used only by tools/ scripts, was installed
    # into every user's environment).
    declared = {re.split(r"[<>=!~ ;\[]", requirement)[0].lower()
                for requirement in _pyproject()["project"]["dependencies"]}
    assert declared == _third_party_imports() - {"torch"}


@pytest.mark.parametrize("name", sorted(_pyproject()["project"]["scripts"]))
def test_console_script_entry_points_resolve_and_show_help(name, capsys):
    module_name, _, attr = _pyproject()["project"]["scripts"][name].partition(":")
    main = getattr(importlib.import_module(module_name), attr)
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert name in capsys.readouterr().out


@pytest.mark.slow
def test_wheel_built_from_the_sdist_holds_the_whole_package(tmp_path):
    # A user's path: the sdist (what an index would serve), unpacked elsewhere, built into a
    # wheel without the repository around it. Compiles the extension (minutes on 2 cores).
    backend = ("import sys, scikit_build_core.build as b; "
               "print(b.build_sdist(sys.argv[1]))")
    sdist_name = subprocess.run([sys.executable, "-c", backend, str(tmp_path)], cwd=ROOT,
                                check=True, capture_output=True, text=True).stdout.split()[-1]
    with tarfile.open(tmp_path / sdist_name) as sdist:
        sdist.extractall(tmp_path / "src", filter="data")
    (source,) = (tmp_path / "src").iterdir()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                    "-w", str(tmp_path / "dist"), str(source)], check=True,
                   capture_output=True, text=True)
    (wheel,) = (tmp_path / "dist").glob("patrickstar-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())

    package = os.path.join(ROOT, "python", "patrickstar")
    sources = {os.path.relpath(os.path.join(d, f), os.path.dirname(package))
               for d, _, files in os.walk(package) for f in files if f.endswith(".py")}
    assert not sources - names, sorted(sources - names)
    assert any(re.fullmatch(r"patrickstar/_C\..*\.so", n) for n in names), sorted(names)
    # Only the package and its metadata: no GoogleTest/benchmark binaries, no build files.
    assert {n.split("/")[0] for n in names} == {
        "patrickstar", f"patrickstar-{patrickstar.__version__}.dist-info"}, sorted(names)
    entry_points = zipfile.ZipFile(wheel).read(
        f"patrickstar-{patrickstar.__version__}.dist-info/entry_points.txt").decode()
    for name, target in _pyproject()["project"]["scripts"].items():
        assert f"{name} = {target}" in entry_points, entry_points
    assert not (source / "build").exists()  # the wheel's build never touched a dev build/
    build_info = zipfile.ZipFile(wheel).read("patrickstar/_build_info.py").decode()
    assert f'TORCH_VERSION = "{torch.__version__}"' in build_info, build_info


def test_torch_of_another_minor_release_is_refused_naming_both_versions():
    # Note [The torch _C was built with]: the dynamic loader's "undefined symbol" named neither.
    from patrickstar.torch_abi import check_built_torch
    with pytest.raises(ImportError, match=r"built against torch 2\.12\.1\+cpu, but torch "
                                          r"2\.13\.0\+cu128 is installed.*torch==2\.12\.1"):
        check_built_torch("2.13.0+cu128", built="2.12.1+cpu")
    check_built_torch("2.13.1", built="2.13.0+cpu")  # patch releases keep the symbols


def test_configure_without_torch_points_at_no_build_isolation(tmp_path):
    # What `pip install .` (build isolation on, pip's default) showed: "import torch failed ...
    # install requirements.txt first", while torch was installed, only hidden from the build.
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("no cmake on PATH")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")],
                   check=True)
    python = tmp_path / "venv" / "bin" / "python"  # the base interpreter, without torch
    assert subprocess.run([python, "-c", "import torch"], capture_output=True).returncode != 0
    result = subprocess.run(
        [cmake, "-S", ROOT, "-B", str(tmp_path / "build"), "-DPS_BUILD_TESTS=OFF",
         "-DPS_BUILD_BENCHMARKS=OFF", "-DPS_WITH_CUDA=OFF", f"-DPython_EXECUTABLE={python}"],
        capture_output=True, text=True)
    assert result.returncode != 0
    message = " ".join(result.stderr.split())
    assert "pip install --no-build-isolation ." in message, result.stderr
