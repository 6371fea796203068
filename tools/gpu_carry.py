#!/usr/bin/env python3
"""What to carry to a GPU machine without internet, and the GPU check run there with it.

    python tools/gpu_carry.py prepare --data PATH/tinyshakespeare.txt --nanogpt PATH/TO/nanoGPT   # connected
    python tools/gpu_carry.py check --budget 420 --copy-to "$OUT"                                  # on the GPU

`prepare` (on a machine with PyPI) fills `.gpu-carry/` (ignored by git): `wheels/` with the harness's dependencies
that the lent GPU machine lacks (pure-Python or manylinux wheels for its Python, fetched with `pip download --no-deps
--only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64`, at the versions installed here), `data/`
with the data file, and `nanoGPT/` with a checkout's files (from --nanogpt, else a shallow `git clone`; never
committed here). A few MB in all; the machine's CUDA stack (torch, CuPy, NVML) is its own.

`install` (on the GPU machine) installs the wheels into `.gpu-carry/site` (`pip install --no-index --no-deps --target`),
and `check` installs, then runs tools/gpu_check.py with PYTHONPATH (the checkout and the site directory),
HARNESS_DATA and --nanogpt pointing into `.gpu-carry/`, --out gpu-check (also ignored by git: a warm machine keeps
it, so the same command continues), and with --copy-to DIR copies the summary and every check's command, output and
JSON records there (what comes back from the machine). docs/benchmarks.md, "The GPU check", has the whole procedure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))  # the gpucheck package beside this file
from gpucheck.nanogpt import missing_files  # noqa: E402  (what the GPU check needs of a nanoGPT checkout)

CARRY = ROOT / ".gpu-carry"
# what the lent machine lacked (its Python 3.12 had torch, CuPy, nvidia-ml-py, numpy, scipy, pandas, matplotlib,
# sacrebleu, jinja2, tqdm, attrs): the harness's dependencies and theirs
WHEELS = ("platformdirs", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py", "submitit",
          "cloudpickle", "attrs", "juliacall", "juliapkg", "semver", "tomlkit")
NANOGPT_URL = "https://github.com/karpathy/nanoGPT"
COPY_LIMIT = 5 * 2**20  # files larger than this are not copied back


def say(text: str) -> None:
    print(f"gpu_carry: {text}", file=sys.stderr, flush=True)


def fail(text: str) -> int:
    say(text)
    return 2


def pinned(name: str) -> str:
    """`name==version` at the version installed here (the one the tests ran with), else `name`."""
    try:
        return f"{name}=={version(name)}"
    except PackageNotFoundError:
        return name


def download(dest: Path, packages: list[str], python: str, find_links: Path | None) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version",
           python, "--implementation", "cp", "--platform", "manylinux2014_x86_64", "--dest", str(dest)]
    if find_links is not None:
        cmd += ["--no-index", "--find-links", str(find_links)]
    subprocess.run([*cmd, *packages], check=True)


def copy_nanogpt(source: Path | None, dest: Path) -> str:
    """nanoGPT's files (no .git) into `dest`, from a checkout or a shallow clone; returns where they came from."""
    shutil.rmtree(dest, ignore_errors=True)
    if source is None:
        tmp = dest.with_name("nanoGPT.clone")
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run(["git", "clone", "--quiet", "--depth", "1", NANOGPT_URL, str(tmp)], check=True)
        source = tmp
    commit = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True)
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns(".git", "*.bin", "*.pkl", "out*", "__pycache__"))
    shutil.rmtree(dest.with_name("nanoGPT.clone"), ignore_errors=True)
    origin = f"{source} at {commit.stdout.strip()}" if commit.returncode == 0 else str(source)
    (dest / "CARRIED_FROM").write_text(origin + "\n")
    return origin


