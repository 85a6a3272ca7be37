"""The CUDA floor both packages stand on: arguments, op registration, driver calls, capture, page-locked memory, kernel launch.

kv_ops's ops and engine and all of ple_ops import from here; nothing here imports anything above
it. Bottom first, each module may import only the ones before it:

* :mod:`.torch_internals`: every reach into torch's private names, each with why and what breaks it;
* :mod:`.arguments`: the count, index, name, shape, dtype, seconds and device rules of every public entry point;
* :mod:`.registration`: the one way an operator is registered (schema, fake, CPU, CUDA);
* :mod:`.driver`: every CUDA driver call, through lazily imported bindings, checked;
* :mod:`.capture`: whether a CUDA-graph capture is under way, and the one refusal;
* :mod:`.host_memory`: page-locked host memory, its device views, shared mappings;
* :mod:`.launch`: the kernels' launch shape (programs, tile, warps), alignment, and the direct
  launch of a kernel compiled before.
"""
