"""The suite's own scheduling under `--dist loadfile` (tests/conftest.py::pytest_xdist_make_scheduler): the files
that use one costly session fixture run in one xdist process, so that the fixture starts once. (The fixtures'
names are not written out here: a file naming one is scheduled with its users.)"""

from __future__ import annotations

from pathlib import Path

from tests.conftest import SHARED_FIXTURES, shared_units

RUN, SERVER = SHARED_FIXTURES  # the shared quickstart run, the MLflow tracking server


def test_files_sharing_a_session_fixture_are_one_unit_and_the_rest_are_their_own() -> None:
    units = shared_units(
        {
            "a.py": f"def test_x({RUN}): ...",
            "b.py": f"def test_y({RUN}, tmp_path): ...",
            "c.py": f"def test_z({SERVER}): ...",
            "d.py": "def test_w(tmp_path): ...",
        }
    )
    assert units == {"a.py": RUN, "b.py": RUN, "c.py": SERVER}


def test_a_file_using_two_shared_fixtures_joins_their_units() -> None:
    units = shared_units({"a.py": RUN, "c.py": SERVER, "both.py": f"{RUN} {SERVER}"})
    assert len(set(units.values())) == 1 and units.keys() == {"a.py", "c.py", "both.py"}


def test_the_suites_files_that_start_the_tracking_server_share_one_unit() -> None:
    tests = Path(__file__).parent
    units = shared_units({str(f): f.read_text(encoding="utf-8") for f in tests.rglob("test_*.py")})
    assert str(Path(__file__)) not in units
    assert units[str(tests / "track" / "test_credentials.py")] == units[str(tests / "tune" / "test_sweep.py")] == SERVER