def prepare(args: argparse.Namespace) -> int:
    data = args.data or os.environ.get("HARNESS_DATA")
    if not data or not Path(data).is_file():
        return fail("no data file: pass --data PATH (Tiny Shakespeare) or set HARNESS_DATA")
    missing = missing_files(args.nanogpt) if args.nanogpt is not None else []
    if missing:  # what the GPU check's --nanogpt would refuse there
        return fail(f"--nanogpt {args.nanogpt}: no {', '.join(missing)} there; give a checkout of karpathy/nanoGPT")
    dest = args.dest
    wheels = dest / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    packages = args.package or [pinned(n) for n in WHEELS]
    try:
        download(wheels, packages, args.python, args.find_links)
        (dest / "data").mkdir(exist_ok=True)
        shutil.copyfile(data, dest / "data" / "tinyshakespeare.txt")
        origin = copy_nanogpt(args.nanogpt, dest / "nanoGPT")
    except (OSError, subprocess.CalledProcessError) as exc:
        return fail(f"could not prepare {dest}: {exc}")
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    say(f"{dest}: {len(list(wheels.glob('*.whl')))} wheels, the data file, nanoGPT from {origin}; {size / 2**20:.1f} "
        "MiB in all (the lent machine takes 64 MiB of ignored paths: carry .gpu-carry)")
    return 0


def install(dest: Path) -> Path:
    """The carried wheels installed into `dest/site` (no index, no dependencies resolved: the list is complete);
    returns the site directory."""
    site = dest / "site"
    wheels = sorted((dest / "wheels").glob("*.whl"))
    if not wheels:
        raise FileNotFoundError(f"no wheels in {dest / 'wheels'}: run `python tools/gpu_carry.py prepare` on a "
                                "connected machine and carry .gpu-carry")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--upgrade",
                    "--target", str(site), *map(str, wheels)], check=True)
    return site


def copy_back(out: Path, to: Path) -> None:
    """The summary, and every check's command, output and records (each at most COPY_LIMIT; not the copies of the
    data file the harness keeps under each --out) into `to`."""
    for path in sorted(out.rglob("*")):
        if "data" in path.relative_to(out).parts or "nanoGPT" in path.relative_to(out).parts:
            continue
        if path.is_file() and path.suffix in (".md", ".json", ".txt", ".csv") and path.stat().st_size <= COPY_LIMIT:
            target = to / out.name / path.relative_to(out)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)


def check(args: argparse.Namespace, rest: list[str]) -> int:
    dest = args.dest
    try:
        site = install(dest)
    except (OSError, subprocess.CalledProcessError) as exc:
        return fail(str(exc))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(site)]),
               HARNESS_DATA=str(dest / "data" / "tinyshakespeare.txt"))
    cmd = [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--out", args.out, "--nanogpt", str(dest / "nanoGPT"),
           *rest]
    rc = subprocess.run(cmd, env=env).returncode
    if args.copy_to is not None:
        copy_back(Path(os.path.abspath(args.out)), args.copy_to)
        say(f"copied the summary and the checks' outputs to {args.copy_to / Path(args.out).name}")
    return rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=CARRY, help="the carried folder (default .gpu-carry)")
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("prepare", help="fill the carried folder (needs PyPI, and GitHub without --nanogpt)")
    p.add_argument("--data", type=Path, help="Tiny Shakespeare (default $HARNESS_DATA)")
    p.add_argument("--nanogpt", type=Path, help="a checkout of karpathy/nanoGPT (default: a shallow clone)")
    p.add_argument("--python", default="3.12", help="the GPU machine's Python (3.12)")
    p.add_argument("--package", action="append", help="a package to carry instead of the list (repeatable)")
    p.add_argument("--find-links", type=Path, help="take the wheels from this folder, not PyPI")
    sub.add_parser("install", help="install the carried wheels into .gpu-carry/site")
    c = sub.add_parser("check", help="install, then run tools/gpu_check.py with the carried parts; the options "
                                     "not listed here go to gpu_check.py")
    c.add_argument("--out", default="gpu-check", help="gpu_check.py's --out (default gpu-check)")
    c.add_argument("--copy-to", type=Path, help="copy the summary and the checks' outputs here afterwards ($OUT)")
    args, rest = ap.parse_known_args(argv)
    if args.verb != "check" and rest:
        return fail(f"unknown options {' '.join(rest)} (see --help)")
    args.dest = Path(os.path.abspath(args.dest))
    if args.verb == "prepare":
        return prepare(args)
    if args.verb == "install":
        try:
            site = install(args.dest)
        except (OSError, subprocess.CalledProcessError) as exc:
            return fail(str(exc))
        say(f"installed into {site}: run with PYTHONPATH={ROOT}{os.pathsep}{site}")
        return 0
    return check(args, rest)


if __name__ == "__main__":
    sys.exit(main())
