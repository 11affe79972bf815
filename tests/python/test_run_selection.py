"""The default run's selection (run_selection.py, Note [The default run and --full]): what it
leaves to --full, and that a stale name is an error rather than a silent no-op."""
from __future__ import annotations

import itertools
import os
import subprocess
import sys

import run_selection
from run_selection import WHOLE, deferred, each_choice_cover, function_key


def test_function_key_drops_the_directory_and_the_parametrization():
    assert function_key("tests/python/test_x.py::test_y[a-b]") == "test_x.py::test_y"
    assert function_key("test_x.py::test_y") == "test_x.py::test_y"


def test_each_choice_cover_takes_every_value_of_every_parameter():
    params = [dict(case=c, state=s, weights=w)
              for c, s, w in itertools.product("abcd", ("fp32", "bf16", "int8"), ("x", "y"))]
    kept = each_choice_cover(params)
    assert len(kept) < len(params)
    for name in ("case", "state", "weights"):
        assert {params[i][name] for i in kept} == {p[name] for p in params}
    # The first test always stays, and a single parametrization keeps everything.
    assert 0 in kept
    assert each_choice_cover([dict(a=1), dict(a=2)]) == {0, 1}


def collected(*specs):
    """(nodeid, params, id) triples as conftest hands them to deferred()."""
    return ([s[0] for s in specs], [s[1] for s in specs], [s[2] for s in specs])


def test_full_only_defers_a_whole_function_or_all_but_the_ids_kept(monkeypatch):
    monkeypatch.setattr(run_selection, "FULL_ONLY", {"test_f.py::test_whole": WHOLE,
                                                     "test_f.py::test_some": ("b",)})
    monkeypatch.setattr(run_selection, "EACH_CHOICE", ())
    later, unmatched = deferred(*collected(
        ("d/test_f.py::test_whole", {}, None), ("d/test_f.py::test_some[a]", {"p": "a"}, "a"),
        ("d/test_f.py::test_some[b]", {"p": "b"}, "b"), ("d/test_f.py::test_other", {}, None)))
    assert later == {0, 1}
    assert unmatched == set()


def test_a_stale_name_or_kept_id_is_reported(monkeypatch):
    monkeypatch.setattr(run_selection, "FULL_ONLY", {"test_f.py::test_gone": WHOLE,
                                                     "test_f.py::test_some": ("renamed",),
                                                     "test_elsewhere.py::test_x": WHOLE})
    monkeypatch.setattr(run_selection, "EACH_CHOICE", ("test_f.py::test_also_gone",))
    _, unmatched = deferred(*collected(("test_f.py::test_some[a]", {"p": "a"}, "a")))
    # A file that was not collected (a run of other files) is no error.
    assert unmatched == {"test_f.py::test_gone", "test_f.py::test_also_gone",
                         "test_f.py::test_some[renamed]"}


def test_the_default_run_leaves_out_only_what_the_lists_name(tmp_path):
    """Collecting the real suite: the run's markers are the lists' (a collection error, such as a
    stale name, fails this too)."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
         "-m", "slow", "tests/python/test_boundary_sizes.py", "tests/python/test_packaging.py"],
        capture_output=True, text=True, timeout=600,
        cwd=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    assert out.returncode == 0, out.stdout + out.stderr
    slow = [line for line in out.stdout.splitlines() if "::" in line]
    assert ("tests/python/test_packaging.py::"
            "test_wheel_built_from_the_sdist_holds_the_whole_package") in slow
    keys = {function_key(nodeid) for nodeid in slow}
    assert keys <= set(run_selection.FULL_ONLY) | set(run_selection.EACH_CHOICE)
    assert "test_boundary_sizes.py::test_one_rank_trains_like_the_reference_and_resumes_exactly" \
        in keys
