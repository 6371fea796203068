using NanoGPTFlux
using Random
using Test

const NG = NanoGPTFlux

# A tiny config (the "small" preset's shape, shorter context) and GPT-2-style random weights in
# the Flux layout: Dense (out, in), embeddings (d, rows), vectors unchanged.
function tiny_cfg(; dropout = 0.0, weight_decay = 0.1, grad_clip = 0.0, device = "cpu")
    return Dict{String, Any}(
        "vocab_size" => 11,
        "n_embd" => 8,
        "n_head" => 2,
        "n_layer" => 2,
        "block_size" => 12,
        "d_hidden" => 32,
        "dropout" => dropout,
        "weight_decay" => weight_decay,
        "beta1" => 0.9,
        "beta2" => 0.999,
        "eps" => 1.0e-8,
        "grad_clip" => grad_clip,
        "seed" => 1234,
        "device" => device,
        "tf32" => false,
    )
end

function tiny_params(cfg; seed = 0)
    rng = Random.Xoshiro(seed)
    c = NG.parse_config(cfg)
    params = Dict{String, Any}()
    for spec in NG.param_specs(c)
        leaf = split(spec.name, '.')[end]
        params[spec.name] = if leaf == "bias"
            0.01f0 .* randn(rng, Float32, spec.shape)
        elseif occursin("ln_", spec.name)
            1.0f0 .+ 0.1f0 .* randn(rng, Float32, spec.shape)
        else
            0.02f0 .* randn(rng, Float32, spec.shape)
        end
    end
    return params
end

function tiny_batch(cfg; T = 10, B = 3, seed = 1)
    rng = Random.Xoshiro(seed)
    V = cfg["vocab_size"]
    return rand(rng, 1:V, T, B), rand(rng, 1:V, T, B)
end

# Harness-style keep-masks in the Flux layout (n_embd, T, B), 0/1, one per dropout place.
function tiny_masks(cfg, T, B; p = 0.5, seed = 2)
    rng = Random.Xoshiro(seed)
    sites = ["emb"; ["h.$(i - 1).$(s)" for i in 1:cfg["n_layer"] for s in ("attn", "mlp")]]
    return Dict{String, Any}(s => rand(rng, cfg["n_embd"], T, B) .>= p for s in sites)
end

# ---------------------------------------------------------------------------------------------
# The outside reference: fixture.txt, written by make_fixture.py from the NumPy float64 oracle
# (harness/models/numpy_gpt.py). Format: `config KEY VALUE`, `scalar NAME VALUE`, and `array NAME
# DIMS...` followed by one line of values in column-major order; arrays in the Flux layout.
# ---------------------------------------------------------------------------------------------

struct Fixture
    cfg::Dict{String, Any}
    scalars::Dict{String, Float64}
    arrays::Dict{String, Array{Float64}}
end

config_value(s::AbstractString) = something(
    tryparse(Int, s),
    tryparse(Float64, s),
    String(s),
)

function read_fixture(path::AbstractString)
    cfg = Dict{String, Any}()
    scalars = Dict{String, Float64}()
    arrays = Dict{String, Array{Float64}}()
    lines = readlines(path)
    i = 1
    while i <= length(lines)
        words = split(lines[i])
        i += 1
        (isempty(words) || startswith(words[1], "#")) && continue
        if words[1] == "config"
            cfg[String(words[2])] = config_value(words[3])
        elseif words[1] == "scalar"
            scalars[String(words[2])] = parse(Float64, words[3])
        elseif words[1] == "array"
            dims = Tuple(parse.(Int, words[3:end]))
            values = parse.(Float64, split(lines[i]))
            i += 1
            arrays[String(words[2])] = reshape(values, dims)
        else
            error("fixture.txt: unknown line $(lines[i - 1])")
        end
    end
    return Fixture(cfg, scalars, arrays)
end

const FIXTURE = read_fixture(joinpath(@__DIR__, "fixture.txt"))

fixture_cfg(fx::Fixture) = merge(
    fx.cfg,
    Dict{String, Any}("seed" => 0, "device" => "cpu", "tf32" => false),
)

# The fixture's weights are Float32 values: exactly those, as `T`.
function fixture_params(fx::Fixture, ::Type{T}) where {T}
    c = NG.parse_config(fixture_cfg(fx))
    return Dict{String, Any}(
        spec.name => T.(Float32.(fx.arrays["param/" * spec.name]))
        for spec in NG.param_specs(c)
    )
end

# A case of the fixture: its `case.` config lines over the main config (options: nanoGPT's options; attn:
# attention dropout), and its weights, `case/param/...`.
function case_cfg(fx::Fixture, case::String)
    cfg = fixture_cfg(fx)
    for (k, v) in fx.cfg
        startswith(k, case * ".") || continue
        cfg[k[(length(case) + 2):end]] = v == "true" ? true : v == "false" ? false : v
    end
    return cfg
end

