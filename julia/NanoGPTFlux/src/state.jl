# The training state and the functions the Python bridge calls.

"""
Hyper-parameters read from the `cfg` dictionary passed to [`build`](@ref).
"""
struct Config
    vocab_size::Int
    n_embd::Int
    n_head::Int
    n_layer::Int
    block_size::Int
    d_hidden::Int
    dropout::Float64
    learning_rate::Float64
    weight_decay::Float64
    beta1::Float64
    beta2::Float64
    eps::Float64
    grad_clip::Float64
    seed::Int
    device::Symbol
    tf32::Bool
    decay::Union{Nothing, Set{String}}
    gc_every::Int
    tie_embeddings::Bool
    gelu::String
    bias::Bool
    lm_head_bias::Bool
    attn_dropout::Bool
end

# A value of `cfg` by its String key (or the same name as a Symbol), converted to `T`.
function cfg_value(cfg::AbstractDict, key::String, ::Type{T}, default = nothing) where {T}
    value = if haskey(cfg, key)
        cfg[key]
    elseif haskey(cfg, Symbol(key))
        cfg[Symbol(key)]
    else
        default
    end
    value === nothing && throw(ArgumentError("build: the config has no \"$key\""))
    return convert(T, value)
end

function parse_config(cfg::AbstractDict)
    device = lowercase(cfg_value(cfg, "device", String, "cpu"))
    device in ("cpu", "cuda") ||
        throw(ArgumentError("build: device must be \"cpu\" or \"cuda\", got \"$device\""))
    c = Config(
        cfg_value(cfg, "vocab_size", Int),
        cfg_value(cfg, "n_embd", Int),
        cfg_value(cfg, "n_head", Int),
        cfg_value(cfg, "n_layer", Int),
        cfg_value(cfg, "block_size", Int),
        cfg_value(cfg, "d_hidden", Int),
        cfg_value(cfg, "dropout", Float64),
        cfg_value(cfg, "learning_rate", Float64, 1.0e-3),
        cfg_value(cfg, "weight_decay", Float64),
        cfg_value(cfg, "beta1", Float64),
        cfg_value(cfg, "beta2", Float64),
        cfg_value(cfg, "eps", Float64),
        cfg_value(cfg, "grad_clip", Float64),
        cfg_value(cfg, "seed", Int),
        Symbol(device),
        cfg_value(cfg, "tf32", Bool, false),
        parse_decay(cfg_value(cfg, "decay", String, "")),
        cfg_value(cfg, "gc_every", Int, device == "cuda" ? 1 : 0),
        cfg_value(cfg, "tie_embeddings", Bool, false),
        cfg_value(cfg, "gelu", String, "tanh"),
        cfg_value(cfg, "bias", Bool, true),
        cfg_value(cfg, "lm_head_bias", Bool, true),
        cfg_value(cfg, "attn_dropout", Bool, false),
    )
    c.gelu in ("tanh", "exact") ||
        throw(ArgumentError("build: gelu must be \"tanh\" or \"exact\", got \"$(c.gelu)\""))
    c.n_embd % c.n_head == 0 ||
        throw(ArgumentError("build: n_head=$(c.n_head) does not divide n_embd=$(c.n_embd)"))
    0 <= c.dropout < 1 ||
        throw(ArgumentError("build: dropout must be in [0, 1), got $(c.dropout)"))
    c.gc_every >= 0 ||
        throw(ArgumentError("build: gc_every must be >= 0, got $(c.gc_every)"))
    return c
end

# "decay": the comma-separated names of the parameters AdamW decays (harness/core/weights.py decides);
# empty or absent: nanoGPT's rule, every parameter with two or more dimensions.
parse_decay(s::AbstractString) = isempty(strip(s)) ?
    nothing :
    Set{String}(strip(n) for n in split(s, ','))

"""
One parameter: its canonical name, where it lives in the model (and in a Zygote gradient of the
model), and its Flux-layout size.
"""
struct ParamSpec
    name::String
    path::Tuple
    shape::Tuple{Vararg{Int}}
end

