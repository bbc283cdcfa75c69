"""A test double of vLLM for the GPU kit, named as such: the lent GPU machines
have CUDA and PyTorch but no vLLM, and the connector's worker-side modules that
the GPU checks drive (metadata, ipc, worker) subclass one empty vLLM base class.

It holds only the names those imports need, each an empty class, and is put on
``PYTHONPATH`` by the kit's ``run.sh`` only where ``import vllm`` fails. Nothing
that needs vLLM's behaviour (the scheduler side, ``vllm serve``) runs on it.
"""

STANDIN = True
