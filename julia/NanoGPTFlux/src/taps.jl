# Activation taps: the named intermediate tensors of the forward pass (harness/taps.py), for parity's depth 0.

"""
    taps(s::FluxState, x) -> Dict{String,Array{Float32}}

The named intermediate activations of the forward pass of the (T, B) 1-based token ids `x`,
dropout off, each computed by the model's own layers (the same `wte`, `wpe`, LayerNorms, `Dense`
layers and `NNlib.dot_product_attention` call as [`GPT`](@ref)), as CPU arrays in Flux's layout
(features first); the Python bridge converts them (`harness/backends/flux_layout.py`
`taps_from_flux`):

- "emb" (C, T, B): `wte(x) .+ wpe[:, 1:T]`, before dropout;
- per block i (from 0): "h.i.ln_1", "h.i.attn.y", "h.i.attn.proj", "h.i.res1", "h.i.ln_2",
  "h.i.mlp.proj", "h.i.res2" (C, T, B); "h.i.attn.q", "h.i.attn.k", "h.i.attn.v" as NNlib splits
  the heads, (head_dim, heads, T, B); "h.i.attn.probs", the softmax NNlib returns as its attention
  scores, (T_key, T_query, heads, B); "h.i.mlp.fc" (before the activation) and "h.i.mlp.act"
  (d_hidden, T, B);
- "ln_f" (C, T, B) and "logits" (V, T, B).
"""
function taps(s::FluxState, x::AbstractMatrix{<:Integer})
    m = s.model
    idx = device_tokens(s, x)
    T, B = size(idx)
    mask = mask_for(s, T)
    out = Dict{String, Array{Float32}}()
    function keep!(name, a)
        out[name] = Array(a)
        return a
    end
    h = keep!("emb", m.wte(idx) .+ m.wpe[:, 1:T])
    for (i, b) in enumerate(m.blocks)
        p = "h.$(i - 1)."
        attn, mlp = b.attn, b.mlp
        d = size(h, 1)
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
        y, α = NNlib.dot_product_attention(q, k, v; mask = mask, nheads = attn.n_head)
        keep!(p * "attn.probs", α)
        keep!(p * "attn.y", y)
        h = keep!(p * "res1", h .+ keep!(p * "attn.proj", attn.c_proj(y)))
        n = keep!(p * "ln_2", b.ln_2(h))
        # c_fc carries the activation: the same weights without it give the pre-activation
        keep!(p * "mlp.fc", Flux.Dense(mlp.c_fc.weight, mlp.c_fc.bias)(n))
        a = keep!(p * "mlp.act", mlp.c_fc(n))
        h = keep!(p * "res2", h .+ keep!(p * "mlp.proj", mlp.c_proj(a)))
    end
    keep!("logits", output_layer(m.lm_head, m.wte, keep!("ln_f", m.ln_f(h))))
    return out
end