function case_params(fx::Fixture, case::String, ::Type{T}) where {T}
    c = NG.parse_config(case_cfg(fx, case))
    return Dict{String, Any}(
        spec.name => T.(Float32.(fx.arrays["$case/param/" * spec.name]))
        for spec in NG.param_specs(c)
    )
end

options_cfg(fx::Fixture) = case_cfg(fx, "options")
options_params(fx::Fixture, ::Type{T}) where {T} = case_params(fx, "options", T)

# The attention-dropout case's masks: the main case's block-0 masks and its own attention mask, (T, T, H, B).
function attn_masks(fx::Fixture)
    masks = filter(kv -> kv.first in ("emb", "h.0.attn", "h.0.mlp"), fixture_masks(fx))
    masks["h.0.attn.probs"] = fx.arrays["attn/mask/h.0.attn.probs"]
    return masks
end

fixture_masks(fx::Fixture) = Dict{String, Any}(
    k[6:end] => a
    for (k, a) in fx.arrays
    if startswith(k, "mask/")
)

fixture_tokens(fx::Fixture) = Int.(fx.arrays["x"]), Int.(fx.arrays["y"])

# ‖a - b‖∞ ≤ rtol ‖b‖∞ + atol: one scale per array, as the harness's parity tolerances.
close_to(a, b; rtol, atol = 0.0) = maximum(abs, a .- b) <= rtol * maximum(abs, b) + atol

# The TorchAdamW rule on the fixture's fixed arrays, as element type `T`, learning rate changed
# with `adjust!` before every step: (parameter, m, v, step) after each of the three steps.
function adamw_trace(fx::AbstractDict, k::String, eps::Real, ::Type{T} = Float64) where {T}
    β₁, β₂, _, λ = fx["adamw/hyper"]
    lrs = fx["adamw/lr"]
    p = T.(fx["adamw/param0/$k"])
    rule = NG.TorchAdamW(lrs[1], (β₁, β₂), k == "a" ? λ : 0.0, eps)
    leaf = NG.Optimisers.setup(rule, p)
    trace = Any[]
    for t in 1:3
        NG.Optimisers.adjust!(leaf, T(lrs[t])) # any Real: the rule's fields are Float64
        NG.Optimisers.update!(leaf, p, T.(fx["adamw/grad$t/$k"]))
        m, v, step = leaf.state
        push!(trace, (copy(p), copy(m), copy(v), step))
    end
    return trace
end

# Loss and gradients (any element type, no conversion) of a state's model on one batch.
function loss_and_grads(s, x, y, masks = nothing)
    idx, onehot, mask = NG.device_batch(s, x, y)
    keeps = NG.keeps_for(s, masks, idx)
    res = NG.Zygote.withgradient(m -> NG.loss(m, idx, onehot, mask, keeps), s.model)
    g = Dict(
        spec.name => NG.dense_grad(NG.getpath(res.grad[1], spec.path), p)
        for (spec, p) in zip(s.specs, s.params)
    )
    return res.val, g
end

# Loss and gradients of the Float64 model on the fixture's batch against its `loss_key` and `grad_prefix` arrays.
function check_loss_and_grads(s, x, y, fx, loss_key, grad_prefix, masks = nothing)
    l, g = loss_and_grads(s, x, y, masks)
    @test l ≈ fx.scalars[loss_key] rtol = 1.0e-10
    for spec in s.specs
        @test close_to(g[spec.name], fx.arrays[grad_prefix * spec.name]; rtol = 1.0e-9)
    end
    return nothing
end

# Central differences of the loss `f()` at `per_param` random entries of every parameter against the gradients
# `g`; the model's own arrays are nudged in place and restored.
function check_finite_differences(s, g, f, rng, per_param)
    h = 1.0e-6
    for (spec, p) in zip(s.specs, s.params), i in unique(rand(rng, 1:length(p), per_param))
        p0 = p[i]
        p[i] = p0 + h
        up = f()
        p[i] = p0 - h
        down = f()
        p[i] = p0
        @test g[spec.name][i] ≈ (up - down) / 2h rtol = 1.0e-5 atol = 1.0e-8
    end
    return nothing
end

# Two full training steps (masks, clipping, AdamW with decay) against the fixture's arrays under `prefix`: the
# losses, the parameters, the step counter and, from step `moments_from` on, AdamW's moments (Float64 model).
function check_two_steps(s, x, y, fx, prefix, masks; moments_from = 1)
    for step in 1:2
        loss = train_step!(s, x, y, fx.scalars["$(prefix)lr_$step"], masks)
        @test loss ≈
            fx.scalars["$(prefix)loss_step_$step"] rtol = 1.0e-6 # returned as Float32
        st = opt_state(s)
        @test st["adam_t"] == step
        for (spec, p) in zip(s.specs, s.params)
            ref = fx.arrays["$(prefix)step$step/param/" * spec.name]
            @test close_to(p, ref; rtol = 1.0e-9)
            step >= moments_from || continue
            for kind in ("adam_m", "adam_v")
                ref = fx.arrays["$(prefix)step$step/$kind/" * spec.name]
                @test close_to(st["$kind/" * spec.name], ref; rtol = 1.0e-9)
            end
        end
    end
    return nothing
