# The parts of a training step as closures, for `harness bench parts` (harness/core/parts.py, the Python bridge
# harness/backends/flux_parts.py): each part's forward made of the model's own layers, its backward the Zygote
# pullback of that forward.

"""
    qkv_heads(a::CausalSelfAttention, x) -> (q, k, v)

The fused qkv `Dense` of `a` on `x` (d, T, B), rows split `[q; k; v]`, each with its heads split
as NNlib's `dot_product_attention` splits them: (head_dim, n_head, T, B).
"""
function qkv_heads(a::CausalSelfAttention, x::AbstractArray)
    d = size(x, 1)
    qkv = a.c_attn(x)
    heads(r) = reshape(qkv[r, :, :], d ÷ a.n_head, a.n_head, size(x, 2), size(x, 3))
    return heads(1:d), heads((d + 1):(2d)), heads((2d + 1):(3d))
end

"""
    attend(a::CausalSelfAttention, α, v) -> y

The second half of NNlib's `dot_product_attention`: the probabilities `α` (T_key, T_query,
n_head, B) through `a`'s attention dropout, times the values `v` (head_dim, n_head, T, B), heads
joined: (d, T, B).
"""
function attend(a::CausalSelfAttention, α::AbstractArray, v::AbstractArray)
    dropped = apply_dropout(a.attn_drop, α, nothing)
    x = permutedims(NNlib.batched_mul(permutedims(v, (1, 3, 2, 4)), dropped), (1, 3, 2, 4))
    return reshape(x, :, size(x, 3), size(x, 4))
end

# The forwards of the parts, as functions of (layer, inputs...).
emb_forward(g::GPT, idx) = apply_dropout(
    g.drop,
    g.wte(idx) .+ g.wpe[:, 1:size(idx, 1)],
    nothing,
)
layer_forward(layer, x) = layer(x)
residual(::Nothing, x, branch) = x .+ branch
projection(a::CausalSelfAttention, y) = apply_dropout(a.drop, a.c_proj(y), nothing)
projection(p::MLP, a) = apply_dropout(p.drop, p.c_proj(a), nothing)
# c_fc carries the activation: the same weights without it give the part before it (as `taps`)
fc_forward(l::Flux.Dense, x) = Flux.Dense(l.weight, l.bias)(x)
act_forward(l::Flux.Dense, h) = l.σ.(h)
logits_forward(g::GPT, h) = output_layer(g.lm_head, g.wte, h)
loss_forward(::Nothing, logits, onehot) = Flux.Losses.logitcrossentropy(logits, onehot)

"""
    part_function(m::GPT, s::FluxState, kind::String, block::Integer, raw::AbstractVector)
        -> (layer, f, inputs)

Part `kind` (of block `block`, counted from 0; -1 for a part outside the blocks) of model `m` as
`f(layer, inputs...)`: `layer` holds the part's parameters (`nothing` for a part without), `inputs`
are the part's step-0 inputs `raw` (Flux layout; token ids (T, B) 1-based) on the device.
"""
function part_function(
    m::GPT,
    s::FluxState,
    kind::String,
    block::Integer,
    raw::AbstractVector,
)
    dev(a) = to_device(s.cfg.device, Array{Float32}(a))
    b = block >= 0 ? m.blocks[block + 1] : nothing
    x = kind in ("emb", "loss") ? nothing : dev(raw[1])
    kind == "emb" && return (m, emb_forward, (device_tokens(s, raw[1]),))
    kind in ("ln_1", "ln_2") && return (getfield(b, Symbol(kind)), layer_forward, (x,))
    kind == "ln_f" && return (m.ln_f, layer_forward, (x,))
    kind == "attn.qkv" && return (b.attn, qkv_heads, (x,))
    if kind == "attn.probs"
        mask = mask_for(s, size(x, 3))
        scores(::Nothing, q, k) = NNlib.dot_product_attention_scores(q, k; mask = mask)
        return (nothing, scores, (x, dev(raw[2])))
    end
    kind == "attn.y" && return (b.attn, attend, (x, dev(raw[2])))
    kind == "attn.proj" && return (b.attn, projection, (x,))
    kind in ("res1", "res2") && return (nothing, residual, (x, dev(raw[2])))
    kind == "mlp.fc" && return (b.mlp.c_fc, fc_forward, (x,))
    kind == "mlp.act" && return (b.mlp.c_fc, act_forward, (x,))
    kind == "mlp.proj" && return (b.mlp, projection, (x,))
    kind == "logits" && return (m, logits_forward, (x,))
    if kind == "loss"
        y = OneHotArrays.onehotbatch(device_tokens(s, raw[2]), 1:(s.cfg.vocab_size))
        return (nothing, loss_forward, (dev(raw[1]), y))
    end
    throw(ArgumentError("unknown part \"$kind\""))
