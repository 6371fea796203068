# The nanoGPT model in Flux's native layout: features × time × batch.
#
# Layout of every parameter (the "Flux layout" the Python bridge hands over):
#   Dense weights (out, in) as in PyTorch; Embedding weights (dim, vocab); wpe (dim, block_size);
#   LayerNorm weights and all biases are vectors. Without biases (nanoGPT's `bias = False`) a bias
#   field holds `false`, as Flux's `Dense(W, false)`.

"""
    add_bias(y, b)

`y .+ b` for a bias vector `b`; `y` itself when `b` is `false` (a layer without a bias).
"""
add_bias(y, b::AbstractVector) = y .+ b
add_bias(y, ::Bool) = y

"""
    LayerNorm(weight, bias)

LayerNorm over the first (feature) dimension with PyTorch's semantics, independent of the Flux
version: `(x - μ) / sqrt(σ² + 1f-5) * weight + bias`, with the biased variance σ² and `eps` added to
the variance. (Flux's own `LayerNorm` placed `eps` differently in 0.14, 0.15-0.16.10 and 0.16.11.)
`bias` is a vector, or `false` for no shift (nanoGPT's `LayerNorm(ndim, bias=False)`).
"""
struct LayerNorm{V <: AbstractVector, B}
    weight::V
    bias::B
end

Flux.@layer LayerNorm

const LN_EPS = 1.0f-5

function (ln::LayerNorm)(x::AbstractArray)
    μ = mean(x; dims = 1)
    xc = x .- μ
    σ² = mean(abs2.(xc); dims = 1)
    return add_bias(xc ./ sqrt.(σ² .+ LN_EPS) .* ln.weight, ln.bias)
end

"""
    maybe_dropout(d::Flux.Dropout, x)

Apply `d` only when it is switched on (`d.active === true`) and `d.p > 0`; otherwise return `x`
itself. Dropout with p = 0 is therefore exactly the identity, also inside a gradient (NNlib's
dropout rrule would still draw a mask there), and no random numbers are consumed.
"""
maybe_dropout(d::Flux.Dropout, x) = (d.active === true && d.p > 0) ? d(x) : x

"""
    KeepMask(keep, q)

A dropout keep-mask drawn by the harness (shared by every backend in parity mode): `keep` holds
1 (keep) or 0 (drop) for every entry of the activations it applies to, `q = 1 - p`.
"""
struct KeepMask{A <: AbstractArray, T <: Real}
    keep::A
    q::T
end

"""
    apply_dropout(d::Flux.Dropout, x, keep)

Dropout at one of the model's places. With a [`KeepMask`](@ref) it is inverted dropout with
exactly that mask, `x * keep / (1 - p)`, whether or not `d` is switched on; with `nothing` it is
[`maybe_dropout`](@ref)`(d, x)`, the model's own dropout.
"""
apply_dropout(d::Flux.Dropout, x, ::Nothing) = maybe_dropout(d, x)
apply_dropout(::Flux.Dropout, x, k::KeepMask) = x .* k.keep ./ k.q

"""
    CausalSelfAttention(c_attn, c_proj, attn_drop, drop, n_head)

Causal multi-head self-attention with one fused qkv `Dense(d => 3d)` whose output rows are split
`[q; k; v]` (PyTorch's `split(n_embd, dim=2)`), `NNlib.dot_product_attention` (scale 1/√head_dim,
head h owns feature rows (h-1)*hs+1:h*hs as PyTorch's `view(B, T, nh, hs)`), the output projection
`c_proj` and dropout `drop` after it. `attn_drop` drops attention probabilities (nanoGPT's
`attn_dropout`), as NNlib's `fdrop`: after the softmax, before the product with v; its `p` is 0
when the option is off.
"""
struct CausalSelfAttention{D1, D2, R}
    c_attn::D1
    c_proj::D2
    attn_drop::R
    drop::R
    n_head::Int
end

Flux.@layer CausalSelfAttention

function (a::CausalSelfAttention)(
    x::AbstractArray{<:Real, 3},
    mask::AbstractMatrix{Bool},
    keep = nothing,
    keep_probs = nothing,
)
    d = size(x, 1)
    qkv = a.c_attn(x)
    q = qkv[1:d, :, :]
    k = qkv[(d + 1):(2d), :, :]
    v = qkv[(2d + 1):(3d), :, :]
    # the probabilities α are (key, query, head, batch): the layout of the harness's keep_probs
    y, _ = NNlib.dot_product_attention(
        q,
        k,
        v;
        mask = mask,
        nheads = a.n_head,
        fdrop = α -> apply_dropout(a.attn_drop, α, keep_probs),
    )
    return apply_dropout(a.drop, a.c_proj(y), keep)
end

"""
    MLP(c_fc, c_proj, drop)

`Dense(d => d_h, gelu)` then `Dense(d_h => d)` then dropout, with `gelu` either `NNlib.gelu_tanh`
or the exact `NNlib.gelu_erf` (nanoGPT's `nn.GELU()`; it needs SpecialFunctions loaded, see
[`gelu_function`](@ref)).
"""
struct MLP{D1, D2, R}
    c_fc::D1
    c_proj::D2
    drop::R
end

Flux.@layer MLP

