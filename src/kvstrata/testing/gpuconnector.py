"""``kvstrata selftest gpu``'s connector-stream check: host-mode loads under compute.

The connector's CUDA loads (:class:`~kvstrata.connector.device.CudaCopies`)
run on its own stream while vLLM computes on its current one: the copy
stream first waits for what vLLM queued, and vLLM's stream waits for the
whole load before anything it queues after ``start_load_kv`` (a replayed
FULL graph included, where no layer hook runs). Here a long run of matrix
products stands for vLLM's queued compute, a chunk is scattered from
pinned memory, and "attention" reads every layer's blocks on the compute
stream right after, with no further wait. What it read must be what the
blocks finally hold, and not the poison under them: a read that ran ahead
of the copies would see the poison.
"""

from __future__ import annotations

from kvstrata.testing.gpuipc import CheckFailed

POISON = 0x5A
LAYERS, BLOCKS, PER_CHUNK = 8, 16, 4
COMPUTE_STEPS = 24  # matrix products of 4096 x 4096 queued before the load


def _run() -> int:
    import torch

    from kvstrata.connector.device import CudaCopies
    from kvstrata.connector.layout import detect_layout
    from kvstrata.testing.kvlayouts import layout_to_check, vllm_layers

    device = torch.device("cuda", torch.cuda.current_device())
    case = vllm_layers("LBNHC", num_layers=LAYERS, num_blocks=BLOCKS, device="cuda", seed=3)
    layout = detect_layout(
        case.layers,
        kv_cache_layout=layout_to_check("LBNHC"),
        block_dim=0,
        blocks_per_chunk=PER_CHUNK,
    )
    source = vllm_layers("LBNHC", num_layers=LAYERS, num_blocks=BLOCKS, device="cuda", seed=4)
    ids = [9, 2, 14, 5]
    chunk = torch.empty(layout.chunk_nbytes, dtype=torch.uint8, device="cuda")
    detect_layout(
        source.layers,
        kv_cache_layout=layout_to_check("LBNHC"),
        block_dim=0,
        blocks_per_chunk=PER_CHUNK,
    ).gather([1, 3, 6, 7], chunk)
    pinned = chunk.cpu().pin_memory()
    layers = [t.view(torch.uint8) for t in case.layers.values()]
    for t in layers:
        t[ids] = POISON
    torch.cuda.synchronize()

    copies = CudaCopies(device)
    work = torch.randn(4096, 4096, device="cuda")
    for _ in range(COMPUTE_STEPS):  # vLLM's queued compute, still running below
        work = (work @ work.T).tanh_()
    with copies.loading():
        layout.scatter(pinned, ids)
    # "attention" on vLLM's stream, as a FULL graph replay: no per-layer wait.
    seen = [t[ids].clone() for t in layers]
    copies.loads_done()
    torch.cuda.synchronize()
    copies.close()
    bad = 0
    for layer, t in enumerate(layers):
        final = t[ids]
        if bool((final == POISON).all()):
            raise CheckFailed(f"layer {layer}: the load never landed")
        bad += int((seen[layer] != final).sum())
    return bad


def check_connector_stream() -> str:
    """See the module docstring. Raises CheckFailed."""
    bad = _run()
    if bad:
        raise CheckFailed(f"compute read blocks before their load: {bad} bytes")
    return (
        f"{LAYERS} layers loaded on the connector's stream under {COMPUTE_STEPS} queued "
        "matrix products: every read after start_load was ordered after the whole load"
    )
