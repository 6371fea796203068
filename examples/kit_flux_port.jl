# A Flux.jl nanoGPT checked from outside with the conformance kit (docs/kit.md).
#
#     harness kit export --out kit/ --size small --steps 5
#     julia --project=@kit -e 'using Pkg; Pkg.develop(path="julia/NanoGPTFlux"); Pkg.add(["NPZ", "JSON"])'
#     julia --project=@kit examples/kit_flux_port.jl kit/ kit-results.npz
#     harness kit check kit/ kit-results.npz
#
# It reads the kit with NPZ.jl (`npzread` returns every array with numpy's shape and indices, whatever its
# memory order) and JSON.jl, runs the project's NanoGPTFlux in Float32 and writes the results in the
# canonical (PyTorch) shapes with `npzwrite` (which records Julia's column-major order in each header).

using JSON: JSON
using NPZ: npzread, npzwrite
using NanoGPTFlux: NanoGPTFlux

# Canonical (PyTorch) and Flux layouts differ only in the embedding tables, each the other's transpose:
# Flux's Embedding stores a token's vector as a column, (embd, rows); Dense weights are (out, in) in both.
const TRANSPOSED = ("wte.weight", "wpe.weight")
relayout(name, a) = name in TRANSPOSED ? permutedims(a, (2, 1)) : a

# Step k's (B, T) 0-based token ids as Flux takes them: (T, B), 1-based.
tokens(x, k) = permutedims(x[k, :, :], (2, 1)) .+ 1

# Step k's keep-mask as Flux takes it, its axes reversed: (B, T, C) -> (C, T, B) and, at the attention
# probabilities (attn_dropout), (B, H, T_query, T_key) -> NNlib's (T_key, T_query, H, B).
function flux_mask(m, k)
    a = selectdim(m, 1, k)
    return permutedims(a, ndims(a):-1:1)
end

# An activation tap from NanoGPTFlux.taps in the canonical layout: q, k and v come as NNlib splits the heads,
# (D, H, T, B) -> (B, H, T, D); every other tap has its axes reversed ((C, T, B) -> (B, T, C), the attention
# probabilities (key, query, H, B) -> (B, H, query, key)).
const HEAD_TAPS = (".attn.q", ".attn.k", ".attn.v")
canonical_tap(name, a) = any(endswith(name, t) for t in HEAD_TAPS) ?
    permutedims(a, (4, 2, 3, 1)) :
    permutedims(a, ndims(a):-1:1)

# The manifest's config entries NanoGPTFlux.build reads (besides vocab_size, seed, device and decay),
# the model options (tied embeddings, GELU form, biases, attention dropout) included; a kit from before
# an option existed lacks it, and NanoGPTFlux's default is the original model.
const CONFIG_KEYS = [
    "n_embd",
    "n_head",
    "n_layer",
    "block_size",
    "d_hidden",
    "dropout",
    "learning_rate",
    "weight_decay",
    "beta1",
    "beta2",
    "eps",
    "grad_clip",
    "tie_embeddings",
    "gelu",
    "bias",
    "lm_head_bias",
    "attn_dropout",
]

"""
    run_kit(kit, out)

Read the kit in directory `kit`, run NanoGPTFlux on it and write every depth of the results to `out`.
"""
function run_kit(kit::AbstractString, out::AbstractString)
    manifest = JSON.parsefile(joinpath(kit, "manifest.json"))
    c = manifest["config"]
    batches = npzread(joinpath(kit, "batches.npz"))
    x, y = batches["x"], batches["y"] # (steps, B, T), 0-based
    dropout = c["dropout"] > 0
    masks = dropout ? npzread(joinpath(kit, "masks.npz")) : nothing
    masks_at(k) = Dict(key => flux_mask(m, k) for (key, m) in masks)
    cfg = Dict{String, Any}(key => c[key] for key in CONFIG_KEYS if haskey(c, key))
    cfg["vocab_size"] = manifest["vocab_size"]
    cfg["seed"] = manifest["seed"]
    cfg["device"] = "cpu"
    # the parameters AdamW decays, as the manifest lists them (its `decay` convention)
    cfg["decay"] = join(manifest["training"]["decayed_parameters"], ",")
    weights = npzread(joinpath(kit, "weights.npz"))
    s = NanoGPTFlux.build(cfg, Dict(name => relayout(name, a) for (name, a) in weights))

    results = Dict{String, Any}()
    # step 0: logits (Flux (V, T, B) -> canonical (B, T, V)) and gradients, dropout off
    results["logits"] = permutedims(NanoGPTFlux.logits(s, tokens(x, 1)), (3, 2, 1))
    # the activation taps on the first rows of step 0's batch (tokens are (T, B): the first columns),
    # dropout off except at the sites of taps.masks (the attention probabilities, with attn_dropout):
    # there step 0's masks of those rows apply (the batch is the last axis in the Flux layout)
    rows = manifest["taps"]["rows"]
    sites = get(manifest["taps"], "masks", [])
    first_rows(m) = collect(selectdim(m, ndims(m), 1:rows))
    tap_masks = isempty(sites) ?
        () :
        (Dict{String, Any}(site => first_rows(masks_at(1)[site]) for site in sites),)
    for (name, a) in NanoGPTFlux.taps(s, tokens(x, 1)[:, 1:rows], tap_masks...)
        results["tap/$name"] = canonical_tap(name, a)
    end
    for (name, g) in NanoGPTFlux.gradients(s, tokens(x, 1), tokens(y, 1))
        results["grad/$name"] = relayout(name, g)
    end
    if dropout
        # and with the step-0 masks
        grads = NanoGPTFlux.gradients(s, tokens(x, 1), tokens(y, 1), masks_at(1))
        for (name, g) in grads
            results["dropout_grad/$name"] = relayout(name, g)
        end
    end
    losses = Float32[]
    for k in 1:manifest["steps"]
        # step k's rate from the schedule (nanoGPT's get_lr), as the manifest lists it
        xk, yk, lr = tokens(x, k), tokens(y, k), manifest["training"]["learning_rates"][k]
        # with dropout, the kit's masks replace Flux's own dropout
        loss = if dropout
            NanoGPTFlux.train_step!(s, xk, yk, lr, masks_at(k))
        else
            NanoGPTFlux.train_step!(s, xk, yk, lr)
        end
        push!(losses, loss)
        params, state = NanoGPTFlux.parameters(s), NanoGPTFlux.opt_state(s)
        for (name, p) in params
            results["opt/$k/param/$name"] = relayout(name, p)
            results["opt/$k/adam_m/$name"] = relayout(name, state["adam_m/$name"])
            results["opt/$k/adam_v/$name"] = relayout(name, state["adam_v/$name"])
        end
    end
    results["loss"] = losses
    npzwrite(out, results)
    println("wrote $out: $(length(results)) arrays (float32)")
    return nothing
end

if abspath(PROGRAM_FILE) == @__FILE__
    length(ARGS) == 2 || error("usage: julia examples/kit_flux_port.jl KIT RESULTS.npz")
    run_kit(ARGS[1], ARGS[2])
end
