"""A damaged checkpoint file (truncated shard, corrupted metadata.json) is one line naming the file and the
cause, and status 1, instead of megatron's bare EOFError / JSONDecodeError traceback.

The wrapper is tested on a stand-in for megatron's loader that reads the files the way megatron's readers do
(``json.load`` of ``metadata.json``, ``pickle.load`` of a shard), so no training run is needed.
"""

from __future__ import annotations

import json
import pickle
import sys
import types
from pathlib import Path

import pytest

from megatron_pp_ext.integration import checkpoint


def _read_metadata(directory: Path) -> object:
    with open(directory / "iter_0000002" / "metadata.json") as stream:
        return json.load(stream)


def _read_shard(directory: Path) -> object:
    shard = directory / "iter_0000002" / "__0_0.distcp"
    with shard.open("rb") as stream:
        return pickle.load(stream)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt" / "iter_0000002"
    folder.mkdir(parents=True)
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist"')  # cut short
    (folder / "__0_0.distcp").write_bytes(pickle.dumps({"weight": list(range(100))})[:40])  # truncated
    return tmp_path / "ckpt"


@pytest.mark.parametrize(
    ("reader", "name", "cause"),
    [
        (_read_metadata, "metadata.json", "not valid JSON (JSONDecodeError"),
        (_read_shard, "__0_0.distcp", "the file ends early (truncated"),
    ],
)
def test_the_line_names_the_file_and_the_cause(ckpt: Path, reader, name: str, cause: str) -> None:
    with pytest.raises(checkpoint.DAMAGED) as info:
        reader(ckpt)
    line = checkpoint.describe_load_error(info.value, ckpt)
    assert f"cannot load the checkpoint from {ckpt}: " in line and cause in line, line
    assert line.split(": ")[1].endswith(name), line
    assert "\n" not in line


def test_a_file_outside_the_checkpoint_is_not_blamed(tmp_path: Path, ckpt: Path) -> None:
    other = tmp_path / "other.json"
    other.write_text("{")
    with pytest.raises(json.JSONDecodeError) as info, open(other) as stream:
        json.load(stream)
    assert "a file of it" in checkpoint.describe_load_error(info.value, ckpt)


def test_the_wrapper_exits_with_status_1_and_one_line(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = types.ModuleType(checkpoint.MODULE)

    def load(load_dir: str, *args: object, **kwargs: object) -> object:
        return _read_shard(Path(load_dir))

    fake._load_base_checkpoint = load  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, checkpoint.MODULE, fake)
    checkpoint.fail_loudly_on_bad_checkpoint()
    with pytest.raises(SystemExit) as info:
        fake._load_base_checkpoint(str(ckpt))  # type: ignore[attr-defined]
    assert info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "__0_0.distcp: the file ends early" in err[0], err