end

# The part's inputs from the bridge: a Dict and its keys, in order, comma-separated.
inputs_of(names::AbstractString, arrays::AbstractDict) = Any[
    arrays[String(n)]
    for n in split(names, ",")
]

# A copy of the model with its dropout on, as in a training step: the parts never touch the model
# `train_step!` trains (which switches its dropout off after every step).
function training_copy(s::FluxState)
    m = deepcopy(s.model)
    set_dropout!(m, true)
    return m
end

"""
    part_forward(s::FluxState, kind, block, names, arrays) -> closure

The forward of a part (see [`part_function`](@ref)) on its step-0 inputs `arrays[name]` for each of
the comma-separated `names`, on a training copy of the model, as a closure of no arguments that
returns the part's output.
"""
function part_forward(
    s::FluxState,
    kind::AbstractString,
    block::Integer,
    names::AbstractString,
    arrays::AbstractDict,
)
    layer, f, xs = part_function(
        training_copy(s),
        s,
        String(kind),
        block,
        inputs_of(names, arrays),
    )
    return () -> f(layer, xs...)
end

# The step-0 gradient of output `name` on the device (a number for the loss).
function cotangent(s::FluxState, name::String, grads::AbstractDict)
    name == "loss" && return Float32(grads[name])
    return to_device(s.cfg.device, Array{Float32}(grads[name]))
end

"""
    part_backward(s::FluxState, kind, block, names, arrays, outputs, grads) -> closure

The backward of a part: the Zygote pullback of its forward (with respect to its layer and its
inputs), taken once, as a closure of no arguments that applies it to the step-0 gradients of the
part's outputs, `grads[name]` for each of the comma-separated `outputs` (a number for the loss).
"""
function part_backward(
    s::FluxState,
    kind::AbstractString,
    block::Integer,
    names::AbstractString,
    arrays::AbstractDict,
    outputs::AbstractString,
    grads::AbstractDict,
)
    layer, f, xs = part_function(
        training_copy(s),
        s,
        String(kind),
        block,
        inputs_of(names, arrays),
    )
    _, back = Zygote.pullback(f, layer, xs...)
    cts = Any[cotangent(s, String(n), grads) for n in split(outputs, ",")]
    ct = length(cts) == 1 ? cts[1] : Tuple(cts)
    return () -> back(ct)
end

"""
    optimizer_closure(s::FluxState, grads::AbstractDict) -> closure

Global-norm clipping and AdamW exactly as [`train_step!`](@ref) applies them, on copies of the
parameters and the optimizer state, with the step-0 gradients `grads` (Flux layout, by canonical
name), as a closure of no arguments (it returns the parameters it updates).
"""
function optimizer_closure(s::FluxState, grads::AbstractDict)
    params = Any[copy(p) for p in s.params]
    leaves = deepcopy(s.leaves)
    gs = Any[
        to_device(s.cfg.device, fetch_array(grads, spec.name, size(p)))
        for (spec, p) in zip(s.specs, s.params)
    ]
    function step()
        s.cfg.grad_clip > 0 && clip_global_norm!(gs, s.cfg.grad_clip)
        for i in eachindex(params, leaves, gs)
            Optimisers.update!(leaves[i], params[i], gs[i])
        end
        return params
    end
    return step
end
