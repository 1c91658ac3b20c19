"""Can this FAISS build search on this GPU? Run as a child process by `check_index_device`:

    python -m ragtrain.index.gpu_probe <index.factory> <dim>

It prints the GPU's name and compute capability, copies an empty `factory` index to GPU 0 (a factory FAISS cannot
put on a GPU exits GPU_PROBE_FACTORY_EXIT with FAISS's reason on the last line), then adds vectors to a flat GPU
index and searches them: the first calls that run FAISS's CUDA kernels. A FAISS build without code for this GPU
fails there with a CUDA assertion that aborts the process, which no `try` can catch: hence a child, so the run that
asks gets one line naming the GPU instead of a dead process (and holds no CUDA context of its own afterwards).
"""

from __future__ import annotations

import sys

import faiss
import numpy as np
import torch

from ragtrain.index.faiss_index import GPU_PROBE_FACTORY_EXIT, index_to_gpu, make_index
from ragtrain.runtime.errors import ConfigError

WRONG_EXIT = 4  # the kernels ran and returned wrong neighbours


def main(argv: list[str]) -> int:
    factory, dim = argv[0], int(argv[1])
    major, minor = torch.cuda.get_device_capability(0)
    print(f"{torch.cuda.get_device_name(0)}, compute capability {major}.{minor}", flush=True)
    res = faiss.StandardGpuResources()
    res.noTempMemory()  # no 1.5 GiB scratch reservation for a probe
    try:
        copy = index_to_gpu(make_index(factory, dim), factory, faiss, res)
    except ConfigError as e:
        print(e, flush=True)
        return GPU_PROBE_FACTORY_EXIT
    del copy
    flat = faiss.GpuIndexFlatL2(res, dim)  # an untrained IVF copy would add nothing: a flat index runs kernels
    x = np.random.default_rng(0).random((16, dim), dtype=np.float32)
    flat.add(x)
    _, ids = flat.search(x, 1)
    if ids[:, 0].tolist() != list(range(len(x))):  # each vector's nearest (L2) is itself
        print(f"a search on the GPU returned wrong neighbours: {ids[:, 0].tolist()}", flush=True)
        return WRONG_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