"""
    param_specs(c::Config) -> Vector{ParamSpec}

Every parameter in the canonical order of `harness/core/weights.py`, with its Flux-layout size:
embedding tables transposed ((d, V), (d, block_size)), Dense weights (out, in), vectors unchanged.
The options leave parameters out as there: `bias = false` the biases of the blocks and `ln_f`,
`lm_head_bias = false` the head's bias, `tie_embeddings` the head's weight (it is `wte.weight`).
"""
function param_specs(c::Config)
    d, dh, V = c.n_embd, c.d_hidden, c.vocab_size
    specs = ParamSpec[
        ParamSpec("wte.weight", (:wte, :weight), (d, V)),
        ParamSpec("wpe.weight", (:wpe,), (d, c.block_size)),
    ]
    # a layer's weight, and its bias where it has one; `path` leads to the layer in the model
    function layer!(name, path, shape, bias)
        push!(specs, ParamSpec(name * ".weight", (path..., :weight), shape))
        bias && push!(specs, ParamSpec(name * ".bias", (path..., :bias), shape[1:1]))
        return nothing
    end
    for i in 1:c.n_layer
        p, blk = "h.$(i - 1).", (:blocks, i)
        layer!(p * "ln_1", (blk..., :ln_1), (d,), c.bias)
        layer!(p * "attn.c_attn", (blk..., :attn, :c_attn), (3d, d), c.bias)
        layer!(p * "attn.c_proj", (blk..., :attn, :c_proj), (d, d), c.bias)
        layer!(p * "ln_2", (blk..., :ln_2), (d,), c.bias)
        layer!(p * "mlp.c_fc", (blk..., :mlp, :c_fc), (dh, d), c.bias)
        layer!(p * "mlp.c_proj", (blk..., :mlp, :c_proj), (d, dh), c.bias)
    end
    layer!("ln_f", (:ln_f,), (d,), c.bias)
    c.tie_embeddings ||
        push!(specs, ParamSpec("lm_head.weight", (:lm_head, :weight), (V, d)))
    c.lm_head_bias && push!(specs, ParamSpec("lm_head.bias", (:lm_head, :bias), (V,)))
    return specs
end

"""
    getpath(x, path)

Follow `path` (field names and tuple indices) into a model or into its Zygote gradient;
`nothing` as soon as a branch is absent (no gradient reached it).
"""
function getpath(x, path::Tuple)
    for k in path
        x === nothing && return nothing
        x = k isa Symbol ? getproperty(x, k) : x[k]
    end
    return x
end

# `d[key]` as an Array of element type `T`, checked against the expected Flux-layout size.
function fetch_array(
    d::AbstractDict,
    key::String,
    shape::Tuple,
    ::Type{T} = Float32,
) where {T}
    haskey(d, key) || throw(ArgumentError("missing array \"$key\""))
    a = d[key]
    a isa AbstractArray || throw(ArgumentError("\"$key\" is a $(typeof(a)), not an array"))
    size(a) == shape ||
        throw(DimensionMismatch(
            "\"$key\": expected size $shape (Flux layout), got $(size(a))",
        ))
    return Array{T}(a)
end

"""
    gelu_function(c::Config)

The MLP's activation: `NNlib.gelu_tanh`, or for `gelu = "exact"` `NNlib.gelu_erf`, x Φ(x) with
`erf` (NNlib 0.9.28+ defines it, and its derivative `deriv_gelu_erf`, in the extension that
loading SpecialFunctions activates; this package imports SpecialFunctions for that).
"""
gelu_function(c::Config) = c.gelu == "exact" ? NNlib.gelu_erf : NNlib.gelu_tanh

function build_model(c::Config, arrays::AbstractDict, rng)
    dev(name) = to_device(c.device, arrays[name])
    # `false` for a layer without a bias, as Flux's `Dense(W, false)`
    bias(name, has) = has ? dev(name * ".bias") : false
    drop(p = c.dropout) = Flux.Dropout(p; rng = rng, active = false)
    dense(name, σ = identity) = Flux.Dense(dev(name * ".weight"), bias(name, c.bias), σ)
    layernorm(name) = LayerNorm(dev(name * ".weight"), bias(name, c.bias))
    head = if c.tie_embeddings
        TiedHead(bias("lm_head", c.lm_head_bias))
    else
        Flux.Dense(dev("lm_head.weight"), bias("lm_head", c.lm_head_bias))
    end
    blocks = ntuple(c.n_layer) do i
        p = "h.$(i - 1)."
        return Block(
            layernorm(p * "ln_1"),
            CausalSelfAttention(
                dense(p * "attn.c_attn"),
                dense(p * "attn.c_proj"),
                drop(c.attn_dropout ? c.dropout : 0.0), # p = 0: no attention dropout
                drop(),
                c.n_head,
            ),
            layernorm(p * "ln_2"),
            MLP(dense(p * "mlp.c_fc", gelu_function(c)), dense(p * "mlp.c_proj"), drop()),
        )
    end
    return GPT(
        Flux.Embedding(dev("wte.weight")),
        dev("wpe.weight"),
        drop(),
        blocks,
        layernorm("ln_f"),
        head,
    )
