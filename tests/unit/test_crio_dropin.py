"""CRI-O: the drop-in crio.conf.d/99-gpuprov.conf written with tomlkit; handler names and runtime paths validated
(a quote cannot break the TOML, no name moves the file out of crio.conf.d); the operator's runtimes are theirs."""
from __future__ import annotations

import pytest
import tomllib

from provision.engines import crio
from provision.engines.configure import configure
from provision.errors import GpuprovError
from tests.conftest import run_cli

RT = "/usr/local/bin/gpuprov-runtime"


def files(d) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_dropin_written_and_idempotent(tmp_path):
    d = tmp_path / "crio.conf.d"
    d.mkdir()
    res = configure("crio", config=str(d), runtime_path=RT, default=True, cdi=True)
    assert res.changed and res.verified is True and res.path == str(d / "99-gpuprov.conf")
    doc = tomllib.loads((d / "99-gpuprov.conf").read_text())
    assert doc == {"crio": {"runtime": {"default_runtime": "nvidia", "cdi_spec_dirs": ["/etc/cdi", "/var/run/cdi"],
                                        "runtimes": {"nvidia": {"runtime_path": RT, "runtime_type": "oci",
                                                                "runtime_root": "/run/gpuprov-runtime"}}}}}
    snapshot = files(tmp_path)
    assert not configure("crio", config=str(d), runtime_path=RT, default=True, cdi=True).changed
    assert files(tmp_path) == snapshot


def test_fixed_name_in_the_dropin_dir(tmp_path):
    eng = crio.CrioEngine()
    assert eng.config_path(None, None) == crio.Path("/etc/crio/crio.conf.d/99-gpuprov.conf")
    assert crio.dropin_path("anything") == "/etc/crio/crio.conf.d/99-gpuprov.conf"
    assert eng.config_path(str(tmp_path / "new/crio.conf.d"), None) == tmp_path / "new/crio.conf.d/99-gpuprov.conf"
    assert eng.config_path(str(tmp_path / "mine.conf"), None) == tmp_path / "mine.conf"
    # crio.conf itself (what detect reports, and a daemon's --config) is the operator's: the drop-in goes beside it
    assert eng.config_path(str(tmp_path / "crio.conf"), None) == tmp_path / "crio.conf.d/99-gpuprov.conf"


@pytest.mark.parametrize("name,path", [('nv"idia', RT), ("../../../etc/cron.d/x", RT), ("a/b", RT), ("..", RT),
                                       ("nvidia", "relative/runtime"), ("nvidia", '/usr/bin/x"\nruntime_type = "vm'),
                                       ("nvidia", "/usr/bin/../../tmp/x"), ("nvidia", "/usr/bin/x\\")])
def test_hostile_names_refused(tmp_path, name, path):
    d = tmp_path / "crio.conf.d"
    d.mkdir()
    with pytest.raises(GpuprovError) as e:
        configure("crio", config=str(d), runtime_name=name, runtime_path=path)
    assert e.value.exit_code == 2 and "\n" not in str(e.value)
    assert files(tmp_path) == {}


def test_cli_quote_in_name(tmp_path):
    r = run_cli("engine", "configure", "crio", "--config", str(tmp_path), "--runtime-path", RT, "--runtime-name",
                'x"]\n[crio.runtime]\ndefault_runtime = "evil')
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and files(tmp_path) == {}


def test_render_escapes_what_it_writes():
    """tomlkit writes the strings: even a path with a space reads back exactly."""
    text = crio.render(runtime_path="/opt/gpu prov/bin/gpuprov-runtime")
    assert tomllib.loads(text)["crio"]["runtime"]["runtimes"]["nvidia"]["runtime_path"] == \
        "/opt/gpu prov/bin/gpuprov-runtime"


def test_invalid_own_dropin_untouched(tmp_path):
    (tmp_path / "99-gpuprov.conf").write_text("[crio.runtime\n")
    with pytest.raises(GpuprovError) as e:
        configure("crio", config=str(tmp_path), runtime_path=RT)
    assert e.value.exit_code == 6 and (tmp_path / "99-gpuprov.conf").read_text() == "[crio.runtime\n"


def test_operators_runtime_and_default_are_theirs(tmp_path):
    d = tmp_path / "crio.conf.d"
    d.mkdir()
    (d / "10-mine.conf").write_text('[crio.runtime]\ndefault_runtime = "kata"\n[crio.runtime.runtimes.nvidia]\n'
                                    'runtime_path = "/usr/bin/nvidia-container-runtime"\n')
    with pytest.raises(GpuprovError) as e:
        configure("crio", config=str(d), runtime_path=RT)
    assert e.value.exit_code == 14 and "nvidia-container-runtime" in str(e.value)
    with pytest.raises(GpuprovError) as e:
        configure("crio", config=str(d), runtime_name="gpu", runtime_path=RT, default=True)
    assert e.value.exit_code == 14 and "'kata'" in str(e.value)
    assert files(tmp_path) == {"crio.conf.d/10-mine.conf": (d / "10-mine.conf").read_bytes()}
    assert configure("crio", config=str(d), runtime_path=RT, default=True, replace=True).changed
