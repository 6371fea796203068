# Activation taps: the named intermediate tensors of the forward pass (harness/core/taps.py), for parity's depth 0.

"""
    tap_keeps(c::Config, masks) -> function (key, shape) -> KeepMask or nothing

The harness's keep-masks the taps are taken with, as a function of a dropout site's key and its
Flux-layout size: a [`KeepMask`](@ref) for a site `masks` has, `nothing` (dropout off there) for
one it has not or when `masks` is `nothing`. `masks` may hold any of the sites of
[`keep_masks`](@ref), in its layouts; parity hands the attention probabilities' step-0 masks
("h.{i}.attn.probs", (T_key, T_query, heads, B)) of a model with attention dropout.
"""
function tap_keeps(c::Config, masks::Union{Nothing, AbstractDict})
    masks === nothing && return (key, shape) -> nothing
    probs = c.attn_dropout && c.dropout > 0 # the attention sites exist
    sites = probs ? ("attn.probs", "attn", "mlp") : ("attn", "mlp")
    known = ["emb"; ["h.$(i - 1).$(site)" for i in 1:(c.n_layer) for site in sites]]
    unknown = sort!([string(k) for k in keys(masks) if !(string(k) in known)])
    isempty(unknown) ||
        throw(ArgumentError("unknown dropout mask(s) $(join(unknown, ", "))"))
    q = Float32(1 - c.dropout)
    function site_keep(key, shape)
        haskey(masks, key) || return nothing
        a = fetch_array(masks, key, shape)
        all(v -> v == 0 || v == 1, a) ||
            throw(ArgumentError("dropout mask \"$key\" has entries other than 0 and 1"))
        return KeepMask(to_device(c.device, a), q)
    end
    return site_keep
end

"""
    taps(s::FluxState, x, masks = nothing) -> Dict{String,Array{Float32}}

The named intermediate activations of the forward pass of the (T, B) 1-based token ids `x`,
each computed by the model's own layers (the same `wte`, `wpe`, LayerNorms, `Dense` layers,
`NNlib.dot_product_attention` call and dropout as [`GPT`](@ref)), as CPU arrays in Flux's layout
(features first); the Python bridge converts them (`harness/backends/flux_layout.py`
`taps_from_flux`). Dropout is off, except at the sites of the harness's `masks` (see
[`tap_keeps`](@ref)): there exactly those masks apply, as in [`gradients`](@ref).

- "emb" (C, T, B): `wte(x) .+ wpe[:, 1:T]`, before dropout;
- per block i (from 0): "h.i.ln_1", "h.i.attn.y", "h.i.attn.proj", "h.i.res1", "h.i.ln_2",
  "h.i.mlp.proj", "h.i.res2" (C, T, B); "h.i.attn.q", "h.i.attn.k", "h.i.attn.v" as NNlib splits
  the heads, (head_dim, heads, T, B); "h.i.attn.probs", the softmax NNlib returns as its attention
  scores before the dropout, (T_key, T_query, heads, B) ("h.i.attn.y" is the dropped ones times
  v); "h.i.mlp.fc" (before the activation) and "h.i.mlp.act" (d_hidden, T, B);
- "ln_f" (C, T, B) and "logits" (V, T, B).
"""
function taps(
    s::FluxState,
    x::AbstractMatrix{<:Integer},
    masks::Union{Nothing, AbstractDict} = nothing,
)
    m = s.model
    idx = device_tokens(s, x)
    T, B = size(idx)
    mask = mask_for(s, T)
    site_keep = tap_keeps(s.cfg, masks)
    out = Dict{String, Array{Float32}}()
    function keep!(name, a)
        out[name] = Array(a)
        return a
    end
    d = size(m.wpe, 1)
    emb = keep!("emb", m.wte(idx) .+ m.wpe[:, 1:T])
    h = apply_dropout(m.drop, emb, site_keep("emb", (d, T, B)))
    for (i, b) in enumerate(m.blocks)
        p = "h.$(i - 1)."
        attn, mlp = b.attn, b.mlp
        hs = d ÷ attn.n_head
        n = keep!(p * "ln_1", b.ln_1(h))
        qkv = attn.c_attn(n)
        q = qkv[1:d, :, :]
        k = qkv[(d + 1):(2d), :, :]
        v = qkv[(2d + 1):(3d), :, :]
        for (name, a) in (("q", q), ("k", k), ("v", v))
            # the heads as NNlib's split_heads makes them
            keep!(p * "attn." * name, reshape(a, hs, attn.n_head, T, B))
        end
        # NNlib hands fdrop the softmax and multiplies v by what fdrop returns: the tap is the
        # probabilities before the dropout, y the dropped ones times v (the model's own call)
        kp = site_keep(p * "attn.probs", (T, T, attn.n_head, B))
        fdrop = α -> apply_dropout(attn.attn_drop, keep!(p * "attn.probs", α), kp)
        y, _ = NNlib.dot_product_attention(
            q,
            k,
            v;
            mask = mask,
            nheads = attn.n_head,
            fdrop = fdrop,
        )
        keep!(p * "attn.y", y)
        proj = keep!(p * "attn.proj", attn.c_proj(y))
        h = keep!(
            p * "res1",
            h .+ apply_dropout(attn.drop, proj, site_keep(p * "attn", (d, T, B))),
        )
        n = keep!(p * "ln_2", b.ln_2(h))
        # c_fc carries the activation: the same weights without it give the pre-activation
        keep!(p * "mlp.fc", Flux.Dense(mlp.c_fc.weight, mlp.c_fc.bias)(n))
        a = keep!(p * "mlp.act", mlp.c_fc(n))
        proj = keep!(p * "mlp.proj", mlp.c_proj(a))
        h = keep!(
            p * "res2",
            h .+ apply_dropout(mlp.drop, proj, site_keep(p * "mlp", (d, T, B))),
        )
    end
    keep!("logits", output_layer(m.lm_head, m.wte, keep!("ln_f", m.ln_f(h))))
    return out
end