end

"""
    TorchAdamW(eta, beta, lambda, epsilon)

`torch.optim.AdamW` (single-tensor path, amsgrad off) as an Optimisers.jl rule, in the same order
of operations as torch and the NumPy oracle (harness/models/numpy_gpt.py `AdamW`). At step t (an
integer kept in the state, from 1):

    p *= 1 - eta * lambda                          decoupled decay (skipped when lambda == 0)
    m += (1 - β₁) (g - m)                          torch's lerp
    v  = β₂ v + (1 - β₂) g²
    p -= eta / (1 - β₁ᵗ) * m / (√v / √(1 - β₂ᵗ) + ϵ)

The bias corrections `1 - βᵗ` are computed in Float64 from the integer t, as torch and the oracle
do (Optimisers' own `AdamW` keeps βᵗ as a running product in the parameters' element type). The
hyper-parameters are Float64 fields, so `Optimisers.adjust!(leaf, eta)` rebuilds the rule with any
real `eta` (Optimisers >= 0.4.5 rebuilds it through `ConstructionBase.constructorof`).

`apply!` scales the parameter in place for the decay and returns the Adam step, which
`Optimisers.update!` subtracts (`x .= x .- step`): use it with `update!` only.
"""
struct TorchAdamW <: Optimisers.AbstractRule
    eta::Float64
    beta::Tuple{Float64, Float64}
    lambda::Float64
    epsilon::Float64
end

Optimisers.init(::TorchAdamW, x::AbstractArray) = (zero(x), zero(x), 0)

function Optimisers.apply!(o::TorchAdamW, state, x::AbstractArray{T}, dx) where {T}
    m, v, t = state
    t += 1
    β₁, β₂ = o.beta
    bias_correction1 = 1 - β₁^t # Float64, as torch's Python-float arithmetic
    bias_correction2_sqrt = sqrt(1 - β₂^t)
    step_size = o.eta / bias_correction1
    o.lambda != 0 && (x .*= T(1 - o.eta * o.lambda))
    m .+= T(1 - β₁) .* (dx .- m)
    v .= v .* T(β₂) .+ T(1 - β₂) .* dx .* dx
    step = T(step_size) .* (m ./ (sqrt.(v) ./ T(bias_correction2_sqrt) .+ T(o.epsilon)))
    return (m, v, t), step
end

"""
    decays(c::Config, spec::ParamSpec) -> Bool

Whether AdamW decays this parameter: listed in `c.decay` when the harness gave the list (from
harness/core/weights.py `decays`), else nanoGPT's rule (two or more dimensions).
"""
decays(c::Config, spec::ParamSpec) = c.decay === nothing ?
    length(spec.shape) >= 2 :
    spec.name in c.decay

"""
    adamw_rule(c::Config, decay::Bool) -> TorchAdamW

The AdamW rule of one parameter: weight decay `c.weight_decay` where `decay`, else none.
"""
adamw_rule(c::Config, decay::Bool) = TorchAdamW(
    c.learning_rate,
    (c.beta1, c.beta2),
    decay ? c.weight_decay : 0.0,
    c.eps,
)

"""
The state [`build`](@ref) returns: the model, its parameters (references into the model, in the
canonical order), one `Optimisers.Leaf` per parameter, the causal masks by sequence length and
the number of optimizer steps taken.
"""
mutable struct FluxState{M}
    model::M
    cfg::Config
    specs::Vector{ParamSpec}
    params::Vector{Any}
    leaves::Vector{Any}
    masks::Dict{Int, Any}
    step::Int
end

