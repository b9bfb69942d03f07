"""What a replica needs: memory (weights + KV cache at the profile's context + a stated overhead), and the CPU
cores its engine's threads take."""

from ground.engines import cores_taken

MIB = 1024**2
# llama.cpp's compute buffers, the HTTP server, the runtime: measured ~60-110 MiB for small models on CPU.
OVERHEAD_BYTES = 128 * MIB
OVERHEAD_FRACTION = 0.05  # plus 5 % of the weights for larger models' scratch buffers
KV_BYTES_PER_ELEMENT = 2  # f16 K and V cache, llama.cpp's default


def kv_cache_bytes(gguf: dict, context_size: int) -> int:
    layers = int(gguf.get("block_count") or 0)
    heads = int(gguf.get("head_count") or 0)
    kv_heads = int(gguf.get("head_count_kv") or heads or 0)
    embedding = int(gguf.get("embedding_length") or 0)
    if not (layers and heads and embedding):
        return 0
    key_len = int(gguf.get("key_length") or embedding // heads)
    value_len = int(gguf.get("value_length") or embedding // heads)
    context = min(int(context_size), int(gguf.get("context_length") or context_size)) if context_size else 0
    return layers * context * kv_heads * (key_len + value_len) * KV_BYTES_PER_ELEMENT


def estimate(file_size: int, gguf: dict, context_size: int) -> int:
    weights = int(file_size)
    return weights + kv_cache_bytes(gguf or {}, context_size) + OVERHEAD_BYTES + int(weights * OVERHEAD_FRACTION)


def replica_threads(snapshot: dict | None) -> int:
    """The CPU cores a placed replica takes: the threads it was started with (its snapshot), else its engine's
    default."""
    snapshot = snapshot if isinstance(snapshot, dict) else {}
    args, engine = snapshot.get("args"), snapshot.get("engine")
    threads = args.get("threads") if isinstance(args, dict) else None
    if threads is not None and not isinstance(threads, int):
        threads = None  # not a number a profile could hold: the engine's default
    kind = engine.get("kind") if isinstance(engine, dict) else None
    return cores_taken(str(kind or ""), threads)
