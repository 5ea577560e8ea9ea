"""Run folders under damage: checksummed checkpoints with fallback, durable writes, full disks, stale temporaries,
the run lock, metrics with bad lines, run names, and SIGKILL in the middle of a write."""

import errno
import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from tokengym.agents.runtime import runs as R

CKPT = R.CHECKPOINTS


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def modules(seed):
    torch.manual_seed(seed)
    return {"policy": torch.nn.Linear(4, 3), "critic": torch.nn.Linear(4, 1)}


def save(run_dir, step, keep=5):
    mods = modules(step)
    R.save_checkpoint(str(run_dir), step, mods, {"agent": {"step": step}}, keep=keep)
    return mods


def ckpt(run_dir, step):
    return os.path.join(str(run_dir), CKPT, f"step-{step:08d}")


def latest_name(run_dir):
    with open(os.path.join(str(run_dir), CKPT, "latest")) as f:
        return f.read().strip()


def same_weights(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def flip_byte(path, offset=-3):
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))


def cut(path, keep_fraction=0.5):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * keep_fraction))


def tmp_entries(run_dir):
    root = os.path.join(str(run_dir), CKPT)
    return [n for n in os.listdir(root) if ".tmp" in n] + [n for n in os.listdir(str(run_dir)) if ".tmp" in n]


# ---------------------------------------------------------------------------------------------- checkpoints
def test_save_load_round_trip_with_manifest(tmp_path):
    saved = save(tmp_path, 2)
    path = ckpt(tmp_path, 2)
    with open(os.path.join(path, R.MANIFEST)) as f:
        manifest = json.load(f)
    assert sorted(manifest["files"]) == ["critic.safetensors", "policy.safetensors", R.STATE_FILE]
    assert all(len(e["sha256"]) == 64 and e["size"] > 0 for e in manifest["files"].values())
    assert R.verify_checkpoint(path) is None
    fresh = modules(99)
    state = R.load_checkpoint(path, fresh, verify=True)
    assert state["step"] == 2 and state["agent"] == {"step": 2}
    assert all(same_weights(fresh[k], saved[k]) for k in saved)
    assert tmp_entries(tmp_path) == []


def test_flipped_byte_is_detected_and_resume_falls_back(tmp_path):
    old = save(tmp_path, 2)
    save(tmp_path, 4)
    flip_byte(os.path.join(ckpt(tmp_path, 4), "policy.safetensors"))
    assert R.verify_checkpoint(ckpt(tmp_path, 4)) == "policy.safetensors: checksum mismatch"
    path, messages = R.latest_intact_checkpoint(str(tmp_path))
    assert path == ckpt(tmp_path, 2)
    assert messages == ["checkpoints/step-00000004 is damaged (policy.safetensors: checksum mismatch); "
                        "falling back to step-00000002"]
    fresh = modules(99)
    assert R.load_checkpoint(path, fresh)["step"] == 2
    assert all(same_weights(fresh[k], old[k]) for k in old)


@pytest.mark.parametrize("fname, damage, reason", [
    ("policy.safetensors", lambda p: cut(p), "policy.safetensors: cut short"),
    ("policy.safetensors", lambda p: cut(p, 0), "policy.safetensors: cut short (0 bytes"),
    (R.STATE_FILE, lambda p: cut(p), f"{R.STATE_FILE}: cut short"),
    (R.STATE_FILE, lambda p: cut(p, 0), f"{R.STATE_FILE}: cut short (0 bytes"),
    (R.STATE_FILE, os.remove, f"{R.STATE_FILE}: missing"),
    ("critic.safetensors", lambda p: open(p, "ab").write(b"x"), "critic.safetensors: too long"),
    (R.MANIFEST, lambda p: cut(p), f"{R.MANIFEST}: unreadable"),
])
def test_damaged_files_are_detected(tmp_path, fname, damage, reason):
    save(tmp_path, 2)
    save(tmp_path, 4)
    damage(os.path.join(ckpt(tmp_path, 4), fname))
    assert R.verify_checkpoint(ckpt(tmp_path, 4)).startswith(reason)
    path, messages = R.latest_intact_checkpoint(str(tmp_path))
    assert path == ckpt(tmp_path, 2)
    assert len(messages) == 1 and messages[0].startswith(f"checkpoints/step-00000004 is damaged ({reason}")
    assert messages[0].endswith("; falling back to step-00000002")


