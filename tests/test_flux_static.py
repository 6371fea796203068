"""Static checks of the Julia side that need no Julia: formatting and lint (fatou), the juliapkg.json and
Project.toml contents, and that every Julia function the Python bridge calls is exported by NanoGPTFlux."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
JULIA_DIR = ROOT / "julia"
PKG_DIR = JULIA_DIR / "NanoGPTFlux"
JULIAPKG_JSON = ROOT / "harness" / "juliapkg.json"

# UUIDs as read from each package's own Project.toml (FluxML/Flux.jl, FluxML/NNlib.jl, FluxML/Optimisers.jl,
# FluxML/Zygote.jl, FluxML/OneHotArrays.jl, JuliaGPU/CUDA.jl and its lib/cudnn; SpecialFunctions from NNlib's).
UUIDS = {
    "Flux": "587475ba-b771-5e3f-ad9e-33799f191a9c",
    "NNlib": "872c559c-99b0-510c-b3b7-b6c96a88d5cd",
    "Optimisers": "3bd65402-5787-11e9-1adc-39752487f4e2",
    "Zygote": "e88e6eb3-aa80-5325-afca-941959d7151f",
    "OneHotArrays": "0b1bfda6-eb8a-41d2-88d8-f5af5cad476f",
    "CUDA": "052768ef-5323-5732-b1bb-66c8b64840ba",
    "cuDNN": "02a925ec-e4fe-4b08-9a7e-0d78e3d38ccd",
    "SpecialFunctions": "276daf66-3868-5448-9aa4-cd146d93841b",  # NNlib's weak dependency: gelu_erf
}
# Lower bounds the code relies on (see the comments in Project.toml).
MIN_VERSIONS = {"Flux": (0, 16, 0), "NNlib": (0, 9, 37), "Optimisers": (0, 4, 2), "OneHotArrays": (0, 2, 4),
                "CUDA": (5, 5, 0), "Zygote": (0, 6, 67), "cuDNN": (1, 3, 0), "SpecialFunctions": (2, 0, 0)}


def _fatou(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("fatou")
    if exe is None:
        pytest.skip("fatou is not installed (pip install fatou, part of the dev extra)")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_fatou_format_check():
    result = _fatou("format", "--check", "julia")
    assert result.returncode == 0, result.stdout + result.stderr


def test_fatou_lint():
    result = _fatou("lint", "julia")
    assert result.returncode == 0, result.stdout + result.stderr


def _lower_bounds(spec: str) -> list[tuple[int, ...]]:
    return [tuple(int(p) for p in part.strip().lstrip("^~=").split(".")) for part in spec.split(",")]


def test_juliapkg_json():
    doc = json.loads(JULIAPKG_JSON.read_text(encoding="utf-8"))
    assert doc["julia"] == "1.10"
    packages = doc["packages"]
    assert set(packages) == set(UUIDS)  # NanoGPTFlux is added at run time with its real path
    for name, uuid in UUIDS.items():
        assert packages[name]["uuid"] == uuid, name
        bounds = _lower_bounds(packages[name]["version"])
        lowest = min(bounds)
        assert lowest >= MIN_VERSIONS[name][: len(lowest)], name
        assert all(b[0] < 10 for b in bounds), name  # no open-ended or silly bounds
    juliapkg = pytest.importorskip("juliapkg.compat")
    for name, spec in packages.items():
        assert juliapkg.Compat.parse(spec["version"]), name
    assert juliapkg.Compat.parse(doc["julia"]) & juliapkg.Compat.parse("^1.10.3")  # juliacall's own bound


def test_project_toml_matches_juliapkg_json():
    project = tomllib.loads((PKG_DIR / "Project.toml").read_text(encoding="utf-8"))
    doc = json.loads(JULIAPKG_JSON.read_text(encoding="utf-8"))
    assert project["name"] == "NanoGPTFlux"
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", project["uuid"])
    assert project["compat"]["julia"] == doc["julia"]
    for name, uuid in UUIDS.items():
        assert project["deps"][name] == uuid, name
        assert project["compat"][name] == doc["packages"][name]["version"], name
    assert {"Random", "Statistics", "LinearAlgebra"} <= set(project["deps"])
    assert project["targets"]["test"] == ["Test"]
    assert (PKG_DIR / "test" / "runtests.jl").is_file()


def test_bridge_calls_exported_functions():
    """Every `self._mod.NAME(...)` in the bridge (and `mod.NAME(...)` in its part runner) is an exported Julia function
    (`_b` suffix = `!`)."""
    source = (PKG_DIR / "src" / "NanoGPTFlux.jl").read_text(encoding="utf-8")
    export_block = re.search(r"^export\b(.*?)\n\s*\n", source, re.S | re.M)  # up to the first blank line
    assert export_block
    exported = {name.strip() for name in export_block.group(1).split(",") if name.strip()}
    bridge = (ROOT / "harness" / "backends" / "flux.py").read_text(encoding="utf-8")
    called = {re.sub(r"_b$", "!", m) for m in re.findall(r"self\._mod\.(\w+)\(", bridge)}
    assert called, "no Julia calls found in the bridge"
    runner = (ROOT / "harness" / "backends" / "flux_parts.py").read_text(encoding="utf-8")
    in_runner = set(re.findall(r"\bmod\.(\w+)\(", runner))
    assert in_runner >= {"part_forward", "part_backward", "optimizer_closure"}, in_runner
    called |= in_runner
    assert called <= exported, called - exported
    julia_src = "\n".join(p.read_text(encoding="utf-8") for p in (PKG_DIR / "src").glob("*.jl"))
    for name in exported:
        assert re.search(rf"^(function\s+)?{re.escape(name)}\(", julia_src, re.M), f"{name} is exported but not defined"


def _julia_source() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted((PKG_DIR / "src").glob("*.jl")))


def test_bridge_hands_masks_to_julia():
    """The shared-mask contract: train_step/gradients take masks=None, and the Julia methods take them last."""
    import inspect

    from harness.backends.flux import FluxBackend

    for method in (FluxBackend.train_step, FluxBackend.gradients):
        param = inspect.signature(method).parameters["masks"]
        assert param.default is None, method.__name__
    src = _julia_source()
    for name in ("train_step!", "gradients"):
        m = re.search(rf"^function {re.escape(name)}\((.*?)\n\)", src, re.S | re.M)
        assert m, name
        assert m.group(1).rstrip().rstrip(",").endswith("masks::Union{Nothing, AbstractDict} = nothing"), name
    # the Julia model's mask sites are the harness's: "emb", "h.{i}.attn", "h.{i}.mlp" (i from 0), and with
    # attention dropout "h.{i}.attn.probs" in NNlib's (key, query, head, batch) layout
    assert '"emb"' in src and '"h.$(i - 1).$(site)"' in src
    assert 'sites = probs ? ("attn.probs", "attn", "mlp") : ("attn", "mlp")' in src
    assert 'keep("h.$(i - 1).attn.probs", (T, T, c.n_head, B))' in src


def test_julia_attention_dropout_is_nnlibs_fdrop():
    """The attention dropout sits where NNlib's dot_product_attention applies `fdrop` (after the softmax, before the
    product with v): the model hands it the layer's own dropout or the harness's keep-mask, with p = 0 when the
    option is off; the bridge passes the option."""
    src = _julia_source()
    assert "fdrop = α -> apply_dropout(a.attn_drop, α, keep_probs)" in src
    assert "drop(c.attn_dropout ? c.dropout : 0.0)" in src
    assert 'cfg_value(cfg, "attn_dropout", Bool, false)' in src
    assert "b.attn.attn_drop.active = active" in src  # set_dropout! switches it with the others
    bridge = (ROOT / "harness" / "backends" / "flux.py").read_text(encoding="utf-8")
    assert '"attn_dropout": bool(config.attn_dropout)' in bridge


def test_julia_uses_its_own_adamw_and_the_native_cuda_rng():
    """Names the review flagged: Optimisers' AdamW (Float32 bias corrections) and CUDA.default_rng() (deprecated in
    CUDA.jl 6.0) are gone, except default_rng() as the CUDA.jl 5 fallback of cuda_native_rng()."""
    src = _julia_source()
    assert "Optimisers.AdamW" not in src
    assert re.search(r"struct TorchAdamW <: Optimisers\.AbstractRule", src)
    assert "Optimisers.init(::TorchAdamW" in src and "Optimisers.apply!(o::TorchAdamW" in src
    assert "Float64(lr)" in src  # adjust! gets a Float64 learning rate
    body = re.search(r"function cuda_native_rng\(\)(.*?)\nend", src, re.S)
    assert body and "native_rng()" in body.group(1)
    assert src.count("CUDA.default_rng()") - src.count("`CUDA.default_rng()`") == 1  # code, not docs
    assert "cuda_native_rng()" in re.search(r"function dropout_rng\(.*?\nend", src, re.S).group(0)
