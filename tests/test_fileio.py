import json

import pytest

from ddspec.fileio import write_json_atomic


def test_write_json_atomic_replaces_whole_files_and_leaves_no_temp(tmp_path):
    path = tmp_path / "manifest.json"
    write_json_atomic(path, {"shards": {"00000": 1}})
    write_json_atomic(path, {"shards": {"00000": 1, "00001": 2}}, indent=2)
    assert json.loads(path.read_text()) == {"shards": {"00000": 1, "00001": 2}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]


def test_write_json_atomic_keeps_the_old_file_when_the_write_fails(tmp_path):
    path = tmp_path / "layers.json"
    write_json_atomic(path, {"layers": [2, 15]})
    with pytest.raises(TypeError):  # not JSON: nothing is written, the old file stands
        write_json_atomic(path, {"layers": {1, 2}})
    (tmp_path / "layers.json.tmp").mkdir()  # the temp name cannot be written: OSError, old file intact
    with pytest.raises(OSError):
        write_json_atomic(path, {"layers": [3]})
    assert json.loads(path.read_text()) == {"layers": [2, 15]}