@pytest.mark.parametrize("damage", [cut, lambda p: cut(p, 0)])
def test_load_of_damaged_trainer_state_is_one_line_usage_error(tmp_path, damage):
    save(tmp_path, 2)
    state_path = os.path.join(ckpt(tmp_path, 2), R.STATE_FILE)
    damage(state_path)
    with pytest.raises(R.UsageError) as e:
        R.load_checkpoint(ckpt(tmp_path, 2), modules(1))
    assert state_path in str(e.value) and "damaged" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(R.UsageError, match="cut short"):
        R.load_checkpoint(ckpt(tmp_path, 2), modules(1), verify=True)


@pytest.mark.parametrize("damage", [cut, lambda p: cut(p, 0)])
def test_load_of_damaged_safetensors_is_one_line_usage_error(tmp_path, damage):
    save(tmp_path, 2)
    file = os.path.join(ckpt(tmp_path, 2), "critic.safetensors")
    damage(file)
    with pytest.raises(R.UsageError) as e:
        R.load_checkpoint(ckpt(tmp_path, 2), modules(1))
    assert file in str(e.value) and "damaged" in str(e.value) and "\n" not in str(e.value)


def test_load_of_a_different_model_says_so(tmp_path):
    save(tmp_path, 2)
    mods = {"policy": torch.nn.Linear(5, 3), "critic": torch.nn.Linear(4, 1)}
    with pytest.raises(R.UsageError, match="does not fit this run's policy") as e:
        R.load_checkpoint(ckpt(tmp_path, 2), mods)
    assert "\n" not in str(e.value)


def test_checkpoint_without_manifest_is_accepted_only_if_it_loads(tmp_path):
    saved = save(tmp_path, 2)
    save(tmp_path, 4)
    for step in (2, 4):
        os.remove(os.path.join(ckpt(tmp_path, step), R.MANIFEST))
    assert R.verify_checkpoint(ckpt(tmp_path, 2)) is None
    fresh = modules(99)
    R.load_checkpoint(ckpt(tmp_path, 2), fresh)
    assert all(same_weights(fresh[k], saved[k]) for k in saved)
    cut(os.path.join(ckpt(tmp_path, 4), "policy.safetensors"))
    reason = R.verify_checkpoint(ckpt(tmp_path, 4))
    assert reason.startswith("policy.safetensors: unreadable") and "without manifest.json" in reason
    path, messages = R.latest_intact_checkpoint(str(tmp_path))
    assert path == ckpt(tmp_path, 2) and len(messages) == 1


