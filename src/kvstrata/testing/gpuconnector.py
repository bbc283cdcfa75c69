"""``kvstrata selftest gpu``'s connector-stream check: host-mode loads under compute.

The connector's CUDA loads (:class:`~kvstrata.connector.device.CudaCopies`)
run on its own stream while vLLM computes on its current one: the copy
stream first waits for what vLLM queued, each layer's copies end with an
event, and ``wait_for_layer_load`` makes vLLM's stream wait for that layer
only (or, for a step replayed as a full CUDA graph, ``wait_for_all_loads``
for the whole load). Here a long run of matrix products stands for vLLM's
queued compute, a chunk is scattered layer by layer from pinned memory,
and "attention" reads each layer's blocks on the compute stream right
after the wait. What it read must be what the blocks finally hold, and
not the poison under them: a read that ran ahead of its layer's copies
would see the poison.
"""

from __future__ import annotations

from kvstrata.testing.gpuipc import CheckFailed

POISON = 0x5A
LAYERS, BLOCKS, PER_CHUNK = 8, 16, 4
COMPUTE_STEPS = 24  # matrix products of 4096 x 4096 queued before the load


def _run(whole_before_compute: bool) -> int:
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

    copies = CudaCopies(device, layout.plan.num_layers)
    work = torch.randn(4096, 4096, device="cuda")
    for _ in range(COMPUTE_STEPS):  # vLLM's queued compute, still running below
        work = (work @ work.T).tanh_()
    with copies.loading():
        for layer in range(layout.plan.num_layers):
            layout.copier.scatter_layer(layer, pinned, ids)
            copies.layer_loaded(layer)
    if whole_before_compute:
        copies.wait_for_all_loads()
    seen = []
    for layer, t in enumerate(layers):
        if not whole_before_compute:
            copies.wait_for_layer(min(layer, layout.plan.num_layers - 1))
        seen.append(t[ids].clone())  # "attention" on vLLM's stream
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
    per_layer = _run(whole_before_compute=False)
    whole = _run(whole_before_compute=True)
    if per_layer or whole:
        raise CheckFailed(
            f"attention read blocks before their load: {per_layer} bytes (per-layer waits), "
            f"{whole} bytes (whole load before a full-graph step)"
        )
    return (
        f"{LAYERS} layers loaded on the connector's stream under {COMPUTE_STEPS} queued "
        "matrix products: per-layer waits and the whole-load wait both ordered every read"
    )