"""
    build(cfg::AbstractDict, params::AbstractDict; float_type = Float32) -> FluxState

`cfg` maps String keys (Symbols also accepted) to values: `vocab_size`, `n_embd`, `n_head`,
`n_layer`, `block_size`, `d_hidden` (Int); `dropout`, `weight_decay`, `beta1`, `beta2`, `eps`,
`grad_clip` (Real; `grad_clip` 0 disables clipping); `seed` (Int, dropout RNG); `device`
("cpu" or "cuda"); `tf32` (Bool, default false); `learning_rate` (optional, only the initial
`eta`: [`train_step!`](@ref) sets the rate of every step); `decay` (optional String, the
comma-separated names of the parameters AdamW decays; default: those with two or more
dimensions); `gc_every` (optional Int, `GC.gc(false)` after every `gc_every`-th training step on
CUDA so that the memory figures count little garbage; default 1 on CUDA, 0 = never); the model
options (harness/config/fields.py), each optional with the original model as default:
`tie_embeddings` (Bool, false: the output layer uses `wte.weight`, see [`TiedHead`](@ref)),
`gelu` ("tanh" or "exact", see [`gelu_function`](@ref)), `bias` (Bool, true: biases in the
blocks' Dense layers and LayerNorms and in `ln_f`), `lm_head_bias` (Bool, true) and
`attn_dropout` (Bool, false: dropout with probability `dropout` on the attention probabilities
too, nanoGPT's `attn_dropout`; see [`CausalSelfAttention`](@ref)).
`params` must hold exactly the parameters these options leave ([`param_specs`](@ref)).

`params` maps every canonical name (e.g. "h.0.attn.c_attn.weight") to an array already in the
Flux layout; the arrays are copied (as Float32) and moved to the device.

`float_type = Float64` builds the same model in double precision: the package's tests use it to
compare with the float64 NumPy oracle and for finite differences. The Python bridge always
uses Float32, and [`parameters`](@ref) and [`gradients`](@ref) return Float32 copies.
"""
function build(
    cfg::AbstractDict,
    params::AbstractDict;
    float_type::Type{<:AbstractFloat} = Float32,
)
    c = parse_config(cfg)
    if c.device === :cuda
        cuda_functional() ||
            throw(ArgumentError(
                "device \"cuda\" requested but CUDA.jl finds no usable GPU (CUDA.functional() is false)",
            ))
        set_math_mode!(c.tf32)
    end
    specs = param_specs(c)
    known = Set(spec.name for spec in specs)
    unknown = sort!([string(k) for k in keys(params) if !(string(k) in known)])
    isempty(unknown) ||
        throw(ArgumentError("build: unknown parameter(s) $(join(unknown, ", "))"))
    c.decay === nothing ||
        issubset(c.decay, known) ||
        throw(ArgumentError(
            "build: \"decay\" names unknown parameter(s) $(join(sort!(collect(setdiff(c.decay, known))), ", "))",
        ))
    arrays = Dict{String, Array{float_type}}(
        spec.name => fetch_array(params, spec.name, spec.shape, float_type)
        for spec in specs
    )
    model = build_model(c, arrays, dropout_rng(c.device, c.seed))
    plist = Any[getpath(model, spec.path) for spec in specs]
    leaves = Any[
        Optimisers.setup(adamw_rule(c, decays(c, spec)), p)
        for (spec, p) in zip(specs, plist)
    ]
    return FluxState(model, c, specs, plist, leaves, Dict{Int, Any}(), 0)
end

# Token ids (T, B), 1-based, checked and moved to the device.
function device_tokens(s::FluxState, x::AbstractMatrix{<:Integer})
    xi = Matrix{Int}(x)
    T = size(xi, 1)
    1 <= T <= s.cfg.block_size ||
        throw(ArgumentError(
            "sequence length $T is outside 1:$(s.cfg.block_size) (block_size); tokens are (T, B)",
        ))
    lo, hi = extrema(xi)
    1 <= lo && hi <= s.cfg.vocab_size ||
        throw(ArgumentError(
            "token ids must be 1-based in 1:$(s.cfg.vocab_size), got ids in $lo:$hi",
        ))
    return to_device(s.cfg.device, xi)
end

# The causal mask of length T, built once per length and kept on the device.
mask_for(s::FluxState, T::Int) = get!(
    () -> to_device(s.cfg.device, causal_mask(T)),
    s.masks,
    T,
)