def _nan_bytes(path):
    """Overwrite the first float32 value of the file's first tensor with NaN, in place (the header stays valid)."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        key = next(iter(f.keys()))
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    start = 8 + n + header[key]["data_offsets"][0]
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(b"\x00\x00\xc0\x7f")  # float32 NaN


def test_a_checkpoint_whose_manifest_was_deleted_is_damaged_when_the_run_has_manifests(tmp_path):
    """A lost manifest leaves nothing vouching for the bytes: with NaN written into the weights, resuming from it
    would train on (and end with) NaN. The run falls back to the newest checkpoint that has its manifest."""
    saved = save(tmp_path, 2)
    save(tmp_path, 4)
    os.remove(os.path.join(ckpt(tmp_path, 4), R.MANIFEST))
    _nan_bytes(os.path.join(ckpt(tmp_path, 4), "policy.safetensors"))
    assert R.verify_checkpoint(ckpt(tmp_path, 4)) == f"{R.MANIFEST}: missing, though the run's other checkpoints have one"
    path, messages = R.latest_intact_checkpoint(str(tmp_path))
    assert path == ckpt(tmp_path, 2) and len(messages) == 1 and "step-00000004 is damaged" in messages[0]
    fresh = modules(99)
    R.load_checkpoint(path, fresh)
    assert all(same_weights(fresh[k], saved[k]) for k in saved)


def test_old_checkpoints_without_manifests_holding_nan_are_damaged(tmp_path):
    save(tmp_path, 2)
    save(tmp_path, 4)
    for step in (2, 4):
        os.remove(os.path.join(ckpt(tmp_path, step), R.MANIFEST))
    _nan_bytes(os.path.join(ckpt(tmp_path, 4), "critic.safetensors"))
    reason = R.verify_checkpoint(ckpt(tmp_path, 4))
    assert reason.startswith("critic.safetensors:") and "NaN or inf" in reason and "without manifest.json" in reason
    assert R.latest_intact_checkpoint(str(tmp_path))[0] == ckpt(tmp_path, 2)


def test_weights_with_nan_never_load_silently(tmp_path):
    """A checkpoint whose manifest vouches for NaN weights (a diverged run saved them) is refused in one line."""
    mods = modules(0)
    with torch.no_grad():
        mods["critic"].weight[0, 0] = float("inf")
    R.save_checkpoint(str(tmp_path), 2, mods, {"step": 2})
    with pytest.raises(R.UsageError, match=r"critic.safetensors holds NaN or inf in weight") as e:
        R.load_checkpoint(ckpt(tmp_path, 2), modules(1), verify=True)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("pointer", [None, "", "step-00000004\x00garbage", "\xff\xfe"])
def test_missing_or_garbled_latest_still_finds_the_checkpoints(tmp_path, pointer):
    save(tmp_path, 2)
    save(tmp_path, 4)
    p = os.path.join(str(tmp_path), CKPT, "latest")
    os.remove(p)
    if pointer is not None:
        with open(p, "w", encoding="latin-1") as f:
            f.write(pointer)
    path, messages = R.latest_intact_checkpoint(str(tmp_path))
    assert path == ckpt(tmp_path, 4)
    assert len(messages) == 1 and "checkpoints/latest is" in messages[0]
    assert R.latest_checkpoint(str(tmp_path)) == ckpt(tmp_path, 4)


def test_latest_naming_a_missing_folder_falls_back(tmp_path):
    save(tmp_path, 2)
    save(tmp_path, 4)
    import shutil

    shutil.rmtree(ckpt(tmp_path, 4))
    path, messages = R.latest_intact_checkpoint(str(tmp_path))
    assert path == ckpt(tmp_path, 2)
    assert messages == ["checkpoints/step-00000004 (named by checkpoints/latest) is missing; falling back to step-00000002"]


def test_folder_newer_than_latest_is_ignored(tmp_path):
    save(tmp_path, 2)
    save(tmp_path, 4)
    with open(os.path.join(str(tmp_path), CKPT, "latest"), "w") as f:  # as if killed before `latest` moved to 4
        f.write("step-00000002\n")
    assert R.latest_intact_checkpoint(str(tmp_path)) == (ckpt(tmp_path, 2), [])


def test_no_checkpoint_and_no_intact_checkpoint(tmp_path):
    assert R.latest_intact_checkpoint(str(tmp_path)) == (None, [])
    assert R.latest_checkpoint(str(tmp_path)) is None
    save(tmp_path, 2)
    flip_byte(os.path.join(ckpt(tmp_path, 2), R.STATE_FILE))
    path, messages = R.latest_intact_checkpoint(str(tmp_path))
    assert path is None and messages[0].endswith("no intact checkpoint left")
    with pytest.raises(R.UsageError, match="has no intact checkpoint: checkpoints/step-00000002 is damaged"):
        R.latest_checkpoint(str(tmp_path))


def test_pruning_keeps_the_new_checkpoint_when_a_newer_damaged_one_exists(tmp_path):
    save(tmp_path, 2)
    save(tmp_path, 4)
    flip_byte(os.path.join(ckpt(tmp_path, 4), "policy.safetensors"))
    path, _ = R.latest_intact_checkpoint(str(tmp_path))
    assert path == ckpt(tmp_path, 2)
    save(tmp_path, 3, keep=1)  # the resumed run saves at a step below the damaged one
    assert os.path.isdir(ckpt(tmp_path, 3)) and not os.path.exists(ckpt(tmp_path, 2))
    assert os.path.isdir(ckpt(tmp_path, 4))  # newer than the save: left alone (a later save of step 4 replaces it)
    assert latest_name(tmp_path) == "step-00000003"
    assert R.latest_intact_checkpoint(str(tmp_path)) == (ckpt(tmp_path, 3), [])
    save(tmp_path, 4, keep=1)  # re-saving the damaged step replaces it
    assert R.verify_checkpoint(ckpt(tmp_path, 4)) is None and not os.path.exists(ckpt(tmp_path, 3))


def test_keep_prunes_older_checkpoints(tmp_path):
    for step in (1, 2, 3, 4):
        save(tmp_path, step, keep=2)
    assert sorted(os.listdir(os.path.join(str(tmp_path), CKPT))) == ["latest", "step-00000003", "step-00000004"]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name fsynced descriptors")
def test_save_fsyncs_files_and_folders_before_and_after_the_renames(tmp_path, monkeypatch):
    events = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", os.path.realpath(b))), real_rename(a, b))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", os.path.realpath(b))), real_replace(a, b))[1])
    save(tmp_path, 2)
    root = os.path.realpath(os.path.join(str(tmp_path), CKPT))
    final = os.path.join(root, "step-00000002")
    rename = events.index(("rename", final))
    synced_before = {os.path.basename(p) for op, p in events[:rename] if op == "fsync"}
    assert {"policy.safetensors", "critic.safetensors", R.STATE_FILE, R.MANIFEST} <= synced_before
    assert any(op == "fsync" and os.path.basename(p).startswith(".tmp-step-00000002") for op, p in events[:rename])
    replace = events.index(("replace", os.path.join(root, "latest")))
    assert ("fsync", root) in events[rename:replace]  # the rename is durable before `latest` moves
    assert ("fsync", root) in events[replace:]  # and so is the new `latest`


# ---------------------------------------------------------------------------------------------- full / read-only disk
def enospc_after_partial_write():
    def fake(obj, f, *a, **k):
        with open(f, "wb") as out:
            out.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", f)

    return fake


def test_enospc_during_save_leaves_no_tmp_and_is_one_line(tmp_path, monkeypatch):
    save(tmp_path, 2)
    monkeypatch.setattr(torch, "save", enospc_after_partial_write())
    with pytest.raises(R.UsageError) as e:
        save(tmp_path, 4)
    msg = str(e.value)
    assert "no space left on device" in msg and " free on the file system of " in msg and "\n" not in msg
    assert ckpt(tmp_path, 4) in msg
    assert tmp_entries(tmp_path) == []
    assert not os.path.exists(ckpt(tmp_path, 4))
    assert latest_name(tmp_path) == "step-00000002"
    assert R.latest_intact_checkpoint(str(tmp_path)) == (ckpt(tmp_path, 2), [])


@pytest.mark.parametrize("code, reason", [(errno.EROFS, "read-only file system"), (errno.EACCES, "permission denied")])
def test_unwritable_folder_during_save_is_one_line(tmp_path, monkeypatch, code, reason):
    def fake(obj, f, *a, **k):
        raise OSError(code, os.strerror(code), f)

    monkeypatch.setattr(torch, "save", fake)
    with pytest.raises(R.UsageError) as e:
        save(tmp_path, 2)
    msg = str(e.value)
    assert f"the folder {os.path.join(str(tmp_path), CKPT)} is not writable ({reason})" in msg and "\n" not in msg
    assert tmp_entries(tmp_path) == []


def test_other_oserrors_propagate_and_still_clean_up(tmp_path, monkeypatch):
    def fake(obj, f, *a, **k):
        raise OSError(errno.EIO, "Input/output error", f)

    monkeypatch.setattr(torch, "save", fake)
    with pytest.raises(OSError) as e:
        save(tmp_path, 2)
    assert e.value.errno == errno.EIO and not isinstance(e.value, R.UsageError)
    assert tmp_entries(tmp_path) == []


def test_storage_errors_and_write_json_atomic(tmp_path, monkeypatch):
    path = os.path.join(str(tmp_path), "config.json")
    R.write_json_atomic(path, {"a": 1})
    with open(path) as f:
        assert json.load(f) == {"a": 1}

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(R.UsageError, match="cannot write config.json to .*: no space left on device"):
        R.write_json_atomic(path, {"a": 2})
    monkeypatch.undo()
    with open(path) as f:
        assert json.load(f) == {"a": 1}
    assert [n for n in os.listdir(str(tmp_path)) if ".tmp" in n] == []
    with pytest.raises(R.UsageError, match="cannot write the metrics to x: disk quota exceeded"):
        with R.storage_errors("x", "the metrics"):
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
    with pytest.raises(ValueError):
        with R.storage_errors("x", "the metrics"):
            raise ValueError("not a storage error")


# ---------------------------------------------------------------------------------------------- atomic folders
def test_write_folder_atomic(tmp_path, monkeypatch):
    target = os.path.join(str(tmp_path), "model")

    def write(p):
        torch.save({"w": torch.ones(2)}, os.path.join(p, "model.pt"))
        os.makedirs(os.path.join(p, "sub"))
        with open(os.path.join(p, "sub", "tok.json"), "w") as f:
            f.write("{}")

    R.write_folder_atomic(target, write)
    assert sorted(os.listdir(target)) == ["model.pt", "sub"]
    with pytest.raises(R.UsageError, match="already exists"):
        R.write_folder_atomic(target, write)

    def failing(p):
        write(p)
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(p, "x"))

    with pytest.raises(R.UsageError, match="cannot write model to .*model2: no space left on device"):
        R.write_folder_atomic(target + "2", failing)

    def crashing(p):
        write(p)
        raise RuntimeError("bug in the writer")

    with pytest.raises(RuntimeError):
        R.write_folder_atomic(target + "3", crashing)
    assert sorted(os.listdir(str(tmp_path))) == ["model"]


# ---------------------------------------------------------------------------------------------- stale temporaries
def test_clean_stale_tmp_removes_only_leftovers(tmp_path):
    run = str(tmp_path)
    save(tmp_path, 2)
    root = os.path.join(run, CKPT)
    os.makedirs(os.path.join(root, ".tmp-step-00000004-4242"))
    with open(os.path.join(root, ".tmp-step-00000004-4242", "policy.safetensors"), "wb") as f:
        f.write(b"half")
    os.makedirs(os.path.join(root, ".tmp-old-step-00000002-4242"))
    for name in ("latest.tmp", "latest.tmp-77"):
        open(os.path.join(root, name), "w").close()
    os.makedirs(os.path.join(run, "model.tmp-123"))
    for name in ("config.json.tmp-5", "metrics.jsonl.tmp", "config.json", "metrics.jsonl",
                 "metrics.jsonl.damaged-20250101T000000Z", "events.out.tfevents.1.host.tmp-9.0", ".lock"):
        open(os.path.join(run, name), "w").close()
    removed = R.clean_stale_tmp(run)
    assert sorted(removed) == sorted([
        "checkpoints/.tmp-old-step-00000002-4242", "checkpoints/.tmp-step-00000004-4242", "checkpoints/latest.tmp",
        "checkpoints/latest.tmp-77", "config.json.tmp-5", "metrics.jsonl.tmp", "model.tmp-123"])
    assert sorted(os.listdir(run)) == [".lock", "checkpoints", "config.json", "events.out.tfevents.1.host.tmp-9.0",
                                       "metrics.jsonl", "metrics.jsonl.damaged-20250101T000000Z"]
    assert sorted(os.listdir(root)) == ["latest", "step-00000002"]
    assert R.clean_stale_tmp(run) == []
    assert R.clean_stale_tmp(os.path.join(run, "nope")) == []


# ---------------------------------------------------------------------------------------------- SIGKILL during a write
KILLED_SAVE = """
import sys, torch
from tokengym.agents.runtime import runs as R
torch.manual_seed(4)
what, run = sys.argv[1], sys.argv[2]
if what == "checkpoint":
    R.save_checkpoint(run, 4, {"policy": torch.nn.Linear(4, 3), "critic": torch.nn.Linear(4, 1)}, {}, keep=1)