(m::MLP)(x::AbstractArray, keep = nothing) = apply_dropout(
    m.drop,
    m.c_proj(m.c_fc(x)),
    keep,
)

"""
    Block(ln_1, attn, ln_2, mlp)

Pre-LayerNorm transformer block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`. Called as
`block(x, mask, keeps)` with `keeps` either `nothing` (the layers' own dropout) or
`(probs = KeepMask or nothing, attn = KeepMask, mlp = KeepMask)`, the harness's masks for the
block's dropout places (`probs`: the attention probabilities, with attention dropout only).
"""
struct Block{L, A, M}
    ln_1::L
    attn::A
    ln_2::L
    mlp::M
end

Flux.@layer Block

function (b::Block)(
    x::AbstractArray{<:Real, 3},
    mask::AbstractMatrix{Bool},
    keeps = nothing,
)
    h = x .+
        b.attn(
            b.ln_1(x),
            mask,
            keeps === nothing ? nothing : keeps.attn,
            keeps === nothing ? nothing : keeps.probs,
        )
    return h .+ b.mlp(b.ln_2(h), keeps === nothing ? nothing : keeps.mlp)
end

"""
    TiedHead(bias)

The output layer of tied embeddings (nanoGPT's `wte.weight = lm_head.weight`): logits = wteᵀ h
(+ `bias`, a vector or `false`), with the token table itself as the weight, so Zygote adds the
gradients of both uses into the one array `wte.weight`.
"""
struct TiedHead{B}
    bias::B
end

Flux.@layer TiedHead

"""
    output_layer(head, wte, h)

The logits (V, T, B) of the final hidden states `h` (d, T, B): `head(h)` for an untied `Dense`
head; `wte.weight` transposed times `h`, plus the bias, for a [`TiedHead`](@ref).
"""
output_layer(head::Flux.Dense, ::Flux.Embedding, h::AbstractArray) = head(h)

function output_layer(head::TiedHead, wte::Flux.Embedding, h::AbstractArray)
    logits = transpose(wte.weight) * reshape(h, size(h, 1), :)
    return reshape(add_bias(logits, head.bias), :, size(h)[2:end]...)
end

"""
    GPT(wte, wpe, drop, blocks, ln_f, lm_head)

Token embedding (`Flux.Embedding`, weight (d, V)) plus the learned position table `wpe` (d, n),
dropout, the blocks (a `Tuple`), the final LayerNorm and the output layer: an untied `lm_head`
`Dense(d => V)` (with a bias or `false`) or a [`TiedHead`](@ref) that uses `wte`'s weight.
Called as `model(idx, mask)` with 1-based token ids `idx` (T, B) and the causal mask (T, T);
returns logits (V, T, B). `model(idx, mask, keeps)` applies the harness's dropout masks instead of
the layers' own dropout: `keeps = (emb = KeepMask, blocks = ((probs = …, attn = …, mlp = …), …))`
(see [`keep_masks`](@ref)).
"""
struct GPT{E, P, D, B <: Tuple, L, H}
    wte::E
    wpe::P
    drop::D
    blocks::B
    ln_f::L
    lm_head::H
end

Flux.@layer GPT

# The blocks in turn; `keeps` is `nothing` or a tuple with one entry per remaining block.
apply_blocks(::Tuple{}, x, mask, keeps) = x
apply_blocks(blocks::Tuple, x, mask, keeps) = apply_blocks(
    Base.tail(blocks),
    first(blocks)(x, mask, keeps === nothing ? nothing : first(keeps)),
    mask,
    keeps === nothing ? nothing : Base.tail(keeps),
)

function (m::GPT)(
    idx::AbstractMatrix{<:Integer},
    mask::AbstractMatrix{Bool},
    keeps = nothing,
)
    T = size(idx, 1)
    tok = m.wte(idx)
    pos = m.wpe[:, 1:T]
    x = apply_dropout(m.drop, tok .+ pos, keeps === nothing ? nothing : keeps.emb)
    x = apply_blocks(m.blocks, x, mask, keeps === nothing ? nothing : keeps.blocks)
    return output_layer(m.lm_head, m.wte, m.ln_f(x))
end

"""
    set_dropout!(m::GPT, active::Bool)

Switch every dropout layer of `m` on (training) or off (evaluation, gradients for parity).
"""
function set_dropout!(m::GPT, active::Bool)
    m.drop.active = active
    for b in m.blocks
        b.attn.attn_drop.active = active
        b.attn.drop.active = active
        b.mlp.drop.active = active
    end
    return m
end

"""
    causal_mask(T) -> Matrix{Bool}

`m[i, j] = i ≤ j`: key i is visible to query j (the same matrix as `NNlib.make_causal_mask`, whose
convention `true` = keep is what `dot_product_attention` expects).
"""
causal_mask(T::Integer) = Bool[i <= j for i in 1:T, j in 1:T]

"""
    loss(m, idx, onehot, mask, keeps = nothing) -> Float32

Mean cross-entropy over all T·B positions: `Flux.Losses.logitcrossentropy` of the (V, T, B) logits
against the (V, T, B) one-hot targets.
"""
loss(m::GPT, idx, onehot, mask, keeps = nothing) = Flux.Losses.logitcrossentropy(
    m(idx, mask, keeps),
    onehot,
)
