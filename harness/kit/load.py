"""Reading what `harness kit check` grades: the kit (every file against its manifest's sha256, size and arrays) and
the port's results file (every array's name, shape and dtype against the kit, from its .npy header before any data
is read; then the file as a whole: each depth given whole, every value finite, one precision). Anything off is a
UsageError: one line, exit 2, nothing written.

The results file is one NPZ holding any subset of the depths (tap/<name>; logits; grad/<name>; dropout_grad/<name>;
opt/<k>/...; loss), each complete (docs/kit.md).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from harness.core.taps import PREFIX as TAP_PREFIX
from harness.errors import UsageError
from harness.files import open_regular
from harness.kit.export import KINDS, MANIFEST, opt_key
from harness.kit.schema import FIX, kit_file, load_manifest
from harness.npz import describe_dtype, read_npz, read_npz_file

# the depths of a check, in the order the model computes them: a port gives each but the learning rate, which is read
# from the optimizer states it gives
DEPTHS = ("taps", "logits", "gradients", "dropout_gradients", "optimizer", "learning_rate", "loss")


OPT_NAME = re.compile(r"^opt/(\d+)/(param|adam_m|adam_v)/(.+)$")


RESULTS_FIX = "write it with numpy.savez or NPZ.jl's npzwrite"


def _kit_array_check(name: str, declared: dict[str, Any]) -> Callable[[str, tuple[int, ...], np.dtype], None]:
    """The header check of kit file `name`: every array as the manifest declares it (name, shape, dtype)."""
    def check(key: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
        entry = declared.get(key)
        if entry is None:
            raise UsageError(f"kit file {name} holds array {key!r}, which {MANIFEST} does not list; {FIX}")
        # kits exported before export.npz_bytes kept 0-d arrays wrote logits_loss as (1,) under a declared (): the
        # same one number, still read
        same = list(shape) == entry["shape"] or math.prod(shape) == math.prod(entry["shape"]) == 1
        if not same or dtype.newbyteorder("=") != np.dtype(entry["dtype"]):
            raise UsageError(f"kit file {name}: array {key!r} is {describe_dtype(dtype)} {shape} but {MANIFEST} "
                             f"says {entry['dtype']} {tuple(entry['shape'])}; {FIX}")
    return check


def load_kit(kit: Path) -> tuple[dict[str, Any], dict[str, dict[str, np.ndarray]]]:
    """The manifest and every file of a kit, each verified against its sha256; UsageError if anything is off.

    The manifest is checked against its schema (harness.kit.schema); every file must be a regular file inside the
    kit, of the size and sha256 the manifest gives, holding exactly the arrays it declares (headers checked before
    any data is read; a kit's members are uncompressed, so what is read is at most the files' sizes).
    """
    manifest = load_manifest(kit)
    arrays: dict[str, dict[str, np.ndarray]] = {}
    for name, entry in manifest["files"].items():
        file = kit_file(kit, name)
        if not os.path.lexists(file):
            raise UsageError(f"kit file {name} is missing from {str(kit)!r}; {FIX}")
        with open_regular(file, "kit file", FIX) as f:  # hashed and read through one descriptor
            size = os.fstat(f.fileno()).st_size
            if size != entry["bytes"]:
                raise UsageError(f"kit file {name} is {size:,} bytes, {MANIFEST} says {entry['bytes']:,} (the kit was "
                                 f"changed or damaged); {FIX}")
            digest = hashlib.sha256()
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
            if digest.hexdigest() != entry["sha256"]:
                raise UsageError(f"kit file {name} does not match its sha256 in {MANIFEST} (the kit was changed or "
                                 "damaged); export it again")
            arrays[name] = read_npz_file(f, file, "kit file", FIX, _kit_array_check(name, entry["arrays"]),
                                         max_array_bytes=size, stored_only=True)
        missing = sorted(set(entry["arrays"]) - set(arrays[name]))
        if missing:
            raise UsageError(f"kit file {name} lacks array {missing[0]!r}, which {MANIFEST} lists; {FIX}")
        _finite(name, arrays[name])
    _check_batches(arrays.get("batches.npz") or {}, manifest["vocab_size"])
    for name in ("weights.npz", "expected.npz"):  # the schema requires both entries; their arrays must be right too
        params = manifest["parameters"]
        want = params if name == "weights.npz" else {f"grad/{n}": s for n, s in params.items()}
        for key, shape in want.items():
            if key not in arrays[name] or list(arrays[name][key].shape) != shape:
                raise UsageError(f"kit file {name} has no array {key!r} of shape {tuple(shape)} (field 'parameters' "
                                 f"of {MANIFEST}); {FIX}")
    expected, steps = arrays["expected.npz"], manifest["steps"]
    need = {"logits": None, "loss": (steps,), **{opt_key(k, kind, n): tuple(shape) for k in range(1, steps + 1)
                                                 for kind in KINDS for n, shape in manifest["parameters"].items()}}
    for key, shape in need.items():
        if key not in expected or (shape is not None and expected[key].shape != shape):
            raise UsageError(f"kit file expected.npz has no array {key!r}" + (f" of shape {shape}" if shape else "")
                             + f" (fields 'steps' and 'parameters' of {MANIFEST}); {FIX}")
    for site in manifest["taps"].get("masks", []):  # the masks the taps were taken with: masks[0] on the tap rows
        m = arrays.get("masks.npz", {}).get(site)
        if m is None or m.ndim != 5 or m.shape[0] != steps or m.shape[1] < manifest["taps"]["rows"]:
            raise UsageError(f"kit file masks.npz has no array {site!r} of {steps} steps of at least "
                             f"{manifest['taps']['rows']} rows (field 'taps.masks' of {MANIFEST}); {FIX}")
    return manifest, arrays


def _finite(name: str, arrays: Mapping[str, np.ndarray]) -> None:
    """Every float value of kit file `name` is finite: the oracle's answers, weights and learning rates never hold
    NaN or inf (export refuses them), so one that does is a damaged kit, never a difference of the port's."""
    for key, value in arrays.items():
        if value.dtype.kind not in "fc":
            continue
        bad = ~np.isfinite(value)
        if bad.any():
            first = int(np.argmax(bad))
            where = tuple(int(i) for i in np.unravel_index(first, value.shape)) if value.ndim else ()
            raise UsageError(f"kit file {name}: array {key!r} holds {value.flat[first]} at index {where}, which "
                             f"no kit holds (the kit was changed or damaged); {FIX}")