else:
    R.write_folder_atomic(run + "/model", lambda p: torch.save({"w": torch.ones(2)}, p + "/model.pt"), what="model")
print("not killed")
"""


@pytest.mark.parametrize("what", ["checkpoint", "model"])
def test_sigkill_during_write_leaves_previous_state_and_a_cleanable_tmp(tmp_path, what):
    run = str(tmp_path)
    save(tmp_path, 2)
    env = dict(os.environ, **{R.KILL_ENV: what})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(KILLED_SAVE), what, run], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr[-2000:]
    assert "not killed" not in proc.stdout
    leftovers = tmp_entries(tmp_path)
    assert len(leftovers) == 1
    if what == "checkpoint":
        assert leftovers[0].startswith(".tmp-step-00000004-")
        assert len(os.listdir(os.path.join(run, CKPT, leftovers[0]))) == 1  # killed right after the first file
        assert not os.path.exists(ckpt(tmp_path, 4))
    else:
        assert leftovers[0].startswith("model.tmp-") and not os.path.exists(os.path.join(run, "model"))
    assert latest_name(tmp_path) == "step-00000002"
    assert R.latest_intact_checkpoint(run) == (ckpt(tmp_path, 2), [])
    assert len(R.clean_stale_tmp(run)) == 1 and tmp_entries(tmp_path) == []


@pytest.mark.parametrize("setting, kills", [("model", False), ("checkpoints", False), ("model,checkpoint-x", False),
                                             ("checkpoint", True), (" model , checkpoint ", True), ("", False)])
def test_kill_hook_fires_only_for_the_write_it_names(monkeypatch, setting, kills):
    """The hook SIGKILLs itself exactly when the comma-separated list names this write (a whole name, not a
    substring); ``os.kill`` is recorded instead of run."""
    sent = []
    monkeypatch.setattr(R.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setenv(R.KILL_ENV, setting)
    R.kill_during_write("checkpoint")
    assert sent == ([(os.getpid(), signal.SIGKILL)] if kills else [])


# ---------------------------------------------------------------------------------------------- run lock
HOLDER = """
import sys
from tokengym.agents.runtime import runs as R
lock = R.RunLock(sys.argv[1]).acquire()
print("locked", flush=True)
sys.stdin.readline()
"""


def test_run_lock_refuses_a_second_process_and_dies_with_its_holder(tmp_path):
    run = os.path.join(str(tmp_path), "run")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER), run], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(R.UsageError) as e:
            R.RunLock(run).acquire()
        assert str(e.value) == (f"{run} is in use by another tokengym process (pid {holder.pid}); "
                                "wait for it to finish or stop it")
        holder.kill()  # SIGKILL: no cleanup code runs, the OS drops the flock
        holder.wait(timeout=60)
        with R.RunLock(run) as lock:
            assert lock.held
            with open(os.path.join(run, ".lock")) as f:
                assert f.read().split()[0] == str(os.getpid())
        assert not lock.held
        R.RunLock(run).acquire().release()  # released: can be taken again
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=60)


def test_run_lock_excludes_a_second_holder_in_the_same_process(tmp_path):
    with R.RunLock(str(tmp_path)):
        with pytest.raises(R.UsageError, match=f"pid {os.getpid()}"):
            R.RunLock(str(tmp_path)).acquire()


def test_run_lock_create(tmp_path):
    missing = os.path.join(str(tmp_path), "missing")
    with pytest.raises(R.UsageError, match="does not exist"):
        R.RunLock(missing, create=False).acquire()
    assert not os.path.exists(missing)
    with R.RunLock(missing):
        assert os.path.isfile(os.path.join(missing, ".lock"))


# ---------------------------------------------------------------------------------------------- metrics
def write_metrics(run_dir, text):
    with open(os.path.join(str(run_dir), "metrics.jsonl"), "w") as f:
        f.write(text)


def rec(step):
    return json.dumps({"step": step, "loss": step / 10}) + "\n"


def test_bad_line_in_the_middle_keeps_later_records_and_a_damaged_copy(tmp_path):
    original = rec(1) + rec(2) + "{not json\n" + rec(3) + rec(4) + rec(5)[:9]  # + a last line cut short by a kill
    write_metrics(tmp_path, original)
    assert [r["step"] for r in R.read_metrics(str(tmp_path))] == [1, 2, 3, 4]
    assert "1 unreadable line (line 3)" in R.metrics_damage(str(tmp_path))
    kept = R.truncate_metrics(str(tmp_path), 3)
    assert isinstance(kept, list) and [r["step"] for r in kept] == [1, 2, 3]
    assert "1 unreadable line (line 3)" in kept.warning and "metrics.jsonl.damaged-" in kept.warning
    assert R.metrics_damage(str(tmp_path)) is None  # the rewrite removed the bad line
    copies = [n for n in os.listdir(str(tmp_path)) if n.startswith("metrics.jsonl.damaged-")]
    assert len(copies) == 1 and copies[0] in kept.warning
    with open(os.path.join(str(tmp_path), copies[0])) as f:
        assert f.read() == original
    with open(os.path.join(str(tmp_path), "metrics.jsonl")) as f:
        assert f.read() == rec(1) + rec(2) + rec(3)
    again = R.truncate_metrics(str(tmp_path), 3)  # nothing damaged any more: no warning, no second copy
    assert again == kept and again.warning is None and R.metrics_damage(str(tmp_path)) is None
    assert len([n for n in os.listdir(str(tmp_path)) if ".damaged-" in n]) == 1
    assert [n for n in os.listdir(str(tmp_path)) if ".tmp" in n] == []


def test_cut_short_last_line_is_not_damage(tmp_path):
    write_metrics(tmp_path, rec(1) + rec(2) + rec(3)[:-4])
    assert R.metrics_damage(str(tmp_path)) is None
    kept = R.truncate_metrics(str(tmp_path), 5)
    assert [r["step"] for r in kept] == [1, 2] and kept.warning is None
    assert os.listdir(str(tmp_path)) == ["metrics.jsonl"]
    write_metrics(tmp_path, rec(1) + rec(2)[:-1])  # a complete record missing only its newline is kept
    assert [r["step"] for r in R.truncate_metrics(str(tmp_path), 5)] == [1, 2]


def test_damaged_copy_never_overwrites_an_earlier_one(tmp_path, monkeypatch):
    monkeypatch.setattr(R.time, "strftime", lambda fmt, t=None: "20250101T000000Z")
    base = os.path.join(str(tmp_path), "metrics.jsonl.damaged-20250101T000000Z")
    with open(base, "w") as f:
        f.write("earlier")
    write_metrics(tmp_path, rec(1) + "\x00\x00\x00\n" + rec(2))
    kept = R.truncate_metrics(str(tmp_path), 9)
    assert [r["step"] for r in kept] == [1, 2] and "damaged-20250101T000000Z-1" in kept.warning
    with open(base) as f:
        assert f.read() == "earlier"
    with open(base + "-1") as f:
        assert f.read() == rec(1) + "\x00\x00\x00\n" + rec(2)


def test_truncate_metrics_without_a_file(tmp_path):
    assert R.truncate_metrics(str(tmp_path), 3) == [] and R.read_metrics(str(tmp_path)) == []


# ---------------------------------------------------------------------------------------------- run names
@pytest.mark.parametrize("name, problem", [
    ("../../escape", "path separator"), ("/abs", "absolute path"), ("a/b", "path separator"), (".hidden", "starts with '.'"),
    ("..", "'..'"), ("", "is empty"), ("a\\b", "path separator"),
])
def test_run_path_refuses_bad_names(tmp_path, name, problem):
    with pytest.raises(R.UsageError, match="run name .*" + re.escape(problem)) as e:
        R.run_path(str(tmp_path), name)
    assert "\n" not in str(e.value)


def test_run_path_refuses_a_runs_dir_that_is_a_file(tmp_path):
    f = os.path.join(str(tmp_path), "runs")
    open(f, "w").close()
    with pytest.raises(R.UsageError, match=f"--runs-dir {f} is a file, not a folder"):
        R.run_path(f, "ok")
    assert R.run_path(str(tmp_path), "grpo-arith-1") == os.path.join(str(tmp_path), "grpo-arith-1")
    assert R.run_path(os.path.join(str(tmp_path), "not-yet"), "r") == os.path.join(str(tmp_path), "not-yet", "r")


def test_a_full_disk_reported_as_iostream_error_says_no_space_left(tmp_path, monkeypatch):
    """torch.save reports a full disk as a RuntimeError ("iostream error"), not ENOSPC: with almost no space
    free it is still explained as a full disk, and nothing half-written is left."""
    def failing_save(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0: iostream error")

    monkeypatch.setattr(torch, "save", failing_save)
    monkeypatch.setattr(R.shutil, "disk_usage", lambda p: type("U", (), {"free": 4096, "total": 10**9, "used": 0})())
    with pytest.raises(R.UsageError, match="no space left on device"):
        R.save_checkpoint(str(tmp_path), 1, {"policy": torch.nn.Linear(2, 2)}, {})
    assert os.listdir(tmp_path / "checkpoints") == []
    monkeypatch.setattr(R.shutil, "disk_usage", lambda p: type("U", (), {"free": 10**9, "total": 10**9, "used": 0})())
    with pytest.raises(RuntimeError, match="iostream error"):  # plenty of space: not the disk, not re-labelled
        R.save_checkpoint(str(tmp_path), 1, {"policy": torch.nn.Linear(2, 2)}, {})
