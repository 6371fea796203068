# Device handling: "cpu" or "cuda". CUDA.jl 5.x defines everything used here in module `CUDA`;
# CUDA.jl 6.x moved the core into `CUDA.CUDACore` and forwards only public names, so internal
# names (pool_create, stream_ordered, name, ...) are looked up in whichever module holds them.

"""
    cuda_core() -> Module

`CUDA.CUDACore` on CUDA.jl 6, `CUDA` itself on CUDA.jl 5.
"""
cuda_core() = isdefined(CUDA, :CUDACore) ? getfield(CUDA, :CUDACore) : CUDA

"""
    cuda_functional() -> Bool

Whether CUDA.jl finds a usable GPU (driver, runtime and device).
"""
cuda_functional() = cuda_core().functional()

"""
    to_device(device::Symbol, a::AbstractArray)

`a` itself on `:cpu`; a `CuArray` copy on `:cuda`.
"""
to_device(device::Symbol, a::AbstractArray) = device === :cuda ? CUDA.CuArray(a) : a

"""
    cuda_native_rng()

CUDA.jl's task-local kernel-based generator (Philox2x32): `CUDA.cuRAND.native_rng()` (a
`cuRAND.NativeRNG`) on CUDA.jl 6, where `CUDA.default_rng()` was deprecated in 6.0 and returns
the GPUArrays generator from 6.1 on; `CUDA.default_rng()` (a `CUDA.RNG`, the same generator) on
CUDA.jl 5.
"""
function cuda_native_rng()
    if isdefined(CUDA, :cuRAND)
        curand = getfield(CUDA, :cuRAND)
        isdefined(curand, :native_rng) && return curand.native_rng()
    end
    return CUDA.default_rng()
end

"""
    dropout_rng(device::Symbol, seed::Integer)

The random number generator of the dropout layers (only used when the harness gives no masks):
`Random.Xoshiro(seed)` on the CPU; CUDA.jl's native GPU generator reseeded with `seed` on the
GPU (NNlib refuses a CPU RNG for a `CuArray`).
"""
function dropout_rng(device::Symbol, seed::Integer)
    device === :cuda || return Random.Xoshiro(seed)
    rng = cuda_native_rng()
    Random.seed!(rng, seed % UInt64)
    return rng
end

"""
    set_math_mode!(tf32::Bool)

`CUDA.DEFAULT_MATH` (no TF32: cuBLAS uses `CUBLAS_DEFAULT_MATH`) unless `tf32`, then
`CUDA.FAST_MATH` (cuBLAS `CUBLAS_TF32_TENSOR_OP_MATH`).
"""
function set_math_mode!(tf32::Bool)
    core = cuda_core()
    core.math_mode!(tf32 ? core.FAST_MATH : core.DEFAULT_MATH)
    return nothing
end

# The stream-ordered memory pool CUDA.jl allocates from, or `nothing` when pools are unsupported
# or disabled (JULIA_CUDA_MEMORY_POOL=none).
function cuda_pool()
    core = cuda_core()
    dev = core.device()
    core.stream_ordered(dev) || return nothing
    return core.pool_create(dev)
end

function pool_attribute(pool, attr::Symbol)
    core = cuda_core()
    return Int(core.attribute(UInt64, pool, getfield(core, attr)))
end

"""
    device_memory_stats(gc_every::Integer) -> Dict{String,Any}

Pool figures of the GPU: `peak_bytes` is the pool's MEMPOOL_ATTR_USED_MEM_HIGH, the high-water
mark of bytes handed out and not yet given back. Julia gives a `CuArray` back only when its
garbage collector finalizes it, so this counts live arrays plus garbage not yet collected; the
training step runs `GC.gc(false)` after every `gc_every`-th step (0: never, CUDA.jl's own
policy) so that at most that many steps of garbage are counted. torch's `max_memory_allocated`
counts live tensors only: the Flux figure is an upper bound of the same quantity.
`peak_reserved_bytes` is MEMPOOL_ATTR_RESERVED_MEM_HIGH (≈ `max_memory_reserved`).
"""
function device_memory_stats(gc_every::Integer)
    gc = gc_every > 0 ?
        "GC.gc(false) after every $(gc_every) training step(s)" :
        "no forced GC (CUDA.jl collects only under memory pressure)"
    pool = cuda_pool()
    pool === nothing &&
        return Dict{String, Any}(
            "kind" => "device",
            "peak_bytes" => nothing,
            "gc_every" => gc_every,
            "note" => "CUDA memory pool not in use; no peak figure",
        )
    return Dict{String, Any}(
        "kind" => "device",
        "peak_bytes" => pool_attribute(pool, :MEMPOOL_ATTR_USED_MEM_HIGH),
        "peak_reserved_bytes" => pool_attribute(pool, :MEMPOOL_ATTR_RESERVED_MEM_HIGH),
        "used_bytes" => pool_attribute(pool, :MEMPOOL_ATTR_USED_MEM_CURRENT),
        "reserved_bytes" => pool_attribute(pool, :MEMPOOL_ATTR_RESERVED_MEM_CURRENT),
        "gc_every" => gc_every,
        "peak_bytes_meaning" =>
            "high-water mark of CUDA.jl pool bytes in use: live arrays plus garbage " *
                "not yet collected by Julia's GC ($gc); an upper bound of the live-bytes " *
                "peak that torch.cuda.max_memory_allocated reports",
        "source" => "CUDA.jl memory pool (cuMemPoolGetAttribute)",
    )
end

function reset_device_peak!()
    pool = cuda_pool()
    pool === nothing && return nothing
    core = cuda_core()
    core.attribute!(pool, core.MEMPOOL_ATTR_USED_MEM_HIGH, UInt64(0))
    core.attribute!(pool, core.MEMPOOL_ATTR_RESERVED_MEM_HIGH, UInt64(0))
    return nothing
end

function device_synchronize(device::Symbol)
    device === :cuda && cuda_core().synchronize()
    return nothing
end

function device_description(device::Symbol)
    device === :cuda || return Dict{String, Any}("device" => "cpu", "math_mode" => "n/a")
    core = cuda_core()
    return Dict{String, Any}(
        "device" => core.name(core.device()),
        "math_mode" => string(core.math_mode()),
        "cuda_runtime" => string(core.runtime_version()),
        "cuda_driver" => string(core.driver_version()),
    )
end
