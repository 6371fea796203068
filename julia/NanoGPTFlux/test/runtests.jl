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
        @test NG.clip_global_norm!(grads, max_norm) ≈ total rtol = 1.0e-5
        @test sqrt(sum(sum(abs2, Float64.(a)) for a in grads)) ≈ max_norm rtol = 1.0e-4
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
            reset_peak!(s_gpu)
            @test memory_stats(s_gpu)["kind"] == "device"
            @test describe(s_gpu)["math_mode"] == "DEFAULT_MATH"
        end
    else
        @info "CUDA.jl finds no GPU: the CUDA testset is skipped"
    end
end
