"""Step checkpoint folders: only complete ones are found, incomplete ones are named and skipped, keep=K prunes."""

import os

import pytest

from graphpipe.errors import InputError
from graphpipe.runtime.step_checkpoints import (MANIFEST, is_complete, list_steps, newest_complete, prune, publish,
                                                 step_dir, temporary_dir)


def _save(root, step, files=None, token="abc"):
    tmp = temporary_dir(root, step, token)
    os.makedirs(os.path.join(tmp, "sub"))
    for name, text in (files or {"__0_0.distcp": "w" * (10 + step), "sub/.metadata": "m"}).items():
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    publish(tmp, step_dir(root, step))
    return step_dir(root, step)


def test_published_folders_are_complete_and_the_newest_wins(tmp_path):
    for step in (3, 10, 7):
        _save(tmp_path, step)
    assert [(s, ok) for s, _, ok in list_steps(tmp_path)] == [(3, True), (7, True), (10, True)]
    assert newest_complete(tmp_path) == (10, step_dir(tmp_path, 10))
    assert not any(".tmp-" in name for name in os.listdir(tmp_path))


@pytest.mark.parametrize("damage, reason", [
    ("manifest", "cut off while written"),
    ("truncate", "has 3 bytes"),
    ("delete", "is missing"),
])
def test_a_damaged_newest_checkpoint_is_named_and_skipped(tmp_path, damage, reason):
    _save(tmp_path, 4)
    newest = _save(tmp_path, 8)
    if damage == "manifest":
        os.remove(os.path.join(newest, MANIFEST))
    elif damage == "truncate":
        with open(os.path.join(newest, "__0_0.distcp"), "w") as f:
            f.write("abc")
    else:
        os.remove(os.path.join(newest, "sub", ".metadata"))
    warnings = []
    assert newest_complete(tmp_path, warn=warnings.append) == (4, step_dir(tmp_path, 4))
    assert len(warnings) == 1 and "step-8" in warnings[0] and reason in warnings[0]
    assert not is_complete(newest)[0]


def test_a_save_killed_before_publishing_leaves_only_a_temporary_folder(tmp_path):
    _save(tmp_path, 2)
    os.makedirs(temporary_dir(tmp_path, 5, "dead"))  # the job died mid-write: never renamed
    assert newest_complete(tmp_path) == (2, step_dir(tmp_path, 2))
    assert newest_complete(tmp_path / "nothing-here") is None


def test_saving_a_step_again_replaces_it_whole(tmp_path):
    _save(tmp_path, 6, {"a": "old", "b": "old"})
    _save(tmp_path, 6, {"a": "new!"}, token="xyz")
    path = step_dir(tmp_path, 6)
    assert sorted(os.listdir(path)) == sorted(["a", MANIFEST, "sub"]) and open(os.path.join(path, "a")).read() == "new!"
    assert is_complete(path)[0]


def test_prune_keeps_the_newest_complete_ones(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step)
    os.makedirs(temporary_dir(tmp_path, 2, "dead"))
    os.makedirs(temporary_dir(tmp_path, 9, "live"))  # a save in progress is left alone
    os.remove(os.path.join(step_dir(tmp_path, 4), MANIFEST))  # incomplete: does not count towards keep
    assert prune(tmp_path, keep=2) == [1]
    assert [(s, ok) for s, _, ok in list_steps(tmp_path)] == [(2, True), (3, True), (4, False)]
    assert sorted(n for n in os.listdir(tmp_path) if ".tmp-" in n) == ["step-9.tmp-live"]
    assert prune(tmp_path, keep=1) == [2]
    with pytest.raises(InputError, match="keep must be a positive integer"):
        prune(tmp_path, keep=0)
    with pytest.raises(InputError, match="non-negative integer"):
        step_dir(tmp_path, -1)
