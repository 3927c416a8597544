"""Bad inputs against kit's readers and run set-up: how many give a clear kit error, a raw error, are
accepted (and with what data), or hang. Compares this checkout with another commit (issue 27's figures).

    python benchmarks/trust_tally.py                 # this checkout
    python benchmarks/trust_tally.py --base 72c55eb  # and that commit, in a temporary git worktree

Each version runs in its own process (address space limited to 5 GiB, so a reader that allocates what a
file claims fails with MemoryError instead of swapping the machine). Outcomes:

- clear: a kit error naming the file / key (or, for a damaged newest checkpoint, the documented fallback
  to an intact older one with its data as written);
- raw: any other exception, or a kit error that names neither;
- accepted: no error although the input is bad — ``same`` when the data read equals what was written
  (the damage did not matter, or a text file's changed digit is read as the bytes now say, checked with
  Python's own parsers), ``other`` when it differs (a silent misread, or a foreign file changed);
- hang: no answer within 20 s.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = 40  # random mutations per file kind


# ---- running one case -------------------------------------------------------------------------


def classify(run: Callable[[], Any], names: list[str], timeout: float = 20.0) -> str:
    """'clear' / 'raw' / 'accepted-same' / 'accepted-other' / 'hang' for one bad input."""
    import kit

    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = run()
        except BaseException as e:  # noqa: BLE001 - classified below
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return "hang"
    error = box.get("error")
    if error is None:
        if box["value"] == "handled":  # the documented outcome of a bad input that is not an error
            return "clear"
        return "accepted-same" if box["value"] else "accepted-other"
    text = str(error)
    if isinstance(error, kit.KitError) and any(n in text for n in names):
        return "clear"
    return "raw"


# ---- the file kinds: a valid file, how to read it, and whether what was read is what was written ---------


def _hdf_case(tmp: Path) -> tuple[bytes, Callable[[Path], bool]]:
    import numpy as np

    from kit.data.hdf import HDFDataset, write_hdf

    rng = np.random.default_rng(0)
    seqs = [{"data": rng.standard_normal((t, 3)).astype("float32"), "classes": rng.integers(0, 5, t)}
            for t in (3, 5, 2, 4, 6)]
    write_hdf(tmp / "orig.hdf", seqs, [f"utt{i}" for i in range(5)])

    def read(path: Path) -> bool:
        ds = HDFDataset(str(path))
        try:
            got = [ds.get_seq(i) for i in range(ds.num_seqs)]
            return (len(got) == 5 and all(np.array_equal(g[k], s[k]) for g, s in zip(got, seqs) for k in s)
                    and ds.all_tags() == [f"utt{i}" for i in range(5)] and ds.dims == {"data": 3, "classes": 5})
        finally:
            ds.close()

    return (tmp / "orig.hdf").read_bytes(), read


def _score_case(tmp: Path, returnn: bool) -> tuple[bytes, Callable[[Path], bool]]:
    from kit.scores import ScoreTable

    table = ScoreTable()
    for epoch in (1, 2, 3):
        table.set_learning_rate(epoch, 0.01 / epoch)
        table.set_scores(epoch, {"train_loss_ce": 1.0 / epoch, "dev_loss_ce": 1.1 / epoch})
        table.set_meta(epoch, global_train_step=10 * epoch)
    if returnn:
        from kit.compat.returnn_run import returnn_lr_file_text

        data = returnn_lr_file_text(table).encode()
    else:
        data = table.to_json().encode()
    written = json.dumps(table.state_dict()["epochs"], sort_keys=True)
    sys.path.insert(0, str(ROOT / "tests" / "fuzz"))
    from fuzzlib import canonical  # this checkout's oracle: what Python's own parsers read in the bytes
    from test_fuzz_scores import reference

    def read(path: Path) -> bool:
        got = ScoreTable.load(path).state_dict()
        if json.dumps(got["epochs"], sort_keys=True) == written:
            return True
        try:  # a changed digit: kit must read what the bytes now say
            expected = reference(path.read_bytes())
        except Exception:  # noqa: BLE001 - Python's parsers refuse it, kit accepted it
            return False
        return canonical(expected["epochs"]) == canonical(got["epochs"])

    return data, read


def _checkpoint_case(tmp: Path, part: str) -> tuple[bytes, Callable[[Path], bool]]:
    import torch

    import kit.checkpoints as ck

    prefix = str(tmp / "model")
    states = {}
    for epoch in (1, 2):
        torch.manual_seed(epoch)
        states[epoch] = {"w": torch.randn(4, 3)}
        ck.save(prefix, epoch=epoch, model_state=states[epoch], train_state={"progress": {"epoch": epoch},
                "rng": {}}, global_train_step=epoch)
    name = {"model": "model.002.pt", "manifest": "model.002.manifest.json"}[part]

    def read(path: Path) -> bool:
        for other in tmp.iterdir():
            if other.name.startswith("model.") and other.name != name:
                shutil.copy(other, path.parent / other.name)
        shutil.copy(path, path.parent / name)
        found = ck.load_latest(str(path.parent / "model"))
        if found is None:
            return False
        ckpt, model_file, _ = found
        return torch.equal(model_file["model"]["w"], states[ckpt.epoch]["w"])

    return (tmp / name).read_bytes(), read


def _mutate(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(buf) + 1)
        kind = rng.choice(["flip", "truncate", "overwrite", "insert"])
        if kind == "flip" and buf:
            buf[at % len(buf)] ^= 1 << rng.randrange(8)
        elif kind == "truncate":
            del buf[at:]
        elif kind == "overwrite":
            buf[at:at + 4] = bytes(rng.randrange(256) for _ in range(4))
        else:
            buf[at:at] = rng.choice([b"-1", b"1e999", b"9" * 400, b"nan", b"[" * 500, b"\x00", b"2**40"])
    return bytes(buf)


def mutation_cases(tmp: Path) -> dict[str, list[str]]:
    kinds = {"hdf": lambda d: _hdf_case(d), "score file": lambda d: _score_case(d, False),
             "learning-rate file": lambda d: _score_case(d, True),
             "checkpoint": lambda d: _checkpoint_case(d, "model"), "manifest": lambda d: _checkpoint_case(d, "manifest")}
    out: dict[str, list[str]] = {}
    for kind, make in kinds.items():
        src = tmp / kind.replace(" ", "_")
        src.mkdir()
        original, read = make(src)
        rng = random.Random(27)
        results = []
        for i in range(MUTANTS):
            case = tmp / f"{src.name}_{i}"
            case.mkdir()
            path = case / ("f.hdf" if kind == "hdf" else "file")
            data = _mutate(original, rng)
            path.write_bytes(data)
            results.append(classify(lambda p=path, r=read: r(p), [str(path), path.name, "model.002"]))
        out[kind] = results
    return out


# ---- the issue's own cases --------------------------------------------------------------------------


def _hdf_edit(tmp: Path, name: str, edit: Callable[[Any], None]) -> Path:
    import h5py
    import numpy as np

    from kit.data.hdf import write_hdf

    rng = np.random.default_rng(1)
    seqs = [{"data": rng.standard_normal((t, 3)).astype("float32"), "classes": rng.integers(0, 5, t)}
            for t in rng.integers(3, 9, 20)]
    path = tmp / f"{name}.hdf"
    write_hdf(path, seqs, [f"t{i}" for i in range(20)])
    with h5py.File(path, "r+") as f:
        edit(f)
    return path


def _set_lengths(f: Any, change: Callable[[Any], Any]) -> None:
    lengths = change(f["seqLengths"][...].astype("float64"))
    del f["seqLengths"]
    f.create_dataset("seqLengths", data=lengths)


def issue_cases(tmp: Path) -> dict[str, str]:
    import numpy as np

    from kit.data.hdf import HDFDataset

    def hdf(name: str, edit: Callable[[Any], None]) -> str:
        path = _hdf_edit(tmp, name, edit)

        def run() -> bool:
            ds = HDFDataset(str(path))
            [ds.get_seq(i) for i in range(ds.num_seqs)]
            ds.all_tags()
            return False  # anything read from these files differs from what was meant

        return classify(run, [str(path)])

    def at(i: int, j: int, v: Any) -> Callable[[Any], Any]:
        def change(a: Any) -> Any:
            a[i, j] = v
            return a
        return change

    out = {
        "hdf length -2": hdf("neg", lambda f: _set_lengths(f, at(3, 0, -2))),
        "hdf length 2**40": hdf("huge", lambda f: _set_lengths(f, at(3, 0, 2**40))),
        "hdf length NaN": hdf("nan", lambda f: _set_lengths(f, at(3, 0, np.nan))),
        "hdf lengths sum differs": hdf("sum", lambda f: _set_lengths(f, at(19, 0, 1))),
        "hdf seqTags short": hdf("tags", lambda f: (f.__delitem__("seqTags"), f.create_dataset(
            "seqTags", data=np.array([b"t0", b"t1"])))),
        "hdf byte-string lengths": hdf("bytes", lambda f: (f.__delitem__("seqLengths"), f.create_dataset(
            "seqLengths", data=np.array([[b"x13", b"7"]] * 20)))),
        "hdf no targets/size": hdf("nosize", lambda f: f.__delitem__("targets/size")),
        "hdf no targets/data": hdf("nodata", lambda f: f.__delitem__("targets/data")),
    }
    out.update(_config_cases(tmp))
    out.update(_file_cases(tmp))
    out["hdf FIFO"] = _fifo_case(tmp)
    return out


def _fifo_case(tmp: Path) -> str:
    """In a process of its own: h5py opening a FIFO blocks holding the GIL, which would freeze this one."""
    fifo = tmp / "fifo.hdf"
    os.mkfifo(fifo)
    code = ("import sys\nfrom kit.data.hdf import HDFDataset\nfrom kit.errors import KitError\n"
            "try:\n    HDFDataset(sys.argv[1])\nexcept KitError as e:\n    print('clear' if sys.argv[1] in str(e) "
            "else 'raw')\nexcept Exception:\n    print('raw')\nelse:\n    print('accepted-other')\n")
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(fifo)], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "hang"
    return proc.stdout.strip() or "raw"


def _engine(tmp: Path, name: str, **keys: Any) -> Any:
    sys.path.insert(0, str(Path.cwd() / "tests"))
    from helpers.models import tiny_config

    import kit
    from kit.engine.engine import Engine

    keys.setdefault("num_epochs", 2)
    return Engine(kit.Config(tiny_config(str(tmp / name / "run" / "model"), **keys)))


def _config_cases(tmp: Path) -> dict[str, str]:
    def train(name: str, names: list[str], writes: bool = False, **keys: Any) -> str:
        def run() -> bool:
            engine = _engine(tmp, name, **keys)
            try:
                engine.train()
            finally:
                engine.close()
            return False
        result = classify(run, names, timeout=120)
        if writes:  # an error that can only come after training: the trained epochs must be saved first
            saved = sorted(p.name for p in (tmp / name).rglob("*.manifest.json"))
            return result + f" (saved: {', '.join(saved) or 'nothing'})"
        left = (tmp / name).exists() and any((tmp / name).rglob("*"))
        return result + (" (left files)" if left and result == "clear" else "")

    return {
        "num_workers 'two'": train("workers", ["num_workers", "torch_dataloader_opts"],
                                   torch_dataloader_opts={"num_workers": "two"}),
        "error measure naming no score": train("measure", ["learning_rate_control_error_measure"], writes=True, num_epochs=3,
                                               learning_rate_control="newbob",
                                               learning_rate_control_error_measure="dev_loss_xyz"),
        "extern_data shape 'abc'": train("shape", ["extern_data", "shape"], extern_data={"data": {"shape": "abc"}}),
    }


def _file_cases(tmp: Path) -> dict[str, str]:
    import torch

    import kit
    from kit.scores import ScoreTable

    out = {}
    lr = tmp / "learning_rates"
    lr.write_text("{1: EpochData(learningRate=0.01, error={}),\n2: EpochData(learningRate=-0.01, error={}),\n}\n")
    out["negative lr in learning_rate_file"] = classify(lambda: ScoreTable.load(lr) and False, [str(lr)])
    big = tmp / "big_scores"
    with open(big, "wb") as f:
        f.truncate(6 << 30)
    out["6 GB sparse score file"] = classify(lambda: ScoreTable.load(big) and False, [str(big)])
    from kit.data.distrib_files import DistributeFilesDataset

    out["missing DistributeFilesDataset file"] = classify(lambda: DistributeFilesDataset(
        files=[str(tmp / "nope.hdf")] * 2, get_sub_epoch_dataset=lambda f: {}) and False, ["nope.hdf"])
    listing = tmp / "files.py"
    listing.write_text("[__import__('os').getcwd()]\n")
    out[".py file list with code"] = classify(lambda: DistributeFilesDataset(
        files=str(listing), get_sub_epoch_dataset=lambda f: {}) and False, ["files.py"])
    kit.checkpoints.save(str(tmp / "find" / "model"), epoch=1, model_state={}, train_state=None, global_train_step=3)
    with kit.Session(**_tiny(tmp / "find")) as session:
        out["checkpoints.find('step:abc')"] = classify(lambda: session.checkpoints.find("step:abc") and False,
                                                       ["step:abc"])
    out["torch storage numel -5 (newest)"] = _numel_case(tmp, torch)
    out["model.lock deleted while held"] = _lock_case(tmp)
    out["damaged newest RETURNN checkpoint"] = _returnn_case(tmp)
    return out


def _tiny(path: Path) -> dict[str, Any]:
    from helpers.models import tiny_config

    return tiny_config(str(path / "model"))


def _numel_case(tmp: Path, torch: Any) -> str:
    import io
    import struct
    import zipfile

    import kit.checkpoints as ck

    prefix = str(tmp / "numel" / "model")
    os.makedirs(os.path.dirname(prefix))
    for epoch in (1, 2):
        ck.save(prefix, epoch=epoch, model_state={"w": torch.arange(7.0) + epoch}, train_state=None,
                global_train_step=epoch)
    path = f"{prefix}.002.pt"
    src = zipfile.ZipFile(io.BytesIO(open(path, "rb").read()))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("data.pkl"):
                data = data.replace(b"K\x07", b"J" + struct.pack("<i", -5), 1)
            out.writestr(info, data)
    manifest = json.loads(open(f"{prefix}.002.manifest.json").read())
    data = open(path, "rb").read()
    manifest["files"]["model"].update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    open(f"{prefix}.002.manifest.json", "w").write(json.dumps(manifest))

    def run() -> str | bool:
        found = ck.load_latest(prefix)
        if found is None or found[0].epoch != 1:
            return False
        # the documented outcome: skipped with a warning, the older checkpoint as written
        return "handled" if torch.equal(found[1]["model"]["w"], torch.arange(7.0) + 1) else False

    return classify(run, ["model.002"])


def _lock_case(tmp: Path) -> str:
    from kit.checkpoints.lock import PrefixLock

    prefix = str(tmp / "lock" / "model")
    os.makedirs(os.path.dirname(prefix))
    code = "import sys,time\nfrom kit.checkpoints.lock import PrefixLock\nl=PrefixLock.acquire(sys.argv[1])\n" \
           "print('ok',flush=True)\ntime.sleep(60)\n"
    holder = subprocess.Popen([sys.executable, "-c", code, prefix], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ok"
        os.unlink(prefix + ".lock")
        return classify(lambda: PrefixLock.acquire(prefix) and False, [prefix])
    finally:
        holder.kill()
        holder.wait()


def _returnn_case(tmp: Path) -> str:
    sys.path.insert(0, str(Path.cwd()))
    from tests.returnn_compat.test_run_dir import _session, make_returnn_run

    run_dir = tmp / "returnn"
    run_dir.mkdir()
    make_returnn_run(run_dir)
    newest = run_dir / "model.002.pt"
    newest.write_bytes(newest.read_bytes()[:300])
    foreign = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in run_dir.glob("model.*")}

    def run() -> bool:
        with _session(run_dir) as session:
            session.train()
        return False

    result = classify(run, ["model.002"], timeout=120)
    after = {n: hashlib.sha256((run_dir / n).read_bytes()).hexdigest() if (run_dir / n).exists() else None
             for n in foreign}
    return "accepted-other (overwrote RETURNN's files)" if after != foreign else result


# ---- driver ------------------------------------------------------------------------------------------


def child() -> None:
    """Run every case in this process (kit from PYTHONPATH) and print the tally as JSON."""
    import logging

    resource.setrlimit(resource.RLIMIT_AS, (5 << 30, 5 << 30))
    logging.getLogger("kit").setLevel(logging.ERROR)
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.time()
        result = {"mutations": mutation_cases(Path(tmp)), "issue": issue_cases(Path(tmp)),
                  "seconds": round(time.time() - started, 1)}
    print("TALLY " + json.dumps(result), flush=True)
    os._exit(0)  # a hung reader thread (e.g. a FIFO) must not keep the process alive


def run_version(source: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(source), KIT_TALLY_CHILD="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve())], cwd=source, env=env,
                          capture_output=True, text=True, timeout=1800)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("TALLY ")), None)
    if line is None:
        raise SystemExit(f"the tally of {source} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(line[len("TALLY "):])


def summary(result: dict) -> dict[str, int]:
    outcomes = [o for results in result["mutations"].values() for o in results] + list(result["issue"].values())
    counts = {"tried": len(outcomes)}
    for key in ("clear", "raw", "accepted-same", "accepted-other", "hang"):
        counts[key] = sum(o.split(" ")[0] == key for o in outcomes)
    counts["clear but left files"] = sum("left files" in o for o in outcomes)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="a commit to compare with (checked out in a temporary worktree)")
    args = parser.parse_args()
    versions = {"this checkout": ROOT}
    cleanup: list[Path] = []
    if args.base:
        worktree = Path(tempfile.mkdtemp(prefix="kit-tally-")) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(worktree), args.base],
                       check=True)
        # the checkout's test helpers build the cases; the base commit's kit is measured
        shutil.copytree(ROOT / "benchmarks", worktree / "benchmarks", dirs_exist_ok=True)
        versions = {args.base: worktree, **versions}
        cleanup.append(worktree)
    try:
        results = {name: run_version(path) for name, path in versions.items()}
    finally:
        for worktree in cleanup:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False)
    for name, result in results.items():
        print(f"\n== {name}: {json.dumps(summary(result))} ({result['seconds']} s)")
        for kind, outcomes in result["mutations"].items():
            print(f"  {kind:<20} " + ", ".join(f"{k} {outcomes.count(k)}" for k in sorted(set(outcomes))))
        for case, outcome in result["issue"].items():
            print(f"  {case:<40} {outcome}")


if __name__ == "__main__":
    if os.environ.get("KIT_TALLY_CHILD"):
        with contextlib.suppress(BrokenPipeError):
            child()
    else:
        main()
