"""The machine's side: how this CPU (or GPU) multiplies, attends and normalises fastest.

Nothing in the book's model depends on this package; :func:`~llmlib.kernels.prepare.prepare`
swaps its modules in after a model is built.

* :mod:`~llmlib.kernels.flags` — the one record of every ``LLMLIB_*`` switch and CPU capability;
* :mod:`~llmlib.kernels.native` — the C++ sources (``csrc/``) and their build;
* :mod:`~llmlib.kernels.matvec` — one-row float32 products, where MKL streams slowly;
* :mod:`~llmlib.kernels.integer` — int8/int4 products by integer dot products (VNNI or AVX2);
* :mod:`~llmlib.kernels.onednn` — bfloat16 (and float32) held in oneDNN's blocked layout;
* :mod:`~llmlib.kernels.paged_attention` — decode attention read where a cache holds the keys;
* :mod:`~llmlib.kernels.paged_triton` — the same on a GPU, and the paged KV write, in Triton;
* :mod:`~llmlib.kernels.norm` — RMSNorm in one C++ pass per row;
* :mod:`~llmlib.kernels.weights` — how a matrix is stored for the kernel that multiplies it;
* :mod:`~llmlib.kernels.layout` — where a CPU model's float matrices live in memory;
* :mod:`~llmlib.kernels.modules` — the layers that hold a stored matrix (``PackedLinear``);
* :mod:`~llmlib.kernels.prepare` — a model's matrices stored for this machine, once, at load.
"""