def _check_batches(batches: Mapping[str, np.ndarray], vocab_size: int) -> None:
    """The inputs a port is graded on are possible ones: token ids of the batches (x, y) whole numbers within the
    vocabulary 0..vocab_size - 1, and every step's learning rate (lr) >= 0 (finite: `_finite`). A kit that holds others
    is malformed; a port is never graded against impossible inputs."""
    for key in ("x", "y"):
        ids = batches.get(key)
        if ids is None:
            continue
        if ids.dtype.kind not in "iu":
            raise UsageError(f"kit file batches.npz: array {key!r} holds {describe_dtype(ids.dtype)} values, not "
                             f"token ids (whole numbers); {FIX}")
        bad = (ids < 0) | (ids >= vocab_size)
        if bad.any():
            first = int(np.argmax(bad))
            where = tuple(int(i) for i in np.unravel_index(first, ids.shape))
            raise UsageError(f"kit file batches.npz: array {key!r} holds token id {ids.flat[first]} at index {where}, "
                             f"outside the vocabulary's 0..{vocab_size - 1} (field 'vocab_size' of {MANIFEST}); "
                             f"{FIX}")
    lr = batches.get("lr")
    if lr is not None and (lr < 0).any():
        first = int(np.argmax(lr < 0))
        raise UsageError(f"kit file batches.npz: array 'lr' holds the negative learning rate {lr.flat[first]} at "
                         f"step {first}; {FIX}")


def load_results(path: Path, manifest: dict[str, Any], kit: dict[str, dict[str, np.ndarray]]
                 ) -> dict[str, np.ndarray]:
    """The port's results file, every array's name, shape and dtype checked (from its .npy header) against the kit
    before any array is read; the file may be at most twice the kit's expected.npz plus 16 MiB."""
    expected = {k: v.shape for k, v in kit["expected.npz"].items()}
    params, steps = list(manifest["parameters"]), int(manifest["steps"])
    cap = 2 * manifest["files"]["expected.npz"]["bytes"] + (16 << 20)
    return read_npz(path, "results file", RESULTS_FIX,
                    lambda key, shape, dtype: check_array(key, shape, dtype, expected, params, steps),
                    max_file_bytes=cap, max_array_bytes=cap,
                    too_big="it is far larger than any results file of this kit; write only the arrays the kit names")