function device_batch(
    s::FluxState,
    x::AbstractMatrix{<:Integer},
    y::AbstractMatrix{<:Integer},
)
    size(x) == size(y) || throw(DimensionMismatch("x is $(size(x)) but y is $(size(y))"))
    idx = device_tokens(s, x)
    onehot = OneHotArrays.onehotbatch(device_tokens(s, y), 1:(s.cfg.vocab_size))
    return idx, onehot, mask_for(s, size(idx, 1))
end

# A gradient as a dense array of the parameter's type (zeros where AD found none).
dense_grad(::Nothing, p) = zero(p)
dense_grad(g::DenseArray, p) = g
dense_grad(g::AbstractArray, p) = copyto!(similar(p), g)

collect_grads(s::FluxState, g) = Any[
    dense_grad(getpath(g, spec.path), p)
    for (spec, p) in zip(s.specs, s.params)
]

"""
    clip_global_norm!(grads, max_norm) -> AbstractVector

`torch.nn.utils.clip_grad_norm_`: total = ‖(‖g₁‖, ‖g₂‖, …)‖₂; every gradient is scaled in place by
min(1, max_norm / (total + 1e-6)) (also when that is 1, as torch). The norms, the total and the
coefficient stay one-element arrays on the gradients' device (reductions with `dims`), so
clipping never waits for the GPU. Returns the total norm before clipping as such an array.
"""
function clip_global_norm!(grads::AbstractVector, max_norm::Real)
    # ‖g‖ of each gradient as a one-element vector: sum with `dims` keeps the result on the device
    norms = [sqrt.(vec(sum(abs2, g; dims = 1:ndims(g)))) for g in grads]
    total = sqrt.(sum(n -> abs2.(n), norms))
    T = eltype(total)
    coef = min.(T(max_norm) ./ (total .+ T(1.0e-6)), one(T))
    for g in grads
        g .*= coef # a one-element vector broadcasts over any shape
    end
    return total
end

"""
    keep_masks(c::Config, masks::AbstractDict, T::Integer, B::Integer)

The harness's dropout keep-masks as the model takes them (see `GPT`): `masks` maps "emb",
"h.{i}.attn" and "h.{i}.mlp" (i from 0) to Bool (or 0/1) arrays of size (n_embd, T, B), the Flux
layout of the harness's (B, T, n_embd) masks, and with attention dropout (`c.attn_dropout` and
`c.dropout > 0`) "h.{i}.attn.probs" to arrays of size (T, T, n_head, B), (key, query, head,
batch): NNlib's layout of the attention probabilities, the harness's (B, n_head, T, T) reversed.
They are copied to the device as Float32 0/1 arrays, with q = 1 - dropout (Float32).
"""
function keep_masks(c::Config, masks::AbstractDict, T::Integer, B::Integer)
    probs = c.attn_dropout && c.dropout > 0 # the attention sites exist
    sites = probs ? ("attn.probs", "attn", "mlp") : ("attn", "mlp")
    expected = ["emb"; ["h.$(i - 1).$(site)" for i in 1:(c.n_layer) for site in sites]]
    unknown = sort!([string(k) for k in keys(masks) if !(string(k) in expected)])
    isempty(unknown) ||
        throw(ArgumentError("unknown dropout mask(s) $(join(unknown, ", "))"))
    q = Float32(1 - c.dropout)
    function keep(key, shape = (c.n_embd, T, B))
        a = fetch_array(masks, key, shape)
        all(v -> v == 0 || v == 1, a) ||
            throw(ArgumentError("dropout mask \"$key\" has entries other than 0 and 1"))
        return KeepMask(to_device(c.device, a), q)
    end
    keep_probs(i) = probs ? keep("h.$(i - 1).attn.probs", (T, T, c.n_head, B)) : nothing
    blocks = ntuple(
        i -> (
            probs = keep_probs(i),
            attn = keep("h.$(i - 1).attn"),
            mlp = keep("h.$(i - 1).mlp"),
        ),
        c.n_layer,
    )
    return (emb = keep("emb"), blocks = blocks)
end

keeps_for(::FluxState, ::Nothing, idx) = nothing
keeps_for(s::FluxState, masks::AbstractDict, idx) = keep_masks(s.cfg, masks, size(idx)...)

