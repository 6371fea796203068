"""`harness setup julia`: resolve, install and precompile the Flux.jl environment ahead of the first run.
"""

from __future__ import annotations

import time

from harness.errors import UsageError

JULIA_PACKAGES = ("Flux", "NNlib", "Optimisers", "Zygote", "OneHotArrays", "CUDA", "cuDNN", "PythonCall")


def _step(i: int, n: int, what: str) -> None:
    print(f"[harness setup julia] {i}/{n} {what}", flush=True)


def setup_julia(force: bool = False, smoke_test: bool = True) -> int:
    """Install, precompile and smoke-test the Julia side, with visible progress. UsageError when impossible."""
    from harness.backends import flux
    from harness.backends.base import BackendUnavailable

    n = 4 if smoke_test else 3
    _step(1, n, "checking juliacall, Julia and the network")
    reason = flux.unavailable_reason("cpu")
    if reason is not None:
        raise UsageError(reason)
    exe, source = flux.find_julia()
    print(f"    Julia: {exe} (from {source})" if exe else "    no Julia found: juliapkg will download one",
          flush=True)

    path = flux.register_package()
    _step(2, n, f"installing the Julia packages into the juliapkg environment ({flux.PACKAGE} from {path}); "
                "the first time this downloads and precompiles Flux, CUDA.jl, ... and takes several minutes")
    t0 = time.perf_counter()
    if flux._bypass():
        print("    PYTHON_JULIACALL_EXE/PROJECT are set: juliapkg is bypassed, that project must already "
              f"develop {flux.PACKAGE}", flush=True)
    else:
        import juliapkg

        try:
            juliapkg.resolve(force=force)
        except Exception as exc:  # URLError, CalledProcessError, ...
            raise UsageError(f"setup julia: installing the Julia environment failed ({flux._one_line(exc)}); "
                             "see the output above") from None
    print(f"    done in {time.perf_counter() - t0:.0f} s", flush=True)

    _step(3, n, f"starting Julia and loading {flux.PACKAGE}")
    t0 = time.perf_counter()
    try:
        jl = flux.load_julia()
        gpu = bool(jl.seval(f"{flux.PACKAGE}.cuda_functional()"))
    except BackendUnavailable as exc:
        raise UsageError(str(exc)) from None
    print(f"    loaded in {time.perf_counter() - t0:.0f} s; CUDA.jl GPU: {'yes' if gpu else 'no'}", flush=True)

    if smoke_test:
        _step(4, n, "smoke test: one training step of a tiny model on the CPU (compiles the training code)")
        t0 = time.perf_counter()
        try:
            loss = _smoke_test()
        except Exception as exc:  # report any failure on one line
            raise UsageError(f"setup julia: the smoke test failed ({flux._one_line(exc)})") from None
        print(f"    loss {loss:.4f} in {time.perf_counter() - t0:.0f} s", flush=True)
    print("[harness setup julia] ready: `harness run --backend flux` will start without installing", flush=True)
    return 0


def _smoke_test() -> float:
    import numpy as np

    from harness.backends.flux import FluxBackend
    from harness.config.load import load_config
    from harness.core.weights import init_weights

    config = load_config("small").replace(block_size=16, batch_size=2, dropout=0.0)
    vocab = 11
    backend = FluxBackend()
    backend.setup(config, init_weights(config, vocab, 0), vocab, "cpu", 0)
    rng = np.random.default_rng(0)
    x = rng.integers(0, vocab, size=(2, 16), dtype=np.int64)
    y = rng.integers(0, vocab, size=(2, 16), dtype=np.int64)
    loss = backend.train_step(x, y, 1e-3)
    if not np.isfinite(loss) or backend.logits(x).shape != (2, 16, vocab):
        raise RuntimeError(f"unexpected result: loss {loss}")
    return float(loss)


def doctor_rows() -> list[tuple[str, str, str]]:
    """The flux backend's rows of `harness doctor` (component, status, fix): juliacall, the Julia executable, the
    Julia environment, NanoGPTFlux and the Julia packages; from files and metadata only, Julia never started."""
    from harness.backends import flux

    st = flux.julia_status(probe_network=True)
    out = [("juliacall", st["juliacall"] or "missing",
            "" if st["juliacall"] else "pip install juliacall (needed only for the flux backend)")]
    if st["julia_exe"]:
        jl = f"{st['julia_version'] or '?'} at {st['julia_exe']} (from {st['julia_source']})"
        fix = "" if st["julia_version"] else "this file is not a working Julia: " + flux.SETUP_HINT
    elif st["julia_source"]:
        jl, fix = f"not found: {st['julia_source']}", "point the variable at a Julia 1.10+ executable or unset it"
    else:
        can_download = st["network"] is True
        jl = "not found" + (" (juliapkg will download one)" if can_download else "")
        fix = "run `harness setup julia`" if can_download else flux.SETUP_HINT
    out.append(("Julia executable", jl, fix))
    env = f"{st['project']} ({st['project_from']})"
    if st["resolved"]:
        out.append(("Julia environment", f"installed: {env}", ""))
    else:
        no_net = st["network"] is False and not st["offline"]
        out.append(("Julia environment", f"not installed: {env}",
                    "run `harness setup julia`" + (" on a machine with internet" if no_net else "")))
    out.append((f"{flux.PACKAGE} (Julia)", st["package_path"] or "missing from this installation",
                "" if st["package_path"] else "reinstall nanogpt-parity"))
    if st["installed"]:
        for name in JULIA_PACKAGES:
            version = st["installed"].get(name)
            out.append((f"  {name}.jl", version or "not installed", "" if version else "run `harness setup julia`"))
    else:
        out.append(("  Julia packages", f"not installed ({', '.join(JULIA_PACKAGES[:6])}, ...)",
                    "run `harness setup julia`" if st["juliacall"] else ""))
    return out