end

@testset "NanoGPTFlux" begin
    @testset "shapes and layout" begin
        cfg = tiny_cfg()
        params = tiny_params(cfg)
        s = build(cfg, params)
        x, y = tiny_batch(cfg)
        out = logits(s, x)
        @test out isa Array{Float32, 3}
        @test size(out) == (11, 10, 3)
        p = parameters(s)
        @test Set(keys(p)) == Set(keys(params))
        for (name, a) in params
            @test p[name] == a
            @test p[name] isa Array{Float32}
        end
        g = gradients(s, x, y)
        @test Set(keys(g)) == Set(keys(params))
        for (name, a) in params
            @test size(g[name]) == size(a)
            @test all(isfinite, g[name])
        end
        # only the first T columns of the position table are used
        @test all(iszero, g["wpe.weight"][:, 11:end])
        @test !all(iszero, g["wpe.weight"][:, 1:10])
        @test_throws DimensionMismatch build(
            cfg,
            merge(params, Dict{String, Any}("wte.weight" => zeros(Float32, 11, 8))),
        )
        @test_throws ArgumentError logits(s, zeros(Int, 10, 3)) # ids are 1-based
        @test_throws ArgumentError logits(s, ones(Int, 13, 3))  # longer than block_size
    end

    @testset "activation taps: the model's own forward pass, Flux layouts" begin
        cfg = tiny_cfg()
        s = build(cfg, tiny_params(cfg))
        x, _ = tiny_batch(cfg)
        t = taps(s, x)
        d, T, B = cfg["n_embd"], size(x)...
        H = cfg["n_head"]
        names = ["emb"; "ln_f"; "logits"]
        for i in 0:(cfg["n_layer"] - 1), k in (
                "ln_1",
                "attn.q",
                "attn.k",
                "attn.v",
                "attn.probs",
                "attn.y",
                "attn.proj",
                "res1",
                "ln_2",
                "mlp.fc",
                "mlp.act",
                "mlp.proj",
                "res2",
            )
            push!(names, "h.$i.$k")
        end
        @test Set(keys(t)) == Set(names)
        @test t["logits"] ≈
            logits(s, x) rtol = 1.0e-6 # the taps are the model's forward pass
        @test size(t["emb"]) == (d, T, B)
        @test size(t["h.0.attn.q"]) == (d ÷ H, H, T, B)
        @test size(t["h.0.attn.probs"]) == (T, T, H, B) # (key, query, head, batch)
        @test sum(t["h.0.attn.probs"]; dims = 1) ≈ ones(Float32, 1, T, H, B)
        @test all(iszero, t["h.0.attn.probs"][2, 1, :, :]) # key 2 is future to query 1
        @test size(t["h.0.mlp.fc"]) == (cfg["d_hidden"], T, B)
        @test t["h.0.mlp.act"] ≈ NG.NNlib.gelu_tanh.(t["h.0.mlp.fc"])
    end

    @testset "the parts of harness bench parts: forwards on the taps, pullbacks" begin
        cfg = tiny_cfg()
        s = build(cfg, tiny_params(cfg))
        x, y = tiny_batch(cfg)
        t = Dict{String, Any}(taps(s, x))
        t["idx"], t["targets"] = x, y
        # (kind, block, inputs, the tap the forward gives)
        cases = [
            ("emb", -1, "idx", "emb"),
            ("ln_1", 0, "emb", "h.0.ln_1"),
            ("attn.qkv", 0, "h.0.ln_1", "h.0.attn.q"),
            ("attn.probs", 0, "h.0.attn.q,h.0.attn.k", "h.0.attn.probs"),
            ("attn.y", 0, "h.0.attn.probs,h.0.attn.v", "h.0.attn.y"),
            ("attn.proj", 0, "h.0.attn.y", "h.0.attn.proj"),
            ("res1", 0, "emb,h.0.attn.proj", "h.0.res1"),
            ("ln_2", 0, "h.0.res1", "h.0.ln_2"),
            ("mlp.fc", 0, "h.0.ln_2", "h.0.mlp.fc"),
            ("mlp.act", 0, "h.0.mlp.fc", "h.0.mlp.act"),
            ("mlp.proj", 0, "h.0.mlp.act", "h.0.mlp.proj"),
            ("res2", 1, "h.1.res1,h.1.mlp.proj", "h.1.res2"),
            ("ln_f", -1, "h.1.res2", "ln_f"),
            ("logits", -1, "ln_f", "logits"),
        ]
        for (kind, block, inputs, out) in cases
            o = part_forward(s, kind, block, inputs, t)()
            @test (kind == "attn.qkv" ? o[1] : o) ≈ t[out] rtol = 1.0e-5
        end
        @test part_forward(s, "loss", -1, "logits,targets", t)() ≈
            eval_loss(s, x, y) rtol = 1.0e-5
        # the loss's pullback, then the head's, give the head's gradient of the whole model
        unit = Dict{String, Any}("loss" => 1.0)
        dlogits = part_backward(s, "loss", -1, "logits,targets", t, "loss", unit)()[2]
        ct = Dict{String, Any}("logits" => dlogits)
        head = part_backward(s, "logits", -1, "ln_f", t, "logits", ct)()[1]
        full = gradients(s, x, y)
        @test head.lm_head.weight ≈ full["lm_head.weight"] rtol = 1.0e-4
        # the optimizer works on copies: the model's parameters stay as they are
        before = parameters(s)
        updated = optimizer_closure(s, full)()
        @test parameters(s) == before
        @test any(Array(u) != before[spec.name] for (spec, u) in zip(s.specs, updated))
    end

    @testset "LayerNorm matches the formula" begin
        rng = Random.Xoshiro(3)
        x = randn(rng, Float32, 6, 4, 2) .* 3.0f0 .+ 1.0f0
        w = randn(rng, Float32, 6)
        b = randn(rng, Float32, 6)
        y = NG.LayerNorm(w, b)(x)
        for t in 1:4, n in 1:2
            col = Float64.(x[:, t, n])
            μ = sum(col) / 6
            σ² = sum(abs2, col .- μ) / 6 # biased variance
            expected = (col .- μ) ./ sqrt(σ² + 1.0e-5) .* w .+ b
            @test y[:, t, n] ≈ expected rtol = 1.0e-5 atol = 1.0e-5
        end
    end

    @testset "causal: future tokens never change earlier logits" begin
        cfg = tiny_cfg()
        s = build(cfg, tiny_params(cfg))
        x, _ = tiny_batch(cfg)
        base = logits(s, x)
        for k in 1:9
            x2 = copy(x)
            x2[(k + 1):end, :] .= mod1.(x2[(k + 1):end, :] .+ 3, 11)
            changed = logits(s, x2)
            @test changed[:, 1:k, :] ≈ base[:, 1:k, :] atol = 1.0e-6
            @test !(changed[:, (k + 1):end, :] ≈ base[:, (k + 1):end, :])
        end
    end

    @testset "loss at init ≈ log(V)" begin
        cfg = tiny_cfg()
        s = build(cfg, tiny_params(cfg))
        x, y = tiny_batch(cfg)
        @test abs(eval_loss(s, x, y) - log(11)) < 0.1
        @test eval_loss(s, x, y) isa Float32
    end

    @testset "dropout p = 0 is the identity; p > 0 is active only in training" begin
        cfg = tiny_cfg()
        s = build(cfg, tiny_params(cfg))
        x, y = tiny_batch(cfg)
        idx, _, mask = NG.device_batch(s, x, y)
        evaluated = s.model(idx, mask)
        NG.set_dropout!(s.model, true)
        trained = s.model(idx, mask)
        NG.set_dropout!(s.model, false)
        @test trained == evaluated

        cfg2 = tiny_cfg(; dropout = 0.5)
        s2 = build(cfg2, tiny_params(cfg2))
        @test logits(s2, x) == logits(s2, x) # off outside training
        NG.set_dropout!(s2.model, true)
        @test s2.model(idx, mask) != s2.model(idx, mask)
        NG.set_dropout!(s2.model, false)
        train_step!(s2, x, y, 1.0e-3)
        @test !s2.model.drop.active # switched off again after the step
    end

    @testset "one AdamW step equals the hand-computed update" begin
        cfg = tiny_cfg(; weight_decay = 0.1, grad_clip = 0.0)
        s = build(cfg, tiny_params(cfg))
        x, y = tiny_batch(cfg)
        lr = 1.0e-2
        g = gradients(s, x, y)
        p0 = parameters(s)
        train_step!(s, x, y, lr)
        p1 = parameters(s)
        β1, β2, ϵ = 0.9, 0.999, 1.0e-8
        for (name, w0) in p0
            w = Float64.(w0)
            gw = Float64.(g[name])
            m̂ = ((1 - β1) .* gw) ./ (1 - β1)
            v̂ = ((1 - β2) .* gw.^2) ./ (1 - β2)
            λ = ndims(w) >= 2 ? 0.1 : 0.0 # decay only matrices and embeddings
            expected = w .- lr .* (m̂ ./ (sqrt.(v̂) .+ ϵ) .+ λ .* w)
            @test p1[name] ≈ expected rtol = 1.0e-4 atol = 1.0e-6
        end
        st = opt_state(s)
        @test st["adam_t"] == 1
        for (name, gw) in g
            @test st["adam_m/" * name] ≈ 0.1f0 .* gw rtol = 1.0e-5 atol = 1.0e-9
            @test st["adam_v/" * name] ≈ 0.001f0 .* gw.^2 rtol = 1.0e-4 atol = 1.0e-12
        end
    end

    @testset "global-norm clipping as torch.nn.utils.clip_grad_norm_" begin
        max_norm = 1.0e-3
        cfg = tiny_cfg(; grad_clip = max_norm)
        s = build(cfg, tiny_params(cfg))
        x, y = tiny_batch(cfg)
        g = gradients(s, x, y)
        total = sqrt(sum(sum(abs2, Float64.(a)) for a in values(g)))
        @test total > max_norm
        coef = max_norm / (total + 1.0e-6)
        train_step!(s, x, y, 1.0e-3)
        st = opt_state(s)
        for (name, gw) in g
            @test st["adam_m/" * name] ≈ 0.1 .* coef .* gw rtol = 1.0e-4 atol = 1.0e-12
        end
        grads = Any[copy(a) for a in values(g)]
        norm = NG.clip_global_norm!(grads, max_norm)
        @test norm isa Vector{Float32} &&
            length(norm) == 1 # stays an array (on the GPU: no sync)
        @test only(norm) ≈ total rtol = 1.0e-5
        @test sqrt(sum(sum(abs2, Float64.(a)) for a in grads)) ≈ max_norm rtol = 1.0e-4
        small = Any[1.0f-4 .* copy(a) for a in values(g)] # below max_norm: unchanged
        NG.clip_global_norm!(small, max_norm)
        @test all(small[i] == 1.0f-4 .* a for (i, a) in enumerate(values(g)))
    end

    @testset "the harness's dropout masks replace the model's dropout" begin
        x, y = tiny_batch(tiny_cfg())
        T, B = size(x)
        # dropout 0 in the config and all-ones masks: the plain gradients (x .* 1 ./ 1)
        cfg0 = tiny_cfg()
        s0 = build(cfg0, tiny_params(cfg0))
        ones_masks = Dict{String, Any}(
            k => trues(size(m))
            for (k, m) in tiny_masks(cfg0, T, B)
        )
        g_ones, g_plain = gradients(s0, x, y, ones_masks), gradients(s0, x, y)
        @test all(g_ones[k] ≈ g_plain[k] for k in keys(g_plain))
        # dropout 0.5: the masks decide, deterministically, and differ from no dropout
        cfg = tiny_cfg(; dropout = 0.5)
        params = tiny_params(cfg)
        s = build(cfg, params)
        masks = tiny_masks(cfg, T, B)
        g1 = gradients(s, x, y, masks)
        @test g1 == gradients(s, x, y, masks)
        @test g1 != gradients(s, x, y)
        @test !s.model.drop.active
        # x .* keep ./ (1 - p) at the embedding: with only "emb" dropping, a dropped entry of the
        # embedding sum gets no gradient through wpe from that position
        keep_emb = Dict{String, Any}(k => trues(size(m)) for (k, m) in masks)
        keep_emb["emb"] = trues(8, T, B)
        keep_emb["emb"][:, 3, :] .= false # position 3 dropped in every sequence
        @test all(iszero, gradients(s, x, y, keep_emb)["wpe.weight"][:, 3])
        @test !all(iszero, gradients(s, x, y, keep_emb)["wpe.weight"][:, 2])
        # training steps with masks are deterministic
        s2 = build(cfg, params)
        @test train_step!(s, x, y, 1.0e-2, masks) == train_step!(s2, x, y, 1.0e-2, masks)
        @test parameters(s) == parameters(s2)
        # bad masks
        @test_throws ArgumentError gradients(s, x, y, delete!(copy(masks), "h.1.mlp"))
        @test_throws ArgumentError gradients(
            s,
            x,
            y,
            merge(masks, Dict{String, Any}("h.0.attn_probs" => masks["emb"])),
        )
        @test_throws DimensionMismatch gradients(
            s,
            x,
            y,
            merge(masks, Dict{String, Any}("emb" => trues(8, B, T))),
        )
        @test_throws ArgumentError gradients(
            s,
            x,
            y,
            merge(masks, Dict{String, Any}("emb" => fill(0.5, 8, T, B))),
        )
    end

    @testset "weight decay on the parameters the harness names" begin
        cfg = merge(tiny_cfg(), Dict{String, Any}("decay" => "wte.weight,h.0.ln_1.bias"))
        s = build(cfg, tiny_params(cfg))
        λ = Dict(spec.name => leaf.rule.lambda for (spec, leaf) in zip(s.specs, s.leaves))
        @test λ["wte.weight"] == 0.1 && λ["h.0.ln_1.bias"] == 0.1
        @test λ["lm_head.weight"] == 0.0 && λ["h.0.ln_1.weight"] == 0.0
        s_default = build(
            tiny_cfg(),
            tiny_params(tiny_cfg()),
        ) # no list: two or more dimensions
        @test all(
            leaf.rule.lambda == (length(spec.shape) >= 2 ? 0.1 : 0.0)
            for (spec, leaf) in zip(s_default.specs, s_default.leaves)
        )
        @test_throws ArgumentError build(
            merge(tiny_cfg(), Dict{String, Any}("decay" => "wte.weight,nope")),
            tiny_params(tiny_cfg()),
        )
    end

    @testset "TorchAdamW equals the NumPy oracle's AdamW (fixed arrays)" begin
        fx = FIXTURE.arrays
        ϵ = fx["adamw/hyper"][3]
        for k in ("a", "b")
            # "a" decayed, "b" not
            trace = adamw_trace(fx, k, ϵ)
            for t in 1:3
                p, m, v, step = trace[t]
                @test step == t
                @test close_to(p, fx["adamw/step$t/param/$k"]; rtol = 1.0e-11)
                @test close_to(m, fx["adamw/step$t/adam_m/$k"]; rtol = 1.0e-11)
                @test close_to(v, fx["adamw/step$t/adam_v/$k"]; rtol = 1.0e-11)
            end
            # Float32 arrays: the same to Float32 rounding
            @test close_to(
                adamw_trace(fx, k, ϵ, Float32)[3][1],
                fx["adamw/step3/param/$k"];
                rtol = 1.0e-6,
            )
        end
        # the check is sharp: the gradients are of the order of eps, so eps 1e-8 misses it
        @test !close_to(
            adamw_trace(fx, "b", 1.0e-8)[3][1],
            fx["adamw/step3/param/b"];
            rtol = 1.0e-6,
        )
    end

    @testset "outside reference: the NumPy oracle, Float64 model" begin
        fx = FIXTURE
        cfg = fixture_cfg(fx)
        s = build(cfg, fixture_params(fx, Float64); float_type = Float64)
        x, y = fixture_tokens(fx)
        masks = fixture_masks(fx)
        @test length(masks) == 1 + 2 * cfg["n_layer"]
        @test close_to(logits(s, x), fx.arrays["logits"]; rtol = 1.0e-10)
        check_loss_and_grads(s, x, y, fx, "loss", "grad/")
        check_loss_and_grads(s, x, y, fx, "loss_masked", "grad_masked/", masks)
        # two full steps: masks, clipping (active: the fixture checks), AdamW with decay
        check_two_steps(s, x, y, fx, "", masks)
    end

    @testset "outside reference: the NumPy oracle, Float32 model (the bridge's path)" begin
        fx = FIXTURE
        s = build(fixture_cfg(fx), fixture_params(fx, Float32))
        x, y = fixture_tokens(fx)
        masks = fixture_masks(fx)
        @test close_to(logits(s, x), fx.arrays["logits"]; rtol = 1.0e-5)
        @test eval_loss(s, x, y) ≈ fx.scalars["loss"] rtol = 1.0e-5
        g = gradients(s, x, y)
        gm = gradients(s, x, y, masks)
        for spec in s.specs
            @test close_to(g[spec.name], fx.arrays["grad/" * spec.name]; rtol = 1.0e-4)
            @test close_to(
                gm[spec.name],
                fx.arrays["grad_masked/" * spec.name];
                rtol = 1.0e-4,
            )
        end
        for step in 1:2
            lr = fx.scalars["lr_$step"]
            @test train_step!(s, x, y, lr, masks) ≈
                fx.scalars["loss_step_$step"] rtol = 1.0e-5
            p = parameters(s)
            for spec in s.specs
                ref = fx.arrays["step$step/param/" * spec.name]
                @test close_to(p[spec.name], ref; rtol = 1.0e-4, atol = 1.0e-3 * lr)
            end
        end
    end

    @testset "outside reference: nanoGPT's options (tied, exact GELU, no biases), Float64" begin
        fx = FIXTURE
        cfg = options_cfg(fx)
        c = NG.parse_config(cfg)
        @test c.tie_embeddings && c.gelu == "exact" && !c.bias && !c.lm_head_bias
        names = [spec.name for spec in NG.param_specs(c)]
        @test !("lm_head.weight" in names) && !any(n -> endswith(n, ".bias"), names)
        s = build(cfg, options_params(fx, Float64); float_type = Float64)
        @test s.model.lm_head isa NG.TiedHead && s.model.lm_head.bias === false
        @test s.model.blocks[1].mlp.c_fc.σ === NG.NNlib.gelu_erf
        x, y = fixture_tokens(fx)
        masks = filter(kv -> kv.first in ("emb", "h.0.attn", "h.0.mlp"), fixture_masks(fx))
        @test close_to(logits(s, x), fx.arrays["options/logits"]; rtol = 1.0e-10)
        # wte.weight: the sum of the embedding's and the output layer's gradient
        check_loss_and_grads(s, x, y, fx, "options/loss", "options/grad/")
        # two steps with the schedule's rates (a warm-up step, then the peak), masks, clipping; the fixture
        # holds AdamW's moments of step 2
        check_two_steps(s, x, y, fx, "options/", masks; moments_from = 2)
        # the bridge's Float32 path
        s32 = build(cfg, options_params(fx, Float32))
        @test close_to(logits(s32, x), fx.arrays["options/logits"]; rtol = 1.0e-5)
        g32 = gradients(s32, x, y)
        @test all(
            close_to(g32[spec.name], fx.arrays["options/grad/" * spec.name]; rtol = 1.0e-4)
            for spec in s32.specs
        )
        # parameters that the options remove are refused
        @test_throws ArgumentError build(
            cfg,
            merge(
                options_params(fx, Float32),
                Dict{String, Any}("lm_head.weight" => zeros(Float32, 5, 4)),
            ),
        )
        @test_throws ArgumentError build(
            merge(cfg, Dict{String, Any}("gelu" => "erf")),
            options_params(fx, Float32),
        )
    end

    @testset "outside reference: dropout on the attention probabilities (attn_dropout)" begin
        fx = FIXTURE
        cfg = case_cfg(fx, "attn")
        c = NG.parse_config(cfg)
        @test c.attn_dropout && c.n_layer == 1
        s = build(cfg, case_params(fx, "attn", Float64); float_type = Float64)
        @test s.model.blocks[1].attn.attn_drop.p == c.dropout
        x, y = fixture_tokens(fx)
        masks = attn_masks(fx)
        @test size(masks["h.0.attn.probs"]) == (6, 6, 2, 2) # (key, query, head, batch)
        # the oracle's loss and gradients under the four masks: the attention mask reaches NNlib's fdrop
        check_loss_and_grads(s, x, y, fx, "attn/loss_masked", "attn/grad_masked/", masks)
        l3, _ = loss_and_grads(
            build(cfg, case_params(fx, "attn", Float64); float_type = Float64),
            x,
            y,
            merge(masks, Dict{String, Any}("h.0.attn.probs" => ones(6, 6, 2, 2))),
        )
        @test !(l3 ≈ fx.scalars["attn/loss_masked"]) # the mask matters
        # two steps with the masks: clipping, AdamW with decay (parameters only)
        check_two_steps(s, x, y, fx, "attn/", masks; moments_from = 3)
        # the bridge's Float32 path
        s32 = build(cfg, case_params(fx, "attn", Float32))
        g32 = gradients(s32, x, y, masks)
        @test all(
            close_to(
                g32[spec.name],
                fx.arrays["attn/grad_masked/" * spec.name];
                rtol = 1.0e-4,
            )
            for spec in s32.specs
        )
        # with attention dropout the attention masks are required; without it they are refused
        @test_throws ArgumentError gradients(
            s32,
            x,
            y,
            delete!(copy(masks), "h.0.attn.probs"),
        )
        @test_throws DimensionMismatch gradients(
            s32,
            x,
            y,
            merge(masks, Dict{String, Any}("h.0.attn.probs" => trues(6, 6, 2))),
        )
        s_off = build(case_cfg(fx, "options"), options_params(fx, Float32))
        @test_throws ArgumentError gradients(s_off, x, y, masks)
        # finite differences through the attention dropout (masks given: deterministic)
        _, g = loss_and_grads(s, x, y, masks)
        idx, onehot, mask = NG.device_batch(s, x, y)
        keeps = NG.keeps_for(s, masks, idx)
        # the taps with masks: the model's own forward pass under them
        @test taps(s, x, masks)["logits"] ≈ s.model(idx, mask, keeps) rtol = 1.0e-6
        # with the attention mask alone (what parity hands): attn.probs before the dropout, attn.y
        # the dropped probabilities times v, head by head
        t0 = taps(s, x)
        tp = taps(s, x, Dict{String, Any}("h.0.attn.probs" => masks["h.0.attn.probs"]))
        @test tp["h.0.attn.probs"] == t0["h.0.attn.probs"]
        α = tp["h.0.attn.probs"] .* masks["h.0.attn.probs"] ./ (1 - c.dropout)
        v = tp["h.0.attn.v"] # (D, H, T, B)
        yh = similar(v)
        for b in axes(v, 4), h in axes(v, 2), i in axes(v, 3)
            yh[:, h, i, b] = sum(α[j, i, h, b] .* v[:, h, j, b] for j in axes(v, 3))
        end
        @test tp["h.0.attn.y"] ≈ reshape(yh, :, size(v, 3), size(v, 4)) rtol = 1.0e-5
        @test !(tp["h.0.attn.y"] ≈ t0["h.0.attn.y"])
        @test_throws ArgumentError taps(
            s_off,
            x,
            masks,
        ) # no attention sites without the option
        f = () -> NG.loss(s.model, idx, onehot, mask, keeps)
        check_finite_differences(s, g, f, Random.Xoshiro(11), 3)
    end

    @testset "attention dropout: Flux's own dropout on the probabilities while training" begin
        cfg = merge(tiny_cfg(; dropout = 0.5), Dict{String, Any}("attn_dropout" => true))
        s = build(cfg, tiny_params(cfg))
        @test all(b.attn.attn_drop.p == 0.5 for b in s.model.blocks)
        s_off = build(tiny_cfg(; dropout = 0.5), tiny_params(cfg))
        @test all(
            b.attn.attn_drop.p == 0
            for b in s_off.model.blocks
        ) # the option off: p = 0
        x, y = tiny_batch(cfg)
        idx, _, mask = NG.device_batch(s, x, y)
        @test logits(s, x) == logits(s, x) # off outside training
        # only the attention probabilities drop: the other layers' p set to 0
        s.model.drop.p = 0
        for b in s.model.blocks
            b.attn.drop.p = 0
            b.mlp.drop.p = 0
        end
        NG.set_dropout!(s.model, true)
        @test all(b.attn.attn_drop.active === true for b in s.model.blocks)
        @test s.model(idx, mask) != s.model(idx, mask)
        NG.set_dropout!(s.model, false)
        @test s.model(idx, mask) == logits(s, x)
        train_step!(s, x, y, 1.0e-3)
        @test !any(
            b.attn.attn_drop.active
            for b in s.model.blocks
        ) # off again after the step
    end

    @testset "finite differences: tied embeddings and exact GELU (Float64 model)" begin
        fx = FIXTURE
        s = build(options_cfg(fx), options_params(fx, Float64); float_type = Float64)
        x, y = fixture_tokens(fx)
        _, g = loss_and_grads(s, x, y)
        idx, onehot, mask = NG.device_batch(s, x, y)
        check_finite_differences(
            s,
            g,
            () -> NG.loss(s.model, idx, onehot, mask),
            Random.Xoshiro(7),
            4,
        )
    end

    @testset "finite differences agree with the gradients (Float64 model, with masks)" begin
        fx = FIXTURE
        s = build(fixture_cfg(fx), fixture_params(fx, Float64); float_type = Float64)
        x, y = fixture_tokens(fx)
        masks = fixture_masks(fx)
        _, g = loss_and_grads(s, x, y, masks)
        idx, onehot, mask = NG.device_batch(s, x, y)
        keeps = NG.keeps_for(s, masks, idx)
        f = () -> NG.loss(s.model, idx, onehot, mask, keeps)
        check_finite_differences(s, g, f, Random.Xoshiro(42), 3)
    end

    @testset "training lowers the loss on a repeated batch" begin
        cfg = tiny_cfg(; grad_clip = 1.0)
        s = build(cfg, tiny_params(cfg))
        x, y = tiny_batch(cfg)
        losses = [train_step!(s, x, y, 1.0e-2) for _ in 1:50]
        @test all(isfinite, losses)
        @test losses[end] < losses[1] - 0.1
        @test eval_loss(s, x, y) < losses[1]
    end

    @testset "checkpoint: parameters and optimizer state round-trip" begin
        cfg = tiny_cfg(; grad_clip = 1.0)
        params = tiny_params(cfg)
        s = build(cfg, params)
        x, y = tiny_batch(cfg)
        for _ in 1:3
            train_step!(s, x, y, 1.0e-2)
        end
        s2 = build(cfg, params)
        load_parameters!(s2, parameters(s))
        load_opt_state!(s2, opt_state(s))
        @test s2.step == 3
        @test all(
            s2.leaves[i].state[3] == s.leaves[i].state[3]
            for i in eachindex(s.leaves)
        )
        l1 = train_step!(s, x, y, 5.0e-3)
        l2 = train_step!(s2, x, y, 5.0e-3)
        @test l1 == l2
        p, p2 = parameters(s), parameters(s2)
        @test all(p[k] == p2[k] for k in keys(p))
    end

    @testset "describe and memory" begin
        cfg = tiny_cfg()
        s = build(cfg, tiny_params(cfg))
        d = describe(s)
        @test d["framework"] == "Flux.jl"
        @test d["device"] == "cpu"
        @test haskey(d, "Flux") && haskey(d, "compile_time_s")
        m = memory_stats(s)
        @test m["kind"] == "rss" && m["peak_bytes"] > 0
        @test reset_peak!(s) === nothing
        @test synchronize(s) === nothing
    end

    if NG.cuda_functional()
        @testset "CUDA matches the CPU" begin
            cfg = tiny_cfg()
            params = tiny_params(cfg)
            s_cpu = build(cfg, params)
            s_gpu = build(tiny_cfg(; device = "cuda"), params)
            x, y = tiny_batch(cfg)
            @test logits(s_gpu, x) ≈ logits(s_cpu, x) rtol = 1.0e-4 atol = 1.0e-5
            @test train_step!(s_gpu, x, y, 1.0e-2) ≈
                train_step!(s_cpu, x, y, 1.0e-2) rtol = 1.0e-5
            masks = tiny_masks(cfg, size(x)...)
            g_gpu, g_cpu = gradients(s_gpu, x, y, masks), gradients(s_cpu, x, y, masks)
            @test all(close_to(g_gpu[k], g_cpu[k]; rtol = 1.0e-4) for k in keys(g_cpu))
            reset_peak!(s_gpu)
            stats = memory_stats(s_gpu)
            @test stats["kind"] == "device" && stats["gc_every"] == 1
            @test haskey(stats, "peak_bytes_meaning")
            @test describe(s_gpu)["math_mode"] == "DEFAULT_MATH"
            @test NG.cuda_native_rng() isa Random.AbstractRNG
        end
    else
        @info "CUDA.jl finds no GPU: the CUDA testset is skipped"
    end
end