function step!(s::FluxState, idx, onehot, mask, lr::Real, keeps)
    model = s.model
    keeps === nothing && set_dropout!(model, true) # given masks replace the layers' dropout
    res = try
        Zygote.withgradient(m -> loss(m, idx, onehot, mask, keeps), model)
    finally
        set_dropout!(model, false)
    end
    grads = collect_grads(s, res.grad[1])
    s.cfg.grad_clip > 0 && clip_global_norm!(grads, s.cfg.grad_clip)
    eta = Float64(lr) # the rule's field type; Optimisers >= 0.4.5 rebuilds the rule with it
    for i in eachindex(s.params, s.leaves, grads)
        Optimisers.adjust!(s.leaves[i], eta)
        Optimisers.update!(s.leaves[i], s.params[i], grads[i])
    end
    s.step += 1
    s.cfg.device === :cuda &&
        s.cfg.gc_every > 0 &&
        s.step % s.cfg.gc_every == 0 &&
        GC.gc(false)
    return Float32(res.val)
end

"""
    train_step!(s::FluxState, x, y, lr::Real, masks = nothing) -> Float32

One training step on the batch `x`, `y` (integer (T, B) matrices of 1-based token ids): forward
and backward with dropout (the harness's `masks`, see [`keep_masks`](@ref), else the model's own
dropout), global-norm clipping when `grad_clip > 0`, then AdamW ([`TorchAdamW`](@ref)) with
learning rate `lr` (set on every leaf with `Optimisers.adjust!`, which keeps each leaf's λ).
Returns the loss of the batch before the update.
"""
function train_step!(
    s::FluxState,
    x::AbstractMatrix{<:Integer},
    y::AbstractMatrix{<:Integer},
    lr::Real,
    masks::Union{Nothing, AbstractDict} = nothing,
)
    idx, onehot, mask = device_batch(s, x, y)
    return step!(s, idx, onehot, mask, lr, keeps_for(s, masks, idx))
end

"""
    eval_loss(s::FluxState, x, y) -> Float32

Mean cross-entropy with dropout off, no gradient.
"""
function eval_loss(s::FluxState, x::AbstractMatrix{<:Integer}, y::AbstractMatrix{<:Integer})
    idx, onehot, mask = device_batch(s, x, y)
    return Float32(loss(s.model, idx, onehot, mask))
end

"""
    logits(s::FluxState, x) -> Array{Float32,3}

Logits (V, T, B) of the (T, B) token ids `x`, dropout off, as a CPU `Array`.
"""
function logits(s::FluxState, x::AbstractMatrix{<:Integer})
    idx = device_tokens(s, x)
    return Array(s.model(idx, mask_for(s, size(idx, 1))))
end

"""
    gradients(s::FluxState, x, y, masks = nothing) -> Dict{String,Array{Float32}}

Gradients of the mean loss by canonical name, Flux layout, no clipping, no update; dropout off,
or with exactly the harness's `masks` (see [`keep_masks`](@ref)).
"""
function gradients(
    s::FluxState,
    x::AbstractMatrix{<:Integer},
    y::AbstractMatrix{<:Integer},
    masks::Union{Nothing, AbstractDict} = nothing,
)
    idx, onehot, mask = device_batch(s, x, y)
    keeps = keeps_for(s, masks, idx)
    g = Zygote.gradient(m -> loss(m, idx, onehot, mask, keeps), s.model)[1]
    grads = collect_grads(s, g)
    return Dict{String, Array{Float32}}(
        spec.name => Array(gi)
        for (spec, gi) in zip(s.specs, grads)
    )
end

"""
    parameters(s::FluxState) -> Dict{String,Array{Float32}}

Current parameters by canonical name, Flux layout, CPU copies.
"""
parameters(s::FluxState) = Dict{String, Array{Float32}}(
    spec.name => Array(p)
    for (spec, p) in zip(s.specs, s.params)
)

"""
    load_parameters!(s::FluxState, params::AbstractDict)

Overwrite every parameter in place from Flux-layout arrays (by canonical name).
"""
function load_parameters!(s::FluxState, params::AbstractDict)
    for (spec, p) in zip(s.specs, s.params)
        copyto!(p, fetch_array(params, spec.name, spec.shape))
    end
    return nothing
end

