"""
    NanoGPTFlux

The character-level nanoGPT of nanogpt-parity in Flux.jl, driven from Python through juliacall.
Everything is Float32; arrays cross the boundary in the "Flux layout" (Dense weights (out, in),
embedding tables (dim, rows), vectors unchanged) and token ids as 1-based (T, B) integer matrices.

Entry points (see their docstrings): [`build`](@ref), [`train_step!`](@ref), [`eval_loss`](@ref),
[`logits`](@ref), [`gradients`](@ref), [`parameters`](@ref), [`load_parameters!`](@ref),
[`opt_state`](@ref), [`load_opt_state!`](@ref), [`memory_stats`](@ref), [`reset_peak!`](@ref),
[`describe`](@ref), [`synchronize`](@ref), [`compile_time`](@ref), [`taps`](@ref); for
`harness bench parts` [`part_forward`](@ref), [`part_backward`](@ref), [`optimizer_closure`](@ref).
"""
module NanoGPTFlux

import CUDA
import cuDNN # loaded for NNlib's cuDNN extension (GPU softmax); MLDataDevices wants both
import Flux
import LinearAlgebra
import NNlib
import OneHotArrays
import Optimisers
import Random
import SpecialFunctions # loaded for NNlib's SpecialFunctions extension: NNlib.gelu_erf (exact GELU)
import Zygote
using Statistics: mean

export build,
    train_step!,
    eval_loss,
    logits,
    gradients,
    parameters,
    load_parameters!,
    opt_state,
    load_opt_state!,
    memory_stats,
    reset_peak!,
    describe,
    synchronize,
    compile_time,
    taps,
    part_forward,
    part_backward,
    optimizer_closure

include("layers.jl")
include("devices.jl")
include("state.jl")
include("taps.jl")
include("parts.jl")

end # module NanoGPTFlux