def _depth_of(name: str) -> str | None:
    if name in ("logits", "loss"):
        return name
    if name.startswith(TAP_PREFIX):
        return "taps"
    if name.startswith("grad/"):
        return "gradients"
    if name.startswith("dropout_grad/"):
        return "dropout_gradients"
    if OPT_NAME.match(name):
        return "optimizer"
    return None


def _names(expected: Mapping[str, Any]) -> str:
    """The array names a results file may hold, as the messages list them."""
    valid = ["tap/<name>", "logits", "grad/<name>"] + (["dropout_grad/<name>"] if any(
        k.startswith("dropout_grad/") for k in expected) else [])
    return ", ".join([*valid, "opt/<k>/param|adam_m|adam_v/<name>", "loss"])


def check_array(key: str, shape: tuple[int, ...], dtype: np.dtype, expected: Mapping[str, tuple[int, ...]],
                params: list[str], steps: int) -> None:
    """One results array's name, shape and dtype against the kit (`expected`: the shape of every array of
    expected.npz). Called on each .npy header before any data is read, so nothing undeclared is ever allocated."""
    names = _names(expected)
    if key == "logits_loss" or key not in expected or _depth_of(key) is None:
        m = OPT_NAME.match(key)
        hint = (f"k must be 1..{steps} and the name a parameter of this kit" if m else
                f"the names are {names}; parameters: {', '.join(params)}")
        raise UsageError(f"results: unknown array {key!r}; {hint} (docs/kit.md)")
    want = tuple(expected[key])
    if key == "loss" and len(shape) == 1 and 0 < shape[0] <= steps:
        want = tuple(shape)  # a port may check the first few steps only
    if tuple(shape) != want:
        raise UsageError(f"results: {key!r} has shape {tuple(shape)}, expected {want} (canonical layout, "
                         "docs/kit.md)")
    if dtype.kind != "f" or dtype.itemsize not in (4, 8):
        raise UsageError(f"results: {key!r} has dtype {describe_dtype(dtype)}; write float32 or float64")


def validate(results: dict[str, np.ndarray], expected: dict[str, np.ndarray], params: list[str],
             dtype: str | None) -> tuple[list[str], str, int]:
    """Check the results file as a whole against the kit; returns (depths given, precision, optimizer steps given).

    `results` comes from `load_results`, which has already held every array's name, shape and dtype to the kit
    (`check_array`: valid names are those of expected.npz but logits_loss; `loss` may hold the first 1..steps
    losses). Here: a depth given is given whole (every parameter, and for the optimizer every step 1..K for some
    K <= steps; the taps, `tap/<name>`, may be any subset), every value is finite, and the precision is one.
    """
    names = _names(expected)
    given = [d for d in DEPTHS if any(_depth_of(k) == d for k in results)]
    if not given:
        raise UsageError(f"results hold no arrays; write at least one depth: {names}")
    opt_k = max((int(m.group(1)) for m in map(OPT_NAME.match, results) if m), default=0)
    required = ([f"grad/{n}" for n in params] if "gradients" in given else []) + \
        ([f"dropout_grad/{n}" for n in params] if "dropout_gradients" in given else []) + \
        [opt_key(k, kind, n) for k in range(1, opt_k + 1) for kind in KINDS for n in params]
    for key in required:
        if key not in results:
            raise UsageError(f"results: {key!r} is missing (a depth is checked whole: every parameter"
                             + (f", every step 1..{opt_k}" if key.startswith("opt/") else "") + ")")
    float_dtypes = set()
    for key, value in results.items():
        float_dtypes.add(value.dtype.newbyteorder("=").name)
        bad = ~np.isfinite(value)
        if bad.any():
            first = int(np.argmax(bad))
            where = tuple(int(i) for i in np.unravel_index(first, value.shape)) if value.ndim else ()
            raise UsageError(f"results: {key!r} holds {value.flat[first]} at index {where}; a port that produces "
                             "NaN or inf is broken before it can be compared")
    if dtype is None:
        if len(float_dtypes) > 1:
            raise UsageError("results mix float32 and float64 arrays; write one dtype or say which the port "
                             "computed in with --dtype")
        dtype = float_dtypes.pop()
    elif dtype == "float64" and "float32" in float_dtypes:
        raise UsageError("--dtype float64 but the results hold float32 arrays, which cannot carry float64 "
                         "results; write float64 or pass --dtype float32")
    return given, dtype, opt_k