"""
    opt_state(s::FluxState) -> Dict{String,Any}

AdamW state: "adam_m/<name>" and "adam_v/<name>" (first and second moments, Flux layout, CPU
arrays) and "adam_t" (number of steps taken).
"""
function opt_state(s::FluxState)
    d = Dict{String, Any}("adam_t" => s.step)
    for (spec, leaf) in zip(s.specs, s.leaves)
        m, v, _ = leaf.state
        d["adam_m/" * spec.name] = Array(m)
        d["adam_v/" * spec.name] = Array(v)
    end
    return d
end

"""
    load_opt_state!(s::FluxState, d::AbstractDict)

Restore what [`opt_state`](@ref) returned (moments copied in place, the step count of every
leaf's [`TorchAdamW`](@ref) state set from "adam_t").
"""
function load_opt_state!(s::FluxState, d::AbstractDict)
    haskey(d, "adam_t") || throw(ArgumentError("missing \"adam_t\""))
    t = Int(d["adam_t"])
    t >= 0 || throw(ArgumentError("adam_t must be >= 0, got $t"))
    for (spec, leaf) in zip(s.specs, s.leaves)
        m, v, _ = leaf.state
        copyto!(m, fetch_array(d, "adam_m/" * spec.name, spec.shape))
        copyto!(v, fetch_array(d, "adam_v/" * spec.name, spec.shape))
        leaf.state = (m, v, t)
    end
    s.step = t
    return nothing
end

"""
    memory_stats(s::FluxState) -> Dict{String,Any}

On CUDA the memory pool's figures (`peak_bytes` = MEMPOOL_ATTR_USED_MEM_HIGH, live arrays plus
uncollected garbage, with the forced-GC period `gc_every` and what the figure means; see
`device_memory_stats` and [`reset_peak!`](@ref)); on the CPU the peak resident set size of the whole process
(`Sys.maxrss()`, Python included, cannot be reset).
"""
function memory_stats(s::FluxState)
    s.cfg.device === :cuda && return device_memory_stats(s.cfg.gc_every)
    return Dict{String, Any}(
        "kind" => "rss",
        "peak_bytes" => Int(Sys.maxrss()),
        "source" => "Sys.maxrss() of the whole process",
    )
end

"""
    reset_peak!(s::FluxState)

Reset the CUDA pool's high-water marks (no-op on the CPU).
"""
function reset_peak!(s::FluxState)
    s.cfg.device === :cuda && reset_device_peak!()
    return nothing
end

"""
    synchronize(s::FluxState)

Wait for queued GPU work (`CUDA.synchronize()`); no-op on the CPU.
"""
synchronize(s::FluxState) = device_synchronize(s.cfg.device)

"""
    compile_time() -> Dict{String,Any}

Julia's cumulative compilation and recompilation time in seconds
(`Base.cumulative_compile_time_ns()`), counted only while timing is enabled
(`Base.cumulative_compile_timing(true)`, which the Python bridge calls before loading this package).
"""
function compile_time()
    comp, recomp = Base.cumulative_compile_time_ns()
    return Dict{String, Any}(
        "compile_time_s" => comp / 1.0e9,
        "recompile_time_s" => recomp / 1.0e9,
    )
end

"""
    describe(s::FluxState) -> Dict{String,Any}

Versions (Julia, Flux, NNlib, Optimisers, Zygote, OneHotArrays, CUDA, cuDNN, SpecialFunctions), device name, CUDA
math mode, dtype, thread counts and the compile time so far.
"""
function describe(s::FluxState)
    d = Dict{String, Any}(
        "framework" => "Flux.jl",
        "julia" => string(VERSION),
        "Flux" => string(pkgversion(Flux)),
        "NNlib" => string(pkgversion(NNlib)),
        "Optimisers" => string(pkgversion(Optimisers)),
        "Zygote" => string(pkgversion(Zygote)),
        "OneHotArrays" => string(pkgversion(OneHotArrays)),
        "CUDA" => string(pkgversion(CUDA)),
        "cuDNN" => string(pkgversion(cuDNN)),
        "SpecialFunctions" => string(pkgversion(SpecialFunctions)),
        "dtype" => "float32",
        "tf32" => s.cfg.tf32,
        "julia_threads" => Threads.nthreads(),
        "blas_threads" => LinearAlgebra.BLAS.get_num_threads(),
    )
    merge!(d, device_description(s.cfg.device), compile_time())
    return d
end
